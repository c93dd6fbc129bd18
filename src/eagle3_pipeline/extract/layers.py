"""Which layers the extract stage captures, and the model dims the records are checked against.

Owns `model_dims(target)` (number of decoder layers and hidden size, read from the model's
`config.json`; multimodal configs use their `text_config`) and `captured_layer_ids(cfg, target)`
(aux ids + final layer N, via `contracts.resolve_layer_ids`). Reads only the model config; never
loads weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eagle3_pipeline.config import ExtractConfig, TargetConfig
from eagle3_pipeline.contracts import ContractError, resolve_layer_ids


@dataclass(frozen=True)
class ModelDims:
    num_layers: int   # N decoder layers
    hidden_size: int  # H


def _config_dict(target: TargetConfig) -> dict:
    local = Path(target.model) / "config.json"
    if local.is_file():
        return json.loads(local.read_text())
    from transformers import AutoConfig  # lazy: hub names only

    return AutoConfig.from_pretrained(target.model, revision=target.revision,
                                      trust_remote_code=target.trust_remote_code).to_dict()


def model_dims(target: TargetConfig) -> ModelDims:
    """N and H of the target's language model (the `text_config` of a multimodal model)."""
    cfg = _config_dict(target)
    text = cfg.get("text_config") or cfg
    try:
        return ModelDims(int(text["num_hidden_layers"]), int(text["hidden_size"]))
    except KeyError as e:
        raise ContractError(f"{target.model}: model config has no {e.args[0]!r}; cannot place layer ids") from e


def captured_layer_ids(cfg: ExtractConfig, target: TargetConfig) -> list[int]:
    """All captured ids, ascending, the final layer N last (e.g. [2, 4, 5, 8] for N=8)."""
    return resolve_layer_ids(model_dims(target).num_layers, cfg.layer_ids)

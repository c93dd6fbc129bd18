"""Which layers the extract stage captures, and the model dims the records are checked against.

Owns `captured_layer_ids(cfg, target)` (aux ids + final layer N, via `contracts.resolve_layer_ids`);
re-exports `contracts.model_dims`. Reads only the model config; never loads weights.
"""

from __future__ import annotations

from eagle3_pipeline.config import ExtractConfig, TargetConfig
from eagle3_pipeline.contracts import ModelDims, model_dims, resolve_layer_ids

__all__ = ["ModelDims", "captured_layer_ids", "model_dims"]


def captured_layer_ids(cfg: ExtractConfig, target: TargetConfig) -> list[int]:
    """All captured ids, ascending, the final layer N last (e.g. [2, 4, 5, 8] for N=8)."""
    return resolve_layer_ids(model_dims(target).num_layers, cfg.layer_ids)

"""Data contracts written once: layer ids, record shapes/dtypes, and `check_record`.

Owns the meaning of a hidden-state record `hs_{i}.safetensors` (DESIGN §2):
  token_ids      int64[T]        == row i's input_ids
  hidden_states  bf16[T, L, H]   L = len(aux_layer_ids) + 1, ascending ids, last = final layer N
  (fp8 storage: hidden_states float8_e4m3fn + hidden_states_scales fp32[T, 1, 1])
Layer id k is the residual stream after k decoder layers (HF `hidden_states[k]`); id N is the last
layer's output before the final norm.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eagle3_pipeline.errors import InputError

HS_KEY, TOKENS_KEY, SCALES_KEY = "hidden_states", "token_ids", "hidden_states_scales"
STORAGE_DTYPES = {"bf16": "BF16", "fp8": "F8_E4M3"}  # safetensors dtype names
FP8_MAX = 448.0


class ContractError(InputError):
    """A record or a layer list that breaks the contract; the message names file, sample, layer, shapes."""


def default_aux_layer_ids(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def resolve_layer_ids(num_layers: int, aux_layer_ids: list[int] | None) -> list[int]:
    """All captured layer ids: the aux ids (default `[2, N//2, N-3]`) then the final layer N.
    Raises ContractError for ids out of range, duplicated or not ascending."""
    aux = list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(num_layers)
    if not aux:
        raise ContractError("layer ids: at least one auxiliary layer id is required")
    bad = [k for k in aux if not 0 <= k < num_layers]
    if bad:
        raise ContractError(f"layer ids {aux}: {bad} out of range [0, {num_layers - 1}] for a {num_layers}-layer model")
    if len(set(aux)) != len(aux):
        raise ContractError(f"layer ids {aux}: duplicates (a {num_layers}-layer model needs distinct ids)")
    if aux != sorted(aux):
        raise ContractError(f"layer ids {aux}: must be ascending")
    return aux + [num_layers]


@dataclass(frozen=True)
class RecordSpec:
    """What one record must look like, as a function of model dims and storage."""
    num_layers_captured: int  # L
    hidden_size: int          # H
    storage_dtype: str = "bf16"

    def shape(self, num_tokens: int) -> tuple[int, int, int]:
        return (num_tokens, self.num_layers_captured, self.hidden_size)  # [T, L, H]

    @property
    def st_dtype(self) -> str:
        return STORAGE_DTYPES[self.storage_dtype]


@dataclass(frozen=True)
class ModelDims:
    """The target's language-model dims (the `text_config` of a multimodal wrapper such as Kimi-K2.5)."""
    num_layers: int   # N decoder layers
    hidden_size: int  # H
    vocab_size: int   # V
    head_dim: int
    model_type: str


def model_dims(target) -> ModelDims:
    """Dims of `target` (a TargetConfig) from its config.json; hub names go through AutoConfig.
    Never loads weights."""
    local = Path(target.model) / "config.json"
    if local.is_file():
        try:
            cfg = json.loads(local.read_text())
        except json.JSONDecodeError as e:
            raise ContractError(f"{local}: not valid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise ContractError(f"{local}: expected a JSON object, found {type(cfg).__name__}")
    elif Path(target.model).is_dir():
        found = sorted(p.name for p in Path(target.model).iterdir())[:10]
        raise ContractError(f"model directory {target.model}: no config.json (found {found})")
    else:
        from transformers import AutoConfig  # lazy: hub names only

        from eagle3_pipeline.config import hub_token

        cfg = AutoConfig.from_pretrained(target.model, revision=target.revision,
                                         trust_remote_code=target.trust_remote_code, token=hub_token(target)).to_dict()
    text = cfg.get("text_config") or cfg
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if k not in text]
    if missing:
        raise ContractError(f"{target.model}: model config has no {missing}; cannot place layer ids")
    heads = text.get("num_attention_heads") or 1
    return ModelDims(int(text["num_hidden_layers"]), int(text["hidden_size"]), int(text["vocab_size"]),
                     int(text.get("head_dim") or text["hidden_size"] // heads), str(text.get("model_type", "?")))

"""What differs by model family, in one place: `FAMILIES`, one `Family` entry each.

A target's config.json is read through `text_config` (the language model of a multimodal wrapper); a family is
recognised from that config (`Family.matches`), and says what it changes: the one-layer model the verify
reference streams (`one_layer`), one token's KV cache (`kv_bytes_per_token`, `head_dim`), its routed experts and
what happens to its logits after lm_head. Everything else is read the plain decoder's way (Llama, Qwen, Mistral).
Adding a family is one entry in `FAMILIES` (docs/targets.md, "Adding a model family").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Family:
    name: str
    models: str  # which models, and what differs (one line, for the reader)
    matches: Callable[[dict], bool]  # from the text config (text_config below)
    # what to set so that a one-layer model's layer 0 is built like layer k of the full model (verify/worker.py)
    one_layer: Callable[[dict, int], dict] | None = None
    # (kv elements per token per layer on every rank, attention kernel head size) where it is not K and V per head
    latent_kv: Callable[[dict], tuple[int, int]] | None = None
    experts: tuple[str, ...] = ()  # config keys that count its routed experts (a MoE when one is set)
    logit_keys: tuple[str, ...] = ()  # config keys that scale or soft-cap the logits after lm_head
    unmodelled_output: str | None = None  # why the final-layer fingerprint (RMSNorm + lm_head) does not fit it


def _deepseek_layer(text: dict, k: int) -> dict:
    """Layer i is MoE iff i >= first_k_dense_replace (and, DeepSeek-V2, i % moe_layer_freq == 0); the
    multi-token-prediction layers are not decoder layers."""
    out: dict = {}
    if "first_k_dense_replace" in text:
        fk = int(text["first_k_dense_replace"] or 0)
        freq = int(text.get("moe_layer_freq") or 1)
        moe = k >= fk and k % freq == 0
        out["first_k_dense_replace"] = 0 if moe else 1
        if "moe_layer_freq" in text:
            out["moe_layer_freq"] = 1
    if "num_nextn_predict_layers" in text:
        out["num_nextn_predict_layers"] = 0
    return out


def _mla_kv(text: dict) -> tuple[int, int]:
    """One latent vector per token and layer, kv_lora_rank + qk_rope_head_dim, on every rank."""
    width = int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim", 64))
    return width, int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim") or 0)


def _qwen_moe_layer(text: dict, k: int) -> dict:
    """Layer k is sparse iff it is not in mlp_only_layers and (k + 1) % decoder_sparse_step == 0."""
    step = int(text.get("decoder_sparse_step") or 1)
    sparse = k not in (text.get("mlp_only_layers") or []) and (k + 1) % step == 0
    return {"decoder_sparse_step": 1, "mlp_only_layers": [] if sparse else [0]}


def _qwen_window_layer(text: dict, k: int) -> dict:
    """Sliding-window attention from layer max_window_layers on (configs without per-layer layer_types)."""
    return {"max_window_layers": 0 if k >= int(text["max_window_layers"]) else 1}


_SCALED = ("logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")

FAMILIES: tuple[Family, ...] = (
    Family("deepseek", "DeepSeek-V2/V3, Kimi-K2/K2.5: dense layers first, then MoE; multi-token-prediction layers",
           matches=lambda c: "first_k_dense_replace" in c or "num_nextn_predict_layers" in c,
           one_layer=_deepseek_layer, experts=("n_routed_experts",)),
    Family("mla", "multi-head latent attention (DeepSeek-V2/V3, Kimi-K2/K2.5): one latent KV vector per token",
           matches=lambda c: bool(c.get("kv_lora_rank")), latent_kv=_mla_kv),
    Family("qwen-moe", "Qwen2/3-MoE: sparse layers every decoder_sparse_step, dense ones in mlp_only_layers",
           matches=lambda c: "decoder_sparse_step" in c or "mlp_only_layers" in c, one_layer=_qwen_moe_layer,
           experts=("num_experts",)),
    Family("qwen-window", "Qwen2/3: sliding-window attention from max_window_layers on",
           matches=lambda c: "max_window_layers" in c and "layer_types" not in c, one_layer=_qwen_window_layer),
    Family("mixtral", "Mixtral: routed experts in every layer", matches=lambda c: "num_local_experts" in c,
           experts=("num_local_experts",)),
    Family("gemma", "Gemma: (1 + weight) RMSNorm, embeddings scaled, Gemma 2's soft-capped logits",
           matches=lambda c: "gemma" in str(c.get("model_type", "")), logit_keys=("final_logit_softcapping",),
           unmodelled_output="its norm and logit scaling differ from RMSNorm + lm_head"),
    Family("scaled-logits", "Cohere (logit_scale), Granite (logits_scaling), Grok (output_multiplier_scale) and "
           "soft-capped logits: the logits are scaled after lm_head",
           matches=lambda c: any(c.get(k) not in (None, 1, 1.0) for k in _SCALED),
           logit_keys=_SCALED),
)


def text_config(full: dict) -> dict:
    """The language model's part of a model's config.json: `text_config` of a multimodal wrapper (Kimi-K2.5),
    else the config itself; a quantisation config of the wrapper is carried into it. The one reader of that
    nesting (contracts, engine/start, evaluate/prompts, verify/worker)."""
    text = dict(full.get("text_config") or full)
    if "quantization_config" in full and "quantization_config" not in text:
        text["quantization_config"] = full["quantization_config"]
    return text


def families_of(text: dict) -> list[Family]:
    """The families whose marks `text` (a text config) carries, in FAMILIES' order (none: a plain decoder)."""
    return [f for f in FAMILIES if f.matches(text)]


def layer_config(text: dict, k: int) -> dict:
    """`text` (the language model's config.json as a dict) turned into a one-layer model whose layer 0
    is built like layer k: per-layer lists cut to layer k's entry, then each family's own rule."""
    n = int(text["num_hidden_layers"])
    cfg = dict(text)
    for key, v in text.items():  # per-layer lists: layer_types, no_rope_layers, ...
        if isinstance(v, list) and len(v) == n and key not in ("architectures",):
            cfg[key] = [v[k]]
    cfg["num_hidden_layers"] = 1
    for fam in families_of(text):
        if fam.one_layer is not None:
            cfg.update(fam.one_layer(text, k))
    cfg["vocab_size"] = 8  # the embedding and lm_head are not read: keep their random init small
    cfg["pad_token_id"] = None
    cfg["use_cache"] = False
    return cfg


def known_model_type(cfg: dict) -> dict:
    """A text config whose `model_type` transformers does not know (Kimi-K2's `kimi_k2`) but whose
    architecture it does (`DeepseekV3ForCausalLM`) gets that architecture's model type."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if cfg.get("model_type") in CONFIG_MAPPING_NAMES or "auto_map" in cfg:
        return cfg
    by_arch = {v: k for k, v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if isinstance(v, str)}
    for arch in cfg.get("architectures") or []:
        if arch in by_arch:
            return {**cfg, "model_type": by_arch[arch]}
    return cfg


def _latent(text: dict) -> Callable[[dict], tuple[int, int]] | None:
    return next((f.latent_kv for f in families_of(text) if f.latent_kv is not None), None)


def is_latent_attention(text: dict) -> bool:
    """Whether its KV cache is one latent vector per token and layer (MLA), not K and V per head."""
    return _latent(text) is not None


def head_dim(text: dict) -> int:
    """The attention kernel's head size (MLA: kv_lora_rank + qk_rope_head_dim)."""
    latent = _latent(text)
    if latent is not None:
        return latent(text)[1]
    return int(text.get("head_dim") or text["hidden_size"] // (text.get("num_attention_heads") or 1))


def kv_bytes_per_token(c: dict, dtype_bytes: int, tp: int) -> int:
    """KV cache bytes of one token on one TP rank: every layer's K and V (MLA: its one latent vector,
    kv_lora_rank + qk_rope_head_dim, on every rank)."""
    layers = int(c.get("num_hidden_layers", 0))
    latent = _latent(c)
    if latent is not None:
        return layers * latent(c)[0] * dtype_bytes
    heads = int(c.get("num_attention_heads", 1))
    kv_heads = int(c.get("num_key_value_heads") or heads)
    per_head = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
    return layers * 2 * max(1, kv_heads // tp) * per_head * dtype_bytes


def is_moe(text: dict) -> bool:
    """Whether it routes tokens to experts (any family's expert count set)."""
    return any(text.get(k) for f in FAMILIES for k in f.experts)


def read_text_config(model_dir: Path) -> dict | None:
    """The text config of a local model directory's config.json (None: none there, or not JSON)."""
    try:
        c = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return text_config(c) if isinstance(c, dict) else None


def logit_transform(model_dir: Path) -> str | None:
    """What config.json says happens to the logits after lm_head (soft-capping, scaling), if anything."""
    c = read_text_config(model_dir) or {}
    found = {k: c[k] for f in FAMILIES for k in f.logit_keys if c.get(k) not in (None, 1, 1.0)}
    return f"its logits are transformed after lm_head ({found})" if found else None


def unmodelled_output(text: dict) -> str | None:
    """Why the final-layer fingerprint (RMSNorm + lm_head) cannot model the output of `text`'s family (None: it can)."""
    return next((f"model type {text.get('model_type', '?')}: {f.unmodelled_output}" for f in families_of(text)
                 if f.unmodelled_output), None)

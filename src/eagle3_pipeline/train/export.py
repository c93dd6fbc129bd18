"""The train stage's export check: is a checkpoint the draft we meant (vocab mappings, shapes, copied
verifier weights)? `train_draft` runs it on checkpoint_best before returning.

What speculators copies from the verifier (and export_check verifies): `embed_tokens.weight` (frozen,
the full [V, H] matrix) and `lm_head.weight` = the verifier's lm_head rows of the draft vocab ([K, H],
frozen; the verifier's embed_tokens when it ties embeddings). The verifier's final norm is used in
training to build targets but is not saved.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from eagle3_pipeline.core.errors import GateFailed
from eagle3_pipeline.records.contracts import model_dims
from eagle3_pipeline.records.vocab import load_vocab


class ExportCheckError(GateFailed, ValueError):
    """A draft checkpoint that is not the draft we meant; the message names the file, tensor, shapes."""


def export_check(checkpoint_dir: Path, vocab_dir: Path, target_model_dir: Path) -> None:
    """Raise ExportCheckError unless `checkpoint_dir` is a speculators EAGLE-3 draft for this target
    and vocab: config and tensors present with the right shapes, d2t/t2d embedded and equal to
    vocab_dir's, the copied verifier weights (embed_tokens; lm_head rows of the draft vocab) equal
    to the target's, and no NaN left in any weight (speculators initialises copied weights to NaN)."""
    import torch
    from safetensors.torch import load_file
    from speculators.utils.loading import load_model_layers

    ckpt = Path(checkpoint_dir)
    cfg_path, st_path = ckpt / "config.json", ckpt / "model.safetensors"
    for p in (cfg_path, st_path):
        if not p.exists():
            raise ExportCheckError(f"{ckpt}: {p.name} missing")
    conf = json.loads(cfg_path.read_text())
    if conf.get("speculators_model_type") != "eagle3":
        raise ExportCheckError(f"{cfg_path}: speculators_model_type {conf.get('speculators_model_type')!r}, expected 'eagle3'")
    tl = conf.get("transformer_layer_config") or {}
    k = conf.get("draft_vocab_size")
    dims = model_dims(target_model_dir)
    v, h, n = dims.vocab_size, dims.hidden_size, dims.num_layers
    if tl.get("vocab_size") != v or tl.get("hidden_size") != h:
        raise ExportCheckError(f"{cfg_path}: transformer_layer_config vocab_size/hidden_size "
                               f"{tl.get('vocab_size')}/{tl.get('hidden_size')}, target has {v}/{h}")
    aux = conf.get("eagle_aux_hidden_state_layer_ids") or []
    if not aux or any(not 0 <= a <= n for a in aux):
        raise ExportCheckError(f"{cfg_path}: eagle_aux_hidden_state_layer_ids {aux} not within [0, {n}]")

    w = load_file(str(st_path))
    ref_d2t, ref_t2d = load_vocab(vocab_dir, v)
    if k == v and "d2t" not in w and "t2d" not in w:  # full target vocab: speculators stores no mapping
        w = {**w, "d2t": torch.from_numpy(ref_d2t), "t2d": torch.from_numpy(ref_t2d)}
    for name in ("d2t", "t2d"):
        if name not in w:
            raise ExportCheckError(f"{st_path}: tensor {name!r} missing (vLLM needs it to map draft ids to target ids)")
    d2t, t2d = w["d2t"], w["t2d"]
    if list(d2t.shape) != [k] or d2t.dtype != torch.int64:
        raise ExportCheckError(f"{st_path}: d2t expected int64[{k}] (draft_vocab_size), found {d2t.dtype}{list(d2t.shape)}")
    if list(t2d.shape) != [v] or t2d.dtype != torch.bool:
        raise ExportCheckError(f"{st_path}: t2d expected bool[{v}] (target vocab), found {t2d.dtype}{list(t2d.shape)}")
    for name, got, ref in (("d2t", d2t.numpy(), ref_d2t), ("t2d", t2d.numpy(), ref_t2d)):
        if got.shape != ref.shape:
            raise ExportCheckError(f"{st_path}: {name} shape {list(got.shape)}, {vocab_dir} has {list(ref.shape)}")
        diff = np.nonzero(got != ref)[0]
        if diff.size:
            i = int(diff[0])
            raise ExportCheckError(f"{st_path}: {name} differs from {vocab_dir} at {len(diff)} positions "
                                   f"(first: index {i}, checkpoint {got[i]!r}, vocab {ref[i]!r})")

    n_aux = len(aux)
    expect = {"fc.weight": [h, n_aux * h], "lm_head.weight": [k, h]}
    for name, shape in expect.items():
        if name not in w:
            raise ExportCheckError(f"{st_path}: tensor {name!r} missing")
        if list(w[name].shape) != shape:
            raise ExportCheckError(f"{st_path}: {name} expected {shape}, found {list(w[name].shape)}")
    for name, t in w.items():
        if t.is_floating_point() and torch.isnan(t).any():
            raise ExportCheckError(f"{st_path}: {name} {list(t.shape)} contains NaN (a weight never loaded or a diverged run)")

    verifier = load_model_layers(["embed_tokens.weight", "lm_head.weight"], str(target_model_dir))
    embed = verifier["embed_tokens.weight"]  # [V, H]
    head = verifier.get("lm_head.weight", embed)  # [V, H]
    target_ids = torch.arange(k) + d2t  # [K]
    shared = {"lm_head.weight": head[target_ids]}  # [K, H]
    if "embed_tokens.weight" in w:  # vLLM shares the target's embedding when the draft has none
        shared["embed_tokens.weight"] = embed
    for name, ref in shared.items():
        got = w[name]
        if list(got.shape) != list(ref.shape):
            raise ExportCheckError(f"{st_path}: {name} expected {list(ref.shape)} (from {target_model_dir}), "
                                   f"found {list(got.shape)}")
        ref = ref.to(got.dtype)
        if not torch.equal(got, ref):
            rows = torch.nonzero((got != ref).any(dim=-1)).flatten()
            raise ExportCheckError(f"{st_path}: {name} differs from the target's in {rows.numel()} of "
                                   f"{got.shape[0]} rows (first: row {int(rows[0])}); speculators copies and "
                                   f"freezes it from the verifier, so it must match exactly")

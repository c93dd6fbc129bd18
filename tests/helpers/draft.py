"""Test helper: a randomly initialised speculators EAGLE-3 draft for a given target model, built in
this process without a vocab stage, an extraction or a train child.

Owns `make_random_draft(target_dir, out_dir, ...)`. Reads the target's config.json and weights
(speculators copies the target's embeddings and the draft-vocab rows of its lm_head into the draft);
writes a speculators checkpoint directory (config.json + model.safetensors holding `d2t`/`t2d`) that
vLLM serves as an EAGLE-3 draft. The decoder weights are random, so acceptance is near zero. Used by
tests/integration/test_evaluate.py to test the evaluate stage's plumbing on its own; the pipeline's
own untrained baseline is `eagle3_pipeline.train.stage.make_untrained_draft` (the train worker's
`untrained` mode, with the vocab stage's d2t/t2d and the version's aux layer ids).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def make_random_draft(
    target_dir: str | Path,
    out_dir: str | Path,
    *,
    aux_layer_ids: Sequence[int] = (2, 4, 5),
    draft_vocab_size: int = 512,
    draft_token_ids: Sequence[int] | None = None,
    num_layers: int = 1,
    ttt_steps: int = 3,
    seed: int = 0,
) -> Path:
    """Save a random EAGLE-3 draft for `target_dir` to `out_dir` and return `out_dir`.

    The draft vocabulary is `draft_token_ids` (target ids; default: the first `draft_vocab_size`
    ids), stored speculators-style: `d2t` int64[K] offsets (target id = i + d2t[i]) and `t2d`
    bool[V]. `aux_layer_ids` are the target layers concatenated into the draft's fc input (the
    default is the 8-layer tiny target's `contracts.default_aux_layer_ids(8)`)."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config
    from transformers import AutoConfig

    target_dir, out_dir = str(Path(target_dir).resolve()), Path(out_dir)
    vocab_size = AutoConfig.from_pretrained(target_dir).vocab_size
    ids = sorted(set(draft_token_ids)) if draft_token_ids is not None else list(range(draft_vocab_size))
    if len(ids) != draft_vocab_size or ids[-1] >= vocab_size:
        raise ValueError(f"draft_token_ids: expected {draft_vocab_size} distinct ids < {vocab_size}, "
                         f"found {len(ids)} (max {ids[-1] if ids else None})")
    target_ids = torch.tensor(ids, dtype=torch.long)                # [K]
    d2t = target_ids - torch.arange(draft_vocab_size)                # [K] offsets
    t2d = torch.zeros(vocab_size, dtype=torch.bool)                 # [V]
    t2d[target_ids] = True

    torch.manual_seed(seed)
    layer_cfg = create_transformer_layer_config(
        verifier_name_or_path=target_dir, num_layers=num_layers, draft_arch="llama", hidden_act=None,
        sliding_window=4096, full_attention_indices=list(range(num_layers)))
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer_cfg, t2d=t2d, d2t=d2t, verifier_name_or_path=target_dir,
        draft_vocab_size=draft_vocab_size, norm_before_residual=False, ttt_steps=ttt_steps,
        target_layer_ids=list(aux_layer_ids), draft_attn_impl="sdpa")
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(str(out_dir))
    return out_dir

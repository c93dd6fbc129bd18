"""Numeric reference: recompute hidden states with Hugging Face transformers and compare per layer.

Reads the target model (HF directory) and a sampled subset of records. Layer id k < N maps to HF
`hidden_states[k]` (residual stream after k decoder layers); id N maps to the last decoder layer's
output *before* the final norm (HF's `hidden_states[N]` is after it), taken with a forward hook.
Tolerances are bf16-appropriate: bf16 keeps 8 mantissa bits, and vLLM's and HF's kernels differ in
accumulation order, so we compare cosine similarity and relative L2 error per layer, not bits.
"""

from __future__ import annotations

from pydantic import BaseModel

from eagle3_pipeline.data.prepare import load_tokenized

MIN_COSINE = 0.99
MAX_REL_ERR = 0.10


class ReferenceResult(BaseModel):
    samples_checked: list[int]
    max_rel_err: float | None
    min_cosine: float | None
    per_layer_max_rel_err: dict[int, float]
    problems: list[str]
    bad_rows: list[int] = []
    skipped: str | None = None


def choose_rows(seq_lens: list[int], count: int, rows_per_shard: int) -> list[int]:
    """Sampled rows: always the longest and the shortest, then rows spread evenly over the dataset so
    that different shards are covered."""
    n = len(seq_lens)
    if n == 0 or count <= 0:
        return []
    picks = [max(range(n), key=seq_lens.__getitem__), min(range(n), key=seq_lens.__getitem__)]
    step = max(1, n // max(1, count))
    for i in range(0, n, step):
        if len(set(picks)) >= count:
            break
        picks.append(i)
    shards = {r // rows_per_shard for r in picks}
    if len(shards) == 1 and n > rows_per_shard:  # make sure at least two shards are represented
        picks.append(n - 1)
    return sorted(set(picks))[: max(count, 2)]


def reference_check(target, version, rows: list[int], *, log=print) -> ReferenceResult:
    """Recompute `rows` of `version` (layout.ExtractVersion) with the target (config.TargetConfig)."""
    import torch

    from eagle3_pipeline.contracts import dequantise, read_record

    model_dir, trust_remote_code, layer_ids = target.model, target.trust_remote_code, version.layer_ids

    try:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                     trust_remote_code=trust_remote_code)
    except Exception as e:
        note = f"reference check skipped: transformers cannot load {model_dir} here ({type(e).__name__}: {e})"
        log(note)
        return ReferenceResult(samples_checked=[], max_rel_err=None, min_cosine=None,
                               per_layer_max_rel_err={}, problems=[], skipped=note)
    model.eval()
    layers = model.model.layers
    n_layers = len(layers)
    captured = {}
    hook = layers[-1].register_forward_hook(
        lambda mod, inp, out: captured.__setitem__("last", out[0] if isinstance(out, tuple) else out))
    ds = load_tokenized(version.tokenized_dir)
    problems, bad_rows, worst, worst_cos = [], set(), {}, 1.0
    try:
        for i in rows:
            ids = ds[i]["input_ids"]
            with torch.no_grad():
                out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
            got = dequantise(read_record(version.record_path(i)))  # [T, L, H]
            for li, lid in enumerate(layer_ids):
                ref = captured["last"][0] if lid == n_layers else out.hidden_states[lid][0]  # [T, H]
                ref = ref.float()
                if got.shape[0] != ref.shape[0] or li >= got.shape[1]:
                    bad_rows.add(i)
                    problems.append(f"hs_{i}: layer {lid} expected [{ref.shape[0]}, {ref.shape[1]}], "
                                    f"found {list(got.shape)} for the whole record")
                    continue
                g = got[:, li]
                rel = float((g - ref).norm() / ref.norm().clamp_min(1e-6))
                cos = float(torch.nn.functional.cosine_similarity(g, ref, dim=-1).min())
                worst[lid] = max(worst.get(lid, 0.0), rel)
                worst_cos = min(worst_cos, cos)
                if rel > MAX_REL_ERR or cos < MIN_COSINE:
                    bad_rows.add(i)
                    problems.append(f"hs_{i} (sample {ds[i]['sample_id']}): layer {lid} differs from the "
                                    f"reference: relative error {rel:.4f} (max {MAX_REL_ERR}), min token "
                                    f"cosine {cos:.4f} (min {MIN_COSINE})")
    finally:
        hook.remove()
    log(f"verify reference: {len(rows)} samples, max relative error "
        f"{max(worst.values(), default=0):.4f}, min cosine {worst_cos:.4f}")
    return ReferenceResult(samples_checked=rows, max_rel_err=max(worst.values(), default=None),
                           min_cosine=worst_cos if worst else None, per_layer_max_rel_err=worst,
                           problems=problems, bad_rows=sorted(bad_rows))

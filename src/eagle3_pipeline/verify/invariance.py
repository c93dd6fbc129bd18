"""Batch invariance: samples extracted alone (a batch of one) must match the stored records, which the
extract stage wrote from inside large batches.

The comparison runs inside the extract engine (extract/worker.py `_invariance`): at the end of each
shard group a few of its rows (`invariance_rows`: the longest, then rows spread over the group, none
the first of its batch, which an offset bug spares) are prefilled again alone with the engine already
loaded, and per-layer differences (contracts.compare_layers: relative error, min / mean token cosine,
fraction of tokens below cosine 0.9) go into the extract manifest (`invariance`, by row). No second
model load anywhere: verify only judges those numbers (`judge`) against VerifyConfig thresholds.

What it catches that structure checks cannot: token offsets that drift between the requests of a
batch, one request's rows written into another request's file, padding or stale cache slots read as
data. When the stored record equals the alone record shifted by a few tokens, the message says so.

The kernels see other batch shapes, so bits differ, and on MoE targets routing flips on near-ties move
single tokens a lot (the calibration: docs/verification.md, "Calibration"). Defaults (VerifyConfig):
rel err <= 0.1, mean cosine >= 0.99, fraction below 0.9 <= 0.05 — a wrong request's states, shifted
offsets or stale slots give mean cosines far below 0.9.
"""

from __future__ import annotations

from pydantic import BaseModel

from eagle3_pipeline.core.config import VerifyConfig

# fp8 storage: tolerances on the stored states this many times looser (3 mantissa bits instead of 7). Not
# final_layer.FP8_SLACK, which loosens a tolerance on logits (the error adds up through lm_head).
FP8_STATE_SLACK = 4.0


class InvarianceResult(BaseModel):
    samples_checked: list[int]
    max_rel_err: float | None
    min_cosine: float | None          # the worst per-layer mean token cosine
    per_layer_max_rel_err: dict[int, float]
    problems: list[str]
    bad_rows: list[int] = []
    skipped: str | None = None


def judge(entries: dict[int, dict], cfg: VerifyConfig, storage_dtype: str, names: dict[int, str]) -> InvarianceResult:
    """The verdict on the extract engine's invariance entries {row: {"layers": [LayerDiff dicts],
    "shifts": {layer id: s}} | {"error": ...}}; `names[row]` names the record in messages."""
    slack = FP8_STATE_SLACK if storage_dtype == "fp8" else 1.0
    max_rel = cfg.invariance_max_rel_err * slack
    min_cos = 1 - (1 - cfg.invariance_min_mean_cosine) * slack
    max_frac = min(1.0, cfg.invariance_max_frac_below * slack)
    problems, bad, worst, worst_cos = [], set(), {}, 1.0
    for row in sorted(entries):
        e, name = entries[row], names.get(row, f"row {row}")
        if e.get("error"):
            problems.append(f"{name}: batched and alone extraction differ in shape: {e['error']}")
            bad.add(row)
            continue
        for d in e.get("layers", []):
            lid = int(d["layer_id"])
            worst[lid] = max(worst.get(lid, 0.0), d["rel_err"])
            worst_cos = min(worst_cos, d["mean_cosine"])
            if d["rel_err"] > max_rel or d["mean_cosine"] < min_cos or d["frac_below"] > max_frac:
                s = (e.get("shifts") or {}).get(str(lid))
                why = (f"; it equals the alone extraction shifted by {s:+d} token{'s' if abs(s) > 1 else ''} "
                       f"(token t holds token t{s:+d}): an offset that moves between the requests of a batch"
                       if s is not None else "")
                first = f", first token below cosine 0.9: {d['first_below']}" if d.get("first_below") is not None else ""
                problems.append(f"{name}: layer {lid}: batched extraction differs from the same sample extracted alone "
                                f"(batch of one): relative error {d['rel_err']:.4f} (max {max_rel:g}), mean token cosine "
                                f"{d['mean_cosine']:.4f} (min {min_cos:g}), {d['frac_below']:.1%} of tokens below "
                                f"cosine 0.9 (max {max_frac:.0%}){first}{why}")
                bad.add(row)
    return InvarianceResult(samples_checked=sorted(entries), max_rel_err=max(worst.values(), default=None),
                            min_cosine=worst_cos if worst else None, per_layer_max_rel_err=worst,
                            problems=problems, bad_rows=sorted(bad))

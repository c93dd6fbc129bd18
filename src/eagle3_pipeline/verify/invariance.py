"""Batch invariance: samples extracted alone (a batch of one) must match the stored records, which the
extract stage wrote from inside large batches.

More: docs/internals.md, "verify/invariance.py".
"""

from __future__ import annotations

from eagle3_pipeline.core.config import VerifyConfig
from eagle3_pipeline.records.verification import InvarianceCheckResult
from eagle3_pipeline.verify.check import Outcome, RecordCheck

# fp8 storage: tolerances on the stored states this many times looser (3 mantissa bits instead of 7). Not
# final_layer.FP8_SLACK, which loosens a tolerance on logits (the error adds up through lm_head).
FP8_STATE_SLACK = 4.0


class Invariance(RecordCheck):
    """The verdict on the extract engine's invariance entries, one item per row: (row, {"layers": [LayerDiff
    dicts], "shifts": {layer id: s}} | {"error": ...}); `names[row]` names the record in messages, `why_none` says
    why there are no entries when there are none."""
    name, result = "invariance", InvarianceCheckResult

    def __init__(self, cfg: VerifyConfig, storage_dtype: str, names: dict[int, str], why_none: str = "no entries"):
        slack = FP8_STATE_SLACK if storage_dtype == "fp8" else 1.0
        self.max_rel = cfg.invariance_max_rel_err * slack
        self.min_cos = 1 - (1 - cfg.invariance_min_mean_cosine) * slack
        self.max_frac = min(1.0, cfg.invariance_max_frac_below * slack)
        self.names, self.why_none = names, why_none

    def unable(self, items) -> str | None:
        return None if items else self.why_none

    def row_of(self, item) -> int:
        return item[0]

    def problems_of(self, item) -> list[str]:
        row, e = item
        name = self.names.get(row, f"row {row}")
        if e.get("error"):
            return [f"{name}: batched and alone extraction differ in shape: {e['error']}"]
        out = []
        for d in e.get("layers", []):
            lid = int(d["layer_id"])
            if d["rel_err"] > self.max_rel or d["mean_cosine"] < self.min_cos or d["frac_below"] > self.max_frac:
                s = (e.get("shifts") or {}).get(str(lid))
                why = (f"; it equals the alone extraction shifted by {s:+d} token{'s' if abs(s) > 1 else ''} "
                       f"(token t holds token t{s:+d}): an offset that moves between the requests of a batch"
                       if s is not None else "")
                first = f", first token below cosine 0.9: {d['first_below']}" if d.get("first_below") is not None else ""
                out.append(f"{name}: layer {lid}: batched extraction differs from the same sample extracted alone "
                           f"(batch of one): relative error {d['rel_err']:.4f} (max {self.max_rel:g}), mean token "
                           f"cosine {d['mean_cosine']:.4f} (min {self.min_cos:g}), {d['frac_below']:.1%} of tokens "
                           f"below cosine 0.9 (max {self.max_frac:.0%}){first}{why}")
        return out

    def numbers(self, items) -> dict:
        diffs = [d for _, e in items if not e.get("error") for d in e.get("layers", [])]
        return {"samples": sorted(r for r, _ in items),
                "max_rel_err": max((d["rel_err"] for d in diffs), default=None),
                "min_cosine": min((d["mean_cosine"] for d in diffs), default=None)}


def judge(entries: dict[int, dict], cfg: VerifyConfig, storage_dtype: str, names: dict[int, str]) -> Outcome:
    """The verdict (check.Outcome: an InvarianceCheckResult and the flags by row) on the engine's entries by row."""
    return Invariance(cfg, storage_dtype, names).run(sorted(entries.items()))

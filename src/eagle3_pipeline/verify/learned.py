"""The checks of verify's one pass over the records (verify/structure.py `judge_records`), as check objects
(verify/check.py). Three judge what the scan measured on each record alone: structure, the final-layer
fingerprint and the state sketch. Three learn from the good records what a record looks like and flag the ones
that do not: layer identity, the target's own predictions and the norm bounds. A learned flag is recomputed
with the target before it may stop a run (verify/stage.py `_confirm_learned`).
"""

from __future__ import annotations

import math
from dataclasses import asdict

import numpy as np

from eagle3_pipeline.checks import layer_identity as identity
from eagle3_pipeline.records.contracts import record_name
from eagle3_pipeline.records.verification import (
    FingerprintCheckResult,
    IdentityCheckResult,
    NormBoundsCheckResult,
    PredictionCheckResult,
    SketchCheckResult,
    StructureCheckResult,
)
from eagle3_pipeline.verify import prediction, row_signal
from eagle3_pipeline.verify.check import Check, RecordCheck, Verdict

MIN_NORM_FILES = 8      # fewer good files than this: no norm bounds (noted in the result)
MAD_TO_SIGMA = 1.4826   # MAD of a normal distribution x this = its standard deviation


def sample_id(ds, row: int):
    return ds[row].get("sample_id") if "sample_id" in ds.column_names else None


def _named(ds, r) -> str:
    return f"{record_name(r.row)} (row {r.row}, sample {sample_id(ds, r.row)}, {r.tokens} tokens)"


# ------------------------------------------------------------------ what the scan measured, record by record
class StructureRecords(RecordCheck):
    """A record's contract: readable, keys, token ids, shapes, dtype, finite, no zero layer or token, no two
    layers equal (measured by verify/scan.py; the problems name the file, the layer and the first bad token)."""
    name, result = "structure", StructureCheckResult

    def problems_of(self, r) -> list[str]:
        return list(r.problems)


class FingerprintAgreement(RecordCheck):
    """The final layer against the target's own logits, per record with a fingerprint (fingerprint.py)."""
    name, result = "fingerprint", FingerprintCheckResult

    def __init__(self, final, required: bool, min_agreement: float):
        self.final, self.required, self.min_agreement = final, required, min_agreement

    def admits(self, r) -> bool:
        return r.agreement is not None

    def unable(self, items) -> str | None:
        if self.final is None:
            return "no final-layer check (no fingerprints or no readable lm_head)"
        if not items:
            return "no records to check" if self.required else "no fingerprints (extract.fingerprints false)"
        return None

    def problems_of(self, r) -> bool:
        return r.agreement < self.min_agreement  # its problem is the scan's (structure._fingerprint_problems)

    def numbers(self, items) -> dict:
        agree = [r.agreement for r in items]
        clean = [r.fp_margin for r in items if r.fp_margin is not None and r.agreement >= self.min_agreement]
        return {"clean_margin": round(max(clean), 4) if clean else None, "min_agreement": min(agree),
                "mean_agreement": sum(agree) / len(agree)}

    def run(self, batch):
        out = super().run(batch)
        if self.final is not None:
            out.result.rows_without = sum(r.agreement is None and r.sig is not None for r in batch)
        return out


class StateSketch(RecordCheck):
    """Every stored state against the engine's sketch of the state it computed (state_sketch.py)."""
    name, result = "state_sketch", SketchCheckResult

    def admits(self, r) -> bool:
        return r.sketch_margin is not None

    def unable(self, items) -> str | None:
        return None if items else "no records to check"

    def problems_of(self, r) -> bool:
        return r.sketch_margin > 1.0  # its problem is the scan's (structure._sketch_check)

    def numbers(self, items) -> dict:
        clean = [r.sketch_margin for r in items if r.sketch_margin <= 1.0]
        return {"margin": round(max(clean), 4) if clean else None}


# ------------------------------------------------------------------ learned over the good records
class LayerIdentity(Check):
    """Learn layer profiles over the good records; flag every slot that does not look like its own layer
    (checks/layer_identity.py). Its profile is what online training judges each row against."""
    name, result = "identity", IdentityCheckResult

    def __init__(self, ds, layer_ids: list[int], max_z: float | None, log):
        self.ds, self.layer_ids, self.max_z, self.log = ds, layer_ids, max_z, log

    def admits(self, r) -> bool:
        return r.sig is not None

    def unable(self, items) -> str | None:
        if self.max_z is None:
            return "identity check off"
        if len(self.layer_ids) < 2:
            return "one captured layer: nothing to tell apart"
        if len(items) < identity.MIN_FILES:
            self.log(f"verify: layer identity check skipped: {len(items)} good records, it needs {identity.MIN_FILES}")
            return f"only {len(items)} good records; layer profiles need at least {identity.MIN_FILES}"
        return None

    def verdict(self, items) -> Verdict:
        arr = np.stack([r.sig for r in items])  # [files, F]
        med, scale = identity.learn(arr)
        found, worst = identity.problems_of(arr, med, scale, self.layer_ids, self.max_z)
        flags: dict[int, list[str]] = {}
        for f, msg in found:
            r = items[f]
            flags.setdefault(r.row, []).append(f"{record_name(r.row)} (row {r.row}, sample "
                                               f"{sample_id(self.ds, r.row)}): {msg}")
        self.log(f"verify: layer identity: profiles from {len(items)} records, largest deviation {worst:.1f} "
                 f"(max {self.max_z:g}), {len(flags)} records flagged")
        profile = {"median": [float(v) for v in med], "scale": [float(v) for v in scale],
                   "layer_ids": list(self.layer_ids), "max_z": float(self.max_z), "max_deviation": round(worst, 2)}
        return Verdict(flags, {"max_deviation": profile["max_deviation"], "profile": profile})


class Predictions(Check):
    """The target's predictions against each row's next tokens (prediction.py): a flag for every row far below
    rows like it, then the surprise signal (row_signal.py) with the flags left under the cap."""
    name, result = "prediction", PredictionCheckResult

    def __init__(self, ds, max_z: float | None, cap: int | None, surprise_max_z: float, log):
        self.ds, self.max_z, self.cap, self.surprise_max_z, self.log = ds, max_z, cap, surprise_max_z, log

    def unable(self, items) -> str | None:
        if self.max_z is None:
            return "verify.prediction_max_z is null"
        if not any(r.next_scored is not None for r in items):
            return "no fingerprints to take the target's predictions from"
        return None

    def verdict(self, items) -> Verdict:
        rows = [(r.row, r.next_hits, r.next_scored) for r in items if r.next_scored is not None]
        flagged, summary = prediction.judge(rows, self.max_z, self.cap)
        by_row = {r.row: r for r in items}
        flags = {row: [prediction.message(_named(self.ds, by_row[row]), by_row[row].next_hits,
                                          by_row[row].next_scored, z, summary, self.max_z)]
                 for row, z in flagged.items()}
        self.log(f"verify: prediction check on {summary.rows} rows: median next-token hit rate {summary.median_rate}, "
                 f"spread {summary.spread}, {summary.flagged} rows flagged ({summary.above_limit} past the limit)"
                 if summary.skipped is None else f"verify: prediction check skipped: {summary.skipped}")
        left = None if self.cap is None else max(0, self.cap - len(flagged))
        surprise = self._surprise(items, flags, left)
        self.summary = summary
        return Verdict(flags, {"median_rate": summary.median_rate, "spread": summary.spread, "max_z": summary.max_z,
                               "above_limit": summary.above_limit, "surprise": surprise})

    def _surprise(self, good, flags: dict, cap: int | None) -> dict:
        """The target's surprise at each row against the row's bigram difficulty (row_signal.py): a flag for every
        row far more surprised than rows as predictable."""
        judged = [r for r in good if r.gaps is not None]
        if not judged:
            return asdict(row_signal.SurpriseSummary(skipped="no final-layer states with fingerprints to score"))
        every = self.ds.with_format("numpy", columns=["input_ids"])["input_ids"]  # the bigram is fitted on every row
        difficulty = row_signal.bigram_difficulty(list(every))
        y = {r.row: difficulty[r.row][0] for r in judged if r.row < len(difficulty)}
        judged = [r for r in judged if r.row in y]
        flagged, summary = row_signal.judge([(r.row, r.gaps, y[r.row]) for r in judged], self.surprise_max_z, cap)
        by_row = {r.row: r for r in judged}
        for row, z in flagged.items():
            flags.setdefault(row, []).append(row_signal.message(_named(self.ds, by_row[row]), by_row[row].gaps, y[row],
                                                                z, summary, self.surprise_max_z))
        self.log(f"verify: surprise signal on {summary.rows} rows: slope {summary.slope} on the bigram difficulty, "
                 f"spread {summary.spread}, largest clean z {summary.max_z}, {summary.flagged} rows flagged "
                 f"({summary.above_limit} past the limit {self.surprise_max_z:g})" if summary.skipped is None
                 else f"verify: surprise signal skipped: {summary.skipped}")
        return asdict(summary)

    def run(self, batch):
        """The base's run, counted as the hit rate's judgement: the rows with enough scored positions, the rows it
        flagged, and skipped when too few rows to learn from (the surprise signal's flags stand then too; its
        numbers are under `surprise`)."""
        out = super().run(batch)
        if out.result.ran:
            s = self.summary
            out.result.records, out.result.flagged, out.result.skipped = s.rows, s.flagged, s.skipped
            out.result.ran = s.skipped is None
        return out


class NormBounds(Check):
    """Per-layer bounds of a file's median token norm learned from good files spread over every shard (median
    and MAD of the log norms: robust to a bad shard, wherever it lies); a flag for every file outside them.
    After `run`, `bounds` holds (median, lo, hi, margin, outliers per layer) for the layer statistics."""
    name, result = "norm_bounds", NormBoundsCheckResult

    def __init__(self, ds, layer_ids: list[int], samples: int, factor: float, min_ratio: float, log):
        self.ds, self.layer_ids, self.samples, self.factor, self.min_ratio = ds, layer_ids, samples, factor, min_ratio
        self.log, self.bounds = log, None

    def unable(self, items) -> str | None:
        if self.samples <= 0:
            return "norm_bounds_samples is 0"
        if len(items) < MIN_NORM_FILES:
            why = f"only {len(items)} good files; norm bounds need at least {MIN_NORM_FILES}"
            self.log(f"verify: norm bounds skipped: {why}")
            return why
        return None

    def verdict(self, items) -> Verdict:
        med_norm = np.stack([r.stats[5] for r in items])  # [files, L]
        med, lo, hi, n_learn = learn_norm_bounds(med_norm, self.samples, self.factor, self.min_ratio)
        out = (med_norm < lo) | (med_norm > hi)  # [files, L]
        dev = np.abs(np.log(np.maximum(med_norm, 1e-30)) - np.log(med)) / np.log(hi / med)  # 1.0 = at a bound
        margin = dev[~out.any(axis=1)].max(axis=0) if (~out.any(axis=1)).any() else None
        self.bounds = (med, lo, hi, margin, out.sum(axis=0))
        flags = {}
        for j in np.nonzero(out.any(axis=1))[0]:
            r = items[j]
            flags[r.row] = [
                f"{_named(self.ds, r)}: layer {self.layer_ids[li]}: median token norm {med_norm[j, li]:.4g} outside "
                f"the bounds [{lo[li]:.4g}, {hi[li]:.4g}] learned from {n_learn} good files spread over every shard "
                f"(median {med[li]:.4g}, factor {self.factor:g})"
                for li in np.nonzero(out[j])[0]]
        self.log(f"verify: norm bounds from {n_learn} files; clean margin (largest deviation of a kept file ÷ bound) "
                 f"{'n/a' if margin is None else f'{margin.max():.2f}'}, {len(flags)} files outside")
        return Verdict(flags, {"learned_from": n_learn,
                               "margin": None if margin is None else round(float(margin.max()), 4)})


def spread_sample(n: int, k: int):
    """Indices of at most `k` of `n` files (in row order, so over every shard), evenly spaced."""
    return np.arange(n) if n <= k else np.unique(np.linspace(0, n - 1, k).round().astype(np.int64))


def learn_norm_bounds(norms, n_samples: int, factor: float, min_ratio: float):
    """Per-layer bounds of a file's median token norm from up to `n_samples` rows of `norms` (numpy
    [files, L], files in row order) spread evenly over all of them: median x/÷ exp(max(factor * 1.4826 *
    MAD, log(min_ratio))) of the log norms. Returns (median [L], lo [L], hi [L], files used)."""
    sample = np.log(np.maximum(norms[spread_sample(len(norms), n_samples)], 1e-30))
    med = np.median(sample, axis=0)
    mad = np.median(np.abs(sample - med), axis=0)
    half = np.maximum(factor * MAD_TO_SIGMA * mad, math.log(min_ratio))
    return np.exp(med), np.exp(med - half), np.exp(med + half), len(sample)

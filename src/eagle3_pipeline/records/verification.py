"""The verify gate's record, nested by check: `VerifyResult` holds the run's verdict (passed, problems, bad rows,
reuse, the extent of a failure) and `checks`, one typed `CheckResult` per check. Only the models: the checks
themselves are verify/'s (verify/check.py: the base that fills a CheckResult). Here, on the ground floor, so that the
report reads the model verify returns and declares none of its fields again (docs/decisions/report-from-runreport.md).

verify.json and report.json keep every key they had: the flat keys of the record before it was nested
(`reference_max_rel_err`, `identity_profile`, ...) are derived from the checks when the record is written (`FLAT`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, computed_field, model_serializer


class LayerStats(BaseModel):
    layer_id: int
    files: int             # good files the statistics cover
    tokens: int
    mean: float
    std: float
    min: float
    max: float
    mean_token_norm: float
    norm_lo: float | None = None   # bounds of a file's median token norm (None: not checked)
    norm_hi: float | None = None
    norm_median: float | None = None
    norm_outliers: int = 0         # files outside [norm_lo, norm_hi]
    norm_margin: float | None = None  # the largest |log(norm / median)| of a kept file ÷ the bound's half-width


class Extent(BaseModel):
    """How far the damage of a failed verify goes, and what was done (verify/extent.py)."""
    verdict: Literal["records", "local", "spread"]
    says: str
    sampled: int = 0               # rows of the random reference sample
    bad_in_sample: int = 0
    bad_fraction: float | None = None
    ci95: list[float] | None = None  # exact 95% interval of the bad fraction
    escalated: int = 0             # rows of the hit shards recomputed after the sample found damage
    escalated_bad: int = 0
    named: int = 0                 # bad rows named (per-record checks and recomputation)
    cleared: int = 0               # rows recomputed and found right
    hit_shards: list[int] = []
    hit_groups: list[int] = []
    reextract_rows: int = 0        # rows condemned: their records leave the pool and their shards are extracted again
    unjudged: int = 0              # rows kept whose computation no check recomputed (local: the sample vouches for them)


class CheckResult(BaseModel):
    """What one check did; the base of every check (verify/check.py `Check.run`) fills these."""
    ran: bool = False
    records: int = 0                # items (records, rows, engine entries) the check judged
    flagged: int = 0                # of those, the items it flagged
    seconds: float | None = None    # the check's own time (the scan's reading is the structure check's scan_seconds)
    skipped: str | None = None      # why it did not run (None: it ran, or it was not asked for)


class StructureCheckResult(CheckResult):
    tokens_checked: int = 0         # tokens of the good files
    bytes_read: int = 0
    scan_seconds: float | None = None  # the one pass that read every record (verify/scan.py)
    layer_stats: list[LayerStats] = []


class FingerprintCheckResult(CheckResult):
    rows_without: int = 0           # records with no fingerprint sidecar (extracted without one)
    min_agreement: float | None = None
    mean_agreement: float | None = None
    clean_margin: float | None = None  # the largest |margin error| / tolerance of a passing record (1.0: at the limit)


class SketchCheckResult(CheckResult):
    margin: float | None = None     # the largest deviation ÷ tolerance of a record that passed


class IdentityCheckResult(CheckResult):
    max_deviation: float | None = None  # clean margin: the largest robust deviation vs verify.identity_max_z
    profile: dict | None = None     # the learned layer profiles (online training judges every row with them)


class PredictionCheckResult(CheckResult):
    median_rate: float | None = None
    spread: float | None = None     # the hit rate's spread between rows, binomial noise taken out
    max_z: float | None = None      # the largest z of a row that was not flagged
    above_limit: int = 0            # rows past the limit; only the strongest verify.confirm_rows are flagged
    surprise: dict = {}             # the surprise signal's summary (verify/row_signal.py SurpriseSummary)


class NormBoundsCheckResult(CheckResult):
    learned_from: int = 0           # good files, spread over every shard, the bounds were learned from
    margin: float | None = None     # the largest deviation of a kept file ÷ the bound, over the layers


class ReferenceCheckResult(CheckResult):
    samples: list[int] = []         # the sampled rows the target recomputed
    max_rel_err: float | None = None
    min_cosine: float | None = None
    peak_rss_bytes: int | None = None  # of the reference child
    power: dict = {}                # what the sample could catch (reference.power_statement)


class InvarianceCheckResult(CheckResult):
    samples: list[int] = []         # rows the extract engine re-ran alone
    max_rel_err: float | None = None
    min_cosine: float | None = None  # the worst per-layer mean token cosine


class VerifyChecks(BaseModel):
    """One result per check, in the order verify reports them. Reads like a mapping too (`checks["masks"]`)."""
    state_sketch: SketchCheckResult = SketchCheckResult()
    structure: StructureCheckResult = StructureCheckResult()
    fingerprint: FingerprintCheckResult = FingerprintCheckResult()
    identity: IdentityCheckResult = IdentityCheckResult()
    prediction: PredictionCheckResult = PredictionCheckResult()
    norm_bounds: NormBoundsCheckResult = NormBoundsCheckResult()
    reference: ReferenceCheckResult = ReferenceCheckResult()
    invariance: InvarianceCheckResult = InvarianceCheckResult()
    masks: CheckResult = CheckResult()

    def __getitem__(self, name: str) -> CheckResult:
        if name not in type(self).model_fields:
            raise KeyError(name)
        return getattr(self, name)

    def items(self):
        return [(k, getattr(self, k)) for k in type(self).model_fields]


def _fingerprint(c: VerifyChecks) -> dict:
    fp = c.fingerprint
    return {"rows_checked": fp.records, "rows_failed": fp.flagged, "rows_without": fp.rows_without,
            "min_agreement": fp.min_agreement, "mean_agreement": fp.mean_agreement, "clean_margin": fp.clean_margin,
            "skipped": fp.skipped}


def _prediction(c: VerifyChecks) -> dict:
    p = c.prediction
    return {"rows": p.records, "median_rate": p.median_rate, "spread": p.spread, "max_z": p.max_z,
            "flagged": p.flagged, "above_limit": p.above_limit, "skipped": p.skipped, "surprise": p.surprise}


# the record's keys before it was nested by check, derived from the checks (verify.json and report.json keep them)
FLAT: dict[str, Any] = {
    "tokens_checked": lambda c: c.structure.tokens_checked,
    "reference_min_cosine": lambda c: c.reference.min_cosine,
    "reference_samples": lambda c: c.reference.samples,
    "reference_skipped": lambda c: c.reference.skipped,
    "layer_stats": lambda c: [s.model_dump() for s in c.structure.layer_stats],
    "bytes_read": lambda c: c.structure.bytes_read,
    "structure_seconds": lambda c: c.structure.scan_seconds,
    "norm_bounds_files": lambda c: c.norm_bounds.learned_from,
    "norm_bounds_skipped": lambda c: c.norm_bounds.skipped,
    "invariance_samples": lambda c: c.invariance.samples,
    "invariance_max_rel_err": lambda c: c.invariance.max_rel_err,
    "invariance_min_cosine": lambda c: c.invariance.min_cosine,
    "invariance_skipped": lambda c: c.invariance.skipped,
    "fingerprint": _fingerprint,
    "identity_files": lambda c: c.identity.records,
    "identity_skipped": lambda c: c.identity.skipped,
    "identity_max_deviation": lambda c: c.identity.max_deviation,
    "identity_profile": lambda c: c.identity.profile,
    "sketch_failed": lambda c: c.state_sketch.flagged,
    "sketch_margin": lambda c: c.state_sketch.margin,
    "prediction": _prediction,
    "reference_power": lambda c: c.reference.power,
}


class VerifyResult(BaseModel):
    content_key: str
    passed: bool
    mode: str = "offline"  # offline: the stored records; online: rows sampled from the training server (train/online.py)
    problems: list[str]
    bad_rows: list[int]
    moved_files: list[str] = []
    checks: VerifyChecks = VerifyChecks()  # every check: ran (on how many records, flagging how many) or skipped, why
    cleared: dict[int, list[str]] = {}  # rows learned checks flagged and the target itself cleared: their flags
    extent: Extent | None = None  # a failed verify: how far the damage goes, and what was done (verify/extent.py)
    shards_rechecked: int = 0
    shards_reused: int = 0
    rows_rechecked: int = 0     # records read by this verify
    rows_reused: int = 0        # records whose results came from a cache (this version's or the record pool's)
    rows_reused_pool: int = 0   # of those, records linked from the pool and verified in another version
    config_key: str | None = None
    shard_hashes: dict[str, str] = {}  # verified-good shard -> cache.shard_hash of its manifest entry
    seconds: float | None = None

    # report.json's contract keys (report/record.py VerifyEntry), from the checks
    @computed_field
    @property
    def samples_checked(self) -> int:
        return self.checks.structure.records

    @computed_field
    @property
    def reference_max_rel_err(self) -> float | None:
        return self.checks.reference.max_rel_err

    @computed_field
    @property
    def reference_peak_rss_bytes(self) -> int | None:
        return self.checks.reference.peak_rss_bytes

    @model_serializer(mode="wrap")
    def _with_flat_keys(self, handler):
        out = handler(self)
        return {**out, **{k: f(self.checks) for k, f in FLAT.items()}}

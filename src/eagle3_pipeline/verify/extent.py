"""How far a bad extraction goes, once the reference has recomputed rows that differ from their records.

A record that fails a per-record check (structure, fingerprint, sketch, mask) is named exactly: every record is
read. A forward computed wrongly is seen only where the target recomputed a row, so its extent is an estimate:
the bad fraction of the random sample with its exact (Clopper-Pearson) 95% interval, and where the bad rows are.
Damage inside a minority of the shard groups (one engine process, one node) or a few shards is *local*: those
rows are extracted again. Damage elsewhere is *spread*: the engine computes wrongly, extracting again with it
would reproduce the damage, and nothing it wrote is kept (docs/verification.md, "The extent of a bad extraction").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from eagle3_pipeline.records.verification import Extent  # the model (verify.json, the report)

LOCAL_SHARD_SHARE = 0.1  # damage in at most this share of the sampled shards (or one shard) is local


def _log_binom_pmf(k: int, n: int, p: float) -> float:
    if p <= 0.0:
        return 0.0 if k == 0 else -math.inf
    if p >= 1.0:
        return 0.0 if k == n else -math.inf
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p) + (n - k) * math.log1p(-p)


def _tail_ge(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    return min(1.0, sum(math.exp(_log_binom_pmf(i, n, p)) for i in range(k, n + 1)))


def clopper_pearson(k: int, n: int, alpha: float = 0.05) -> tuple[float, float]:
    """The exact two-sided (1 - alpha) interval of a binomial proportion k / n (bisection on the tails)."""
    if n <= 0:
        return 0.0, 1.0

    def solve(f, target: float) -> float:  # f increasing in p
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
        return (lo + hi) / 2

    lower = 0.0 if k == 0 else solve(lambda p: _tail_ge(k, n, p), alpha / 2)
    upper = 1.0 if k == n else solve(lambda p: _tail_ge(k + 1, n, p), 1.0 - alpha / 2)  # P(X <= k) = alpha / 2
    return lower, upper


def shard_of(row: int, shards) -> int | None:
    return next((s.index for s in shards if s.row_start <= row < s.row_end), None)


@dataclass
class Evidence:
    """What verify saw: the random reference sample, the rows the target recomputed differently (sample, confirmed
    flags, escalation), the rows per-record checks named, the hit shards' rows recomputed after the sample, and the
    rows recomputed and found right."""
    sample: list[int]
    computed_bad: set[int]
    record_bad: set[int]
    escalated: list[int] = field(default_factory=list)
    cleared: set[int] = field(default_factory=set)


def assess(ev: Evidence, rows: int, shards, groups: list[list[int]], engine: dict) -> Extent:
    """The extent of the damage over a version of `rows` rows in `shards` and shard `groups`; `engine`: what computed
    the records (build, dtype, TP, batch), named when the damage is spread."""
    sample, computed_bad, escalated = ev.sample, ev.computed_bad, ev.escalated
    named = len(computed_bad | ev.record_bad)
    if not computed_bad:
        return Extent(verdict="records", named=named, cleared=len(ev.cleared), says=(
            f"{named} record(s) failed checks that read every record: each is named, and only their shards are "
            f"extracted again"))
    in_sample = sorted(set(sample) & computed_bad)
    k, n = len(in_sample), len(sample)
    lo, hi = clopper_pearson(k, n) if n else (0.0, 1.0)
    hit = sorted({s for r in computed_bad if (s := shard_of(r, shards)) is not None})
    group_of = {s: g for g, ids in enumerate(groups) for s in ids}
    sampled_shards = {s for r in sample if (s := shard_of(r, shards)) is not None} | set(hit)
    sampled_groups = {group_of[s] for s in sampled_shards if s in group_of}
    hit_groups = sorted({group_of[s] for s in hit if s in group_of})
    base = Extent(verdict="spread", says="", sampled=n, bad_in_sample=k, bad_fraction=round(k / n, 4) if n else None,
                  ci95=[round(lo, 4), round(hi, 4)] if n else None, escalated=len(escalated),
                  escalated_bad=len(set(escalated) & computed_bad), named=named, cleared=len(ev.cleared),
                  hit_shards=hit, hit_groups=hit_groups)
    est = (f"{k} of {n} sampled rows computed wrongly: about {k / n:.1%} of the rows (95% interval {lo:.1%} to "
           f"{hi:.1%})" if n else f"{len(computed_bad)} rows computed wrongly (no random sample)")
    if len(sampled_groups) >= 2 and len(hit_groups) * 2 <= len(sampled_groups):
        condemned = {s for g in hit_groups for s in groups[g]}
        where = f"shard group(s) {hit_groups} of {len(groups)} (one engine process, one node each)"
    elif len(hit) <= max(1, int(LOCAL_SHARD_SHARE * len(sampled_shards))):
        condemned = set(hit)
        where = f"shard(s) {hit} of the {len(sampled_shards)} sampled"
    else:
        base.reextract_rows = rows
        base.says = (f"{est}, in {len(hit)} of {len(sampled_shards)} sampled shards and {len(hit_groups)} of "
                     f"{len(sampled_groups)} groups: spread, so the engine computes wrongly. Extracting again with the "
                     f"same engine would reproduce it: every record of this version leaves the record pool and every "
                     f"shard is marked failed, and nothing it wrote is reused. Change what computes first: "
                     + ", ".join(f"{key} {val}" for key, val in engine.items()) + ".")
        return base
    base.verdict = "local"
    base.reextract_rows = sum(s.row_end - s.row_start for s in shards if s.index in condemned)
    base.unjudged = max(0, rows - base.reextract_rows - len((set(sample) | set(escalated)) - computed_bad))
    base.says = (f"{est}, all in {where}: local. Those {base.reextract_rows} rows are extracted again (their records "
                 f"leave the record pool); the other {rows - base.reextract_rows} rows are kept on the sample's word "
                 f"({base.unjudged} of them not recomputed).")
    return base

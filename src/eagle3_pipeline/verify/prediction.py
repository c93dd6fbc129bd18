"""The target's own predictions as a per-row agreement signal: a learned check, confirmed by recomputation.

More: docs/internals.md, "verify/prediction.py".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_SCORED = 8       # rows with fewer scored positions are not judged (too noisy)
MIN_ROWS = 20        # the version needs this many judged rows to learn m and s


@dataclass
class PredictionSummary:
    rows: int = 0                  # rows judged
    median_rate: float | None = None
    spread: float | None = None    # s: the rate's spread between rows, binomial noise taken out
    max_z: float | None = None     # the largest z of a row that was not flagged (the clean margin ÷ max_z)
    flagged: int = 0
    above_limit: int = 0           # rows past the limit; only the `cap` strongest are flagged (confirm_rows)
    skipped: str | None = None


def hits(top_ids, input_ids) -> tuple[int, int]:
    """(positions whose next token is among the top-2, positions scored) of one record: top_ids int64 [T, 2]
    (-1: not scored), input_ids int64 [T]."""
    top = np.asarray(top_ids)[:-1]
    nxt = np.asarray(input_ids)[1:, None]
    scored = (top >= 0).all(axis=1)
    return int(((top == nxt).any(axis=1) & scored).sum()), int(scored.sum())


def judge(rows: list[tuple[int, int, int]], max_z: float, cap: int | None = None) -> tuple[dict[int, float],
                                                                                             PredictionSummary]:
    """({row: z} of the rows flagged, summary) for rows given as (row, hits, scored). At most `cap` rows are
    flagged, the strongest first: each flag is recomputed with the target, and if the strongest `cap` are all
    cleared, the weaker ones past the limit are the clean tail of a heterogeneous dataset, not a forward bug
    (one that is confirmed fails the run anyway)."""
    use = [(r, h, n) for r, h, n in rows if n >= MIN_SCORED]
    if len(use) < MIN_ROWS:
        return {}, PredictionSummary(rows=len(use), skipped=f"{len(use)} rows with >= {MIN_SCORED} scored positions; "
                                                              f"the prediction check needs {MIN_ROWS}")
    row = np.array([u[0] for u in use])
    h, n = np.array([u[1] for u in use], dtype=np.float64), np.array([u[2] for u in use], dtype=np.float64)
    rate = h / n
    m = float(np.median(rate))
    mad = 1.4826 * float(np.median(np.abs(rate - m)))
    noise = float(np.median(m * (1 - m) / n))
    s2 = max(mad ** 2 - noise, (0.02 * max(m, 1e-3)) ** 2)  # never tighter than 2% of the median rate
    z = (m - rate) / np.sqrt(s2 + m * (1 - m) / n)
    above = sorted(((float(zz), int(r)) for r, zz in zip(row, z) if zz > max_z), reverse=True)
    flagged = {r: zz for zz, r in above[:cap if cap is not None else len(above)]}
    kept = z[z <= max_z]
    return flagged, PredictionSummary(rows=len(use), median_rate=round(m, 4), spread=round(float(np.sqrt(s2)), 4),
                                      max_z=round(float(kept.max()), 3) if len(kept) else None, flagged=len(flagged),
                                      above_limit=len(above))


def message(name: str, r_hits: int, scored: int, z: float, summary: PredictionSummary, max_z: float) -> str:
    return (f"{name}: the target's own predictions in its fingerprint match the row's next tokens at {r_hits} of "
            f"{scored} positions ({r_hits / scored:.1%}) against a median of {summary.median_rate:.1%} over "
            f"{summary.rows} rows ({z:.1f} spreads below, limit {max_z:g}): a forward that computed this row wrong "
            f"(positions, context or inputs), or other data than the row says")

"""How surprised the target is by each row, against how hard the row is: a per-row signal from the prompt scores,
a learned check confirmed by recomputation.

More: docs/internals.md, "verify/row_signal.py".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_SCORED = 8     # rows with fewer scored tokens are not judged
MIN_ROWS = 20      # the version needs this many judged rows to fit the relation and learn the spread
SMOOTH = 1.0       # the bigram's interpolation weight on the unigram (add-alpha toward the unigram)


@dataclass
class SurpriseSummary:
    rows: int = 0
    slope: float | None = None       # x ~ intercept + slope * y over the rows kept
    intercept: float | None = None
    spread: float | None = None      # s
    max_z: float | None = None       # the largest z of a row not flagged
    flagged: int = 0
    above_limit: int = 0
    skipped: str | None = None


def bigram_difficulty(rows_ids: list) -> list[tuple[float, int]]:
    """Per row (its ids int [T]): (mean over its T-1 next tokens of the bigram's log q(next|cur) -
    max_v log q(v|cur), tokens), the bigram fitted on all rows with the row's own pairs left out."""
    arrs = [np.asarray(r, dtype=np.int64) for r in rows_ids]
    V = int(max((a.max() for a in arrs if len(a)), default=0)) + 1
    cur = np.concatenate([a[:-1] for a in arrs if len(a) > 1] or [np.zeros(0, np.int64)])
    nxt = np.concatenate([a[1:] for a in arrs if len(a) > 1] or [np.zeros(0, np.int64)])
    uni = np.bincount(nxt, minlength=V).astype(np.float64) + 0.5
    uni /= uni.sum()
    code = cur * V + nxt
    keys, counts = np.unique(code, return_counts=True)
    ctx = np.bincount(cur, minlength=V).astype(np.float64)
    # per context: its largest pair count and that pair's successor (for the max_v of q)
    order = np.lexsort((-counts, keys // V))
    first = np.ones(len(order), dtype=bool)
    first[1:] = (keys[order][1:] // V) != (keys[order][:-1] // V)
    best_c = np.zeros(V)
    best_c[keys[order][first] // V] = counts[order][first]
    out = []
    for a in arrs:
        if len(a) < 2:
            out.append((0.0, 0))
            continue
        c, n = a[:-1], a[1:]
        own, own_n = np.unique(c * V + n, return_counts=True)
        pair = counts[np.searchsorted(keys, c * V + n)] - own_n[np.searchsorted(own, c * V + n)]
        _, inv, own_c = np.unique(c, return_inverse=True, return_counts=True)
        total = ctx[c] - own_c[inv]  # the context's count without this row's own
        q = (pair + SMOOTH * uni[n]) / (total + SMOOTH)
        top = (np.maximum(best_c[c] - 0.0, 0.0) + SMOOTH * uni.max()) / (total + SMOOTH)  # an upper bound of max_v
        out.append((float(np.mean(np.log(q) - np.log(np.maximum(top, q)))), len(n)))
    return out


def _fit(x, y, keep):
    A = np.stack([np.ones(keep.sum()), y[keep]], axis=1)
    coef, *_ = np.linalg.lstsq(A, x[keep], rcond=None)
    return float(coef[0]), float(coef[1])


def judge(rows: list[tuple[int, tuple, float]], max_z: float, cap: int | None = None
          ) -> tuple[dict[int, float], SurpriseSummary]:
    """({row: z} flagged, summary) for rows given as (row, (gap sum, gap sum of squares, gap count), y: the
    row's bigram difficulty), at most `cap` flagged, the strongest first."""
    use = [(r, g, y) for r, g, y in rows if g is not None and g[2] >= MIN_SCORED]
    if len(use) < MIN_ROWS:
        return {}, SurpriseSummary(rows=len(use), skipped=f"{len(use)} rows with >= {MIN_SCORED} scored tokens; "
                                                           f"the surprise signal needs {MIN_ROWS}")
    row = np.array([u[0] for u in use])
    s1, s2, n = (np.array([u[1][k] for u in use], dtype=np.float64) for k in range(3))
    x, y = s1 / n, np.array([u[2] for u in use], dtype=np.float64)
    noise = np.maximum(s2 / n - x * x, 0.0) / n
    keep = np.ones(len(x), dtype=bool)
    for _ in range(3):
        a, b = _fit(x, y, keep)
        e = x - (a + b * y)
        med = float(np.median(e[keep]))
        mad = 1.4826 * float(np.median(np.abs(e[keep] - med)))
        keep = np.abs(e - med) <= 3 * max(mad, 1e-9)
    between2 = max(mad ** 2 - float(np.median(noise)), (0.02 * abs(float(np.median(x)))) ** 2, 1e-12)
    z = (med - e) / np.sqrt(between2 + noise)
    above = sorted(((float(zz), int(r)) for r, zz in zip(row, z) if zz > max_z), reverse=True)
    flagged = {r: zz for zz, r in above[:cap if cap is not None else len(above)]}
    kept = z[z <= max_z]
    return flagged, SurpriseSummary(rows=len(use), slope=round(b, 4), intercept=round(a, 4),
                                    spread=round(float(np.sqrt(between2)), 4),
                                    max_z=round(float(kept.max()), 3) if len(kept) else None,
                                    flagged=len(flagged), above_limit=len(above))


def message(name: str, gaps: tuple, y: float, z: float, summary: SurpriseSummary, max_z: float) -> str:
    x = gaps[0] / gaps[2]
    want = summary.intercept + summary.slope * y
    return (f"{name}: the target scores this row's next tokens {-x:.2f} nats below its own first choices on average "
            f"over {gaps[2]} tokens, where rows this predictable (a bigram of the data: {y:.2f}) are at {-want:.2f} "
            f"({z:.1f} spreads more surprised, limit {max_z:g}): a forward that computed this row wrong (positions, "
            f"context or KV, inputs), or other data than the row says")

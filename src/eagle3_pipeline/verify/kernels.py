"""The per-token reductions of the verify pass as one compiled loop (numba; vllm depends on it too).

Owns `reduce_tokens`: for every token t of a batch's arena (raw record bytes, [N, L, H] bf16 or fp8
with per-token scales) it converts the token's L slots to fp32 once, into a buffer that stays in
L1/L2, and takes from that buffer, in the same pass:
  sum[t, a], min[t, a], max[t, a]   over H
  gram[t, a, b]  = x_t,a . x_t,b    (the squared norms on the diagonal)
  cross[t, a, b] = x_t,a . x_t-1,b  (0 for the batch's first token)
  final[t]       = x_t,L-1          (fp32, for the final-layer check; only with keep_final)
The torch version it replaces made seven passes over each fp32 block (convert, sum, amin, amax, two
batched matmuls of [L, H] x [H, L], the final copy), each one a call with its own overhead; this loop
reads each converted value from cache and runs without the GIL, so compute threads overlap
(bench/verify_throughput.py).

Non-finite values: sums and the Gram diagonal are computed without fast-math assumptions about
NaN/Inf, so a NaN or Inf anywhere in a slot makes its sum (and squared norm) non-finite, which is what
marks the record a suspect (verify/structure.py reads a suspect again for the exact diagnosis). The
extrema are taken with NaN-free fast math (vectorised): on a record with non-finite values they are
not meaningful, and that record is a suspect anyway.
Compiled on first use and cached beside this file (`cache=True`): seconds once per installation.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(nogil=True, cache=True, fastmath={"reassoc", "contract"}, boundscheck=False)
def _dot(x, y, n):
    d = np.float32(0.0)
    for h in range(n):
        d += x[h] * y[h]
    return d


@njit(nogil=True, cache=True, fastmath={"reassoc", "contract"}, boundscheck=False)
def _sum(x, n):
    s = np.float32(0.0)
    for h in range(n):
        s += x[h]
    return s


@njit(nogil=True, cache=True, fastmath={"nnan", "ninf", "nsz", "reassoc"}, boundscheck=False)
def _extrema(x, n):
    lo = x[0]
    hi = x[0]
    for h in range(n):
        v = x[h]
        lo = v if v < lo else lo
        hi = v if v > hi else hi
    return lo, hi


@njit(nogil=True, cache=True, boundscheck=False)
def _reduce(src, bf16, N, L, H, lut, scales, out_sum, out_min, out_max, gram, cross, final, keep_final):
    bits = np.zeros((2, L, H), np.uint32)  # the current and the previous token, fp32 bit patterns
    vals = bits.view(np.float32)
    for t in range(N):
        c = t & 1
        p = 1 - c
        base = t * L * H
        for a in range(L):
            o = base + a * H
            if bf16:  # a bf16 value is the top half of the fp32 one
                row_bits = bits[c, a]
                for h in range(H):
                    row_bits[h] = np.uint32(src[o + h]) << 16
            else:  # fp8: the value of each of the 256 bit patterns, times the token's scale
                row = vals[c, a]
                s = scales[t]
                for h in range(H):
                    row[h] = lut[src[o + h]] * s
        for a in range(L):
            x = vals[c, a]
            out_sum[t, a] = _sum(x, H)
            lo, hi = _extrema(x, H)
            out_min[t, a] = lo
            out_max[t, a] = hi
            for b in range(a, L):
                d = _dot(x, vals[c, b], H)
                gram[t, a, b] = d
                gram[t, b, a] = d
            for b in range(L):
                cross[t, a, b] = _dot(x, vals[p, b], H) if t > 0 else np.float32(0.0)
        if keep_final:
            x = vals[c, L - 1]
            for h in range(H):
                final[t, h] = x[h]


_FP8_LUT: np.ndarray | None = None


def fp8_values() -> np.ndarray:
    """fp32 [256]: the value of every float8_e4m3fn bit pattern."""
    global _FP8_LUT
    if _FP8_LUT is None:
        import torch

        _FP8_LUT = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    return _FP8_LUT


def reduce_tokens(raw: np.ndarray, storage_dtype: str, N: int, L: int, H: int, scales: np.ndarray | None,
                  keep_final: bool) -> dict[str, np.ndarray]:
    """The reductions (module doc) of the first N tokens of `raw` (uint8: the arena's record bytes,
    [N, L, H] of `storage_dtype`; fp8 with `scales` fp32 [N]). Returns fp32 numpy arrays
    sum/min/max [N, L], gram/cross [N, L, L], final [N, H] (or None)."""
    out = {"sum": np.empty((N, L), np.float32), "min": np.empty((N, L), np.float32),
           "max": np.empty((N, L), np.float32), "gram": np.empty((N, L, L), np.float32),
           "cross": np.empty((N, L, L), np.float32)}
    final = np.empty((N, H) if keep_final else (1, 1), np.float32)
    bf16 = storage_dtype == "bf16"
    src = raw[:N * L * H * (2 if bf16 else 1)]
    src = src.view(np.uint16) if bf16 else src
    lut = fp8_values() if not bf16 else np.zeros(1, np.float32)
    sc = scales[:N] if scales is not None else np.ones(1, np.float32)
    _reduce(src, bf16, N, L, H, lut, sc, out["sum"], out["min"], out["max"], out["gram"], out["cross"], final,
            keep_final)
    out["final"] = final if keep_final else None
    return out

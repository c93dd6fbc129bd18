"""Every row, aux layers: each stored layer slot must stand in the relation to the other slots that
its layer has — the same order, the same neighbours — in every record.

A record's content varies too much for absolute per-slot statistics to tell adjacent layers apart
(tried: per-slot mean direction and norm; clean records overlapped permuted ones). Relations between
the slots of one record do not: per token, the residual stream's norm grows with depth and a deeper
layer's state is closer to the final one, so "fraction of tokens where slot b's norm exceeds slot
a's" and "fraction of tokens where slot b is closer (cosine) to the last slot than slot a" sit near
0 or 1 for every record and flip when two slots are swapped; and adjacent slots of the same token are
similar (mean cosine; fraction of tokens below cosine 0.5) and each token's state is nearer its own
token's state in the next slot than the neighbouring tokens' (a slot shifted by a token flips this),
which states of another request or of a shifted span break. `TokenQuantities` computes these features per record in the structure pass (the
same read); `learn` takes the median and MAD of each feature over the records (robust: a few percent
of bad records do not move them); a record fails when a feature is more than `max_z` robust
deviations from the median. A whole extraction with a wrong layer id is consistent with itself: that
is the reference check's job (verify/reference.py); the final slot is also checked against the
target's logits (verify/fingerprint.py).

Calibration (clean extraction of 112 records of the tiny Llama, ids 2/4/5/8, this machine):
  largest robust deviation of a clean record:            8.9
  a record with two aux slots swapped (2<->4, 4<->5, 2<->5):   >= 38  (all of them)
  one aux slot taken from another record (other request):   median 35, min 3.3 (rows sharing a
                                                              template prefix; see fingerprint/invariance)
Default max_z (VerifyConfig.identity_max_z) 20; feature scale floor 0.03 (fractions of short rows).
"""

from __future__ import annotations

import numpy as np

MIN_FILES = 8     # fewer good records than this: no profiles (noted)
MAD_TO_SIGMA = 1.4826
SCALE_FLOOR = 0.03
LOW_COSINE = 0.5


def feature_names(layer_ids: list[int]) -> list[str]:
    L, names = len(layer_ids), []
    for a in range(L - 1):
        for b in range(a + 1, L):
            names.append(f"layers {layer_ids[a]}/{layer_ids[b]}: share of tokens whose norm grows")
            if b < L - 1:
                names.append(f"layers {layer_ids[a]}/{layer_ids[b]}: share of tokens nearer the last layer")
    for a in range(L - 1):
        names.append(f"layers {layer_ids[a]}/{layer_ids[a + 1]}: mean token cosine")
        names.append(f"layers {layer_ids[a]}/{layer_ids[a + 1]}: share of tokens below cosine {LOW_COSINE}")
        names.append(f"layers {layer_ids[a]}/{layer_ids[a + 1]}: share of tokens nearest their own token (not a neighbour)")
    return names


class TokenQuantities:
    """The per-token quantities the features are means of, filled chunk by chunk (the structure pass
    converts a record to fp32 a cache-sized block of tokens at a time): per token t and slot a, the
    norm, the cosine with the last slot, the cosine with slot a+1 of the same token and of tokens t-1
    and t+1 (which is why a chunk comes with one token of context on each side)."""

    def __init__(self, T: int, L: int):
        import torch

        self.T, self.L = T, L
        self.norm = torch.zeros(T, L)
        self.near_last = torch.zeros(T, L)
        self.c = torch.zeros(T, max(L - 1, 0))
        self.prev = torch.zeros(T, max(L - 1, 0))
        self.nxt = torch.zeros(T, max(L - 1, 0))

    def add(self, x, t0: int, t1: int, lo: int) -> None:
        """x fp32 [m, L, H] holds tokens lo .. lo+m-1 of the record; fill tokens t0 .. t1-1 (with
        lo <= t0 - 1 and lo + m >= t1 + 1 wherever those tokens exist)."""
        import torch

        n = torch.linalg.vector_norm(x, dim=-1)  # [m, L]
        u = x / n.clamp_min(1e-12).unsqueeze(-1)  # [m, L, H]
        s = slice(t0 - lo, t1 - lo)
        self.norm[t0:t1] = n[s]
        self.near_last[t0:t1] = (u[s] * u[s, -1:]).sum(dim=-1)
        self.c[t0:t1] = (u[s, :-1] * u[s, 1:]).sum(dim=-1)
        p0, p1 = max(t0, 1), min(t1, self.T - 1)  # tokens with both neighbours
        if p1 > p0:
            i = slice(p0 - lo, p1 - lo)
            self.prev[p0:p1] = (u[i, :-1] * u[p0 - 1 - lo:p1 - 1 - lo, 1:]).sum(dim=-1)
            self.nxt[p0:p1] = (u[i, :-1] * u[p0 + 1 - lo:p1 + 1 - lo, 1:]).sum(dim=-1)

    def features(self) -> np.ndarray:
        """The features (`feature_names` order), each a mean over the record's tokens, computed for all
        slot pairs at once (a few tensor operations instead of a few per pair: records are many and small)."""
        import torch

        L, T = self.L, self.T
        grows = (self.norm[:, None, :] > self.norm[:, :, None]).float().mean(dim=0)  # [a, b]: norm of b > norm of a
        nearer = (self.near_last[:, None, :] > self.near_last[:, :, None]).float().mean(dim=0)
        cos_mean, cos_low = self.c.mean(dim=0), (self.c < LOW_COSINE).float().mean(dim=0)  # [L - 1]
        if T >= 3:  # token t of slot a against tokens t-1, t+1 of slot a+1: a shifted slot aligns off by one
            own = (self.c[1:-1] > torch.maximum(self.prev[1:-1], self.nxt[1:-1])).float().mean(dim=0)
        else:
            own = torch.ones(L - 1)
        f = []
        for a in range(L - 1):
            for b in range(a + 1, L):
                f.append(grows[a, b])
                if b < L - 1:
                    f.append(nearer[a, b])
        f += [x for a in range(L - 1) for x in (cos_mean[a], cos_low[a], own[a])]
        return torch.stack(f).numpy().astype(np.float32)


def learn(sigs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Profiles from signatures [files, F]: (median [F], scale [F])."""
    med = np.median(sigs, axis=0)
    mad = np.median(np.abs(sigs - med), axis=0) * MAD_TO_SIGMA
    return med, np.maximum(mad, SCALE_FLOOR)


def problems_of(sigs: np.ndarray, med: np.ndarray, scale: np.ndarray, layer_ids: list[int],
                max_z: float) -> tuple[list[tuple[int, str]], float]:
    """([(file index, message)] for records beyond `max_z`, the largest deviation of any record)."""
    z = np.abs(sigs - med) / scale  # [files, F]
    names = feature_names(layer_ids)
    out = []
    for f in np.nonzero(z.max(axis=1) > max_z)[0]:
        j = int(np.argmax(z[f]))
        out.append((int(f), f"aux layers do not relate like layers {layer_ids}: {names[j]} is {sigs[f, j]:.3f}, "
                            f"typically {med[j]:.3f} ({z[f, j]:.0f} robust deviations, max {max_z:g}): slots "
                            f"permuted, shifted or taken from another request in this record"))
    return out, float(z.max()) if z.size else 0.0

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
which states of another request or of a shifted span break. `signature` computes these features per record in the structure pass (the
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


def signature(x) -> np.ndarray:
    """float32 [F] of one record x fp32 [T, L, H] (features in `feature_names` order)."""
    import torch

    L = x.shape[1]
    n = torch.linalg.vector_norm(x, dim=-1)  # [T, L]
    u = x / n.clamp_min(1e-12).unsqueeze(-1)  # [T, L, H]
    near_last = (u * u[:, -1:]).sum(dim=-1)  # [T, L]: cosine with the last slot
    f = []
    for a in range(L - 1):
        for b in range(a + 1, L):
            f.append((n[:, b] > n[:, a]).float().mean())
            if b < L - 1:
                f.append((near_last[:, b] > near_last[:, a]).float().mean())
    for a in range(L - 1):
        c = (u[:, a] * u[:, a + 1]).sum(dim=-1)  # [T]
        f.append(c.mean())
        f.append((c < LOW_COSINE).float().mean())
        if x.shape[0] >= 3:  # token t of slot a against tokens t-1, t+1 of slot a+1: a shifted slot aligns off by one
            prev = (u[1:-1, a] * u[:-2, a + 1]).sum(dim=-1)
            nxt = (u[1:-1, a] * u[2:, a + 1]).sum(dim=-1)
            f.append((c[1:-1] > torch.maximum(prev, nxt)).float().mean())
        else:
            f.append(torch.tensor(1.0))
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

"""Layer identity, shared by verify (every record) and online training (every row the server sends).
Every row, aux layers: each stored layer slot must stand in the relation to the other slots that
its layer has — the same order, the same neighbours — in every record.

More: docs/internals.md, "checks/layer_identity.py".
"""

from __future__ import annotations

import numpy as np

MIN_FILES = 8     # fewer good records than this: no profiles (noted)
MAD_TO_SIGMA = 1.4826
SCALE_FLOOR = 0.03
LOW_COSINE = 0.5
# "nearest its own token": a neighbour within this cosine of the token's own next-slot state is a tie, not a
# miss. In a run of one repeated token (a real model's loops: "000…" for hundreds of tokens) neighbours'
# states are the token's own to ~0.01, so a strict comparison is a coin flip: clean SmolLM2 rows of such loops
# scored 0.40-0.56 against a median 0.99 (robust deviation 19.6 of 20). With the tie they score 0.99, and a
# slot shifted by one token still scores ~0.00-0.15 on ordinary rows (docs/verification.md, "Calibration").
OWN_TIE = 0.02


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


def features(gram, cross, starts, lengths) -> np.ndarray:
    """The features (`feature_names` order) of every record of a batch, [files, F] float32, from the
    scan's per-token products (verify/scan.py `reduce_batch`): `gram` fp32 [N, L, L] (x_t,a . x_t,b),
    `cross` fp32 [N, L, L] (x_t,a . x_t-1,b), the records' tokens at `starts` with `lengths` (in the
    batch's token order). Per token t and slot a: the norm (the Gram diagonal), the cosine with the
    last slot, with slot a+1 of the same token and of tokens t-1 and t+1 (cross products whose other
    token is in another record are not used); each feature a mean over the record's tokens."""
    import torch

    N, L = gram.shape[0], gram.shape[1]
    starts_t = torch.as_tensor(np.asarray(starts, dtype=np.int64))
    lens_t = torch.as_tensor(np.asarray(lengths, dtype=np.int64))
    pos = torch.arange(N) - torch.repeat_interleave(starts_t, lens_t)  # token position within its record
    end = torch.repeat_interleave(lens_t, lens_t)                       # its record's length
    d = torch.diagonal(gram, dim1=1, dim2=2)                            # [N, L] squared norms
    norm = d.clamp_min(0).sqrt()
    inv = 1.0 / norm.clamp_min(1e-12)
    ia, ib = torch.arange(L - 1), torch.arange(1, L)
    near_last = gram[:, :, L - 1] * inv * inv[:, L - 1:L]               # [N, L]
    c = gram[:, ia, ib] * inv[:, :-1] * inv[:, 1:]                     # [N, L-1]: slot a vs a+1, same token
    prev = torch.zeros_like(c)
    nxt = torch.zeros_like(c)
    if N > 1:
        prev[1:] = cross[1:, ia, ib] * inv[1:, :-1] * inv[:-1, 1:]     # token t slot a vs token t-1 slot a+1
        nxt[:-1] = cross[1:, ib, ia] * inv[:-1, :-1] * inv[1:, 1:]     # token t slot a vs token t+1 slot a+1
    grows = (norm[:, None, :] > norm[:, :, None]).float()               # [N, a, b]: norm of b > norm of a
    nearer = (near_last[:, None, :] > near_last[:, :, None]).float()
    interior = ((pos >= 1) & (pos <= end - 2)).float()[:, None]          # tokens with both neighbours
    own = (c > torch.maximum(prev, nxt) - OWN_TIE).float() * interior   # [N, L-1]
    per_token = torch.cat([grows.reshape(N, L * L), nearer.reshape(N, L * L), c, (c < LOW_COSINE).float(), own,
                           interior], dim=1).double().numpy()
    st = np.asarray(starts, dtype=np.int64)
    sums = np.add.reduceat(per_token, st, axis=0) if len(st) else np.zeros((0, per_token.shape[1]))
    n = np.asarray(lengths, dtype=np.float64)[:, None]
    means = sums / n
    cut = np.cumsum([L * L, L * L, L - 1, L - 1, L - 1])  # per_token's column groups, in order; then `interior`
    g, nr, cos_mean, cos_low = np.split(means, cut, axis=1)[:4]
    g, nr = g.reshape(-1, L, L), nr.reshape(-1, L, L)
    own_sum, inner = np.split(sums, cut, axis=1)[4:]
    own_mean = np.where(inner > 0, own_sum / np.maximum(inner, 1), 1.0)  # records of < 3 tokens: 1
    cols = []
    for a in range(L - 1):
        for b in range(a + 1, L):
            cols.append(g[:, a, b])
            if b < L - 1:
                cols.append(nr[:, a, b])
    for a in range(L - 1):
        cols += [cos_mean[:, a], cos_low[:, a], own_mean[:, a]]
    return np.stack(cols, axis=1).astype(np.float32) if cols else np.zeros((len(st), 0), np.float32)


def row_features(hidden) -> np.ndarray:
    """The features of one record from its states (torch [T, L, H], any float dtype): the same products
    the verify scan takes (fp32 Gram of each token's slots, cross Gram with the previous token), so a
    row sent to online training is judged against the profiles the verify gate learned from the sample."""
    import torch

    x = hidden.float()
    T = x.shape[0]
    gram = torch.bmm(x, x.transpose(1, 2))                                  # [T, L, L]
    cross = torch.zeros_like(gram)
    if T > 1:
        cross[1:] = torch.bmm(x[1:], x[:-1].transpose(1, 2))               # x_t,a . x_t-1,b
    return features(gram, cross, [0], [T])[0]


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

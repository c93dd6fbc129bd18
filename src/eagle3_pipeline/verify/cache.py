"""What verify keeps per record so that a re-run reads only new or re-extracted shards.

Owns `<extract-dir>/verify_rows.safetensors` (no pickle): per verified-good record its row, token
count, bytes, statistics [STAT_ROWS, L], identity signature [F], fingerprint agreement and state-sketch margin,
and the shard hash that ties a shard's entry in verify.json to its files: sha256 over the manifest's record and
fingerprint hashes of the shard and each file's size and mtime (shard_hash). A shard is reused when verify.json holds
the same hash, for the same content key and the same verify settings, and every row of it is in the cache; its records
are not read again, but they still take part in everything learned over all records (norm bounds, layer profiles,
statistics), so a new shard is judged against the whole extraction.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from eagle3_pipeline.core.store import atomic_write
from eagle3_pipeline.verify.structure import STAT_ROWS, FileResult

CACHE_NAME = "verify_rows.safetensors"


def shard_hash(entry, version) -> str:
    """Identity of a published shard's files: the manifest's sha256 of each record and fingerprint
    plus each file's size and mtime as it is now (a stat, no read), so a file replaced or edited
    after verify is read again even when the manifest was not touched (`entry`: shardrun.ShardEntry)."""
    stats = []
    files, fps = entry.files, entry.fingerprints or {}
    for name in sorted(files):
        p = version.hidden_states_dir / name
        st = p.stat() if p.exists() else None
        stats.append([name, st.st_size if st else -1, st.st_mtime_ns if st else -1])
    for name in sorted(fps):
        p = version.fingerprints_dir / name
        st = p.stat() if p.exists() else None
        stats.append([name, st.st_size if st else -1, st.st_mtime_ns if st else -1])
    blob = json.dumps({"rows": [entry.row_start, entry.row_end], "files": files, "fingerprints": fps, "stat": stats},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def save(path: Path, results: list) -> None:
    """Store the good per-file results (structure.FileResult with stats) atomically."""
    import torch
    from safetensors.torch import save_file

    good = [r for r in results if not r.problems and r.stats is not None]
    if not good:
        Path(path).unlink(missing_ok=True)
        return
    t = {"row": torch.tensor([r.row for r in good], dtype=torch.int64), **_columns(good)}
    atomic_write(Path(path), lambda p: save_file(t, str(p)))


def load(path: Path) -> dict:
    """{row: structure.FileResult} of a cache file ({} when there is none or it is unreadable)."""
    from safetensors.numpy import load_file

    try:
        t = load_file(str(path))
    except Exception:  # noqa: BLE001 - no cache (or a damaged one): everything is read again
        return {}
    if t["stats"].ndim != 3 or t["stats"].shape[1] != STAT_ROWS:  # written by an older verify: read again
        return {}
    return {row: _result(t, i, row) for i, row in enumerate(t["row"].tolist())}


def _columns(rs: list) -> dict:
    """The cached columns of good per-file results (structure.FileResult), one row each."""
    import torch

    def opt(name: str):
        return torch.tensor([np.nan if getattr(r, name) is None else getattr(r, name) for r in rs], dtype=torch.float32)

    t = {"tokens": torch.tensor([r.tokens for r in rs], dtype=torch.int64),
         "nbytes": torch.tensor([r.nbytes for r in rs], dtype=torch.int64),
         "stats": torch.from_numpy(np.stack([r.stats for r in rs]).astype(np.float64)),  # [R, STAT_ROWS, L]
         "agreement": opt("agreement"), "fp_margin": opt("fp_margin"), "sketch_margin": opt("sketch_margin"),
         "next": torch.tensor([[-1, -1] if r.next_scored is None else [r.next_hits, r.next_scored] for r in rs],
                              dtype=torch.int64),  # [R, 2]: prediction.hits
         "gaps": torch.tensor([[np.nan] * 3 if r.gaps is None else list(r.gaps) for r in rs],
                              dtype=torch.float64)}  # [R, 3]: row_signal's sums (sum, sum of squares, count)
    if all(r.sig is not None for r in rs):
        t["sig"] = torch.from_numpy(np.stack([r.sig for r in rs]).astype(np.float32))  # [R, F]
    return t


def _result(t: dict, i: int, row: int):
    """Row i of cached columns as a structure.FileResult."""
    a = float(t["agreement"][i])
    return FileResult(row=row, tokens=int(t["tokens"][i]), nbytes=int(t["nbytes"][i]), stats=t["stats"][i],
                       sig=t["sig"][i] if "sig" in t else None, agreement=None if np.isnan(a) else a,
                       fp_margin=_margin(t, i), sketch_margin=_margin(t, i, "sketch_margin"),
                       **_next(t, i))


def _next(t: dict, i: int) -> dict:
    out = {}
    if "gaps" in t and not np.isnan(np.asarray(t["gaps"][i], dtype=np.float64)).any():
        g = np.asarray(t["gaps"][i], dtype=np.float64).tolist()
        out["gaps"] = (g[0], g[1], int(g[2]))
    if "next" not in t or int(t["next"][i][1]) < 0:
        return out
    return {**out, "next_hits": int(t["next"][i][0]), "next_scored": int(t["next"][i][1])}


# ---------------------------------------------------------------- the record pool's cache
# `<pool dir>/verify/<verify config key>.safetensors`: per pooled record (row key) its good result and
# the identity of the files it was computed from: [dev, inode, size, mtime_ns] of the record and the
# inode of its fingerprint (-1: none). A version whose record of a row is the same inode as the pool's
# record (a hard link: pool.py), unchanged since, reuses that result without reading the file.
POOL_CACHE_DIR = "verify"


def pool_cache_path(pool, config_key: str) -> Path:
    return pool.dir / POOL_CACHE_DIR / f"{config_key}.safetensors"


def file_identity(record: Path, fingerprint: Path | None) -> list[int] | None:
    """[dev, inode, size, mtime_ns, fingerprint inode or -1] of a record (None when it is missing)."""
    try:
        st = os.stat(record)
        fp = os.stat(fingerprint).st_ino if fingerprint is not None and os.path.exists(fingerprint) else -1
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, fp]


def load_pool(path: Path) -> dict[str, tuple[list[int], object]]:
    """{row key: (file identity, structure.FileResult with row -1)} ({} when missing or unreadable)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            keys = json.loads(f.metadata()["keys"])
            t = {k: f.get_tensor(k) for k in f.keys()}
    except Exception:  # noqa: BLE001 - no cache (or a damaged one): those records are read again
        return {}
    if t["stats"].ndim != 3 or t["stats"].shape[1] != STAT_ROWS:  # written by an older verify: read again
        return {}
    return {rk: (t["ident"][i].tolist(), _result(t, i, -1)) for i, rk in enumerate(keys)}


def save_pool(pool, config_key: str, new: dict[str, tuple[list[int], object]]) -> None:
    """Merge `new` ({row key: (identity, good FileResult)}) into the pool's cache, under the pool's
    lock, dropping entries whose pooled record is gone or changed (gc, a record verify rejected)."""
    import torch
    from safetensors.torch import save_file

    path = pool_cache_path(pool, config_key)
    with pool.lock(None):
        entries = {**load_pool(path), **new}
        keep = {rk: (ident, r) for rk, (ident, r) in entries.items()
                if (now := file_identity(pool.record(rk), None)) is not None and now[:4] == list(ident[:4])}
        if not keep:
            path.unlink(missing_ok=True)
            return
        ks = sorted(keep)
        rs = [keep[k][1] for k in ks]
        t = {"ident": torch.tensor([keep[k][0] for k in ks], dtype=torch.int64), **_columns(rs)}  # ident [R, 5]
        atomic_write(path, lambda p: save_file(t, str(p), metadata={"keys": json.dumps(ks)}))


def _margin(t: dict, i: int, key: str = "fp_margin") -> float | None:
    """A cached record's fingerprint (or state sketch) clean margin (None in caches written before it was kept)."""
    if key not in t:
        return None
    m = float(t[key][i])
    return None if np.isnan(m) else m

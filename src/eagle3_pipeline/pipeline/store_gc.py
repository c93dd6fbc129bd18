"""Garbage collection of the run store (`eagle3 gc --keep N [--apply]`).

More: docs/internals.md, "pipeline/store_gc.py".
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from eagle3_pipeline.core.store import LOCK_NAME, file_locks, within
from eagle3_pipeline.records.lineage import prepare_versions
from eagle3_pipeline.records.pool import RecordPool
from eagle3_pipeline.records.shardrun import MANIFEST_NAME, ShardRun
from eagle3_pipeline.verify import cache


class GcPlan(BaseModel):
    keep: int
    applied: bool
    kept: list[str] = []         # prepare version dirs kept (all datasets)
    removed: list[str] = []      # prepare version dirs removed (or to remove, dry run)
    files: int = 0               # files whose last link goes (version dirs + pool)
    bytes: int = 0               # their bytes (st_size)
    pool_files: int = 0          # of those, record-pool files
    pool_bytes: int = 0


def _inodes(root: Path) -> dict[tuple[int, int], tuple[int, int, int]]:
    """{(dev, ino): (links under root, st_nlink, size)} of the regular files under `root`."""
    out: dict[tuple[int, int], list[int]] = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                st = os.lstat(os.path.join(dirpath, f))
            except OSError:
                continue
            if not os.path.isfile(os.path.join(dirpath, f)) or os.path.islink(os.path.join(dirpath, f)):
                continue
            e = out.setdefault((st.st_dev, st.st_ino), [0, st.st_nlink, st.st_size])
            e[0] += 1
    return {k: tuple(v) for k, v in out.items()}


def _pool_files(dataset_dir: Path) -> list[Path]:
    root = dataset_dir / "pool"
    return sorted(p for p in root.glob("*/*/??/*.safetensors")) if root.is_dir() else []


def _pools(dataset_dir: Path) -> list[Path]:
    root = dataset_dir / "pool"
    return sorted(p for p in root.glob("*/*") if p.is_dir()) if root.is_dir() else []


def _version_locks(prep_dir: Path) -> list[Path]:
    """The locks writers of a prepare version hold: its own, and per extract version the shard,
    verify and manifest locks and every train dir's lock."""
    locks = [prep_dir / LOCK_NAME]
    for ex in prep_dir.glob(f"*/*/{MANIFEST_NAME}"):
        d = ex.parent
        locks += sorted((d / "locks").glob("*.lock")) + [ShardRun(d).lock_path]
        locks += sorted(p / LOCK_NAME for p in (d / "train").glob("*") if p.is_dir())
    return locks


def gc(store_root: Path, keep: int, apply: bool = False, log: Callable[[str], None] = print) -> GcPlan:
    """Plan (and with `apply`, do) the removal of all but the `keep` newest versions per dataset."""
    if keep < 1:
        raise ValueError(f"gc: --keep must be >= 1, got {keep}")
    store_root = Path(store_root)
    plan = GcPlan(keep=keep, applied=apply)
    datasets = sorted(d for d in store_root.iterdir() if d.is_dir() and prepare_versions(d)) if store_root.is_dir() else []
    for ds in datasets:
        versions = prepare_versions(ds)
        kept, gone = versions[:keep], versions[keep:]
        plan.kept += [str(v) for v in kept]
        plan.removed += [str(v) for v in gone]
        removed_links: dict[tuple[int, int], int] = {}
        for v in gone:
            for ino, (n, nlink, size) in _inodes(v).items():
                removed_links[ino] = removed_links.get(ino, 0) + n
                if n == nlink:  # every link of this file is inside the removed version
                    plan.files += 1
                    plan.bytes += size
        for p in _pool_files(ds):
            st = os.stat(p)
            if st.st_nlink - removed_links.get((st.st_dev, st.st_ino), 0) <= 1:
                plan.pool_files += 1
                plan.pool_bytes += st.st_size
        if not apply:
            continue
        for v in gone:
            with file_locks(_version_locks(v), lambda p: f"gc of {p}", log):
                shutil.rmtree(within(ds, v.name))
            log(f"gc: removed {v}")
        for pd in _pools(ds):
            pool = RecordPool(pd, pd.name)
            with pool.lock(log):
                n = 0
                for p in sorted(pd.glob("??/*.safetensors")):
                    if os.stat(p).st_nlink == 1:  # no version links it any more
                        p.unlink()
                        n += 1
                for sub in pd.glob("??"):
                    try:
                        sub.rmdir()  # only when empty
                    except OSError:
                        pass
            for c in (pd / cache.POOL_CACHE_DIR).glob("*.safetensors"):
                cache.save_pool(pool, c.stem, {})  # drops entries of records gone
            log(f"gc: record pool {pd}: {n} unreferenced files removed")
    plan.files += plan.pool_files
    plan.bytes += plan.pool_bytes
    return plan

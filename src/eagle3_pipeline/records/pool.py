"""The record pool: hidden-state records addressed by row content, shared by every extract version.

More: docs/internals.md, "records/pool.py".
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from eagle3_pipeline.core.store import content_key, file_lock, model_fingerprint, slug, within

POOL_DIR = "pool"
RECORD_SUFFIX = ".safetensors"
FP_SUFFIX = ".fp.safetensors"
_SEQ = itertools.count()


def pool_key(target, layer_ids: list[int], storage_dtype: str, connector: str, tensor_parallel_size: int,
             engine: dict) -> str:
    """Everything but the row that determines a record's bytes (target: config.TargetConfig), including the
    engine settings that change a record's values (`engine`: the caller's engine.cpu_build_kwargs())."""
    obj = {"model": model_fingerprint(target.model, target.revision), "layers": list(layer_ids),
           "storage": storage_dtype, "connector": connector, "dtype": target.dtype, "tp": int(tensor_parallel_size),
           "sidecar": "state_sketch"}  # sidecars carry the engine's state sketch: pools of earlier ones are not reused
    if engine:
        obj["engine"] = engine
    return content_key(obj, 16)


def pool_location(dataset_dir: Path, model: str, key: str) -> Path:
    """<store>/<dataset>/pool/<model slug>/<pool key>/"""
    return within(dataset_dir, POOL_DIR, slug(model), key)


def row_keys(tokenized_dir: str | Path, rows: Iterable[int], key: str,
             lengths: dict[int, int] | None = None) -> dict[int, str]:
    """{row: row key} for rows of a tokenized dataset: sha256 of the pool key and the row's token ids
    as int64 bytes (read from the memory-mapped Arrow column; no Python lists). `lengths`, when
    given, is filled with each row's token count."""
    from datasets import load_from_disk

    ds = load_from_disk(str(tokenized_dir))
    if ds._indices is not None:  # not the case for save_to_disk output; kept correct anyway
        ds = ds.flatten_indices()
    col = ds.data.column("input_ids").combine_chunks()  # list<int64>
    offs = col.offsets.to_numpy()
    vals = col.values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    prefix = key.encode()
    out = {}
    for r in rows:
        h = hashlib.sha256(prefix)
        h.update(vals[offs[r]:offs[r + 1]].tobytes())
        out[r] = h.hexdigest()[:32]
        if lengths is not None:
            lengths[r] = int(offs[r + 1] - offs[r])
    return out


def _same_file(a: Path, b: Path) -> bool:
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_ino, sa.st_dev) == (sb.st_ino, sb.st_dev)


class RecordPool:
    """One pool directory (one model + layers + storage + engine numerics)."""

    def __init__(self, directory: str | Path, key: str):
        self.dir = Path(directory)
        self.key = key

    # -- paths
    def record(self, rk: str) -> Path:
        return self.dir / rk[:2] / f"{rk}{RECORD_SUFFIX}"

    def fingerprint(self, rk: str) -> Path:
        return self.dir / rk[:2] / f"{rk}{FP_SUFFIX}"

    @property
    def lock_path(self) -> Path:
        return self.dir / "locks" / "pool.lock"

    @contextlib.contextmanager
    def lock(self, log: Callable[[str], None] | None = None) -> Iterator[None]:
        """The pool's lock: every link into or out of the pool (and gc's sweep) happens under it, so
        a temporary link left in `tmp/` when it is taken belongs to a holder that died: removed."""
        with file_lock(self.lock_path, f"record pool {self.dir}", log):
            if self.tmp_dir.is_dir():
                for t in self.tmp_dir.iterdir():
                    t.unlink(missing_ok=True)
            yield

    @property
    def tmp_dir(self) -> Path:
        return self.dir / "tmp"

    def has(self, rk: str, fingerprint: bool) -> bool:
        return self.record(rk).is_file() and (not fingerprint or self.fingerprint(rk).is_file())

    # -- links (callers hold `lock()`)
    def link(self, src: Path, dst: Path) -> bool:
        """Make `dst` a hard link to `src` atomically: a link under the pool's `tmp/` (the store's
        filesystem), then os.replace onto `dst`. False if `src` is gone."""
        dst.parent.mkdir(parents=True, exist_ok=True)
        if _same_file(src, dst):
            return True
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.tmp_dir / f"{dst.name}.{os.getpid()}.{next(_SEQ)}"
        tmp.unlink(missing_ok=True)
        try:
            os.link(src, tmp)
        except FileNotFoundError:
            return False
        try:
            os.replace(tmp, dst)
        finally:
            tmp.unlink(missing_ok=True)
        return True

    def link_into(self, rk: str, record_dst: Path, fp_dst: Path | None) -> bool:
        """Link the pooled record (and fingerprint when `fp_dst`) of `rk` into a version; False when the
        pool does not hold it (then nothing is linked)."""
        if not self.has(rk, fp_dst is not None):
            return False
        if fp_dst is not None and not self.link(self.fingerprint(rk), fp_dst):
            return False
        return self.link(self.record(rk), record_dst)

    def adopt(self, rk: str, record_src: Path, fp_src: Path | None) -> None:
        """Put a version's newly written record (and fingerprint) into the pool. A complete pair the
        pool already holds is kept (a version linking it keeps its bytes either way: replacing a
        directory entry never changes another link's inode); an incomplete one (a record without the
        fingerprint asked for) is replaced by this pair, so a record and its fingerprint always come
        from the same engine pass."""
        if self.has(rk, fp_src is not None):
            return
        if fp_src is not None:
            self.link(fp_src, self.fingerprint(rk))
        self.link(record_src, self.record(rk))

    def forget(self, rk: str, version_record: Path) -> bool:
        """Remove the pool's record of `rk` (and its fingerprint) when `version_record` is a link to it:
        verify rejected that record, so the next extraction must re-extract it, not link it again."""
        if not _same_file(self.record(rk), version_record):
            return False
        self.record(rk).unlink(missing_ok=True)
        self.fingerprint(rk).unlink(missing_ok=True)
        return True

    def is_pooled(self, rk: str, version_record: Path) -> bool:
        return _same_file(self.record(rk), version_record)


def version_pool(version) -> RecordPool | None:
    """The RecordPool of an ExtractVersion (None for versions planned without one)."""
    if not getattr(version, "pool_dir", None):
        return None
    return RecordPool(Path(version.pool_dir), Path(version.pool_dir).name)

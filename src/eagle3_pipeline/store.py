"""The run store: paths, content-addressed versions, atomic writes and the extract manifest.

Owns the layout of DESIGN §2:
  <root>/<dataset>/<tok-version>/{tokenized/, token_freq.json, quarantine.jsonl, prepare.json}
  <root>/<dataset>/<tok-version>/<model>/<extract-version>/{hidden_states/, manifest.json, vocab/}
A version is a short sha256 of a JSON-canonical description of everything that determines the bytes.
Every file is written as `name.tmp-<tag>` in the same directory, fsynced, then `os.replace`d, so a
reader never sees a partial file under its final name.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
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


def atomic_write(path: Path, write: Callable[[Path], None], tag: str = "0") -> Path:
    """Call `write(tmp)` on a temporary name beside `path`, fsync it, then rename into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{tag}-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
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


def slug(name: str) -> str:
    """A path-safe name for a model or dataset (last path component, odd characters replaced)."""
    base = str(name).rstrip("/").split("/")[-1] or "root"
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in base)


def model_fingerprint(model: str, revision: str | None = None) -> str:
    """Identity of a target model without reading terabytes: config/tokenizer contents plus the names
    and sizes of weight files (a hub name without a local copy is identified by name@revision)."""
    p = Path(model)
    if not p.is_dir():
        return content_key({"model": model, "revision": revision}, 16)
    h = hashlib.sha256()
    for f in sorted(x for x in p.rglob("*") if x.is_file()):
        rel = str(f.relative_to(p))
        if f.suffix in (".json", ".jinja", ".txt", ".model", ".py"):
            h.update(f"{rel}:{sha256_file(f)}".encode())
        elif f.suffix in (".safetensors", ".bin", ".pt"):
            h.update(f"{rel}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def extract_key(prepare_version: str, model_fp: str, layer_ids: list[int], storage_dtype: str,
                connector: str = "eagle3_pipeline.extract.connector.Eagle3HiddenStatesConnector") -> str:
    return content_key({"tokenized": prepare_version, "model": model_fp, "layers": list(layer_ids),
                        "storage": storage_dtype, "connector": connector})


def extract_dir(prepare_dir: Path, model: str, key: str) -> Path:
    """<store>/<dataset>/<tok-version>/<model>/<extract-version>/"""
    return Path(prepare_dir) / slug(model) / key

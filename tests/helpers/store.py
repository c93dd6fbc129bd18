"""Helpers for tests that compare run-store directories after crashes and concurrent runs
(tests/chaos/, tests/integration/test_concurrency.py): file hashes, the deterministic part of an
extract manifest, leftover temporaries, and our processes found by an environment tag. Also the
one set of small-run overrides (`small_overrides`) that every test starting many engines uses."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

# Manifest fields that record how a run went rather than what it produced: timestamps, the child
# attempts, per-shard attempt counts, durations and the last error. Everything else in the manifest
# (content key, layer ids, config, tool versions, each shard's rows, status, tokens, bytes and file
# hashes) must be the same after a crash and resume as after one clean run.
VOLATILE_TOP = ("updated_at", "children", "invariance")  # invariance: rows of the attempt that finished
VOLATILE_SHARD = ("attempts", "seconds", "phases", "error", "published_at")


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def hidden_state_hashes(extract_dir: Path) -> dict[str, str]:
    """{hs_i.safetensors: sha256} of every record under its final name."""
    return {p.name: sha256(p) for p in sorted((Path(extract_dir) / "hidden_states").glob("hs_*.safetensors"))}


def manifest_content(extract_dir: Path, ignore_config: tuple[str, ...] = ()) -> dict:
    """The manifest without its VOLATILE fields (and without the `config.extract` keys in
    `ignore_config`, for settings a test varies on purpose that do not change the bytes)."""
    m = json.loads((Path(extract_dir) / "manifest.json").read_text())
    for k in VOLATILE_TOP:
        m.pop(k, None)
    for k in ignore_config:
        m["config"]["extract"].pop(k, None)
    m["shards"] = [{k: v for k, v in s.items() if k not in VOLATILE_SHARD} for s in m["shards"]]
    return m


def temporaries(root: Path) -> list[Path]:
    """Files or dirs named like an unfinished atomic write (`*.tmp-*`, `*.tmp`) under `root`."""
    root = Path(root)
    return sorted(p for p in root.rglob("*") if ".tmp-" in p.name or p.name.endswith(".tmp"))


def scratch_left(extract_dir: Path) -> list[Path]:
    scratch = Path(extract_dir) / ".scratch"
    return sorted(scratch.rglob("*")) if scratch.exists() else []


def processes_with_env(key: str, value: str) -> list[int]:
    """Pids of live (non-zombie) processes other than this one whose environment has key=value."""
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.status() != psutil.STATUS_ZOMBIE and p.environ().get(key) == value:
                found.append(p.pid)
        except (psutil.Error, OSError):
            pass
    return found


def describe_processes(pids: list[int]) -> list[str]:
    """A line per pid for an assertion message: status, process group, parent, age and command line."""
    import time

    import psutil

    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            out.append(f"pid {pid} {p.status()} pgid {os.getpgid(pid)} ppid {p.ppid()} "
                       f"age {time.time() - p.create_time():.1f}s: {' '.join(p.cmdline())[:160]}")
        except (psutil.Error, OSError) as e:
            out.append(f"pid {pid}: {type(e).__name__}")
    return out


SMALL_ROWS_PER_SOURCE, SMALL_ROWS_PER_SHARD = 14, 4


def small_overrides(tiny_target: Path, store: Path) -> list[str]:
    """configs/tiny-cpu.yaml cut down to ~24 rows in shards of 4 (one engine start dominates a run)."""
    corpus = tiny_target / "corpus"
    n = SMALL_ROWS_PER_SOURCE
    return [f"store={store}", f"target.model={tiny_target}",
            f"prepare.sources=[{{path: {corpus / 'sharegpt.jsonl'}, limit: {n}}}, {{path: {corpus / 'openai.jsonl'}, limit: {n}}}]",
            "prepare.heldout_rows=4", f"extract.rows_per_shard={SMALL_ROWS_PER_SHARD}", "verify.reference_samples=0",
            "verify.allow_skip=[reference]",
            "train.epochs=2", "train.max_seq_len=256"]

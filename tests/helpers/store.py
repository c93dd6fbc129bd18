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


def manifest_content(extract_dir: Path, ignore_config: tuple[str, ...] = (), file_hashes: bool = True) -> dict:
    """The manifest without its VOLATILE fields (and without the `config.extract` keys in
    `ignore_config`, for settings a test varies on purpose that do not change the bytes). With
    `file_hashes=False` each shard's record files are listed by name only: for records another engine
    process computed, which `same_records` compares instead."""
    m = json.loads((Path(extract_dir) / "manifest.json").read_text())
    for k in VOLATILE_TOP:
        m.pop(k, None)
    for k in ignore_config:
        m["config"]["extract"].pop(k, None)
    m["shards"] = [{k: v for k, v in s.items() if k not in VOLATILE_SHARD} for s in m["shards"]]
    if not file_hashes:
        for s in m["shards"]:
            for k in ("files", "fingerprints"):
                if isinstance(s.get(k), dict):
                    s[k] = sorted(s[k])
    return m


# A vLLM CPU engine is not bitwise reproducible from one process to the next. In the CI run of 2026-12-06 one
# group engine of ~15 stored every token after the first with ~2.5% of its bf16 elements one step off (the
# attention, token 0 exact), consistently within that engine: each (token, layer) vector within 0.0022 of its
# length, where a neighbouring row's states sit >= 0.28 away. Records from two engine processes are therefore
# compared by content: bytes, or failing that the same tensors, integers equal, floats within ROUNDING.
ROUNDING = 1e-2


def record_matches(path: Path, ref: Path) -> bool:
    """Assert the safetensors record at `path` holds what `ref` holds: byte-equal (True), or the same header
    metadata, keys, dtypes and shapes, integer tensors equal and every float vector (last dim) within
    ROUNDING of the reference's mean vector length (False: equal at rounding level only)."""
    import torch
    from safetensors import safe_open

    if sha256(path) == sha256(ref):
        return True
    with safe_open(str(path), "pt") as a, safe_open(str(ref), "pt") as b:
        assert a.metadata() == b.metadata(), f"{path.name}: metadata {a.metadata()} != {b.metadata()}"
        assert sorted(a.keys()) == sorted(b.keys()), f"{path.name}: tensors {sorted(a.keys())} != {sorted(b.keys())}"
        for k in a.keys():
            x, y = a.get_tensor(k), b.get_tensor(k)
            assert (x.dtype, x.shape) == (y.dtype, y.shape), f"{path.name}: {k} {x.dtype}{list(x.shape)} != {y.dtype}{list(y.shape)}"
            if not x.is_floating_point():
                assert torch.equal(x, y), f"{path.name}: {k} differs at {(x != y).nonzero()[:5].tolist()}"
                continue
            x, y = x.float(), y.float()
            err = float((x - y).norm(dim=-1).max() / y.norm(dim=-1).mean().clamp_min(1e-30))
            assert err <= ROUNDING, f"{path.name}: {k} off by {err:.3g} of its vectors' mean length (> {ROUNDING})"
    return False


def same_records(out_dir: Path, ref_dir: Path) -> list[str]:
    """Assert the extraction at `out_dir` stored the reference's records (hidden states and fingerprint
    sidecars, every file by `record_matches`). Returns the files equal at rounding level only, and says so."""
    rounding = []
    for sub, pattern in (("hidden_states", "hs_*.safetensors"), ("fingerprints", "fp_*.safetensors")):
        got = {p.name: p for p in (Path(out_dir) / sub).glob(pattern)}
        want = {p.name: p for p in (Path(ref_dir) / sub).glob(pattern)}
        assert sorted(got) == sorted(want), f"{sub}: {sorted(set(got) ^ set(want))} in one only"
        rounding += [name for name in sorted(got) if not record_matches(got[name], want[name])]
    if rounding:
        print(f"\n{len(rounding)} records equal to the reference at rounding level, not byte for byte (another "
              f"engine process; tests/helpers/store.ROUNDING): {rounding}")
    return rounding


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

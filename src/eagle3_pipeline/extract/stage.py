"""What the extract manifest holds, and running groups of shards of an `ExtractVersion` in one engine child
(the attempts, publishing and recovery are the shard run's: shardrun.py; here the job, files and events)

More: docs/internals.md, "extract/stage.py".
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field
from pydantic.json_schema import SkipJsonSchema

from eagle3_pipeline import FORMAT_VERSION
from eagle3_pipeline.core.config import ExtractConfig, PipelineConfig, TargetConfig
from eagle3_pipeline.core.stage_spec import CHILD, IO, Log, Retry, StageSpec
from eagle3_pipeline.core.store import file_locks, sha256_file, write_json
from eagle3_pipeline.engine.build import engine_env
from eagle3_pipeline.engine.start import refusal_of
from eagle3_pipeline.extract.worker import ExtractJob, ShardSpec
from eagle3_pipeline.records.contracts import fingerprint_name, record_name, row_hash
from eagle3_pipeline.records.layout import FINGERPRINTS_DIR, MANIFEST_NAME, ExtractVersion, Shard, plan_shards  # noqa: F401 (re-exported)
from eagle3_pipeline.records.pool import RecordPool, row_keys, version_pool
from eagle3_pipeline.records.results import ExtractResult  # the stage's record (records/results.py)
from eagle3_pipeline.records.shardrun import (
    Attempt,
    Child,
    ChildAttempt,
    ShardEntry,
    ShardRun,
    ShardSummary,
    hashes,
    published_ok,
    tool_versions,
)

LOCKS_DIR = "locks"
WORKER_MODULE = "eagle3_pipeline.extract.worker"


class ExtractFailed(RuntimeError):
    """Some shards of a group are not published; the message names them and the child's error."""


class ShardRecord(ShardSummary):
    """One shard as the manifest knows it after an extract_group call (shardrun.ShardSummary's fields)."""
    reused: bool = False  # True when this call found it published and left it alone


@dataclass
class _Group:
    """One extract_group call, passed whole: its settings, version, manifest, record pool and callbacks."""
    cfg: ExtractConfig
    target: TargetConfig
    version: ExtractVersion
    run: ShardRun
    log: Callable[[str], None]
    on_shard: Callable[[dict], None] | None = None
    pool: RecordPool | None = None


def _ensure_manifest(g: _Group) -> None:
    """Create the manifest, or check that an existing one is for the same content key; a changed
    shard plan (rows_per_shard) starts a fresh shard table (files are rewritten identically)."""
    version, cfg, plan = g.version, g.cfg, g.version.shards

    def fresh(m: dict) -> dict | None:
        if m and m.get("layer_ids") != version.layer_ids:
            raise ExtractFailed(f"{g.run.path}: layer ids {m.get('layer_ids')} recorded, {version.layer_ids} "
                                f"asked for under the same content key {version.content_key!r}")
        ranges = [[s.row_start, s.row_end] for s in plan]
        if m and [[s["row_start"], s["row_end"]] for s in m.get("shards", [])] == ranges:
            return None
        if m:
            g.log(f"extract: shard plan changed ({len(m.get('shards', []))} -> {len(plan)} shards); "
                  f"starting a fresh shard table in {g.run.path}")
        return dict(format_version=FORMAT_VERSION, content_key=version.content_key,
                    config={"extract": cfg.model_dump(), "target": g.target.model_dump(),
                            "state_sketch": bool(cfg.fingerprints)},  # sidecars carry state_sketch.KEY
                    tools=tool_versions(), layer_ids=version.layer_ids,
                    num_rows=plan[-1].row_end if plan else 0, rows_per_shard=cfg.rows_per_shard,
                    children=m.get("children", []),
                    shards=[ShardSummary(**s.model_dump(), status="pending").model_dump() for s in plan])

    g.run.ensure(version.content_key, fresh)


def _check_published(hs_dir: Path, entry: ShardEntry) -> str | None:
    """None if every file of a published shard is present and hashes to the manifest, else why not."""
    expected = {record_name(r) for r in range(entry.row_start, entry.row_end)}
    if set(entry.files) != expected:
        return f"its manifest entry lists {len(entry.files)} files, expected {len(expected)}"
    fp_dir = hs_dir.parent / FINGERPRINTS_DIR
    return published_ok({**{hs_dir / n: sha for n, sha in entry.files.items()},
                         **{fp_dir / n: sha for n, sha in (entry.fingerprints or {}).items()}})


def _job(g: _Group, shards: list[Shard], attempt: Attempt, subsets: dict[int, list[int]]) -> ExtractJob:
    cfg, version, hs_dir = g.cfg, g.version, g.version.hidden_states_dir
    return ExtractJob(
        target=g.target, engine=cfg.engine(), layer_ids=version.layer_ids, hidden_size=version.dims.hidden_size,
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
        tokenized_dir=str(Path(version.tokenized_dir).resolve()),
        hidden_states_dir=str(hs_dir.resolve()), scratch_dir=str(attempt.scratch.resolve()),
        storage_dtype=version.storage_dtype, attempt=attempt.number,
        connector_module=cfg.connector_module, connector_name=cfg.connector_name,
        fingerprints_dir=str((hs_dir.parent / FINGERPRINTS_DIR).resolve()) if cfg.fingerprints else None,
        invariance_rows=cfg.invariance_rows,
        shards=[ShardSpec(**s.model_dump(), rows=subsets.get(s.index)) for s in shards])


def extract_group(cfg: ExtractConfig, target: TargetConfig, version: ExtractVersion, shard_ids: list[int], *,
                  log: Callable[[str], None], force: bool = False,
                  on_shard: Callable[[dict], None] | None = None) -> list[ShardRecord]:
    """Publish the shards `shard_ids` of `version`, starting at most one engine child for those not
    already published (all of them when `force`). Returns their records in shard order. Raises
    ExtractFailed naming the unpublished shards and the child's error tail; the shards it did
    finish stay published, so a retry only does the rest."""
    out_dir, plan = version.path, version.shards
    bad = sorted(k for k in shard_ids if not 0 <= k < len(plan))
    if bad:
        raise ValueError(f"shard ids {bad} outside the plan of {len(plan)} shards "
                         f"({version.rows} rows, {version.rows_per_shard} per shard)")
    g = _Group(cfg, target, version, ShardRun(out_dir, "extract", ExtractFailed), log, on_shard)
    _ensure_manifest(g)

    wanted = sorted(set(shard_ids))
    reused, todo = set(), []
    # Hold the shards' locks from the decision below until the child is gone: a concurrent run of
    # the same shards waits here and then finds them published (no second engine, no interleaved writes).
    with file_locks([shard_lock_path(out_dir, k) for k in wanted],
                    lambda p: f"extract shard {p.stem.rsplit('-', 1)[-1]} of {out_dir}", log):
        g.run.recover_abandoned(wanted, lambda c: _clean_abandoned(g, c))
        entries = g.run.read().shards
        for k in wanted:
            if not force and entries[k].status == "published":
                why = _check_published(version.hidden_states_dir, entries[k])
                if why is None:
                    reused.add(k)
                    continue
                log(f"extract: shard {k} was published but {why}; extracting it again")
            todo.append(k)
        g.pool, subsets = version_pool(version), {}
        if todo and g.pool is not None:
            subsets = _link_from_pool(g, [plan[k] for k in todo], link=not force)
            todo = [k for k in todo if subsets[k].missing]
        if todo:
            _run_group(g, [plan[k] for k in todo], subsets)
        else:
            log(f"extract: shards {wanted} published (from the store or the record pool); no engine started")
        entries = g.run.read_raw()["shards"]
    return [ShardRecord(**entries[k], reused=k in reused) for k in wanted]


class _Subset(BaseModel):
    """What the record pool left to extract of one shard (row -> row key and token count for all its rows)."""
    keys: dict[int, str]
    tokens: dict[int, int]
    missing: list[int]    # rows the engine must extract
    reused: int           # rows linked from the pool


def _link_from_pool(g: _Group, shards: list[Shard], link: bool = True) -> dict[int, _Subset]:
    """Called holding the shards' locks: link every row of `shards` the pool holds into the version
    (record + fingerprint, atomically) and publish the shards that are then complete (no engine).
    Returns per shard what is left to extract (everything when not `link`: a forced re-extraction,
    whose records still go into the pool where it lacks them)."""
    pool, version, log = g.pool, g.version, g.log
    rows = [r for s in shards for r in range(s.row_start, s.row_end)]
    lengths: dict[int, int] = {}
    keys = row_keys(version.tokenized_dir, rows, pool.key, lengths)
    out: dict[int, _Subset] = {}
    entries = g.run.read().shards
    with pool.lock(log):
        for s in shards:
            span = range(s.row_start, s.row_end)
            _distrust(pool, version, entries[s.index], keys, log)
            missing = [r for r in span if not link or not pool.link_into(
                keys[r], version.record_path(r), version.fingerprint_path(r) if g.cfg.fingerprints else None)]
            out[s.index] = _Subset(keys={r: keys[r] for r in span}, tokens={r: lengths[r] for r in span},
                                   missing=missing, reused=len(span) - len(missing))
    linked = sum(x.reused for x in out.values())
    log(f"extract: record pool {pool.dir}: {linked} of {len(rows)} rows of shards {[s.index for s in shards]} "
        f"linked, {len(rows) - linked} to extract")
    for s in shards:
        sub = out[s.index]
        if not sub.missing:
            _publish(g, s, {"files": [], "tokens": 0, "seconds": 0.0}, sub)
            log(f"extract: shard {s.index} published from the record pool ({sub.reused} rows, no engine)")
            if g.on_shard:
                g.on_shard({"shard": s.index, "tokens": sum(sub.tokens.values()), "seconds": 0.0})
    return out


def _distrust(pool: RecordPool, version: ExtractVersion, entry: ShardEntry, keys: dict[int, str],
              log: Callable[[str], None]) -> None:
    """A shard published before whose file no longer hashes to the manifest: when that file is the
    pool's record (a hard link), the pool's copy changed too; take it out of the pool so the row is
    extracted again instead of linked back."""
    files, fps = entry.files, entry.fingerprints or {}
    if not files:
        return
    for r in range(entry.row_start, entry.row_end):
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


def _remove_attempt_files(out_dir: Path, attempt: int, scratch: Path) -> list[Path]:
    """Remove what child `attempt` left: its scratch dir and its half-written files (`*.tmp-<attempt>-*`,
    a tag no other attempt uses); returns the half-written files removed."""
    left = [*(out_dir / "hidden_states").glob(f"*.tmp-{attempt}-*"),
            *(out_dir / FINGERPRINTS_DIR).glob(f"*.tmp-{attempt}-*"), *(out_dir / "jobs").glob(f"extract-{attempt}.json.tmp-*")]
    shutil.rmtree(scratch, ignore_errors=True)
    with contextlib.suppress(OSError):
        scratch.parent.rmdir()  # only when empty: another group may be using its own scratch
    for tmp in left:
        tmp.unlink(missing_ok=True)
    return left


def _clean_abandoned(g: _Group, c: ChildAttempt) -> None:
    """An attempt whose parent was killed before it could close it: remove what its child left
    (a parent that lives removes its child's itself)."""
    out_dir, a = g.version.path, c.attempt
    left = _remove_attempt_files(out_dir, a, Path(c.scratch or _scratch_dir(g.cfg, out_dir, a)))
    g.log(f"extract: child {a} (shards {c.shards}, parent {c.owner}) was abandoned; removing its "
          f"scratch dir and {len(left)} half-written files")


def _run_group(g: _Group, shards: list[Shard], subsets: dict[int, _Subset]) -> None:
    """One engine child for `shards` (of each only the rows `subsets` leaves missing, when given);
    each shard is published when the child reports it done, its new records put into the pool."""
    cfg, out_dir, run, log = g.cfg, g.version.path, g.run, g.log
    attempt = run.open_attempt([s.index for s in shards], lambda a: _scratch_dir(cfg, out_dir, a))
    partial = {k: v.missing for k, v in subsets.items() if v.reused}
    job_path = write_json(out_dir / "jobs" / f"extract-{attempt.number}.json",
                          _job(g, shards, attempt, partial).model_dump())
    log_path = out_dir / "logs" / f"extract-{attempt.number}.log"
    log(f"extract: child {attempt.number} for shards {[s.index for s in shards]} (log {log_path})")
    by_index = {s.index: s for s in shards}

    def on_event(ev: dict) -> None:
        if ev.get("kind") == "engine_ready":
            log(f"extract: engine ready after {ev['seconds']:.1f}s")
        elif ev.get("kind") == "shard_done":
            k = int(ev["shard"])
            _publish(g, by_index[k], ev, subsets.get(k))
            attempt.published.add(k)
            log(f"extract: shard {k} published ({ev['tokens']} tokens in {ev['seconds']:.2f}s)")
            if g.on_shard:
                g.on_shard({"shard": k, "tokens": ev["tokens"], "seconds": ev["seconds"]})
        elif ev.get("kind") == "invariance":
            with run.edit() as m:
                m.setdefault("invariance", {})[str(int(ev["row"]))] = {
                    k: ev[k] for k in ("layers", "shifts", "error") if k in ev} | {"attempt": attempt.number}

    child = Child(module=WORKER_MODULE, job_path=job_path, log_path=log_path,
                  timeout_s=group_deadline(cfg, len(shards)), env=engine_env(cfg),
                  refusal=lambda e, log_path: refusal_of(e, log_path, "extract", cfg, "prepare.max_length"))
    # a record cut off mid-write by a kill (ours only) goes with the scratch dir
    run.run_child(attempt, child, on_event, log,
                  cleanup=lambda: _remove_attempt_files(out_dir, attempt.number, attempt.scratch))


def group_deadline(cfg: ExtractConfig, shards: int) -> float:
    """Seconds one child may run for `shards` shards: the fixed `timeout_s`, or per shard plus start-up."""
    return cfg.timeout_s if cfg.shard_timeout_s is None else cfg.start_timeout_s + cfg.shard_timeout_s * shards


def _publish(g: _Group, shard: Shard, ev: dict, sub: _Subset | None = None) -> None:
    """Publish a shard whose extracted rows (`ev["files"]`: all rows, or `sub.missing`) are written and
    whose other rows were linked from the pool; puts the new records into the pool first."""
    hs_dir, pool = g.version.hidden_states_dir, g.pool
    span = range(shard.row_start, shard.row_end)
    extracted = list(span) if sub is None else sub.missing
    expected = [record_name(r) for r in extracted]
    if sorted(ev["files"]) != sorted(expected):
        raise ExtractFailed(f"shard {shard.index}: child reported files {ev['files'][:3]}... "
                            f"({len(ev['files'])}), expected {len(expected)} named {expected[:1]}..{expected[-1:]}")
    fp_dir = hs_dir.parent / FINGERPRINTS_DIR
    names = [record_name(r) for r in span]
    fp_names = [fingerprint_name(r) for r in span] if sub is not None and g.cfg.fingerprints \
        else ev.get("fingerprint_files") or []
    if pool is not None and sub is not None:
        with pool.lock(None):
            for r in extracted:
                pool.adopt(sub.keys[r], hs_dir / record_name(r), fp_dir / fingerprint_name(r) if fp_names else None)
    absent = [n for n in names if not (hs_dir / n).is_file()] + [n for n in fp_names if not (fp_dir / n).is_file()]
    if absent:
        raise ExtractFailed(f"shard {shard.index}: {len(absent)} files missing after extraction and pool links, "
                            f"e.g. {absent[0]}")
    tokens = int(ev["tokens"]) + (sum(sub.tokens[r] for r in span if r not in set(extracted)) if sub else 0)

    def drop_invariance(m: dict) -> None:
        inv = m.get("invariance") or {}
        for r in span:  # judged on the previous records of these rows
            inv.pop(str(r), None)

    g.run.publish(shard.index, dict(
        tokens=tokens, bytes=sum((hs_dir / n).stat().st_size for n in names), seconds=float(ev["seconds"]),
        phases=ev.get("phases"), files=hashes({n: hs_dir / n for n in names}),
        fingerprints=hashes({n: fp_dir / n for n in fp_names}), extracted_rows=len(extracted),
        reused_rows=len(span) - len(extracted), extracted_tokens=int(ev["tokens"]),
        row_hashes=(ev.get("row_hashes") or {}) | _row_hashes(g.version.tokenized_dir, sorted(set(span) - set(extracted)))),
        also=drop_invariance)


def _row_hashes(tokenized_dir, rows: list[int]) -> dict[str, str]:
    """contracts.row_hash of `rows` of the tokenized dataset, as the extract child takes it for the rows it
    extracts: for the rows linked from the record pool, so that verify's mask check judges them too."""
    if not rows:
        return {}
    from datasets import load_from_disk

    ds = load_from_disk(str(tokenized_dir)).select(rows).with_format("numpy", columns=["input_ids", "loss_mask"])
    return {str(r): row_hash(rec["input_ids"], rec["loss_mask"]) for r, rec in zip(rows, ds)}


def summarize(out_dir: Path, since: float | None = None) -> ExtractResult:
    """The ExtractResult of a version dir, from its manifest alone. `since` (epoch seconds, a run's
    start): the row counts are that run's work, and shards published before it count as from the store."""
    run = ShardRun(out_dir)
    m = run.read()
    pub = m.published()
    now = pub if since is None else [s for s in pub if (s.published_at or 0) >= since]
    old = [s for s in pub if s not in now]
    tokens, seconds = sum(s.tokens for s in pub), sum(s.seconds or 0 for s in pub)
    extracted = sum(s.tokens if s.extracted_tokens is None else s.extracted_tokens for s in pub)  # pool links took no time
    return ExtractResult(content_key=m.content_key, dir=str(Path(out_dir).resolve()),
                         layer_ids=m.layer_ids, shards_total=len(m.shards), shards_published=len(pub),
                         tokens=tokens, tokens_per_s=round(extracted / seconds, 1) if seconds else 0.0,
                         bytes_on_disk=sum(s.bytes for s in pub),
                         hidden_states_dir=str((Path(out_dir) / "hidden_states").resolve()),
                         manifest=str(run.path.resolve()),
                         rows_extracted=sum(s.rows if s.extracted_rows is None else s.extracted_rows for s in now),
                         rows_reused=sum(s.reused_rows for s in now),
                         rows_from_store=sum(s.rows for s in old),
                         cached=since is not None and bool(pub) and not now)


class ExtractInputs(BaseModel):
    version: ExtractVersion
    shard_ids: list[int]  # one group: one engine child publishes these shards
    force: bool = False  # extract again even the published shards
    on_shard: SkipJsonSchema[Callable[[dict], None] | None] = Field(None, exclude=True)  # each shard's event, as it lands


def run(cfg: PipelineConfig, inputs: ExtractInputs, log: Log) -> list[ShardRecord]:
    """The stage's entry (StageSpec.run): one group of shards."""
    return extract_group(cfg.extract, cfg.target, inputs.version, inputs.shard_ids, log=log, force=inputs.force,
                         on_shard=inputs.on_shard)


RETRY = Retry(2, 5, (*IO, *CHILD, RuntimeError),
              "engine child per shard group (crash, OOM, lost node); a retry extracts only the shards not yet "
              "published", count="extract.retries")
STAGE = StageSpec(name="extract", run=run, result=list[ShardRecord], failure=ExtractFailed,
                  worker="eagle3_pipeline.extract.worker", accelerators=True, own_job=True, task="extract-group",
                  retry=RETRY)

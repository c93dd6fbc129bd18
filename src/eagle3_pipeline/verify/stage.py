"""The verify gate: every record, every row — structure, statistics, norm bounds, layer identity of
the aux layers and the final layer against the target's own logits — plus a numeric reference on a
few samples and the batch-invariance numbers the extract engine measured; recorded per version.

More: docs/internals.md, "verify/stage.py".
"""

from __future__ import annotations

import copy
import math
import shutil
import time

from pydantic import BaseModel

from eagle3_pipeline.core.config import PipelineConfig, TargetConfig, VerifyConfig, skipped_checks
from eagle3_pipeline.core.errors import GateFailed
from eagle3_pipeline.core.stage_spec import CHILD, IO, Log, Retry, StageSpec
from eagle3_pipeline.core.store import content_key, file_lock, read_json, sha256_file, write_json
from eagle3_pipeline.data.tokenized import load_tokenized
from eagle3_pipeline.records.contracts import fingerprints_off_problem, record_name
from eagle3_pipeline.records.layout import ExtractVersion
from eagle3_pipeline.records.pool import row_keys, version_pool
from eagle3_pipeline.records.shardrun import ShardEntry, ShardManifest, ShardRun, mark_rows_failed
from eagle3_pipeline.records.verification import Extent, ReferenceCheckResult, VerifyResult
from eagle3_pipeline.verify import cache
from eagle3_pipeline.verify.check import Outcome
from eagle3_pipeline.verify.extent import Evidence, assess
from eagle3_pipeline.verify.fingerprint import final_layer_check
from eagle3_pipeline.verify.invariance import Invariance
from eagle3_pipeline.verify.masks import RowMasks, prepared_hashes
from eagle3_pipeline.verify.reference import (
    ReferenceResult,
    choose_rows,
    power_statement,
    reference_check,
    reference_size,
)
from eagle3_pipeline.verify.structure import Extras, StructureCheck, verify_structure

# verify settings that change no verdict: a new value keeps the verified shards
CONFIG_KEY_EXCLUDE = frozenset({"workers", "move_bad_files"})
# bump when what verify computes per record changes (identity features, fingerprint rule): cached
# per-record results of an older verify are then read again
VERIFY_FORMAT = 7  # 7: the next-token logit gaps (row_signal.py)


class VerifyFailed(GateFailed):
    """The gate found bad data; the message lists the problems (file, sample, layer, shapes)."""


def unrunnable(cfg: VerifyConfig, final_skipped: str | None, ref_skipped: str | None, ref_wanted: bool) -> list[str]:
    """Problems for the checks against the model itself that could not run and that verify.allow_skip
    does not name: a check that cannot run is not a check that passed."""
    out = []
    hint = "make it runnable here, or set verify.allow_skip: [{}] to go on without it (the report says so)"
    if final_skipped and "fingerprint" not in cfg.allow_skip:
        out.append(f"verify: the final-layer fingerprint check cannot run: {final_skipped}; " + hint.format("fingerprint"))
    if ref_wanted and ref_skipped and "reference" not in cfg.allow_skip:
        out.append(f"verify: the reference check did not run: {ref_skipped}. It is the only check that proves which "
                   f"layer each aux slot holds and what the target computes for a row: make it run (a local copy of "
                   f"the model's safetensors, verify.reference_memory_gb for one layer, a transformers that builds "
                   f"the architecture, e.g. with its quantization package); only as a last resort name it in "
                   f"verify.allow_skip, and the report then says the layer map and the rows' computation are unproven")
    return out


def _sketch_skipped(cfg: VerifyConfig, man, fp_required: bool) -> str | None:
    """Why the records' state sketches are not required (None: every record must carry one)."""
    if not fp_required:
        return "no fingerprint sidecars (extract.fingerprints false): the sketches ride in them"
    if not man.config.get("state_sketch"):
        return "this extraction wrote no state sketches (extracted before they were kept, or the online server's rows)"
    if "state_sketch" in cfg.allow_skip:
        return "verify.allow_skip names state_sketch (records that carry one are still checked)"
    return None


def _confirm_learned(cfg: VerifyConfig, st, ref: ReferenceResult | None, why_not: str | None, log) -> list[int]:
    """Rows that only learned checks flagged (layer identity, norm bounds, predictions: judgements of records
    against each other) are recomputed with the target itself (in the reference's one streamed pass,
    verify.confirm_rows of them at most) before they may stop the run: a row the model agrees with is cleared,
    and says so. Rows past the cap, or when the reference could not run (`why_not`), stay flagged. Changes
    `st` in place; returns the cleared rows."""
    rows = st.learned_rows[: cfg.confirm_rows]
    if not rows:
        return []
    if ref is None or ref.skipped:
        log(f"verify: {len(rows)} rows flagged by learned checks stay flagged: the reference did not run "
            f"({why_not or (ref.skipped if ref else 'not asked')})")
        return []
    bad_ref = set(ref.bad_rows)
    cleared = [r for r in rows if r not in bad_ref]
    confirmed = tuple(f"hs_{r} " for r in rows if r in bad_ref)  # the target's own verdict joins the flag
    st.problems += [p for p in ref.problems if p.startswith(confirmed) and p not in st.problems] if confirmed else []
    if cleared:
        mine = tuple(f"{record_name(r)} (row {r}," for r in cleared)
        dropped = [p for p in st.problems if p.startswith(mine)]
        st.problems = [p for p in st.problems if not p.startswith(mine)]
        st.bad_rows = [r for r in st.bad_rows if r not in set(cleared)]
        st.cleared = {r: [p for p in dropped if p.startswith(f"{record_name(r)} (row {r},")] for r in cleared}
    more = len(st.learned_rows) - len(rows)
    log(f"verify: {len(rows)} rows flagged by learned checks recomputed with the target: {len(rows) - len(cleared)} "
        f"confirmed bad, {len(cleared)} cleared (the model agrees){f'; {more} more not confirmed' if more else ''}")
    return cleared


def _reference_pass(cfg: VerifyConfig, target: TargetConfig, version: ExtractVersion, sample: list[int],
                    learned: list[int], log):
    """(the reference over the sample and the learned flags' rows in one streamed pass, or None; why it is
    None). A failure raises when a sample was asked for (the gate cannot pass without it); with learned rows
    only, their flags stand and the log says why."""
    rows = sorted(set(sample) | set(learned))
    if not rows:
        return None, None
    try:
        return reference_check(target, version, rows, log=log, cfg=cfg), None
    except Exception as e:  # noqa: BLE001 - with learned rows only, the flags stand; say why they were not confirmed
        if sample:
            raise
        log(f"verify: the reference failed ({type(e).__name__}: {e})")
        return None, f"{type(e).__name__}: {e}"


def _config_key(cfg: VerifyConfig) -> str:
    return content_key({"verify": cfg.model_dump(exclude=set(CONFIG_KEY_EXCLUDE)), "format": VERIFY_FORMAT})


def verify(cfg: VerifyConfig, target: TargetConfig, version: ExtractVersion, *, log=print,
           rows: list[int] | None = None, fingerprints: bool | None = None) -> VerifyResult:
    """Check everything, record the result in `verify.json`, and return it (the caller raises on failure).
    Holds the extract dir's verify lock throughout. The invariance numbers come from the manifest, written by
    the engine that extracted the records.
    `rows`: check only these rows' records (a sample, e.g. the rows an online-training server produced
    before training: train/online.py); nothing is reused from caches or the record pool then, and
    `fingerprints` says whether every record must have its fingerprint (default: the manifest's setting)."""
    with file_lock(version.path / "locks" / "verify.lock", f"verify of {version.dir}", log):
        return _verify(cfg, target, version, log, rows, fingerprints)


def _reusable(cfg: VerifyConfig, version: ExtractVersion, shards: list[ShardEntry], log) -> tuple[dict, dict[str, str]]:
    """(cached results by row, hashes of the shards they cover) that this verify may reuse."""
    prev = read_json(version.verify_path)
    if not prev or prev.get("content_key") != version.content_key or prev.get("config_key") != _config_key(cfg):
        return {}, {}
    old = prev.get("shard_hashes") or {}
    now = {str(e.index): cache.shard_hash(e, version) for e in shards if e.status == "published"}
    ok = {k: h for k, h in now.items() if old.get(k) == h}  # one stat of each file per shard, not two
    if not ok:
        return {}, {}
    cached = cache.load(version.path / cache.CACHE_NAME)
    rows = {}
    for e in shards:
        if str(e.index) in ok:
            span = range(e.row_start, e.row_end)
            if all(r in cached for r in span):
                rows.update({r: cached[r] for r in span})
            else:
                ok.pop(str(e.index))
    return rows, ok


def _pool_reusable(cfg: VerifyConfig, version: ExtractVersion, pool, keys: dict[int, str], fp_required: bool) -> dict:
    """{row: FileResult} of rows whose record (and fingerprint) is a hard link to a pooled record
    that a verify with the same settings found good, unchanged since (verify/cache.py pool cache)."""
    if pool is None or not keys:
        return {}
    cached = cache.load_pool(cache.pool_cache_path(pool, _config_key(cfg)))
    out = {}
    for r, rk in keys.items():
        hit = cached.get(rk)
        if hit is None:
            continue
        ident = cache.file_identity(version.record_path(r), version.fingerprint_path(r) if fp_required else None)
        pooled = cache.file_identity(pool.record(rk), pool.fingerprint(rk) if fp_required else None)
        if ident is None or ident != pooled or ident != list(hit[0]) or (fp_required and ident[4] < 0):
            continue
        res = copy.copy(hit[1])
        res.row = r
        out[r] = res
    return out


def _pool_save(cfg: VerifyConfig, version: ExtractVersion, pool, keys: dict[int, str], results: list,
               fp_required: bool) -> None:
    """Record the good results of records read now that are the pool's (hard links) in its cache."""
    new = {}
    for res in results:
        rk = keys.get(res.row)
        if rk is None or res.problems or res.stats is None or not pool.is_pooled(rk, version.record_path(res.row)):
            continue
        ident = cache.file_identity(version.record_path(res.row), version.fingerprint_path(res.row) if fp_required else None)
        if ident is not None:
            new[rk] = (ident, res)
    if new:
        cache.save_pool(pool, _config_key(cfg), new)


def _verify(cfg: VerifyConfig, target: TargetConfig, version: ExtractVersion, log, sample: list[int] | None = None,
            fingerprints: bool | None = None) -> VerifyResult:
    return _VerifyRun(cfg, target, version, log, sample, fingerprints).run()


class _VerifyRun:
    """One verification of a version (or of an online sample's rows), its checks in the order each reads
    what the one before produced: which records to read, their structure and fingerprints, the reference,
    batch invariance and masks, then quarantine and the record."""

    def __init__(self, cfg: VerifyConfig, target: TargetConfig, version: ExtractVersion, log,
                 sample: list[int] | None, fingerprints: bool | None):
        self.cfg, self.target, self.version, self.log, self.sample = cfg, target, version, log, sample
        self.t0 = time.time()
        self.man = ShardRun(version.path).read(missing_ok=True)
        self.shards = self.man.shards
        self.ds = load_tokenized(version.tokenized_dir)
        fp_required = bool(self.man.config.get("extract", {}).get("fingerprints"))
        self.fp_required = fp_required if fingerprints is None else fingerprints
        self.sketch_skipped = _sketch_skipped(cfg, self.man, self.fp_required)

    def run(self) -> VerifyResult:
        cfg, version, ds, log = self.cfg, self.version, self.ds, self.log
        self.rows_to_read()
        st, final_skipped = self.structure()
        ref, ran_here, self.power = self.reference(st)
        bad_st = set(st.bad_rows)  # without the rows the target cleared
        inv = _invariance(cfg, version, self.man, ds, log, self.sample)
        # every row's tokens and mask, reused records' too (hashing the rows is cheap; a dataset can change under them)
        masks = RowMasks(ds, self.shards, prepared_hashes(version.tokenized_dir)).run(
            self.todo if self.sample is not None else list(range(len(ds))))
        off = fingerprints_off_problem(self.fp_required, cfg.allow_skip)
        problems = st.problems + [p for p in ref.problems if p not in st.problems] + _problems(inv) + _problems(
            masks) + ([off] if off else []) + unrunnable(
            cfg, final_skipped if self.fp_required else None, ref.skipped if ran_here else None, ran_here)
        bad_rows = sorted(bad_st | set(ref.bad_rows) | set(inv.flags) | set(masks.flags))
        extent, condemned = self.extent(st, inv, bad_rows, problems) if problems and bad_rows else (None, set())
        bad_rows = sorted(set(bad_rows) | getattr(self, "escalated_bad", set()))
        moved = self.quarantine(bad_rows) if problems and cfg.move_bad_files else []
        self.condemn(condemned, extent)
        res = self.record(st, ref, {"invariance": inv, "masks": masks}, problems, bad_rows, moved)
        res.extent = extent
        ran = ", ".join(f"{name} {c.records}" for name, c in res.checks.items() if c.ran)
        log(f"verify: checks run (records): {ran or 'none'}")
        for name, c in res.checks.items():
            if not c.ran:
                log(f"verify: check {name}: skipped ({c.skipped})")
        self.keep(st, set(bad_rows) | condemned)
        write_json(version.verify_path, res.model_dump())
        return res

    def keep(self, st, bad: set[int]) -> None:
        """The verified records' results into this version's cache and the record pool's: never a bad row's, nor
        one a failed gate condemned with its shard or its engine."""
        cache.save(self.version.path / cache.CACHE_NAME, [r for r in [*self.reused.values(), *st.results]
                                                          if r.row not in bad])
        if self.pool is not None:
            _pool_save(self.cfg, self.version, self.pool, self.keys, [r for r in st.results if r.row not in bad],
                       self.fp_required)

    def rows_to_read(self) -> None:
        """The rows whose records this run reads (`todo`); the others are reused: from this version's unchanged
        verified shards, or verified in another version through the record pool."""
        cfg, version, ds = self.cfg, self.version, self.ds
        if self.sample is not None:
            bad_ids = [r for r in self.sample if not 0 <= r < len(ds)]
            if bad_ids or not self.sample:
                raise ValueError(f"verify: sample rows {bad_ids or self.sample} outside the {len(ds)} rows of "
                                 f"{version.tokenized_dir}")
            self.reused, self.reused_hashes, self.pool, self.keys, self.from_pool = {}, {}, None, {}, {}
            self.todo = sorted(set(self.sample))
            return
        self.reused, self.reused_hashes = _reusable(cfg, version, self.shards, self.log)
        self.pool = version_pool(version)
        self.keys = row_keys(version.tokenized_dir, [r for r in range(len(ds)) if r not in self.reused],
                             self.pool.key) if self.pool else {}
        self.from_pool = _pool_reusable(cfg, version, self.pool, self.keys, self.fp_required)
        self.reused.update(self.from_pool)
        self.todo = [r for r in range(len(ds)) if r not in self.reused]

    def structure(self):
        """Every record read: structure, norms, identity, fingerprints, sketches, prediction. (result, why the
        final-layer check was skipped or None)"""
        cfg, version = self.cfg, self.version
        final, final_skipped = final_layer_check(self.target, version.dims, cfg, version.storage_dtype)
        if final_skipped:
            self.log(f"verify: final-layer fingerprint check skipped: {final_skipped}")
        extras = Extras(identity=cfg.identity_max_z is not None,
                         final=final, fingerprints_dir=str(version.fingerprints_dir),
                         fingerprints_required=self.fp_required, min_agreement=cfg.fingerprint_min_agreement,
                         sketch_required=self.sketch_skipped is None)
        self.log(f"verify: {len(self.todo)} records to read, {len(self.reused)} reused ({len(self.reused_hashes)} "
                 f"unchanged verified shards, {len(self.from_pool)} records verified in another version through "
                 f"the record pool)")
        check = StructureCheck(version.tokenized_dir, version.hidden_states_dir, version.layer_ids,
                               version.dims.hidden_size, version.storage_dtype, norm_samples=cfg.norm_bounds_samples,
                               norm_factor=cfg.norm_bounds_factor, norm_min_ratio=cfg.norm_bounds_min_ratio,
                               identity_max_z=cfg.identity_max_z, prediction_max_z=cfg.prediction_max_z,
                               prediction_cap=cfg.confirm_rows, surprise_max_z=cfg.prediction_surprise_max_z,
                               workers=cfg.workers)
        st = verify_structure(check, rows=self.todo, log=self.log, extras=extras, reused=list(self.reused.values()))
        if final_skipped:
            st.checks.fingerprint.skipped = final_skipped
        if self.sketch_skipped:  # records that carry a sketch are still checked
            st.checks.state_sketch.skipped = self.sketch_skipped
        return st, final_skipped

    def reference(self, st):
        """The reference sample and the rows learned checks flagged, recomputed in one streamed pass over the
        weights; the flagged rows the target clears leave `st`'s bad rows. (the sample's verdict, whether it
        ran here, its power)"""
        cfg, version, log = self.cfg, self.version, self.log
        bad_st = set(st.bad_rows)
        good_new = [r for r in self.todo if r not in bad_st and r < len(self.ds)]
        prev = _previous_reference(version)
        rows, power = _reference_rows(cfg, version, self.ds, good_new)
        if rows:
            log(f"verify: reference sample: {power['sampled']} of {power['rows']} rows; {power['says']}")
        learned = st.learned_rows[: cfg.confirm_rows]
        full, why_not = _reference_pass(cfg, self.target, version, rows, learned, log)
        self.sample_rows, self.full_ref = rows, full
        _confirm_learned(cfg, st, full, why_not, log)
        ref = ReferenceResult(samples_checked=[], max_rel_err=None, min_cosine=None, per_layer_max_rel_err={},
                              problems=[], skipped="reference_samples is 0")
        if rows:
            ref = _sample_part(full, rows, why_not)
        elif cfg.reference_samples != 0 and self.reused:
            ref.skipped = ("every record was verified before, unchanged since: in this version"
                           if prev.samples else
                           "every record was verified before, unchanged since: in the version the record pool took "
                           "it from")
            ref.samples_checked, ref.max_rel_err, ref.min_cosine = prev.samples, prev.max_rel_err, prev.min_cosine
        return ref, bool(rows), power

    def extent(self, st, inv, bad_rows: list[int], problems: list[str]) -> tuple[Extent, set[int]]:
        """How far the damage goes (verify/extent.py), after recomputing more rows of the shards where the target
        found rows computed wrongly (verify.escalate_rows); problems of the rows it names join `problems`. (the
        extent, the rows condemned: their records leave the pool and their shards are extracted again)"""
        cfg, version, log, full = self.cfg, self.version, self.log, getattr(self, "full_ref", None)
        recomputed = set(full.samples_checked) if full and not full.skipped else set()
        computed_bad = set(full.bad_rows if full else []) | set(inv.flags)
        escalated, self.escalated_bad = [], set()
        hit = [s for s in self.shards if any(s.row_start <= r < s.row_end for r in computed_bad)]
        named = set(bad_rows)
        todo = [r for s in hit for r in range(s.row_start, s.row_end) if r not in recomputed and r not in named]
        if computed_bad and cfg.escalate_rows and todo and self.sample is None:
            escalated = todo[:: max(1, math.ceil(len(todo) / cfg.escalate_rows))][: cfg.escalate_rows]
            log(f"verify: the target computed {len(computed_bad)} rows differently; recomputing {len(escalated)} more "
                f"rows of their {len(hit)} shard(s) to see how far it goes")
            more = reference_check(self.target, version, escalated, log=log, cfg=cfg)
            self.escalated_bad = set(more.bad_rows)
            computed_bad |= self.escalated_bad
            recomputed |= set(more.samples_checked)
            problems += [p for p in more.problems if p not in problems]
        record_bad = set(bad_rows) - computed_bad
        man = ShardRun(version.path).read(missing_ok=True)
        engine = {"the build": man.tools or "(see the manifest)",
                  "target dtype": self.target.dtype, **{k: man.config.get("extract", {}).get(k) for k in
                  ("tensor_parallel_size", "max_num_seqs", "enforce_eager")}, "storage_dtype": version.storage_dtype}
        ev = Evidence(self.sample_rows, computed_bad, record_bad, escalated, recomputed - computed_bad)
        ext = assess(ev, len(self.ds), self.shards, version.groups, engine)
        log(f"verify: extent: {ext.says}")
        if self.sample is not None:  # online: the server's rows are not stored; the stage stops before training
            return ext, set()
        if ext.verdict == "spread":
            return ext, set(range(len(self.ds)))
        if ext.verdict == "local":
            return ext, {r for s in self.shards if s.index in set(ext.hit_shards) | {
                i for g in ext.hit_groups for i in version.groups[g]} for r in range(s.row_start, s.row_end)}
        return ext, set()

    def condemn(self, rows: set[int], extent: Extent | None) -> None:
        """Rows a failed gate judged by their shard's or their engine's damage, not one by one: their records leave
        the record pool and their shards are marked failed, so the next extract computes them again."""
        if not rows:
            return
        version, log = self.version, self.log
        if self.pool is not None:
            keys = row_keys(version.tokenized_dir, sorted(r for r in rows if r < len(self.ds)), self.pool.key)
            with self.pool.lock(log):
                gone = sum(self.pool.forget(k, version.record_path(r)) for r, k in keys.items())
            log(f"verify: {gone} records of the condemned rows removed from the record pool")
        starts = [s.row_start for s in self.shards if any(s.row_start <= r < s.row_end for r in rows)]
        hit = mark_rows_failed(version.path, starts, f"verify: {extent.verdict} damage" if extent else "verify failed")
        log(f"verify: {len(hit)} shard(s) marked failed for re-extraction ({len(rows)} rows condemned)")

    def quarantine(self, bad_rows: list[int]) -> list[str]:
        """The bad rows' records moved aside (and out of the record pool), their shards marked failed for
        re-extraction; the paths they were moved to."""
        version, log = self.version, self.log
        failed_dir = version.path / "hidden_states_failed"
        if self.pool is not None:  # a rejected record that is the pool's must leave the pool: re-extracted, not re-linked
            bad_keys = row_keys(version.tokenized_dir, [r for r in bad_rows if r < len(self.ds)], self.pool.key)
            with self.pool.lock(log):
                gone = [r for r, k in bad_keys.items() if self.pool.forget(k, version.record_path(r))]
            if gone:
                log(f"verify: rows {gone}: their records were removed from the record pool {self.pool.dir}")
        moved = []
        for r in bad_rows:
            f = version.record_path(r)
            if f.exists():
                failed_dir.mkdir(exist_ok=True)
                shutil.move(str(f), str(failed_dir / f.name))
                moved.append(str(failed_dir / f.name))
        hit = mark_rows_failed(version.path, bad_rows, "verify failed")
        log(f"verify: moved {len(moved)} files to {failed_dir}; shards {hit} marked failed for re-extraction")
        return moved

    def record(self, st, ref: ReferenceResult, judged: dict[str, Outcome], problems, bad_rows, moved) -> VerifyResult:
        """The verify record: the pass's checks (`st`), the reference and the checks `judged` after it."""
        cfg, version = self.cfg, self.version
        bad = set(bad_rows)
        man = ShardRun(version.path).read(missing_ok=True)  # mark_rows_failed may have changed it
        hashes = {str(e.index): cache.shard_hash(e, version) for e in man.published()
                  if not any(e.row_start <= r < e.row_end for r in bad)}
        n_rechecked = len({e.index for e in self.shards if str(e.index) not in self.reused_hashes})
        checks = st.checks.model_copy(update={"reference": _reference_result(ref, self.power),
                                              **{name: out.result for name, out in judged.items()}})
        return VerifyResult(
            content_key=version.content_key, passed=not problems and st.files_checked > 0, problems=problems,
            bad_rows=bad_rows, moved_files=moved, checks=checks, cleared=st.cleared, shards_rechecked=n_rechecked,
            shards_reused=len(self.reused_hashes), config_key=_config_key(cfg), shard_hashes=hashes,
            rows_rechecked=len(self.todo), rows_reused=len(self.reused), rows_reused_pool=len(self.from_pool),
            seconds=round(time.time() - self.t0, 2))


def _problems(out: Outcome) -> list[str]:
    return [p for row in out.flags for p in out.flags[row]]


def _reference_result(ref: ReferenceResult, power: dict) -> ReferenceCheckResult:
    """The reference's entry among the checks: its verdict ran in the reference child (verify/worker.py), over the
    sample this verify chose."""
    return ReferenceCheckResult(ran=bool(ref.samples_checked) and ref.skipped is None, records=len(ref.samples_checked),
                                flagged=len(ref.bad_rows), seconds=ref.seconds, skipped=ref.skipped,
                                samples=ref.samples_checked, max_rel_err=ref.max_rel_err, min_cosine=ref.min_cosine,
                                peak_rss_bytes=ref.peak_rss_bytes, power=power)


def _previous_reference(version: ExtractVersion) -> ReferenceCheckResult:
    """The reference of the last verify of this version (empty: none; a verify.json written before the record was
    nested by check: from its flat keys, which every verify.json still has)."""
    prev = read_json(version.verify_path) or {}
    if "samples" in ((prev.get("checks") or {}).get("reference") or {}):
        return VerifyResult.model_validate(prev).checks.reference
    return ReferenceCheckResult(samples=prev.get("reference_samples") or [], max_rel_err=prev.get("reference_max_rel_err"),
                                min_cosine=prev.get("reference_min_cosine"))


def _sample_part(full: ReferenceResult | None, rows: list[int], why_not: str | None) -> ReferenceResult:
    """The reference's verdict on the sampled `rows` (the pass also held the learned flags' rows)."""
    if full is None:
        return ReferenceResult(samples_checked=[], max_rel_err=None, min_cosine=None, per_layer_max_rel_err={},
                               problems=[], skipped=f"the reference failed: {why_not}")
    if full.skipped:
        return full
    mine = set(rows)
    prefix = tuple(f"hs_{r} " for r in rows)
    return full.model_copy(update={"samples_checked": rows, "bad_rows": [r for r in full.bad_rows if r in mine],
                                   "problems": [p for p in full.problems if p.startswith(prefix)]})


def _reference_rows(cfg: VerifyConfig, version: ExtractVersion, ds, good: list[int]) -> tuple[list[int], dict]:
    """The rows the reference recomputes among `good` (the rows this verify read and found good): sized by
    verify.reference_samples or, when that is None, to catch verify.reference_rate of them with probability
    verify.reference_power; stratified over shards, groups and batch positions (reference.choose_rows). And
    what that sample could catch."""
    if cfg.reference_samples == 0 or not good:
        return [], power_statement(len(good), 0, cfg.reference_rate)
    n = cfg.reference_samples if cfg.reference_samples is not None else \
        reference_size(len(good), cfg.reference_rate, cfg.reference_power)
    lens = ds.select(good)["seq_len"]
    rows = [good[i] for i in choose_rows(lens, n, max(1, version.rows_per_shard * len(good) // max(1, len(ds))))]
    return rows, power_statement(len(good), len(rows), cfg.reference_rate)


def _invariance(cfg: VerifyConfig, version: ExtractVersion, man: ShardManifest, ds, log,
                sample: list[int] | None = None) -> Outcome:
    """Judge the batch-invariance entries the extract engine (or the online server's sampler) wrote into
    the manifest: those of published shards, or with `sample`, of those rows."""
    published = set(sample) if sample is not None else {
        r for e in man.published() for r in range(e.row_start, e.row_end)}
    entries = {int(k): v for k, v in man.invariance.items() if int(k) in published}
    why = "" if entries else _no_invariance(man, published)
    sid = ds["sample_id"] if "sample_id" in ds.column_names and entries else None
    names = {r: f"{record_name(r)} (row {r}, sample {sid[r] if sid else None})" for r in entries}
    out = Invariance(cfg, version.storage_dtype, names, why).run(sorted(entries.items()))
    if not out.result.ran:
        log(f"verify: invariance check skipped: {why}")
    else:
        log(f"verify invariance: {len(entries)} rows re-run alone by the extract engine, max relative error "
            f"{out.result.max_rel_err}, worst mean token cosine {out.result.min_cosine}")
    return out


def _no_invariance(man: ShardManifest, published: set[int]) -> str:
    """Why the manifest holds no invariance entry for the `published` rows."""
    if not man.config.get("extract", {}).get("invariance_rows"):
        return "extract.invariance_rows is 0"
    if all(e.extracted_rows == 0 for e in man.published() if published & set(range(e.row_start, e.row_end))):
        return "no engine ran for these rows: every one was linked from the record pool (judged when it was extracted)"
    return "the extract manifest holds no invariance entries (extracted before they existed?)"


def check_verify_gate(res: VerifyResult, max_listed: int = 20) -> None:
    if res.passed:
        return
    if res.samples_checked == 0:
        raise VerifyFailed("verify: no records to check")
    shown = "\n  ".join(([f"extent: {res.extent.says}"] if res.extent else []) + res.problems[:max_listed])
    more = f"\n  ... and {len(res.problems) - max_listed} more" if len(res.problems) > max_listed else ""
    raise VerifyFailed(f"verify failed: {len(res.problems)} problems in {len(res.bad_rows)} records "
                       f"(moved to hidden_states_failed/: {len(res.moved_files)}):\n  {shown}{more}")


def require_verified(version: ExtractVersion) -> VerifyResult:
    """Refuse to go on (train) with data whose current version did not pass verify."""
    rec = read_json(version.verify_path)
    if rec is None:
        raise VerifyFailed(f"{version.dir}: never verified; run the verify stage first")
    res = VerifyResult(**rec)
    if res.content_key != version.content_key:
        raise VerifyFailed(f"{version.dir}: verified content key {res.content_key} but the data is now "
                           f"{version.content_key}; verify again")
    if not res.passed:
        raise VerifyFailed(f"{version.dir}: the last verify of {version.content_key} failed ({len(res.problems)} problems)")
    changed = files_changed_since_verify(version, res)
    if changed:
        raise VerifyFailed(f"{version.dir}: {len(changed)} shard(s) are not the files verify passed; verify again "
                           f"(it re-reads only those):\n  " + "\n  ".join(changed[:20]))
    return res


REHASH_ALL_BYTES = 2 << 30  # train re-hashes every record up to this much; beyond it, REHASH_SAMPLE of them
REHASH_SAMPLE = 256


def files_changed_since_verify(version: ExtractVersion, res: VerifyResult) -> list[str]:
    """What train would read that is not what verify passed, one line per shard: a published shard verify did
    not pass, files whose size or mtime changed (cache.shard_hash), and records whose sha256 differs from the
    manifest's (every record up to REHASH_ALL_BYTES, else REHASH_SAMPLE spread over the version: a swap that
    kept size and mtime)."""
    man = ShardRun(version.path).read(missing_ok=True)
    out = []
    for e in man.published():
        want = res.shard_hashes.get(str(e.index))
        if want is None:
            out.append(f"shard {e.index} (rows {e.row_start}-{e.row_end - 1}): published but not among the shards "
                       f"verify passed")
        elif cache.shard_hash(e, version) != want:
            out.append(f"shard {e.index} (rows {e.row_start}-{e.row_end - 1}): a record or fingerprint was replaced "
                       f"or edited after verify (size or mtime differs)")
    files = [(e.index, name, sha) for e in man.published() for name, sha in sorted(e.files.items())]
    total = sum(e.bytes for e in man.published())
    if total > REHASH_ALL_BYTES and len(files) > REHASH_SAMPLE:
        step = len(files) / REHASH_SAMPLE
        files = [files[int(i * step)] for i in range(REHASH_SAMPLE)]
    for index, name, sha in files:
        p = version.hidden_states_dir / name
        if not p.is_file():
            out.append(f"shard {index}: {name} is missing")
        elif (got := sha256_file(p)) != sha:
            out.append(f"shard {index}: {name} has sha256 {got[:16]}…, the manifest (as verified) {sha[:16]}…")
    return out


class VerifyInputs(BaseModel):
    version: ExtractVersion  # the stored records to check


def run(cfg: PipelineConfig, inputs: VerifyInputs, log: Log) -> VerifyResult:
    """The stage's entry (StageSpec.run): the verify gate; raises VerifyFailed naming every bad record."""
    for w in skipped_checks(cfg):
        log(f"verify warning: {w}")
    res = verify(cfg.verify, cfg.target, inputs.version, log=log)
    check_verify_gate(res)
    return res


RETRY = Retry(1, 10, (*IO, *CHILD),
              "reads every record and streams the target for the reference check (I/O, the reference child); a "
              "retry reuses each shard an earlier complete verify checked (verify_rows.safetensors) and never turns "
              "a VerifyFailed into a retry")
STAGE = StageSpec(name="verify", run=run, result=VerifyResult, failure=VerifyFailed,
                  worker="eagle3_pipeline.verify.worker", accelerators=True, gate=True, own_job=True, retry=RETRY)

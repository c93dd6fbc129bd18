"""One function per pipeline stage: the glue between configs, the run store and the stage cores.

Each `stage_*` takes the config and the typed records of the stages before it (pydantic models:
`PrepareResult`, `PreflightResult`, the `ExtractVersion` of layout.py, `VerifyResult`, `VocabResult`,
`TrainResult`), calls one core function, and returns its own record. Prefect persists and shows these
models as they are (tasks/ wraps each function; tests call them directly). No Prefect here.
Where things go is the ExtractVersion's business (layout.py): vocab = `version.vocab_dir(K)`,
training = `version.train_dir(train_key)` (keyed by everything that determines the draft, so a second
run with the same inputs reuses the checkpoint and an interrupted one resumes).
Test hook: `faults.fail_once` at the start of prepare, verify and vocab (EAGLE3_TEST_FAIL_ONCE).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from eagle3_pipeline.core.config import PipelineConfig
from eagle3_pipeline.data.prepare import PrepareResult
from eagle3_pipeline.core.faults import fail_once
from eagle3_pipeline.records.layout import ExtractVersion
from eagle3_pipeline.records.layout import plan_extract as _plan_extract
from eagle3_pipeline.preflight.stage import PreflightResult
from eagle3_pipeline.core.store import content_key, dir_lock
from eagle3_pipeline.core.store_check import check_store

__all__ = ["plan_extract", "stage_regenerate", "stage_prepare", "stage_preflight", "stage_gpu_gate", "stage_extract_group",
           "stage_extract_summary", "stage_extract", "stage_verify", "stage_vocab", "train_key", "stage_train",
           "stage_evaluate", "first_quarantined", "heldout_prompts", "evaluate_prompts", "stage_compare_drafts"]


def plan_extract(cfg: PipelineConfig, prep: PrepareResult, pre: PreflightResult) -> ExtractVersion:
    """The ExtractVersion of a prepare and a preflight record, keyed by this vLLM build's engine settings."""
    from eagle3_pipeline.engine.build import cpu_build_kwargs

    return _plan_extract(cfg, prep, pre, cpu_build_kwargs())


def stage_regenerate(cfg: PipelineConfig, log=print):
    """The optional regenerate stage: the target answers the sources' turns (regenerate/); its
    RegenerateResult is what stage_prepare then reads instead of prepare.sources."""
    check_store(Path(cfg.store), log)  # on every host: the pod's mount must hold the store's contract
    from eagle3_pipeline.regenerate.stage import regenerate

    return regenerate(cfg.regenerate, cfg.prepare, cfg.target, Path(cfg.store), log=log)


def stage_prepare(cfg: PipelineConfig, log=print, regenerated=None) -> PrepareResult:
    """Tokenize prepare.sources, or with `regenerated` (a RegenerateResult) the regenerated rows."""
    check_store(Path(cfg.store), log)
    from eagle3_pipeline.data.prepare import prepare

    fail_once("prepare")
    prep_cfg = cfg.prepare
    if regenerated is not None:
        from eagle3_pipeline.regenerate.stage import prepare_config

        prep_cfg = prepare_config(cfg.prepare, regenerated)
        log(f"prepare: reading the regenerated rows of version {regenerated.version} ({regenerated.rows_dir})")
    return prepare(prep_cfg, cfg.target, Path(cfg.store), log=log)


def first_quarantined(prep: PrepareResult, n: int) -> list[dict]:
    """The first `n` quarantine entries (source, row, reason) of a prepare record."""
    out = []
    with open(prep.quarantine) as f:
        for line in f:
            if len(out) >= n:
                break
            r = json.loads(line)
            out.append({"source": r["source"], "row": r["row"], "reason": r["reason"]})
    return out


def stage_preflight(cfg: PipelineConfig, prep: PrepareResult, log=print) -> PreflightResult:
    from eagle3_pipeline.preflight.stage import preflight

    return preflight(cfg, prep.tokens, Path(prep.dir), log=log)


def stage_gpu_gate(where: str, log=print):
    from eagle3_pipeline.gpu.stage import gpu_gate

    rec = gpu_gate(log=lambda m: log(f"[{where}] {m}"))
    return rec.model_copy(update={"where": where})


def stage_extract_group(cfg: PipelineConfig, version: ExtractVersion, shard_ids: list[int], force: bool = False,
                        log=print, on_shard=None) -> list:
    """Publish shards `shard_ids` of `version` with one engine child: list[extract.stage.ShardRecord]."""
    check_store(Path(cfg.store), log)
    from eagle3_pipeline.extract.stage import extract_group

    return extract_group(cfg.extract, cfg.target, version, shard_ids, log=log, force=force, on_shard=on_shard)


def stage_extract_summary(version: ExtractVersion, since: float | None = None):
    """The ExtractResult of `version`, from its manifest; `since` a run's start (counts that run's work)."""
    from eagle3_pipeline.extract.stage import summarize

    return summarize(version.path, since)


def stage_extract(cfg: PipelineConfig, version: ExtractVersion, log=print):
    """The whole extract stage without Prefect: every group in turn (tests, `eagle3 extract`)."""
    t0 = time.time()
    for group in version.groups:
        stage_extract_group(cfg, version, group, log=log)
    return stage_extract_summary(version, since=t0)


def stage_verify(cfg: PipelineConfig, version: ExtractVersion, log=print):
    """The verify gate: raises VerifyFailed naming every bad record; returns the VerifyResult."""
    check_store(Path(cfg.store), log)
    from eagle3_pipeline.verify.stage import check_verify_gate, verify

    fail_once("verify")
    res = verify(cfg.verify, cfg.target, version, log=log, extract_cfg=cfg.extract)
    check_verify_gate(res)
    return res


def stage_vocab(cfg: PipelineConfig, prep: PrepareResult, version: ExtractVersion, log=print):
    from eagle3_pipeline.data.prepare import load_tokenizer
    from eagle3_pipeline.train.vocab import build_vocab

    fail_once("vocab")
    tok = load_tokenizer(cfg.target)
    return build_vocab(cfg.vocab, Path(prep.token_freq), version.dims.vocab_size,
                       version.vocab_dir(cfg.vocab.draft_vocab_size),
                       special_token_ids=[t for t in (tok.eos_token_id,) if t is not None])


# Train settings that change how a run is watched, not the draft it produces: a new value resumes
# the same checkpoint dir instead of training from scratch.
TRAIN_KEY_EXCLUDE = frozenset({"log_freq", "timeout_s", "num_workers", "online_start_timeout_s", "online_request_timeout_s"})


def train_key(cfg: PipelineConfig, version: ExtractVersion) -> str:
    """Keyed by the data, the vocab and the train settings; with `train.init: previous` (and a previous
    draft to continue from) also by that draft (lineage.previous_draft)."""
    vocab_dir = version.vocab_dir(cfg.vocab.draft_vocab_size).resolve()
    prev = previous_for(cfg, version)
    train = cfg.train.model_dump(exclude=set(TRAIN_KEY_EXCLUDE) | ({"init", "refresh_epochs"} if prev is None else set())
                                 | ({"mode"} if cfg.train.mode == "offline" else set()))  # offline keys as before
    return content_key({"extract": version.content_key, "vocab": str(vocab_dir), "train": train,
                        **({"previous": prev.checkpoint} if prev else {})})


def previous_for(cfg: PipelineConfig, version: ExtractVersion):
    """The previous version's draft this training continues from (train.init: previous), or None."""
    from eagle3_pipeline.records.lineage import previous_draft

    return previous_draft(version) if cfg.train.init == "previous" else None


def stage_train(cfg: PipelineConfig, version: ExtractVersion, voc, log=print):
    """offline: the verified stored records; online: a vLLM server started here (stage_train_online)."""
    check_store(Path(cfg.store), log)
    from eagle3_pipeline.train.stage import train_draft
    from eagle3_pipeline.verify.stage import require_verified

    if cfg.train.mode == "online":
        return stage_train_online(cfg, version, voc, log=log)
    require_verified(version)
    prev, tcfg = _train_start(cfg, version, log)
    return train_draft(tcfg, cfg.target, version, Path(voc.dir), version.train_dir(train_key(cfg, version)),
                       log=log, previous=prev)


def _train_start(cfg: PipelineConfig, version: ExtractVersion, log):
    """(the previous draft to continue from or None, the train settings for it), said in the log."""
    prev = previous_for(cfg, version)
    if cfg.train.init == "previous" and prev is None:
        log("train: train.init=previous but no other version of this dataset/model/layers has a trained draft; "
            "training from scratch")
    tcfg = cfg.train if prev is None else cfg.train.model_copy(update={"epochs": cfg.train.refresh_epochs})
    if prev is not None:
        log(f"train: continuing from the draft of version {prev.prepare_version}/{prev.extract_version} "
            f"({prev.checkpoint}) for {tcfg.epochs} epoch(s)")
    return prev, tcfg


def stage_train_online(cfg: PipelineConfig, version: ExtractVersion, voc, log=print):
    """train.mode online: start a vLLM server of the target (extract's engine settings, layers and connector),
    run the verify gate on `verify.online_rows` rows taken from it, then train with every row's hidden
    states fetched from it (train/online.py); the server ends with the stage. The TrainResult carries
    the OnlineResult and its `verify` (the VerifyResult of the sample) for the report."""
    from eagle3_pipeline.data.prepare import load_tokenized
    from eagle3_pipeline.preflight.stage import disk_plans
    from eagle3_pipeline.core.store import write_json
    from eagle3_pipeline.train.stage import train_draft
    from eagle3_pipeline.train.online import HiddenStateServer, OnlineResult, take_sample
    from eagle3_pipeline.verify.stage import VerifyFailed, check_verify_gate, verify

    prev, tcfg = _train_start(cfg, version, log)
    out_dir = version.train_dir(train_key(cfg, version))
    work = out_dir / "online"
    seq_lens = load_tokenized(version.tokenized_dir)["seq_len"]
    max_len = int(max(seq_lens)) + 1
    offline_bytes = disk_plans(cfg, len(version.layer_ids), version.dims.hidden_size, int(sum(seq_lens)))["offline bf16"]
    with dir_lock(work, f"online training dir {work}", log), HiddenStateServer(
            cfg.extract, cfg.target, version, work, max_model_len=max_len,
            start_timeout_s=cfg.train.online_start_timeout_s, log=log) as srv:
        sample = take_sample(srv, cfg, version, work, log=log)
        ver = verify(cfg.verify, srv.target, sample.version, log=log, rows=sample.rows, fingerprints=True)
        ver = ver.model_copy(update={"mode": "online"})
        write_json(sample.version.verify_path, ver.model_dump(mode="json"))
        check_verify_gate(ver)
        rows, tokens, seconds, nbytes = sample.rows, sample.tokens, sample.seconds, sample.bytes
        checks = online_row_checks(cfg, srv.target, version, ver, work)
        try:
            tr = train_draft(tcfg, cfg.target, version, Path(voc.dir), out_dir, log=log, previous=prev,
                             online={"endpoint": srv.endpoint, "model": srv.model,
                                     "request_timeout_s": cfg.train.online_request_timeout_s,
                                     "max_in_flight": max(1, min(cfg.extract.max_num_seqs, 16)),
                                     "hidden_size": version.dims.hidden_size, "checks": checks})
        except Exception as e:
            rejected = _jsonl_rows(checks and checks.rejected_path, "rejected")
            if rejected:
                raise VerifyFailed(f"online training stopped: {len(rejected)} rows from the server failed the "
                                   "per-row checks against the target on every attempt:\n  "
                                   + "\n  ".join(rejected[r] for r in sorted(rejected)[:20])) from e
            raise
        row_checks = confirm_online_flags(cfg, srv.target, version, checks, log)
    peak = srv.scratch_peak()
    res = OnlineResult(endpoint=srv.endpoint, server_start_s=srv.start_s, sample_rows=rows, sample_tokens=tokens,
                       sample_seconds=seconds, sample_bytes=nbytes, scratch_peak_bytes=peak,
                       hidden_states_peak_bytes=peak + nbytes, offline_bytes_estimate=offline_bytes,
                       work_dir=str(work.resolve()))
    write_json(work / "online.json", res.model_dump(mode="json"))
    log(f"online: hidden states on disk peaked at {res.hidden_states_peak_bytes / 1e6:.1f} MB ({nbytes / 1e6:.1f} MB "
        f"verified sample + {peak / 1e6:.2f} MB in flight); the stored dataset would take {offline_bytes / 1e6:.0f} MB")
    return tr.model_copy(update={"hidden_states_peak_bytes": res.hidden_states_peak_bytes,
                                 "online": {**res.model_dump(mode="json"), "verify": ver.model_dump(mode="json"),
                                            "row_checks": row_checks},
                                 "engine_start_s": round((tr.engine_start_s or 0.0) + srv.start_s, 2)})


def online_row_checks(cfg: PipelineConfig, target, version: ExtractVersion, ver, work: Path):
    """What the online trainer judges every row by (train/job.py RowChecksSpec): the target's final
    norm and lm_head against the fingerprint each response carries, and the layer profiles the verify gate
    learned from the sample (`ver`), each on or off by itself: the fingerprint where it ran on the sample, the
    state sketch unless verify.allow_skip names it. None only when every one is skipped by name: then rows get
    their structure checked only, as the report's checks say. Clears the files of an
    earlier attempt (every epoch asks the server for every row again)."""
    from eagle3_pipeline.checks.final_layer import FP8_SLACK
    from eagle3_pipeline.train.job import RowChecksSpec

    fp, sk = ver.checks.get("fingerprint"), ver.checks.get("state_sketch")
    fingerprint, sketch = bool(fp and fp.ran), "state_sketch" not in cfg.verify.allow_skip or bool(sk and sk.ran)
    if not (fingerprint or sketch or ver.identity_profile):
        return None  # every per-row check is skipped by name (verify.allow_skip); the sample's gate said so
    d = work / "row_checks"
    shutil.rmtree(d, ignore_errors=True)
    (d / "flagged" / "hidden_states").mkdir(parents=True)
    return RowChecksSpec(
        model_dir=str(Path(target.model).resolve()), norm_eps=version.dims.norm_eps, atol=cfg.verify.fingerprint_atol,
        rtol=cfg.verify.fingerprint_rtol, stol=cfg.verify.fingerprint_stol,
        slack=FP8_SLACK if version.storage_dtype == "fp8" else 1.0, layer_ids=list(version.layer_ids),
        storage_dtype=version.storage_dtype, identity=ver.identity_profile, fingerprint=fingerprint, sketch=sketch,
        rejected_path=str(d / "rejected.jsonl"),
        flagged_path=str(d / "flagged.jsonl"), flagged_dir=str(d / "flagged" / "hidden_states"))


def _jsonl_rows(path: str | None, kind: str) -> dict[int, str]:
    """{row: why} of the lines of `kind` in a row-checks file (the last line of a row wins)."""
    if not path or not Path(path).is_file():
        return {}
    last = {}
    for line in Path(path).read_text().splitlines():
        ev = json.loads(line)
        last[int(ev["row"])] = ev
    return {row: ev["why"] for row, ev in last.items() if ev.get("kind") == kind}


def confirm_online_flags(cfg: PipelineConfig, target, version: ExtractVersion, checks, log) -> dict:
    """After online training: rows the layer profiles flagged (kept out of training) are recomputed with the
    target itself (the streamed reference, verify.confirm_rows of them); a row the model disagrees with, or
    one left unconfirmed, fails the gate (exit 4), one it agrees with is cleared. Returns what the train
    record keeps: how every row was judged."""
    from eagle3_pipeline.verify.reference import reference_check
    from eagle3_pipeline.verify.stage import VerifyFailed

    if checks is None:
        return {"fingerprint": False, "state_sketch": False, "identity": False, "flagged": [], "cleared": [],
                "unavailable": []}
    flagged = _jsonl_rows(checks.flagged_path, "flagged")
    unavailable = _jsonl_rows(checks.rejected_path, "unavailable")
    out = {"fingerprint": checks.fingerprint, "state_sketch": checks.sketch, "identity": checks.identity is not None,
           "flagged": sorted(flagged), "cleared": [], "unavailable": sorted(unavailable)}
    for name in ("fingerprint", "state_sketch", "identity"):
        log(f"online: per-row check {name}: " + ("every row" if out[name] else "skipped (verify.allow_skip names it, "
                                                                               "or the sample's gate could not run it)"))
    if unavailable:
        log(f"online: {len(unavailable)} rows could not be fetched from the server and were not trained on: "
            f"{sorted(unavailable)[:20]} ({checks.rejected_path})")
    if not flagged:
        ran = [n for n in ("fingerprint", "state_sketch", "identity") if out[n]]
        log(f"online: every row the trainer read passed the per-row checks (structure, {', '.join(ran) or 'no other'})")
        return out
    rows = sorted(flagged)[: cfg.verify.confirm_rows]
    fv = version.model_copy(update={"dir": str(Path(checks.flagged_dir).parent), "pool_dir": None})
    ref = reference_check(target, fv, rows, log=log, cfg=cfg.verify)
    bad = set(sorted(flagged)[cfg.verify.confirm_rows:]) | (set(rows) if ref.skipped else set(ref.bad_rows))
    out["cleared"] = [r for r in rows if r not in bad]
    if bad:
        why = ref.skipped or "; ".join(ref.problems[:5])
        raise VerifyFailed(f"online training: {len(bad)} of {len(flagged)} rows the layer profiles flagged are not "
                           f"cleared by the target ({why}):\n  " + "\n  ".join(flagged[r] for r in sorted(bad)[:20]))
    log(f"online: {len(flagged)} rows flagged by the layer profiles were recomputed with the target and cleared "
        f"(kept out of this training): {out['cleared']}")
    return out


def heldout_prompts(prep: PrepareResult, n: int) -> list[list[int]]:
    lines = Path(prep.heldout).read_text().splitlines()
    return [json.loads(line)["prompt_ids"] for line in lines[:n]]


def evaluate_prompts(cfg: PipelineConfig, prep: PrepareResult | None, out_dir: Path, log=print):
    """The evaluate stage's prompts (a PromptSet): `evaluate.prompts` rendered with the target's chat
    template (skipped rows quarantined in `out_dir`), else prepare's held-out prompts (`prep`)."""
    from eagle3_pipeline.core.config import hub_token
    from eagle3_pipeline.data.prepare import load_tokenizer
    from eagle3_pipeline.evaluate.prompts import (
        QUARANTINE_NAME, PromptSetError, heldout_prompt_set, load_prompt_set, prompt_token_limit)

    ev = cfg.evaluate
    if ev.prompts is None:
        if prep is None:
            raise PromptSetError("evaluate: no evaluate.prompts and no prepared data to take held-out prompts from")
        pset = heldout_prompt_set(prep.heldout, ev.num_prompts)
        if not pset.prompts:
            raise RuntimeError(f"evaluate: no held-out prompts in {prep.heldout} (prepare.heldout_rows is 0?)")
        return pset
    limit = prompt_token_limit(ev.max_model_len, cfg.target.model, ev.max_tokens, ev.num_speculative_tokens)
    return load_prompt_set(ev.prompts, load_tokenizer(cfg.target), num_prompts=ev.num_prompts, max_prompt_tokens=limit,
                           split=ev.prompts_split, token=hub_token(cfg.target),
                           quarantine_path=Path(out_dir) / QUARANTINE_NAME, log=log)


def stage_compare_drafts(cfg: PipelineConfig, drafts: dict[str, Path], run_dir: Path, prep: PrepareResult | None = None,
                         log=print):
    """`eagle3 evaluate --draft`: the given EAGLE-3 checkpoints side by side on this config's prompts
    (evaluate.compare_drafts; no gate). `prep` is needed only without evaluate.prompts."""
    from eagle3_pipeline.evaluate.stage import compare_drafts, validate_draft_dir

    for d in drafts.values():  # before the prompts are even rendered: a bad checkpoint costs nothing
        validate_draft_dir(Path(d), cfg.target)
    prompts = evaluate_prompts(cfg, prep, Path(run_dir) / "evaluate", log=log)
    return compare_drafts(cfg.evaluate, cfg.target, drafts, prompts, Path(run_dir) / "evaluate", log=log)


def stage_evaluate(cfg: PipelineConfig, prep: PrepareResult, version: ExtractVersion, voc, tr, run_dir: Path,
                   log=print):
    check_store(Path(cfg.store), log)
    from eagle3_pipeline.evaluate.stage import check_acceptance_gate, evaluate_pair
    from eagle3_pipeline.train.stage import UNTRAINED_DIR, make_untrained_draft

    prompts = evaluate_prompts(cfg, prep, Path(run_dir) / "evaluate", log=log)
    untrained = None
    if cfg.evaluate.baseline:
        untrained = Path(tr.dir) / UNTRAINED_DIR  # the train child wrote it; made here for older train dirs
        with dir_lock(Path(tr.dir), f"train dir {tr.dir}", log):  # written once, never under a reader
            if not (untrained / "config.json").exists():
                make_untrained_draft(cfg.target, version, Path(voc.dir), untrained, cfg.train)
    from eagle3_pipeline.records.lineage import previous_draft

    prev = previous_draft(version) if cfg.evaluate.compare_previous or cfg.train.init == "previous" else None
    if prev is not None:
        log(f"evaluate: also the previous version's draft {prev.checkpoint} on the same held-out prompts")
    rep = evaluate_pair(cfg.evaluate, cfg.target, Path(tr.checkpoint_best), untrained, prompts,
                        Path(run_dir) / "evaluate", log=log, previous_dir=Path(prev.checkpoint) if prev else None)
    check_acceptance_gate(rep, cfg.evaluate)
    return rep

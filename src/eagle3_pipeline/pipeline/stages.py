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
import time
from pathlib import Path

from eagle3_pipeline.core.config import PipelineConfig, skipped_checks
from eagle3_pipeline.core.faults import fail_once
from eagle3_pipeline.core.store import content_key, dir_lock
from eagle3_pipeline.core.store_check import check_store
from eagle3_pipeline.data.tokenized import PrepareResult
from eagle3_pipeline.preflight.stage import PreflightResult
from eagle3_pipeline.records.layout import ExtractVersion
from eagle3_pipeline.records.layout import plan_extract as _plan_extract

__all__ = ["plan_extract", "stage_regenerate", "stage_prepare", "stage_preflight", "stage_gpu_gate", "stage_extract_group",
           "stage_extract_summary", "stage_extract", "stage_verify", "stage_vocab", "train_key", "stage_train",
           "stage_evaluate", "first_quarantined", "heldout_prompts", "evaluate_prompts", "stage_compare_drafts"]


def plan_extract(cfg: PipelineConfig, prep: PrepareResult, pre: PreflightResult) -> ExtractVersion:
    """The ExtractVersion of a prepare and a preflight record, keyed by this vLLM build's engine settings and by
    the build itself (engine_build: vLLM, torch, CUDA runtime)."""
    from eagle3_pipeline.engine.build import cpu_build_kwargs, engine_build

    return _plan_extract(cfg, prep, pre, {**cpu_build_kwargs(), "build": engine_build()})


def stage_regenerate(cfg: PipelineConfig, log=print):
    """The optional regenerate stage: the target answers the sources' turns (regenerate/); its
    RegenerateResult is what stage_prepare then reads instead of prepare.sources."""
    check_store(Path(cfg.store), log)  # on every host: the pod's mount must hold the store's contract
    from eagle3_pipeline.regenerate.stage import regenerate

    return regenerate(cfg.regenerate, cfg.prepare, cfg.target, Path(cfg.store), log=log)


def stage_prepare(cfg: PipelineConfig, log=print, regenerated=None) -> PrepareResult:
    """Tokenize prepare.sources, or with `regenerated` (a RegenerateResult) the regenerated rows."""
    check_store(Path(cfg.store), log)
    from eagle3_pipeline.data.tokenized import loss_warnings
    from eagle3_pipeline.prepare.stage import prepare

    fail_once("prepare")
    prep_cfg = cfg.prepare
    if regenerated is not None:
        from eagle3_pipeline.regenerate.stage import prepare_config

        prep_cfg = prepare_config(cfg.prepare, regenerated)
        log(f"prepare: reading the regenerated rows of version {regenerated.version} ({regenerated.rows_dir})")
    res = prepare(prep_cfg, cfg.target, Path(cfg.store), log=log)
    for w in loss_warnings(res, cfg.prepare):
        log(f"prepare warning: {w}")
    return res


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
    for w in skipped_checks(cfg):
        log(f"verify warning: {w}")
    res = verify(cfg.verify, cfg.target, version, log=log)
    check_verify_gate(res)
    return res


def stage_vocab(cfg: PipelineConfig, prep: PrepareResult, version: ExtractVersion, log=print):
    from eagle3_pipeline.data.tokenized import load_tokenizer
    from eagle3_pipeline.vocab.stage import build_vocab

    fail_once("vocab")
    tok = load_tokenizer(cfg.target)
    return build_vocab(cfg.vocab, Path(prep.token_freq), version.dims.vocab_size,
                       version.vocab_dir(cfg.vocab.draft_vocab_size),
                       special_token_ids=[t for t in (tok.eos_token_id,) if t is not None])


# Train settings that change how a run is watched, not the draft it produces: a new value resumes
# the same checkpoint dir instead of training from scratch.
TRAIN_KEY_EXCLUDE = frozenset({"log_freq", "timeout_s", "num_workers", "online_start_timeout_s", "online_request_timeout_s",
                               "checkpoint_every_steps", "rdzv_port", "rdzv_timeout_s", "estimate_after_steps",
                               # the topology: the key names the global batch it gives instead (train_key)
                               "nodes", "global_batch_tokens"})


def train_key(cfg: PipelineConfig, version: ExtractVersion) -> str:
    """Keyed by the data, the vocab and the train settings; with `train.init: previous` (and a previous
    draft to continue from) also by that draft (lineage.previous_draft)."""
    vocab_dir = version.vocab_dir(cfg.vocab.draft_vocab_size).resolve()
    prev = previous_for(cfg, version)
    train = cfg.train.model_dump(exclude=set(TRAIN_KEY_EXCLUDE) | ({"init", "refresh_epochs"} if prev is None else set())
                                 | ({"mode"} if cfg.train.mode == "offline" else set())  # offline keys as before
                                 | ({"window_shards", "window_bytes"} if cfg.train.mode != "window" else set()))
    train["fsdp"] = train.pop("sharding") == "fsdp"  # its spelling before the choice: the keys from before
    t = cfg.train
    if t.batch_tokens != t.world_size * t.max_seq_len:  # one node's one row per rank: the keys from before nodes
        train["global_batch_tokens"] = t.batch_tokens
    return content_key({"extract": version.content_key, "vocab": str(vocab_dir), "train": train,
                        **({"previous": prev.checkpoint} if prev else {})})


def previous_for(cfg: PipelineConfig, version: ExtractVersion):
    """The previous version's draft this training continues from (train.init: previous), or None."""
    from eagle3_pipeline.records.lineage import previous_draft

    return previous_draft(version) if cfg.train.init == "previous" else None


def stage_train(cfg: PipelineConfig, version: ExtractVersion, voc, log=print):
    """offline: the verified stored records; online: a vLLM server started here (online_training.train_online);
    window: capture and the trainer through a window of shards (window_training.train_window)."""
    check_store(Path(cfg.store), log)
    from eagle3_pipeline.train.stage import train_draft
    from eagle3_pipeline.verify.stage import require_verified

    if cfg.train.mode == "window":  # capture (extract + verify per shard) beside the trainer, through a window
        from eagle3_pipeline.pipeline.window_training import train_window

        return train_window(cfg, version, voc, train_start(cfg, version, log), version.train_dir(train_key(cfg, version)),
                            log=log)
    if cfg.train.mode == "online":
        from eagle3_pipeline.pipeline.online_training import train_online

        return train_online(cfg, version, voc, train_start(cfg, version, log), version.train_dir(train_key(cfg, version)),
                            log=log)
    require_verified(version)
    prev, tcfg = train_start(cfg, version, log)
    return train_draft(tcfg, cfg.target, version, Path(voc.dir), version.train_dir(train_key(cfg, version)),
                       log=log, previous=prev)


def train_start(cfg: PipelineConfig, version: ExtractVersion, log):
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


def heldout_prompts(prep: PrepareResult, n: int) -> list[list[int]]:
    lines = Path(prep.heldout).read_text().splitlines()
    return [json.loads(line)["prompt_ids"] for line in lines[:n]]


def evaluate_prompts(cfg: PipelineConfig, prep: PrepareResult | None, out_dir: Path, log=print):
    """The evaluate stage's prompts (a PromptSet): `evaluate.prompts` rendered with the target's chat
    template (skipped rows quarantined in `out_dir`), else prepare's held-out prompts (`prep`)."""
    from eagle3_pipeline.core.config import hub_token
    from eagle3_pipeline.data.tokenized import load_tokenizer
    from eagle3_pipeline.evaluate.prompts import (
        QUARANTINE_NAME,
        PromptSetError,
        heldout_prompt_set,
        load_prompt_set,
        prompt_token_limit,
    )

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
                           quarantine_path=Path(out_dir) / QUARANTINE_NAME, log=log, all_turns=ev.turns == "all")


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

"""Every stage's one way in, `run_stage(name, cfg, inputs, log)`: the registry's StageSpec, the run store's contract,
the test fault hook, what the stage needs from a sibling, then `STAGE.run`. No Prefect here (tasks/ wraps it).
The `stage_<name>` helpers build a stage's inputs record from the records as a caller holds them (CLI, tests).
How a stage is reached from a flow: docs/internals.md, "From a flow to a stage's work".
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from eagle3_pipeline.core.config import PipelineConfig
from eagle3_pipeline.core.faults import fail_once
from eagle3_pipeline.core.stage_spec import Log, StageSpec
from eagle3_pipeline.core.store import dir_lock
from eagle3_pipeline.core.store_check import check_store
from eagle3_pipeline.data.tokenized import PrepareResult
from eagle3_pipeline.engine.build import cpu_build_kwargs, engine_build
from eagle3_pipeline.evaluate.stage import EvaluateInputs, compare_drafts, evaluate_prompts, validate_draft_dir
from eagle3_pipeline.extract.stage import ExtractInputs, summarize
from eagle3_pipeline.gpu.stage import GpuGateInputs
from eagle3_pipeline.pipeline import registry
from eagle3_pipeline.pipeline.online_training import train_online
from eagle3_pipeline.pipeline.window_training import train_window
from eagle3_pipeline.preflight.stage import PreflightInputs, PreflightResult
from eagle3_pipeline.prepare.stage import PrepareInputs
from eagle3_pipeline.records.layout import ExtractVersion
from eagle3_pipeline.records.layout import plan_extract as _plan_extract
from eagle3_pipeline.records.results import ExtractResult, RegenerateResult, TrainResult, VocabResult
from eagle3_pipeline.regenerate.stage import RegenerateInputs
from eagle3_pipeline.train.stage import TrainInputs, make_untrained_draft, train_key
from eagle3_pipeline.verify.stage import VerifyInputs, require_verified
from eagle3_pipeline.vocab.stage import VocabInputs

__all__ = ["run_stage", "entry", "NEEDS", "plan_extract", "stage_regenerate", "stage_prepare", "stage_preflight",
           "stage_gpu_gate", "stage_extract_group", "stage_extract_summary", "stage_extract", "stage_verify",
           "stage_vocab", "train_key", "stage_train", "stage_evaluate", "first_quarantined", "heldout_prompts",
           "evaluate_prompts", "stage_compare_drafts"]


def _verified_records(cfg: PipelineConfig, inputs: TrainInputs, log: Log) -> None:
    """Offline training reads only records the verify gate passed (verify's require_verified)."""
    if cfg.train.mode == "offline":
        require_verified(inputs.version)


def _untrained_baseline(cfg: PipelineConfig, inputs: EvaluateInputs, log: Log) -> None:
    """evaluate.baseline needs the untrained draft; the train child wrote it, made here for older train dirs."""
    tr = inputs.tr
    if cfg.evaluate.baseline:
        with dir_lock(Path(tr.dir), f"train dir {tr.dir}", log):  # written once, never under a reader
            if not (tr.untrained_dir() / "config.json").exists():
                make_untrained_draft(cfg.target, inputs.version, Path(inputs.voc.dir), tr.untrained_dir(), cfg.train)


# What a stage needs from a sibling stage (a stage never imports one), made sure of here before its entry runs
NEEDS: dict[str, Callable[[PipelineConfig, BaseModel, Log], None]] = {
    "train": _verified_records, "evaluate": _untrained_baseline}


# The stages whose injected fault (EAGLE3_TEST_FAIL_ONCE, core/faults.py) is raised at their entry; train and
# evaluate raise theirs in their children (a step, an engine start)
FAULT_AT_ENTRY = ("prepare", "verify", "vocab")


# train's entry in its other modes, above both stages: online, where the verify gate and the trainer share one
# server's rows (pipeline/online_training.py); window, where capture (extract + verify per shard) feeds the trainer
# through a window of shards (pipeline/window_training.py)
TRAIN_MODES: dict[str, Callable] = {"online": train_online, "window": train_window}


def entry(spec: StageSpec, cfg: PipelineConfig) -> Callable:
    """The function that runs `spec` under `cfg`: its STAGE.run, but train's in online and window mode (TRAIN_MODES)."""
    return TRAIN_MODES.get(cfg.train.mode, spec.run) if spec.name == "train" else spec.run


def run_stage(name: str, cfg: PipelineConfig, inputs: BaseModel, log: Log = print):
    """Run the registered stage `name` (or its task's name) on `inputs`, its inputs record; returns its record."""
    spec = registry.spec(name)
    if spec.store:
        check_store(Path(cfg.store), log)  # on every host: the pod's mount must hold the store's contract
    if spec.name in FAULT_AT_ENTRY:
        fail_once(spec.name)
    if (need := NEEDS.get(spec.name)) is not None:
        need(cfg, inputs, log)
    return entry(spec, cfg)(cfg, inputs, log)


def plan_extract(cfg: PipelineConfig, prep: PrepareResult, pre: PreflightResult) -> ExtractVersion:
    """The ExtractVersion of a prepare and a preflight record, keyed by this vLLM build's engine settings and by
    the build itself (engine_build: vLLM, torch, CUDA runtime)."""
    return _plan_extract(cfg, prep, pre, {**cpu_build_kwargs(), "build": engine_build()})


# ---------------------------------------------- each stage's inputs from the records as a caller holds them


def stage_regenerate(cfg: PipelineConfig, log: Log = print) -> RegenerateResult:
    return run_stage("regenerate", cfg, RegenerateInputs(), log)


def stage_prepare(cfg: PipelineConfig, log: Log = print, regenerated: RegenerateResult | None = None) -> PrepareResult:
    return run_stage("prepare", cfg, PrepareInputs(regenerated=regenerated), log)


def stage_preflight(cfg: PipelineConfig, prep: PrepareResult, log: Log = print) -> PreflightResult:
    return run_stage("preflight", cfg, PreflightInputs(prep=prep), log)


def stage_gpu_gate(cfg: PipelineConfig, where: str, log: Log = print):
    return run_stage("gpu", cfg, GpuGateInputs(where=where), log)


def stage_extract_group(cfg: PipelineConfig, version: ExtractVersion, shard_ids: list[int], force: bool = False,
                        log: Log = print, on_shard=None) -> list:
    """Publish shards `shard_ids` of `version` with one engine child: list[extract.stage.ShardRecord]."""
    return run_stage("extract", cfg, ExtractInputs(version=version, shard_ids=shard_ids, force=force,
                                                   on_shard=on_shard), log)


def stage_extract_summary(version: ExtractVersion, since: float | None = None) -> ExtractResult:
    """The ExtractResult of `version`, from its manifest; `since` a run's start (counts that run's work)."""
    return summarize(version.path, since)


def stage_extract(cfg: PipelineConfig, version: ExtractVersion, log: Log = print) -> ExtractResult:
    """The whole extract stage without Prefect: every group in turn (tests, `eagle3 extract`)."""
    t0 = time.time()
    for group in version.groups:
        stage_extract_group(cfg, version, group, log=log)
    return stage_extract_summary(version, since=t0)


def stage_verify(cfg: PipelineConfig, version: ExtractVersion, log: Log = print):
    return run_stage("verify", cfg, VerifyInputs(version=version), log)


def stage_vocab(cfg: PipelineConfig, prep: PrepareResult, version: ExtractVersion, log: Log = print) -> VocabResult:
    return run_stage("vocab", cfg, VocabInputs(prep=prep, version=version), log)


def stage_train(cfg: PipelineConfig, version: ExtractVersion, voc: VocabResult, log: Log = print) -> TrainResult:
    return run_stage("train", cfg, TrainInputs(version=version, voc=voc), log)


def stage_evaluate(cfg: PipelineConfig, prep: PrepareResult | None, version: ExtractVersion, voc: VocabResult,
                   tr: TrainResult, run_dir: Path, log: Log = print):
    return run_stage("evaluate", cfg, EvaluateInputs(prep=prep, version=version, voc=voc, tr=tr, run_dir=str(run_dir)),
                     log)


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


def heldout_prompts(prep: PrepareResult, n: int) -> list[list[int]]:
    lines = Path(prep.heldout).read_text().splitlines()
    return [json.loads(line)["prompt_ids"] for line in lines[:n]]


def stage_compare_drafts(cfg: PipelineConfig, drafts: dict[str, Path], run_dir: Path, prep: PrepareResult | None = None,
                         log: Log = print):
    """`eagle3 evaluate --draft`: the given EAGLE-3 checkpoints side by side on this config's prompts
    (evaluate.compare_drafts; no gate). `prep` is needed only without evaluate.prompts."""
    for d in drafts.values():  # before the prompts are even rendered: a bad checkpoint costs nothing
        validate_draft_dir(Path(d), cfg.target)
    prompts = evaluate_prompts(cfg, prep, Path(run_dir) / "evaluate", log=log)
    return compare_drafts(cfg.evaluate, cfg.target, drafts, prompts, Path(run_dir) / "evaluate", log=log)

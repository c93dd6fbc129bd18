"""The pipeline flow: [regenerate → gpu-gate →] prepare → preflight → gpu-gate → extract → gpu-gate →
verify → vocab → train → gpu-gate → evaluate → report ([regenerate] with regenerate.enabled).
With train.mode online: prepare → preflight → gpu-gate → vocab → train
(its own vLLM server; the verify gate on rows sampled from it first) → gpu-gate → evaluate → report.
With train.mode window: prepare → preflight → gpu-gate → vocab → train (capture: extract + verify of each shard
before it is published to the window, beside the trainer reading it) → gpu-gate → evaluate → report.
The report is written also when a stage fails."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Literal

from prefect import flow

from eagle3_pipeline.core.config import PipelineConfig
from eagle3_pipeline.evaluate.stage import EvaluateInputs
from eagle3_pipeline.gpu.stage import GpuGateInputs
from eagle3_pipeline.preflight.stage import installed_versions
from eagle3_pipeline.report.record import RunReport
from eagle3_pipeline.report.runs import RunDir, StageClock, create_run_dir
from eagle3_pipeline.train.stage import TrainInputs
from eagle3_pipeline.verify.stage import VerifyInputs, VerifyResult
from eagle3_pipeline.vocab.stage import VocabInputs
from flows import stage_runs
from flows.config_param import DEFAULT_CONFIG_PATH, resolve_config, switches
from flows.extract import extract
from flows.head import Prepared, prepare_run
from flows.hub_auth import use_hub_secret
from flows.lease import rescheduled_on_lost_lease
from tasks import stage_tasks as t


@flow(name="pipeline", log_prints=True)
def pipeline(config: PipelineConfig | None = None, output_dir: str = "runs", run_dir: str | None = None,
             config_path: str = DEFAULT_CONFIG_PATH, regenerate: bool | None = None,
             train_mode: Literal["offline", "online", "window"] | None = None, evaluate_prompts: str | None = None,
             overrides: list[str] | None = None, prepared: Prepared | None = None) -> RunReport:
    """The whole pipeline. `run_dir` defaults to a new `<output_dir>/<run-id>/` (what a UI run gets).
    Without `config`, the config is read from `config_path` (flows/config_param.py). The switches a UI
    run sets on the form without writing a whole config: `regenerate` (regenerate.enabled),
    `train_mode` (train.mode), `evaluate_prompts` (evaluate.prompts: a JSONL file or dataset of
    prompts with categories) and `overrides` (any `key.sub=value`, as `eagle3 run --set`). `prepared`: the head's
    records when the caller already ran it (the refresh flow)."""
    config = resolve_config(config, config_path, switches(regenerate=regenerate, train_mode=train_mode,
                                                          evaluate_prompts=evaluate_prompts, overrides=overrides))
    run = RunDir(Path(run_dir) if run_dir else create_run_dir(Path(output_dir), config))
    recs: dict = {}  # stage name -> its typed record (report.json is built from these)
    clock = StageClock()  # `with clock.stage(name)` adds wall seconds to report.json `timings`
    error = None
    with rescheduled_on_lost_lease():  # pipeline-k8s has a concurrency limit: flows/lease.py
        try:
            use_hub_secret(config)
            if prepared is None:
                prepared = prepare_run(config, clock)
            recs.update((k, v) for k, v in prepared if v is not None and k != "version")
            prep, version = prepared.prepare, prepared.version
            online = config.train.mode in ("online", "window")  # no extract stage: the train stage captures
            with clock.stage("gpu-gate"):
                t.gpu_gate(config, GpuGateInputs(where="before-extract" if not online else "before-train"))
            if not online:
                with clock.stage("extract"):
                    recs["extract"] = extract(config, version)
                with clock.stage("gpu-gate"):
                    t.gpu_gate(config, GpuGateInputs(where="after-extract"))
                with clock.stage("verify"):
                    recs["verify"] = stage_runs.run_stage(config, "verify", VerifyInputs(version=version))
            with clock.stage("vocab"):
                recs["vocab"] = voc = t.vocab(config, VocabInputs(prep=prep, version=version))
            with clock.stage("train"):
                recs["train"] = tr = stage_runs.run_stage(config, "train", TrainInputs(version=version, voc=voc))
            if online:  # the gate ran inside train: on rows taken from its server before training started (online),
                # on every shard before it was published to the window (window)
                recs["verify"] = VerifyResult.model_validate((tr.online or tr.window).verify)
            with clock.stage("gpu-gate"):
                t.gpu_gate(config, GpuGateInputs(where="after-train"))
            with clock.stage("evaluate"):
                recs["evaluate"] = stage_runs.run_stage(config, "evaluate", EvaluateInputs(
                    prep=prep, version=version, voc=voc, tr=tr, run_dir=str(run.path)))
        except Exception as e:
            error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
            raise
        finally:
            rec = run.report_record(config, recs, installed_versions(), error, clock)
            t.report(str(run.path), rec, str(recs["train"].metrics) if "train" in recs else None)
    return rec

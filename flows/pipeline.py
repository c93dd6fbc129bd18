"""The pipeline flow: prepare → preflight → gpu-gate → extract → gpu-gate → verify → vocab → train →
gpu-gate → evaluate → report. The report is written also when a stage fails."""

from __future__ import annotations

import traceback
from pathlib import Path

from prefect import flow

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.preflight import installed_versions
from eagle3_pipeline.runs import RunDir, create_run_dir
from flows.extract import extract
from flows.hub_auth import use_hub_secret
from tasks import stage_tasks as t


@flow(name="pipeline", log_prints=True)
def pipeline(config: PipelineConfig, output_dir: str = "runs", run_dir: str | None = None) -> dict:
    """The whole pipeline. `run_dir` defaults to a new `<output_dir>/<run-id>/` (what a UI run gets)."""
    run = RunDir(Path(run_dir) if run_dir else create_run_dir(Path(output_dir), config))
    recs: dict[str, dict] = {}
    error = None
    try:
        use_hub_secret(config)
        recs["prepare"] = prep = t.prepare(config)
        recs["preflight"] = pre = t.preflight(config, prep)
        t.gpu_gate("before-extract")
        recs["extract"] = ext = extract(config, prep, pre)
        t.gpu_gate("after-extract")
        recs["verify"] = t.verify(config, prep, pre, ext)
        recs["vocab"] = voc = t.vocab(config, prep, pre, ext)
        recs["train"] = tr = t.train(config, prep, pre, ext, voc)
        t.gpu_gate("after-train")
        recs["evaluate"] = t.evaluate(config, prep, pre, voc, tr, str(run.path))
    except Exception as e:
        error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
        raise
    finally:
        rec = run.report_record(config, recs, installed_versions(), error)
        t.report(str(run.path), rec, recs.get("train", {}).get("metrics"))
    return rec

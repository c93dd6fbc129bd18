"""Run directories: `<output-dir>/<run-id>/` with `<output-dir>/latest` pointing at the newest.

Owns run ids (UTC time + short random suffix), the `latest` link, the run's config snapshot, the
run's time accounting (`StageClock`: report.json `timings`, wall seconds per stage with engine
start-up apart) and the assembly of `report.json`'s record from the stage records (report.py writes it).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

from eagle3_pipeline.core.config import PipelineConfig, skipped_checks
from eagle3_pipeline.core.store import write_json
from eagle3_pipeline.data.tokenized import PrepareResult, loss_warnings
from eagle3_pipeline.records.shardrun import engine_start_since
from eagle3_pipeline.report import stage as report_stage
from eagle3_pipeline.report.decision import curve_point, decide, history_path, record_run
from eagle3_pipeline.report.record import RunReport
from eagle3_pipeline.report.stage import ReportInputs


def run_warnings(config: PipelineConfig, recs: dict) -> list[str]:
    """What a person must read before trusting a run that completed: the checks it skipped (with what each could
    have caught) and the input rows it lost past prepare's limits."""
    prep = recs.get("prepare")
    lost = loss_warnings(PrepareResult.model_validate(prep), config.prepare) if prep else []
    return lost + skipped_checks(config)


def new_run_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def create_run_dir(output_dir: Path, config: PipelineConfig) -> Path:
    """Make `<output_dir>/<run-id>/`, save the resolved config there, point `latest` at it."""
    output_dir = Path(output_dir).resolve()
    run = output_dir / new_run_id()
    run.mkdir(parents=True)
    write_json(run / "config.json", config.model_dump(mode="json"))
    latest = output_dir / "latest"
    tmp = output_dir / f".latest-{run.name}"
    tmp.symlink_to(run.name)
    os.replace(tmp, latest)
    return run


class StageClock:
    """Wall seconds per stage of one run, as the flow saw them (Prefect's own cost included), plus the
    part of each that was engine / child start-up (`engine_start_s`, None where the stage starts
    none): extract = the engine starts of this run's children (manifest `children[].engine_start_s`),
    train = the child's start-up before its first step, evaluate = every engine start of its child.
    A stage timed twice (gpu-gate) adds up."""

    def __init__(self) -> None:
        self.started = time.time()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """`with clock.stage("train"): ...` adds the body's wall seconds to `name` (also when it raises)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def timings(self, recs: dict) -> dict[str, dict]:
        """report.json `timings`: {stage: {"seconds", "engine_start_s"}} in the order stages ran."""
        return {k: {"seconds": round(s, 2), "engine_start_s": _engine_start_s(k, recs.get(k), self.started)}
                for k, s in self.seconds.items()}


def _engine_start_s(stage: str, rec, since: float) -> float | None:
    if rec is None:
        return None
    if stage == "extract":

        return engine_start_since(Path(rec.dir), since)
    v = getattr(rec, "engine_start_s", None)
    return None if v is None else round(float(v), 2)


class RunDir:
    def __init__(self, path: Path):
        self.path = Path(path).resolve()
        self.run_id = self.path.name

    def report_record(self, config: PipelineConfig, recs: dict, versions: dict, error: str | None,
                      clock: StageClock | None = None) -> RunReport:
        """report.json's record from the stages' typed records (pydantic models, by stage name) and
        the run's StageClock."""
        timings = clock.timings(recs) if clock else {}
        recs = {k: (v.model_dump(mode="json") if hasattr(v, "model_dump") else v) for k, v in recs.items()}
        prep, ext, voc, tr = (recs.get(k, {}) for k in ("prepare", "extract", "vocab", "train"))
        artifacts = {
            "tokenized": prep.get("tokenized"), "hidden_states": ext.get("hidden_states_dir"),
            "manifest": ext.get("manifest"), "vocab": voc.get("dir"), "checkpoint": tr.get("checkpoint_best"),
            "target_model": str(Path(config.target.model).resolve()) if Path(config.target.model).exists()
            else config.target.model,
        }
        if recs.get("regenerate"):  # the rows prepare read instead of the configured sources
            artifacts["regenerated"] = recs["regenerate"].get("rows_dir")
        rep = report_stage.run(config, ReportInputs(
            run_id=self.run_id, versions=versions, stages=recs, status="failed" if error else "completed", error=error,
            artifacts={k: (str(v) if v is not None else None) for k, v in artifacts.items()}, timings=timings), print)
        rep.warnings = run_warnings(config, recs) + rep.warnings
        if rep.warnings and not error:
            rep.status = "completed with warnings"
        return self._with_history(rep, config)

    def _with_history(self, rep: RunReport, config: PipelineConfig) -> RunReport:
        """This run's τ against its training data size joins the store's history of the dataset and target,
        and the decision is made again with the curve of the comparable runs (report/decision.py)."""
        point = curve_point(self.run_id, rep.to_json()["stages"])
        if point is None:
            return rep
        try:
            curve = record_run(history_path(Path(config.store), config.prepare.dataset, config.target.model), point)
        except OSError as e:  # the report is written all the same; it says why the curve is missing
            rep.warnings.append(f"history not kept: {type(e).__name__}: {e}")
            return rep
        rep.decision = decide(rep.to_json()["stages"].get("evaluate"), curve)
        return rep

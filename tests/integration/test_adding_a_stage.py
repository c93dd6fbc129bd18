"""Adding a stage (README "Adding a stage"), shown end to end: a toy stage, declared as a `StageSpec` with a run
function and a typed record, is registered (`registry.registered`, what its line in `STAGES` does for good), gets
its task from `stage_task` and runs in a real Prefect flow on the session's temporary server. The flow runs it the
way flows/pipeline.py runs a stage (`with clock.stage(...)`, its record under its name, the report task last).

Checked: the task carries the spec's name and retry policy (a transient error is retried, the count and delay are
the spec's; the spec's own refusal is not retried), it is never answered from Prefect's cache (a second call with the
same inputs runs again), its record is the flow's and its time is in report.json `timings`, and the production
order is back once the block ends. No engine: the toy stage only counts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from pydantic import BaseModel

from eagle3_pipeline.core.config import PipelineConfig
from eagle3_pipeline.core.stage_spec import Log, Retry, StageSpec
from eagle3_pipeline.pipeline import registry
from eagle3_pipeline.report.runs import RunDir, StageClock, create_run_dir
from tasks import stage_tasks as t


class ToyInputs(BaseModel):
    rows: int  # an earlier stage's output


class ToyResult(BaseModel):
    rows: int
    doubled: int


class ToyRefused(RuntimeError):
    """The toy stage's own check said no: an answer, never retried."""


CALLS: list[str] = []  # one entry per call of the run function: what the retry and no-cache checks count
FAULTS: list[BaseException] = []  # raised, in order, by the next calls


def run(cfg: PipelineConfig, inputs: ToyInputs, log: Log) -> ToyResult:
    """The toy stage's entry, of the one signature: config and its inputs record in, a small typed record out."""
    CALLS.append(cfg.name)
    if FAULTS:
        raise FAULTS.pop(0)
    log(f"toy: doubling {inputs.rows} rows")
    return ToyResult(rows=inputs.rows, doubled=2 * inputs.rows)


TOY = StageSpec(name="toy", run=run, result=ToyResult, failure=ToyRefused, reported=False,
                retry=Retry(2, 0.0, (OSError,), "toy: a lost mount passes on a retry"))


def toy_flow():
    """The toy stage's task, built from its spec as tasks/stage_tasks.py builds every stage's (it runs the entry
    through pipeline/stages.py run_stage), and a flow that runs it (as in flows/pipeline.py); built inside
    `registered`, where `stage_task` finds the spec."""
    toy = t.stage_task("toy", tags=["cpu"])

    @flow(name="toy-pipeline")
    def toy_pipeline(config: PipelineConfig, output_dir: str, rows: int) -> dict:
        run = RunDir(create_run_dir(Path(output_dir), config))
        clock, recs = StageClock(), {}
        with clock.stage("toy"):
            recs["toy"] = toy(config, ToyInputs(rows=rows))
        with clock.stage("toy"):
            again = toy(config, ToyInputs(rows=rows))  # the same inputs: no cached answer, the stage runs again
        rec = run.report_record(config, recs, {}, None, clock)
        t.report(str(run.path), rec, None)
        return {"toy": recs["toy"], "again": again, "run_dir": str(run.path)}

    return toy, toy_pipeline


def _task_runs(flow_run_id) -> list:
    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def test_registered_toy_stage_runs_in_a_real_flow(tiny_config, prefect_harness, tmp_path):
    production = registry.STAGES
    CALLS.clear()
    with registry.registered(TOY):
        assert registry.NAMES[-2:] == ("toy", "report") and "toy" not in registry.REPORTED + registry.GATES
        toy, toy_pipeline = toy_flow()
        assert toy.name == "toy" and toy.retries == 2 and toy.retry_delay_seconds == 0.0
        FAULTS[:] = [OSError("the mount went away")]  # transient: the spec's policy retries it once
        state = toy_pipeline(tiny_config, str(tmp_path / "runs"), 21, return_state=True)
    assert registry.STAGES == production and "toy" not in registry.NAMES  # the production order is back
    with pytest.raises(KeyError, match="no stage 'toy'"):
        registry.spec("toy")

    assert state.is_completed(), state.message
    out = state.result()
    assert out["toy"] == out["again"] == ToyResult(rows=21, doubled=42)
    assert len(CALLS) == 3  # the failed attempt, its retry, and the second call (not a cached answer)
    runs = sorted(_task_runs(state.state_details.flow_run_id), key=lambda r: r.expected_start_time)
    toys = [r for r in runs if r.task_key.startswith("toy") or r.name.startswith("toy")]
    assert [r.run_count for r in toys] == [2, 1] and all(r.state.is_completed() for r in toys)
    assert all(r.empirical_policy.retries == 2 and r.empirical_policy.retry_delay == 0 for r in toys)
    assert not any(r.state.name == "Cached" for r in toys)
    report = json.loads((Path(out["run_dir"]) / "report.json").read_text())
    assert report["status"] == "completed" and "toy" in report["timings"]  # where stage times appear
    assert "toy" not in report["stages"]  # reported=False: no entry in report/record.py `Stages`


def test_registered_stage_refusal_is_not_retried(tiny_config, prefect_harness, tmp_path):
    CALLS.clear()
    with registry.registered(TOY):
        _, toy_pipeline = toy_flow()
        FAULTS[:] = [ToyRefused("the toy check said no")]
        state = toy_pipeline(tiny_config, str(tmp_path / "runs"), 3, return_state=True)
    assert state.is_failed() and len(CALLS) == 1  # the spec's failure is an answer: one attempt
    (tr,) = [r for r in _task_runs(state.state_details.flow_run_id) if r.name.startswith("toy")]
    assert tr.state.is_failed() and tr.run_count == 1


def test_registering_a_taken_name_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        with registry.registered(StageSpec(name="verify", run=run, result=ToyResult, failure=None)):
            pass
    assert "verify" in registry.NAMES and len(registry.NAMES) == len(set(registry.NAMES))

"""The stages that may run as their own Kubernetes Job (verify, train, evaluate): in the flow's process, or with
`gpu_stages: deployments` as runs of their own deployments (docs/internals.md, "flows/stage_runs.py").
"""

from __future__ import annotations

import os
import time

from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.states import Cancelling
from pydantic import BaseModel

from eagle3_pipeline.core.config import PipelineConfig
from eagle3_pipeline.data.tokenized import PrepareResult
from eagle3_pipeline.evaluate.stage import EvaluateInputs, EvaluateReport
from eagle3_pipeline.pipeline import registry
from eagle3_pipeline.pipeline.jobs import job_variables
from eagle3_pipeline.records.layout import ExtractVersion
from eagle3_pipeline.train.stage import TrainInputs, TrainResult
from eagle3_pipeline.verify.stage import VerifyInputs, VerifyResult
from eagle3_pipeline.vocab.stage import VocabResult
from flows import attach
from flows.fanout import flow_run_link, with_api_retry
from flows.hub_auth import use_hub_secret
from flows.pods import StartWatch, pod_source
from tasks import stage_tasks as t

DEPLOYMENT = os.environ.get("EAGLE3_STAGE_DEPLOYMENT", "{stage}-stage/{stage}-stage")
POLL_S = float(os.environ.get("EAGLE3_FANOUT_POLL_S", "5"))
RESULT = {"persist_result": True, "result_serializer": "json", "log_prints": True}
RECORD = {"verify": VerifyResult, "train": TrainResult, "evaluate": EvaluateReport}  # what a run's JSON result is


class StageRunFailed(RuntimeError):
    """A stage's deployment run did not complete (twice, when it crashed)."""


@flow(name="verify-stage", **RESULT)
def verify_stage(config: PipelineConfig, version: ExtractVersion) -> VerifyResult:
    use_hub_secret(config)
    return t.verify(config, VerifyInputs(version=version))


@flow(name="train-stage", **RESULT)
def train_stage(config: PipelineConfig, version: ExtractVersion, voc: VocabResult) -> TrainResult:
    use_hub_secret(config)
    return t.train(config, TrainInputs(version=version, voc=voc))


@flow(name="evaluate-stage", **RESULT)
def evaluate_stage(config: PipelineConfig, prep: PrepareResult, version: ExtractVersion, voc: VocabResult,
                   tr: TrainResult, run_dir: str) -> EvaluateReport:
    use_hub_secret(config)
    return t.evaluate(config, EvaluateInputs(prep=prep, version=version, voc=voc, tr=tr, run_dir=run_dir))


def run_stage(config: PipelineConfig, stage: str, inputs: BaseModel):
    """A stage that may run as its own Job (registry.JOB_STAGES): with `gpu_stages: deployments` as a run of its
    deployment, whose parameters are the config and the inputs record's fields; else its task in this flow."""
    if config.gpu_stages == "deployments" and stage in registry.JOB_STAGES:
        return on_pool(config, stage, **dict(inputs))
    return t.TASKS[stage](config, inputs)


def on_pool(config: PipelineConfig, stage: str, **inputs):
    """Run `stage` as a run of its deployment and return its record; a crashed run is submitted once more.
    A run of the same inputs that an earlier controller made is re-attached to while it is going, and gives
    its record without a new Job when it completed (StageRuns)."""
    log, name = get_run_logger(), DEPLOYMENT.format(stage=stage)
    jv = job_variables(config, stage)
    params = {"config": config.model_dump(mode="json"),
              **{k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in inputs.items()}}
    runs = StageRuns(name, attach.stage_base(stage, inputs["version"].content_key, params), f"eagle3-{stage}", log)
    if (done := runs.completed(params)) is not None:
        log.info(f"{stage}: flow run {done.name} of these inputs completed before: its record, no new run - "
                 f"{flow_run_link(done.id)}")
        return RECORD[stage].model_validate(done.state.result())
    problems = []
    for attempt in (1, 2):
        fr, reattached = runs.next(params, jv, f"{stage}-{config.name}")
        log.info(f"{stage}: flow run {fr.name} of {name} ({jv['gpu_count']} GPUs, deadline {jv['deadline_seconds']} s)"
                 f"{' re-attached: an earlier controller submitted it' if reattached else ''}: {flow_run_link(fr.id)}")
        start = StartWatch(f"{stage}: flow run {fr.name}", jv["pod_watch_timeout_seconds"], pod_source(), log.warning,
                           expected=jv.get("pods", 1))
        state = wait_final(fr.id, jv["deadline_seconds"], log, start)
        if state is not None and state.is_completed():
            return RECORD[stage].model_validate(state.result())  # the JSON result comes back as a dict
        problems.append(f"attempt {attempt}: flow run {fr.name} ({fr.id}) "
                        + (f"{state.name}: {state.message}" if state else f"not final after {jv['deadline_seconds']} s")
                        + f" - {flow_run_link(fr.id)}")
        log.error(f"{stage}: {problems[-1]}")
        if state is None or not state.is_crashed() or start.never_started:
            break
        start.stop(fr.id)  # the crashed run's pod cannot run on beside the next attempt
    raise StageRunFailed(f"{stage} ran as deployment {name} and did not complete:\n  " + "\n  ".join(problems))


class StageRuns:
    """The runs made for one stage's inputs (`base`, flows/attach.py) on deployment `name`: the newest one,
    re-attached to while it is going; after it, the next attempt `<base>-<n+1>`."""

    def __init__(self, name: str, base: str, tag: str, log):
        self.name, self.base, self.tag, self.log = name, base, tag, log
        with get_client(sync_client=True) as client:
            dep = with_api_retry(lambda: client.read_deployment_by_name(name), f"read {name}", log.warning)
            runs = with_api_retry(lambda: attach.runs_tagged(client, dep.id, tag), f"runs of {name}", log.warning)
        self.n, self.latest = attach.latest(runs, base)

    def completed(self, parameters: dict):
        """The newest run when it completed with these parameters and its persisted result reads back, else None
        (an evaluate of another run directory is run again: its files belong to this run)."""
        fr = self.latest
        if fr is None or fr.state is None or not fr.state.is_completed() or fr.parameters != parameters:
            return None
        try:
            fr.state.result()
        except Exception as e:  # noqa: BLE001 - its persisted result is gone: the stage runs again
            self.log.warning(f"{fr.name} completed but its result cannot be read ({type(e).__name__}: {e}): "
                             f"running it again")
            return None
        return fr

    def next(self, parameters: dict, jv: dict, flow_run_name: str):
        """(the run to wait for, whether it is one an earlier controller made and still going)."""
        if attach.going(self.latest):
            fr, self.latest = self.latest, None
            return fr, True
        self.n, self.latest = self.n + 1, None
        return with_api_retry(lambda: run_deployment(
            self.name, parameters=parameters, job_variables=jv, timeout=0, as_subflow=True, tags=[self.tag],
            flow_run_name=flow_run_name, idempotency_key=f"{self.base}-{self.n}"), f"submit {self.name}",
            self.log.warning), False


def wait_final(flow_run_id, deadline_s: float, log, start: StartWatch | None = None):
    """The run's final state, or None (after cancelling it) when `deadline_s` passes first; the API
    being away for a while (a server restart, a database outage) is waited out (fanout.with_api_retry).
    With `start`: a run whose pod has not started by its start deadline is cancelled (Cancelling: its worker
    deletes the Job) and its Job deleted here too where the Kubernetes API is at hand; that state, the pod's
    reason in its message, is returned."""
    end = time.monotonic() + deadline_s
    with get_client(sync_client=True) as client:
        while time.monotonic() < end:
            time.sleep(POLL_S)
            fr = with_api_retry(lambda: client.read_flow_run(flow_run_id), f"read flow run {flow_run_id}", log.warning)
            if fr.state is not None and fr.state.is_final():
                return fr.state
            why = start.give_up(flow_run_id, fr.state, time.time()) if start is not None else None
            if why is not None:
                with_api_retry(lambda: client.set_flow_run_state(
                    flow_run_id, Cancelling(message=f"never started: {why}"), force=True),
                    f"cancel flow run {flow_run_id}", log.warning)
                start.stop(flow_run_id)
                return with_api_retry(lambda: client.read_flow_run(flow_run_id), f"read flow run {flow_run_id}",
                                      log.warning).state
        with_api_retry(lambda: client.set_flow_run_state(
            flow_run_id, Cancelling(message=f"no result within {deadline_s:.0f} s"), force=True),
            f"cancel flow run {flow_run_id}", log.warning)
    return None

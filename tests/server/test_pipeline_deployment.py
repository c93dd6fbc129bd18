"""The pipeline deployment on a real server and worker, the way an operator uses it from the UI: Run
(with a node fault injected into shard 2), the run fails naming the shard group, Retry re-executes
only that group (the other is answered from Prefect's cache), and the run leaves its versioned
records (keyed artifacts) and events. Then the cheap operations on the same data: the scheduled
refresh finds nothing changed, a deployed engine task refuses to run without the GPU limit, and a
dataset published by a data job starts the pipeline through the automation."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.server import (
    GPU_LIMIT,
    POOL,
    artifacts,
    read_events,
    subflow_runs,
    task_states,
    ui_retry,
    ui_run,
    wait_final,
)

MODEL = "tiny-target"  # artifact keys: <what>-<dataset>-<model>


@pytest.fixture(scope="module")
def pipeline_run(client, controller, server_config, tmp_path_factory):
    """One pipeline run through the worker: attempt 1 with EAGLE3_TEST_FAIL_SHARDS=2 (shard 2 fails
    once), attempt 2 by the UI's Retry."""
    cfg = server_config("pipeline", "openai.jsonl")
    out = tmp_path_factory.mktemp("runs")
    t0 = time.time()
    fr = ui_run(client, "pipeline/pipeline", {"config": cfg.model_dump(mode="json"), "output_dir": str(out)},
                job_variables={"env": {"EAGLE3_TEST_FAIL_SHARDS": "2"}})
    first = wait_final(client, fr.id, 600, [controller])
    t1 = ui_retry(client, fr.id, controller)
    second = wait_final(client, fr.id, 900, [controller], since=t1)
    print(f"pipeline run: attempt 1 {t1 - t0:.0f}s ({first.state.name}), retry {time.time() - t1:.0f}s "
          f"({second.state.name})")
    return SimpleNamespace(cfg=cfg, out=out, id=fr.id, first=first, second=second, t0=t0)


def _extract_attempts(client, pr) -> tuple[dict, dict]:
    """Task states of the extract subflow in attempt 1 and in the retry."""
    groups = {"extract-shards-[0, 1]", "extract-shards-[2, 3]"}
    runs = subflow_runs(client, pr.id, "extract")
    if len(runs) >= 2:  # a retried parent makes a new subflow run
        return (task_states(client, runs[0].id, wait_for=groups), task_states(client, runs[-1].id, wait_for=groups))
    (run,) = runs     # or re-runs the same one: attempts are told apart by run count
    return (task_states(client, run.id, 1, wait_for=groups), task_states(client, run.id, run.run_count, wait_for=groups))


def test_ui_run_fails_on_a_shard_and_ui_retry_reruns_only_its_group(pipeline_run, client):
    pr = pipeline_run
    assert pr.first.state.is_failed(), pr.first.state
    assert "1 of 2 shard groups failed" in pr.first.state.message and "shards [2, 3]" in pr.first.state.message
    assert pr.second.state.is_completed(), pr.second.state.message
    s1, s2 = _extract_attempts(client, pr)
    assert (s1["extract-shards-[0, 1]"], s1["extract-shards-[2, 3]"]) == ("Completed", "Failed"), s1
    assert (s2["extract-shards-[0, 1]"], s2["extract-shards-[2, 3]"]) == ("Cached", "Completed"), s2
    rep = json.loads((pr.out / "latest" / "report.json").read_text())
    assert rep["status"] == "completed", rep["error"]
    manifest = json.loads(Path(rep["artifacts"]["manifest"]).read_text())
    assert [s["attempts"] for s in manifest["shards"]] == [1, 1, 2, 2]  # shard 3 shares the failed child
    assert rep["stages"]["verify"]["passed"] and rep["stages"]["train"]["steps"] > 0
    assert rep["stages"]["evaluate"]["acceptance_length"] >= 1.0


def test_versioned_records_and_events(pipeline_run, client):
    pr, ds = pipeline_run, "pipeline"
    rep = json.loads((pr.out / "latest" / "report.json").read_text())
    keys = [f"prepare-{ds}", *(f"{w}-{ds}-{MODEL}" for w in ("extract", "verify", "train", "evaluate", "store")),
            "report-srv-pipeline"]
    found = {k: artifacts(client, k) for k in keys}
    assert all(found.values()), {k: len(v) for k, v in found.items()}
    assert len(found[f"prepare-{ds}"]) == 2  # one version per attempt under the same key
    assert len(found["report-srv-pipeline"]) == 2  # the failed attempt's report too

    def table(k):
        data = found[k][-1].data
        return json.loads(data) if isinstance(data, str) else data

    (ext,) = table(f"extract-{ds}-{MODEL}")
    assert ext["shards_published"] == ext["shards_total"] == 4 and ext["attempts"] == 6
    assert ext["extract_version"] == rep["stages"]["extract"]["details"]["content_key"]
    (tr,) = table(f"train-{ds}-{MODEL}")
    assert tr["steps"] == rep["stages"]["train"]["steps"] and tr["checkpoint_best"] == rep["artifacts"]["checkpoint"]
    (ev,) = table(f"evaluate-{ds}-{MODEL}")
    assert ev["acceptance_length"] == rep["stages"]["evaluate"]["acceptance_length"]
    assert {row["layer_id"] for row in table(f"verify-{ds}-{MODEL}")} >= set(rep["stages"]["extract"]["layer_ids"])
    assert rep["artifacts"]["checkpoint"] in found[f"store-{ds}-{MODEL}"][-1].data

    version = rep["stages"]["prepare"]["version"]
    (pub,) = read_events(client, "eagle3.dataset.published", {"eagle3.dataset": ds}, pr.t0)
    assert pub.resource["eagle3.version"] == version and pub.resource["eagle3.training"] == "in-run"
    assert pub.payload["config"]["prepare"]["dataset"] == ds
    (exp,) = read_events(client, "eagle3.draft.exported", {"eagle3.dataset": ds}, pr.t0)
    assert exp.payload["checkpoint"] == rep["artifacts"]["checkpoint"]
    # an in-run publication does not start a second pipeline through the automation
    assert [r.id for r in _pipeline_runs(client, ds)] == [pr.id]


def test_refresh_schedule_and_unchanged_data(pipeline_run, client, controller, server_overrides, server_config_path):
    dep = client.read_deployment_by_name("refresh/refresh")
    (sched,) = dep.schedules
    assert (sched.schedule.cron, sched.schedule.timezone, sched.active) == ("0 3 * * *", "Europe/Berlin", True)
    rep = json.loads((pipeline_run.out / "latest" / "report.json").read_text())
    fr = ui_run(client, "refresh/refresh", {"config_path": str(server_config_path),
                                           "overrides": server_overrides("pipeline", "openai.jsonl"),
                                           "output_dir": str(pipeline_run.out)})
    fr = wait_final(client, fr.id, 300, [controller])
    assert fr.state.is_completed(), fr.state.message
    assert subflow_runs(client, fr.id, "pipeline") == []
    (rec,) = json.loads(artifacts(client, f"refresh-pipeline-{MODEL}")[-1].data)
    assert rec == {**rec, "version": rep["stages"]["prepare"]["version"], "new_version": False, "trains": False,
                   "existing_draft": rep["artifacts"]["checkpoint"]}


def test_deployed_engine_task_refuses_to_run_without_the_gpu_limit(pipeline_run, client, nodes):
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    from eagle3_pipeline.pipeline.stages import plan_extract, stage_preflight, stage_prepare

    cfg = pipeline_run.cfg
    prep = stage_prepare(cfg)
    version = plan_extract(cfg, prep, stage_preflight(cfg, prep))
    client.delete_global_concurrency_limit_by_name(GPU_LIMIT)
    try:
        fr = ui_run(client, "extract-group/extract-group", {
            "config": cfg.model_dump(mode="json"), "version": version.model_dump(mode="json"), "shard_ids": [0, 1],
            "force": True})
        fr = wait_final(client, fr.id, 300, nodes)
    finally:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=GPU_LIMIT, limit=2))
    assert fr.state.is_failed() and f"prefect gcl create {GPU_LIMIT}" in fr.state.message, fr.state.message


def _pipeline_runs(client, dataset: str):
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    dep = client.read_deployment_by_name("pipeline/pipeline")
    runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])))
    return [r for r in runs if r.parameters.get("config", {}).get("prepare", {}).get("dataset") == dataset]


def test_published_dataset_starts_the_pipeline(client, deployed, server_config):
    """`python -m deployments.publish` announces a version (eagle3.training: wanted); the automation
    from prefect.yaml answers with a pipeline run of that config. The queue is paused so that the
    run is only looked at, not executed."""
    from deployments.publish import publish

    (auto,) = client.read_automations_by_name("eagle3-train-on-publish")
    assert auto.enabled
    queue = client.read_work_queue_by_name("default", work_pool_name=POOL)
    client.update_work_queue(queue.id, is_paused=True)
    try:
        cfg = server_config("published", "sharegpt.jsonl")
        t0 = time.time()
        prep = publish(cfg)
        deadline, runs = time.time() + 90, []
        while not runs and time.time() < deadline:
            time.sleep(1)
            runs = _pipeline_runs(client, "published")
        arrived = read_events(client, "eagle3.dataset.published", {"eagle3.dataset": "published"}, t0)
        assert len(runs) == 1, (f"no pipeline run {time.time() - t0:.0f}s after the published event "
                                f"({len(arrived)} such events reached the server)")
        assert runs[0].parameters["config"] == cfg.model_dump(mode="json")
        assert runs[0].state.is_scheduled()
        (ev,) = arrived
        assert ev.resource["eagle3.version"] == prep.version and ev.resource["eagle3.training"] == "wanted"
        client.delete_flow_run(runs[0].id)
    finally:
        client.update_work_queue(queue.id, is_paused=False)

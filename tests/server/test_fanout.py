"""Multi-node extraction on a real server: with extract.parallel_groups=2 the extract flow fans its
shard groups out as `extract-group` deployment runs, and two process workers (queue `gpu`, one run
each) play two GPU nodes. The nodes lose shard 2 once (EAGLE3_TEST_FAIL_SHARDS): the failed group
fails the stage naming its flow run and link; the UI's Retry re-submits only that group."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.helpers.server import read_events, ui_retry, ui_run, wait_final


def _group_runs(client, dataset: str):
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.client.schemas.sorting import FlowRunSort

    dep = client.read_deployment_by_name("extract-group/extract-group")
    runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])),
                                 sort=FlowRunSort.EXPECTED_START_TIME_ASC)
    return [r for r in runs if r.parameters["config"]["prepare"]["dataset"] == dataset]


def test_fanout_to_two_nodes_failed_group_and_retry(client, controller, nodes, server_config, prefect_server):
    cfg = server_config("fanout", "sharegpt.jsonl", "extract.parallel_groups=2")
    t0 = time.time()
    fr = ui_run(client, "rerun-failed/rerun-failed", {"config": cfg.model_dump(mode="json")})
    first = wait_final(client, fr.id, 600, [controller, *nodes])

    assert first.state.is_failed(), first.state
    groups = _group_runs(client, "fanout")
    assert sorted(r.parameters["shard_ids"] for r in groups) == [[0, 1], [2, 3]]
    by_shards = {tuple(r.parameters["shard_ids"]): r for r in groups}
    bad = by_shards[(2, 3)]
    assert by_shards[(0, 1)].state.is_completed() and bad.state.is_failed()
    msg = first.state.message
    assert "shards [2, 3]: flow run" in msg and str(bad.id) in msg and f"{prefect_server.ui}/runs/flow-run/{bad.id}" in msg
    # two nodes: each group ran on its own worker, at the same time
    logs = {w.name: w.log.read_text(errors="replace") for w in nodes}
    # a worker that lost the race for a run logs "submitting flow run <id>" and "Aborted submission of
    # flow run <id>"; the one that runs it logs the run's own lines ("View at .../flow-run/<id>")
    ran_on = {k: [n for n, text in logs.items() if f"/flow-run/{r.id}" in text] for k, r in by_shards.items()}
    assert sorted(sum(ran_on.values(), [])) == ["node-a", "node-b"], ran_on
    a, b = by_shards.values()
    assert a.start_time < b.end_time and b.start_time < a.end_time, [(r.start_time, r.end_time) for r in groups]

    t1 = ui_retry(client, fr.id, controller)
    second = wait_final(client, fr.id, 600, [controller, *nodes], since=t1)
    assert second.state.is_completed(), second.state.message
    groups = _group_runs(client, "fanout")
    assert [r.parameters["shard_ids"] for r in groups if r.id not in {a.id, b.id}] == [[2, 3]]
    assert all(r.state.is_completed() for r in groups if r.id not in {a.id, b.id})
    man = json.loads((Path(groups[0].parameters["version"]["dir"]) / "manifest.json").read_text())
    assert [(s["status"], s["attempts"]) for s in man["shards"]] == [("published", 1)] * 2 + [("published", 2)] * 2
    # rerun-failed published this version without training it: the event says so, and the
    # train-on-publish automation (it answers `wanted` only) started no pipeline run
    (ev,) = read_events(client, "eagle3.dataset.published", {"eagle3.dataset": "fanout"}, t0)
    assert ev.resource["eagle3.training"] == "no"
    assert not [r for r in client.read_flow_runs() if r.parameters.get("config", {}).get("name") == "srv-fanout"
                and client.read_flow(r.flow_id).name == "pipeline"]


def test_gpu_stages_as_deployments(client, controller, nodes, server_config, prefect_server, tmp_path):
    """gpu_stages: deployments: the pipeline flow (on the controller) runs verify, train and evaluate as
    runs of their deployments on the GPU nodes, with the job variables the config implies, and gets
    their records back (the extraction is the previous test's, from the store)."""
    from eagle3_pipeline.pipeline.jobs import job_variables

    cfg = server_config("fanout", "sharegpt.jsonl", "extract.parallel_groups=2", "gpu_stages=deployments")
    fr = ui_run(client, "pipeline/pipeline", {"config": cfg.model_dump(mode="json"), "output_dir": str(tmp_path)})
    done = wait_final(client, fr.id, 900, [controller, *nodes])
    assert done.state.is_completed(), done.state.message
    rep = json.loads((tmp_path / "latest" / "report.json").read_text())
    assert rep["status"] == "completed" and rep["stages"]["verify"]["passed"], rep["error"]
    assert rep["stages"]["evaluate"]["acceptance_length"] >= 1.0
    logs = {w.name: w.log.read_text(errors="replace") for w in nodes}
    for stage in ("verify", "train", "evaluate"):
        (run,) = [r for r in client.read_flow_runs() if r.parent_task_run_id is not None
                  and client.read_flow(r.flow_id).name == f"{stage}-stage" and r.parameters["config"]["name"] == cfg.name]
        assert run.state.is_completed(), (stage, run.state)
        assert run.job_variables == job_variables(cfg, stage), stage
        assert [n for n, text in logs.items() if f"/flow-run/{run.id}" in text], f"{stage} ran on no GPU node"
    assert Path(rep["artifacts"]["checkpoint"]).is_dir()  # the train run's record names the draft it wrote

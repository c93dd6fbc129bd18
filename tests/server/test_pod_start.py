"""Start versus lost, on a real server with fake pods (no cluster here: tests/helpers/fake_pods.py).

A stage's run whose Job is submitted (Pending) but whose pod has not started is waiting, not lost: a pod
slower to start than the heartbeat grace is left to start; a pod that never starts (Unschedulable,
ImagePullBackOff) is cancelled at the config's start deadline (cluster.start_deadline_s), its Job deleted,
and the stage fails naming the pod's own reason, in seconds here and minutes on a cluster rather than the
Job's deadline of hours or days. The runs are made on a work queue no worker polls; this test plays the
Kubernetes worker that moves a submitted run to Pending."""

from __future__ import annotations

import threading
import time

import pytest

from tests.helpers.fake_pods import FakePods

SHORT_START = ["cluster.gpu_node_scale_up_s=8", "cluster.cpu_node_scale_up_s=8", "cluster.image_gib=0.1",
               "cluster.node_pull_gib_per_s=1", "cluster.registry_gib_per_s=1", "cluster.start_margin_s=0"]


def _nobody_queue(monkeypatch, module):
    """Runs of the module's run_deployment go to a work queue no worker polls (they stay Scheduled until the
    test's stand-in worker moves them on)."""
    real = module.run_deployment
    monkeypatch.setattr(module, "run_deployment", lambda *a, **kw: real(*a, **kw, work_queue_name="nobody"))


class StandInWorker(threading.Thread):
    """What the Kubernetes worker does with a run it submits: Pending once its Job exists; and, for a pod
    that starts, Running and then Completed (the run's own process, which these tests do not start)."""

    def __init__(self, api: str, pods: FakePods, tag: str):
        super().__init__(daemon=True)
        self.api, self.pods, self.tag, self.stop = api, pods, tag, threading.Event()

    def run(self):
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
        from prefect.settings import PREFECT_API_URL, temporary_settings
        from prefect.states import Completed, Pending, Running

        # a thread does not inherit the test's settings context: name the server
        with temporary_settings({PREFECT_API_URL: self.api}), get_client(sync_client=True) as client:
            while not self.stop.wait(0.5):
                for fr in client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[self.tag]))):
                    st, fid = fr.state, str(fr.id)
                    if st is None or st.is_final() or st.is_cancelling():
                        continue
                    if st.is_scheduled():
                        client.set_flow_run_state(fr.id, Pending(), force=True)
                    elif st.is_pending() and any(p["status"]["phase"] == "Running" for p in self.pods.of(fid)):
                        client.set_flow_run_state(fr.id, Running(), force=True)
                        client.set_flow_run_state(fr.id, Completed(), force=True)


def test_fanout_waits_for_a_slow_pod_and_gives_up_an_unschedulable_one(client, deployed, server_config, monkeypatch,
                                                                        prefect_server):
    """Two shard groups: one pod starts after 6 s (longer than the 3 s heartbeat grace: not lost, not
    resubmitted), one is Unschedulable: at the ~8 s start deadline its run is cancelled, its Job deleted,
    and the fan-out's answer names it with Kubernetes' reason."""
    from prefect import flow

    from eagle3_pipeline.core.cluster import start_deadline_s
    from eagle3_pipeline.pipeline.stages import plan_extract, stage_preflight, stage_prepare
    from flows import fanout

    cfg = server_config("podstart", "sharegpt.jsonl", "extract.parallel_groups=2", *SHORT_START)
    quiet = lambda _: None  # noqa: E731
    prep = stage_prepare(cfg, log=quiet)
    version = plan_extract(cfg, prep, stage_preflight(cfg, prep, log=quiet))
    assert len(version.groups) == 2
    pods = FakePods()
    monkeypatch.setenv("EAGLE3_POD_SOURCE", "tests.server.test_pod_start:PODS")
    monkeypatch.setitem(globals(), "PODS", pods)
    monkeypatch.setattr(fanout, "POLL_S", 1.0)
    monkeypatch.setattr(fanout, "heartbeat_grace_s", lambda: 3.0)
    _nobody_queue(monkeypatch, fanout)
    real_submit = fanout.run_deployment

    def scripted(*a, **kw):  # the first group's pod starts late, the second's never
        fr = real_submit(*a, **kw)
        pods.script[str(fr.id)] = 6.0 if kw["parameters"]["shard_ids"] == version.groups[0] else "never"
        return fr

    monkeypatch.setattr(fanout, "run_deployment", scripted)
    worker = StandInWorker(prefect_server.api, pods, f"eagle3-extract-{version.content_key}")
    worker.start()

    @flow(name="pod-start-fanout")
    def controller():
        return fanout.run_groups_as_deployments(cfg, version, set())

    t0 = time.time()
    try:
        failed = controller()
    finally:
        worker.stop.set()
        worker.join(5)
    took = time.time() - t0
    deadline = start_deadline_s(cfg, True, 2)
    assert 6 < deadline < 10
    assert len(failed) == 1, failed
    assert f"shards {version.groups[1]}" in failed[0] and "never started" in failed[0], failed
    assert "Unschedulable: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu" in failed[0], failed
    assert f"within {deadline:.0f}s" in failed[0]
    assert took < deadline + 120, took  # the start deadline, not the Job's (hours); slack for a loaded CI machine
    (never,) = [fid for fid, how in pods.script.items() if how == "never"]
    (slow,) = [fid for fid, how in pods.script.items() if how == 6.0]
    assert pods.deleted == [never]  # its Job is gone: nothing waits on for a node
    assert client.read_flow_run(never).state.is_cancelling() or client.read_flow_run(never).state.is_cancelled()
    slow_run = client.read_flow_run(slow)
    assert slow_run.state.is_completed(), slow_run.state  # waited for, never marked lost, not resubmitted
    assert len(pods.script) == 2


@pytest.mark.parametrize("how, reason", [("never", "Unschedulable"), ("image", "ImagePullBackOff")])
def test_a_stage_run_whose_pod_never_starts_fails_with_the_pods_reason(client, deployed, server_config, how, reason):
    """gpu_stages: deployments: the stage's run waits at most its start deadline (the job variables'
    pod_watch_timeout_seconds, from the config) and comes back cancelled, with Kubernetes' reason."""
    from prefect.states import Pending

    from eagle3_pipeline.pipeline.jobs import job_variables
    from flows.pods import StartWatch
    from flows.stage_runs import wait_final

    cfg = server_config("podstart", "sharegpt.jsonl", *SHORT_START)
    jv = job_variables(cfg, "evaluate")
    from prefect import flow

    @flow(name="evaluate-stage-probe")
    def probe():  # never runs: its run is made and moved to Pending as a worker that created its Job would
        pass

    fr = client.create_flow_run(probe, parameters={})
    client.set_flow_run_state(fr.id, Pending(), force=True)
    pods, lines = FakePods(), []
    pods.script[str(fr.id)] = how
    start = StartWatch("evaluate", jv["pod_watch_timeout_seconds"], pods, lines.append)
    t0 = time.time()
    state = wait_final(fr.id, jv["deadline_seconds"], type("Log", (), {"warning": staticmethod(lines.append)}), start)
    took = time.time() - t0
    assert jv["pod_watch_timeout_seconds"] <= took < jv["pod_watch_timeout_seconds"] + 120, took  # not the Job's hours
    assert state.is_cancelling() or state.is_cancelled(), state
    assert reason in state.message and "never started" in state.message, state.message
    assert start.never_started and reason in start.never_started
    assert pods.deleted == [str(fr.id)]
    assert sum(reason in ln for ln in lines) == 1, lines  # reported once, as soon as it was seen

"""A stage's Job is submitted once per content: the train stage's submission (flows/stage_runs.StageRuns, keyed by
flows/attach.py) made again by another controller (rescheduled, re-run by hand) re-attaches to the run already
made, and prefect-kubernetes' own KubernetesWorker, polling the GPU pool of this real Prefect server, creates
exactly one Job for it in a fake Kubernetes API server whose every request and answer is checked against the
API's schemas (tests/helpers/fake_kube.py; docs/decisions/kubernetes-api-fake.md). A run lost (Crashed) is
followed by a new attempt, and so by a second Job."""

from __future__ import annotations

import asyncio
import logging

import pytest

pytest.importorskip("prefect_kubernetes", reason="prefect-kubernetes is not installed (pip install -e '.[k8s]')")
pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (the test extra)")

from tests.helpers.fake_kube import FakeKubeApi  # noqa: E402
from tests.unit.test_k8s_job_template import IMAGE  # noqa: E402

NAME = "train-stage/train-stage-fake-k8s"
LABEL = "prefect.io/flow-run-id"


def _poll_worker() -> None:
    """One poll of the GPU pool by a Kubernetes worker (the worker process's loop, once): it submits the
    scheduled runs it finds, each as a Job, and returns when their Jobs are created."""
    from prefect_kubernetes.worker import KubernetesWorker

    async def go():
        async with KubernetesWorker(work_pool_name="eagle3-gpu", prefetch_seconds=30) as w:
            await w.get_and_submit_flow_runs()

    asyncio.run(go())


def test_a_second_controller_attaches_to_the_train_run_and_no_second_job_is_made(client, deployed, tmp_path,
                                                                                 monkeypatch, request):
    from prefect.states import Crashed

    from flows import attach
    from flows.stage_runs import StageRuns

    flow_id = client.create_flow_from_name("train-stage")
    dep = client.create_deployment(flow_id, "train-stage-fake-k8s", work_pool_name="eagle3-gpu",
                             entrypoint="flows/stage_runs.py:train_stage", job_variables={"image": IMAGE},
                             enforce_parameter_schema=False)  # any JSON parameters: no flow runs here
    request.addfinalizer(lambda: client.delete_deployment(dep))  # the module's server lists only its own after
    params = {"config": {"name": "fake-k8s", "train": {"epochs": 1}}, "version": {"content_key": "abc123"}}
    jv = {"image": IMAGE, "gpu_count": 8}
    base = attach.stage_base("train", "abc123", params)
    log = logging.getLogger("test")
    monkeypatch.setenv("PREFECT_INTEGRATIONS_KUBERNETES_OBSERVER_ENABLED", "false")  # no kopf watch here
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with FakeKubeApi() as kube:
        monkeypatch.setattr("kubernetes_asyncio.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION",
                            str(kube.kubeconfig(tmp_path / "kubeconfig")))
        first, again = StageRuns(NAME, base, "eagle3-train", log).next(params, jv, "train-fake-k8s")
        assert not again
        # a second controller before any worker took it (the pipeline rescheduled, or run again by hand)
        second, again = StageRuns(NAME, base, "eagle3-train", log).next(params, jv, "train-fake-k8s")
        assert again and second.id == first.id
        _poll_worker()
        jobs = [j for j in kube.jobs.values() if j["metadata"]["labels"].get(LABEL) == str(first.id)]
        assert len(jobs) == 1 and len(kube.jobs) == 1, list(kube.jobs)
        assert client.read_flow_run(first.id).state.is_pending()  # the worker submitted it
        third, again = StageRuns(NAME, base, "eagle3-train", log).next(params, jv, "train-fake-k8s")
        assert again and third.id == first.id  # Pending (its Job made, its pod starting): still the same run
        _poll_worker()
        assert len(kube.jobs) == 1, list(kube.jobs)  # and no second Job

        # the run lost (its node gone): the next controller makes attempt 2, and so one more Job
        client.set_flow_run_state(first.id, Crashed(message="node lost"), force=True)
        fourth, again = StageRuns(NAME, base, "eagle3-train", log).next(params, jv, "train-fake-k8s")
        assert not again and fourth.id != first.id and fourth.idempotency_key == f"{base}-2"
        _poll_worker()
        assert sorted(j["metadata"]["labels"][LABEL] for j in kube.jobs.values()) == sorted([str(first.id),
                                                                                               str(fourth.id)])
        # another train setting is another run, never an attach
        other = {**params, "config": {"name": "fake-k8s", "train": {"epochs": 2}}}
        fifth, again = StageRuns(NAME, attach.stage_base("train", "abc123", other), "eagle3-train", log).next(
            other, jv, "train-fake-k8s")
        assert not again and fifth.id not in (first.id, fourth.id)
        assert kube.unknown == [] and kube.errors == []
        assert [c for c in kube.calls if c.startswith("POST")] == ["POST /apis/batch/v1/namespaces/eagle3/jobs"] * 2

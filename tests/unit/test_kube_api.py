"""flows/pods.py's calls to the Kubernetes API (KubernetesPods, StartWatch) over HTTP, through the real
kubernetes_asyncio client, against tests/helpers/fake_kube.py: a fake API server whose Jobs, pods, lists and
Statuses are each checked against Kubernetes' own schemas (kubernetes-validate), because no kube-apiserver
can be installed here (docs/decisions/kubernetes-api-fake.md). The Jobs are the GPU pool's, rendered by
prefect-kubernetes' own code (test_k8s_job_template.render); the pod statuses are the kubelet's and the
scheduler's shapes. The Job's creation by the worker, and that a re-submission makes no second Job:
tests/server/test_kube_submission.py."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

pytest.importorskip("prefect_kubernetes", reason="prefect-kubernetes is not installed (pip install -e '.[k8s]')")
pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (the test extra)")

from prefect.states import Pending, Running  # noqa: E402

from flows.pods import KubernetesPods, StartWatch, describe  # noqa: E402
from tests.helpers.fake_kube import FakeKubeApi, now  # noqa: E402
from tests.unit.test_k8s_job_template import IMAGE, render  # noqa: E402

NS = "eagle3"
UNSCHEDULABLE = {"phase": "Pending", "conditions": [
    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "lastTransitionTime": "2026-12-06T05:00:00Z",
     "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu. preemption: 0/4 nodes are available: "
                "4 No preemption victims found for incoming pod."}]}
SCHEDULED = {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-12-06T05:00:00Z"}


def _container(state: dict) -> dict:
    return {"name": "prefect-job", "image": IMAGE, "imageID": "", "ready": "running" in state, "restartCount": 0,
            "started": "running" in state, "state": state}


IMAGE_PULL = {"phase": "Pending", "conditions": [SCHEDULED], "containerStatuses": [_container({"waiting": {
    "reason": "ImagePullBackOff", "message": f'Back-off pulling image "{IMAGE}"'}})]}
CREATING = {"phase": "Pending", "conditions": [SCHEDULED],
            "containerStatuses": [_container({"waiting": {"reason": "ContainerCreating"}})]}
RUNNING = {"phase": "Running", "conditions": [SCHEDULED], "startTime": "2026-12-06T05:00:00Z",
           "containerStatuses": [_container({"running": {"startedAt": "2026-12-06T05:01:00Z"}})]}


@pytest.fixture
def kube(tmp_path):
    with FakeKubeApi() as api:
        api.pods_client = KubernetesPods(NS, kubeconfig=str(api.kubeconfig(tmp_path / "kubeconfig")))
        yield api
        assert api.unknown == [] and api.errors == []  # called nothing unserved; every answer was schema-valid


def submitted(api: FakeKubeApi) -> tuple[str, str]:
    """A GPU Job for a new flow run, created over the API as the worker creates it: (flow run id, Job name)."""
    import json
    import urllib.request

    job = render({"image": IMAGE})
    req = urllib.request.Request(f"{api.url}/apis/batch/v1/namespaces/{NS}/jobs", json.dumps(job).encode(),
                                 {"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req) as r:
        created = json.loads(r.read())
    return job["metadata"]["labels"]["prefect.io/flow-run-id"], created["metadata"]["name"]


def watch(api: FakeKubeApi, deadline_s: float = 600.0):
    lines: list[str] = []
    return StartWatch("extract: shards [0, 1]", deadline_s, api.pods_client, lines.append), lines


def pending_since(t0: float):
    return Pending(timestamp=datetime.fromtimestamp(t0, timezone.utc))


def test_pending_past_its_deadline_gives_up_with_the_schedulers_reason_and_deletes_the_job(kube):
    fid, job = submitted(kube)
    kube.add_pod(NS, job, UNSCHEDULABLE)
    w, lines = watch(kube)
    t0 = datetime.now(timezone.utc).timestamp()
    assert w.give_up(fid, pending_since(t0), t0 + 60) is None  # within its deadline: waiting, reported once
    assert w.give_up(fid, pending_since(t0), t0 + 120) is None
    assert len(lines) == 1 and "Unschedulable: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu" in lines[0]
    why = w.give_up(fid, pending_since(t0), t0 + 601)
    assert why.startswith("its pod did not start within 600s") and "4 Insufficient nvidia.com/gpu" in why
    assert w.stop(fid) == 1 and kube.jobs == {} and kube.pods == {}  # the Job and its pod, deleted over the API
    assert f"DELETE /apis/batch/v1/namespaces/{NS}/jobs/{job}" in kube.calls
    assert w.stop(fid) == 0  # nothing left: no error


def test_image_pull_failure_is_named_with_the_image(kube):
    fid, job = submitted(kube)
    pod = kube.add_pod(NS, job, CREATING)
    w, lines = watch(kube, deadline_s=300)
    t0 = datetime.now(timezone.utc).timestamp()
    assert w.give_up(fid, pending_since(t0), t0 + 30) is None and lines == []  # pulling: nothing wrong yet
    kube.set_pod_status(NS, pod, IMAGE_PULL)
    assert w.give_up(fid, pending_since(t0), t0 + 60) is None
    assert lines == [f'extract: shards [0, 1]: its pod has not started: pod {pod}: container prefect-job '
                     f'ImagePullBackOff: Back-off pulling image "{IMAGE}"']
    assert "ImagePullBackOff" in w.give_up(fid, pending_since(t0), t0 + 301)


def test_a_started_pod_is_never_given_up(kube):
    fid, job = submitted(kube)
    pod = kube.add_pod(NS, job, CREATING)
    w, lines = watch(kube, deadline_s=60)
    t0 = datetime.now(timezone.utc).timestamp()
    kube.set_pod_status(NS, pod, RUNNING)
    assert describe(kube.pods_client, fid) == (True, None, False)
    assert w.give_up(fid, pending_since(t0), t0 + 3600) is None and lines == []  # started: the flow's own start
    assert w.give_up(fid, Running(), t0 + 3600) is None


def test_a_deleted_pod_fails_its_job_and_the_run_is_given_up_at_once(kube):
    """`kubectl delete pod` (or an eviction) before the container ran: the Job (backoffLimit 0) fails and no
    pod will come, so the run is given up now with the Job's reason, not after the start deadline."""
    fid, job = submitted(kube)
    pod = kube.add_pod(NS, job, UNSCHEDULABLE)
    w, lines = watch(kube, deadline_s=3600)
    t0 = datetime.now(timezone.utc).timestamp()
    assert w.give_up(fid, pending_since(t0), t0 + 10) is None
    kube.delete_pod(NS, pod)
    why = w.give_up(fid, pending_since(t0), t0 + 20)
    assert why == (f"its pod never started: its Job {job} failed: BackoffLimitExceeded: "
                   f"Job has reached the specified backoff limit")


def test_no_job_yet_is_not_final(kube):
    """The worker sets Pending before it creates the Job: a run without a Job (yet) is waited for."""
    w, lines = watch(kube, deadline_s=60)
    t0 = datetime.now(timezone.utc).timestamp()
    assert w.give_up("5f0c3f7e-0000-4000-8000-000000000000", pending_since(t0), t0 + 30) is None
    assert "no pod of its Job exists" in lines[0]


def test_the_fake_refuses_what_the_api_server_refuses(kube):
    """The fake's own check: a Job the schema rejects is answered 422, as the API server answers it."""
    code, out = kube.answer("POST", f"/apis/batch/v1/namespaces/{NS}/jobs",
                            b'{"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, '
                            b'"spec": {"template": {"spec": {"containers": [{"name": "c", "imagePullPolicy": 7}]}}}}')
    assert code == 422 and out["reason"] == "Invalid"
    code, out = kube.answer("GET", f"/api/v1/namespaces/{NS}/pods?labelSelector=a!=b", b"")
    assert code == 400
    assert now().endswith("Z")

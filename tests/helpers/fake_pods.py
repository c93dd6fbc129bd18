"""Pods that never start, or start late, for the start-deadline tests (flows/pods.py's `Pods`): what the
Kubernetes API would return for a flow run's pod (the same JSON: metadata, status), scripted per run.
No cluster runs here, so these stand in for the API; the pods' JSON is the API's own shape
(`kubectl get pod -o json`), read by the product's cluster.pod_problem / pod_started."""

from __future__ import annotations

import time

UNSCHEDULABLE = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu. preemption: 0/4 nodes are "
                            "available: 4 No preemption victims found for incoming pod."}


def pod(name: str, *, phase: str = "Pending", conditions=(), waiting: dict | None = None, running: bool = False) -> dict:
    state = {"waiting": waiting} if waiting else {"running": {"startedAt": "2026-12-05T08:00:00Z"}} if running else {}
    return {"metadata": {"name": name, "labels": {}},
            "status": {"phase": phase, "conditions": list(conditions),
                       "containerStatuses": [{"name": "prefect-job", "ready": running, "state": state}]}}


class FakePods:
    """`script[flow_run_id]` is "never" (Unschedulable), "image" (ImagePullBackOff) or a float: the seconds its
    pod takes to start (ContainerCreating until then, Running after). Runs not scripted have no pod."""

    def __init__(self):
        self.script: dict[str, object] = {}
        self.first_asked: dict[str, float] = {}
        self.deleted: list[str] = []

    def of(self, flow_run_id: str) -> list[dict]:
        how = self.script.get(flow_run_id)
        if how is None or flow_run_id in self.deleted:
            return []
        t0 = self.first_asked.setdefault(flow_run_id, time.time())
        name = f"eagle3-{flow_run_id[:8]}-x7k2p"
        if how == "never":
            return [pod(name, conditions=[UNSCHEDULABLE])]
        if how == "image":
            return [pod(name, conditions=[{"type": "PodScheduled", "status": "True"}],
                        waiting={"reason": "ImagePullBackOff",
                                 "message": 'Back-off pulling image "registry.example/eagle3@sha256:00ff"'})]
        if time.time() - t0 < float(how):
            return [pod(name, conditions=[{"type": "PodScheduled", "status": "True"}],
                        waiting={"reason": "ContainerCreating"})]
        return [pod(name, phase="Running", running=True)]

    def delete(self, flow_run_id: str) -> int:
        self.deleted.append(flow_run_id)
        return 1

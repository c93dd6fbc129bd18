"""The pods of a stage's flow run on Kubernetes, as the flow that submitted the run sees them.

More: docs/internals.md, "flows/pods.py".
"""

from __future__ import annotations

import asyncio
import importlib
import os
import threading
from pathlib import Path
from typing import Protocol

from eagle3_pipeline.core.cluster import pod_problem, pod_started

LABEL = "prefect.io/flow-run-id"
SOURCE_ENV = "EAGLE3_POD_SOURCE"
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class Pods(Protocol):
    def of(self, flow_run_id: str) -> list[dict]:
        """The flow run's pods as the API returns them (dicts: metadata, status)."""

    def delete(self, flow_run_id: str) -> int:
        """Delete the flow run's Jobs with their pods now (grace 30 s); the number of Jobs deleted."""

    # optional: `job_problem(flow_run_id) -> str | None`, why no pod of the run will ever start (its Job failed
    # or is gone); a source without it is judged by its pods alone (describe)


def pod_source() -> Pods | None:
    spec = os.environ.get(SOURCE_ENV)
    if spec:
        module, _, attr = spec.partition(":")
        return getattr(importlib.import_module(module), attr or "PODS")
    if os.environ.get("KUBERNETES_SERVICE_HOST") and (SA_DIR / "token").exists():
        return KubernetesPods((SA_DIR / "namespace").read_text().strip())
    return None


def _run(coro):
    """Run a coroutine to its end from sync code, also where this thread already has an event loop."""
    out: dict = {}

    def target():
        try:
            out["value"] = asyncio.run(coro)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


class KubernetesPods:
    """The Kubernetes API through kubernetes_asyncio (which prefect-kubernetes brings): in-cluster (the pod's
    ServiceAccount), or the kubeconfig file `kubeconfig` (tests: a fake API server, tests/helpers/fake_kube.py)."""

    def __init__(self, namespace: str, kubeconfig: str | None = None):
        self.namespace, self.kubeconfig = namespace, kubeconfig

    async def _client(self):
        from kubernetes_asyncio import config
        from kubernetes_asyncio.client import ApiClient

        if self.kubeconfig:
            return await config.new_client_from_config(config_file=self.kubeconfig)
        config.load_incluster_config()
        return ApiClient()

    def of(self, flow_run_id: str) -> list[dict]:
        async def go():
            from kubernetes_asyncio.client import CoreV1Api

            async with await self._client() as api:
                pods = await CoreV1Api(api).list_namespaced_pod(self.namespace, label_selector=f"{LABEL}={flow_run_id}")
                return [api.sanitize_for_serialization(p) for p in pods.items]

        return _run(go())

    def delete(self, flow_run_id: str) -> int:
        async def go():
            from kubernetes_asyncio.client import BatchV1Api
            from kubernetes_asyncio.client.exceptions import ApiException

            async with await self._client() as api:
                batch = BatchV1Api(api)
                jobs = await batch.list_namespaced_job(self.namespace, label_selector=f"{LABEL}={flow_run_id}")
                n = 0
                for job in jobs.items:
                    try:
                        await batch.delete_namespaced_job(job.metadata.name, self.namespace, grace_period_seconds=30,
                                                          propagation_policy="Foreground")
                        n += 1
                    except ApiException as e:
                        if e.status != 404:
                            raise
                return n

        return _run(go())

    def job_problem(self, flow_run_id: str) -> str | None:
        """Why no pod of the run will start any more, in Kubernetes' words: its Job failed (its pod deleted or
        evicted before it ran, and backoffLimit 0 allows no second); None while it may still make one."""
        async def go():
            from kubernetes_asyncio.client import BatchV1Api

            async with await self._client() as api:
                jobs = await BatchV1Api(api).list_namespaced_job(self.namespace, label_selector=f"{LABEL}={flow_run_id}")
                return [api.sanitize_for_serialization(j) for j in jobs.items]

        for job in _run(go()):  # none yet is not final: the worker sets Pending before it creates the Job
            for cond in (job.get("status") or {}).get("conditions") or []:
                if cond.get("type") == "Failed" and cond.get("status") == "True":
                    return (f"its Job {job['metadata']['name']} failed: {cond.get('reason', '?')}: "
                            f"{cond.get('message', '')}").rstrip(": ")
        return None


def describe(pods: Pods | None, flow_run_id: str, expected: int = 1) -> tuple[bool, str | None, bool]:
    """(whether `expected` pods of the run started: all of a train set's, what keeps its pods from starting in
    Kubernetes' words or None, whether that is final: its Job failed, so no pod will come)."""
    if pods is None:
        return False, None, False
    found = pods.of(str(flow_run_id))
    problems = [p for p in map(pod_problem, found) if p]
    if found and 1 < expected and sum(map(pod_started, found)) < expected and not problems:  # a set, partly up
        problems = [f"{sum(map(pod_started, found))} of the set's {expected} pods started"]
    if not found and (ended := getattr(pods, "job_problem", lambda _: None)(str(flow_run_id))):
        return False, ended, True
    return sum(map(pod_started, found)) >= expected, ("; ".join(problems) if problems else
                                           None if found else "no pod of its Job exists (not created yet; a quota, "
                                           "an admission webhook or the worker refused it; or deleted: "
                                           "`kubectl describe job`)"), False


class StartWatch:
    """One run's start, watched from its submission: Scheduled (waiting for a worker or the pool's GPU slots)
    is capacity, never a failure; Pending (its Job submitted) may last `deadline_s` (cluster.start_deadline_s)
    before the run is given up with what keeps its pod from starting. A problem Kubernetes reports is logged
    once as soon as it is seen, so the UI shows it in minutes, not at the deadline."""

    def __init__(self, what: str, deadline_s: float, pods: Pods | None, log, expected: int = 1):
        self.what, self.deadline_s, self.pods, self.log = what, deadline_s, pods, log
        self.expected = expected  # a train set's pods (jobs.job_variables "pods"): all start, or none runs
        self.all_started = False
        self.pending_since: float | None = None
        self.reported: str | None = None
        self.never_started: str | None = None  # why it was given up, once it was

    def give_up(self, flow_run_id, state, now: float) -> str | None:
        """None while the run may go on waiting (or has started); else why it is given up. A set's run is watched
        past its own start (node 0 runs the flow) until every pod of the set has started."""
        gang = self.expected > 1 and not self.all_started and state is not None and state.is_running()
        if state is None or not (state.is_pending() or gang):
            return None
        if self.pending_since is None:
            self.pending_since = state.timestamp.timestamp() if state.timestamp else now
        try:
            started, problem, final = describe(self.pods, flow_run_id, self.expected)
        except Exception as e:  # noqa: BLE001 - the Kubernetes API away or refusing: judged by the deadline alone
            started, problem, final = False, f"(its pods could not be read: {type(e).__name__}: {str(e)[:200]})", False
        if started:
            self.all_started = self.expected > 1
            return None  # the container runs: the flow's own start (imports, the API) before it reports Running
        if gang and self.pods is None:
            return None  # no pods to read: the set's rendezvous timeout (train.rdzv_timeout_s) ends a partial set
        if problem and problem != self.reported:
            self.reported = problem
            self.log(f"{self.what}: its pod has not started: {problem}")
        waited = now - self.pending_since
        if final:  # no pod will come: waiting out the deadline would hold the run (and a GPU slot) for nothing
            self.never_started = f"its pod never started: {problem}"
            return self.never_started
        if waited <= self.deadline_s:
            return None
        self.never_started = (f"its pod did not start within {self.deadline_s:.0f}s (the config's cluster start deadline: node "
                f"scale-up + image pull, cluster.start_deadline_s): "
                + (problem or ("no pod reason is known (no Kubernetes API here)" if self.pods is None
                               else "pending without a reported reason")))
        return self.never_started

    def stop(self, flow_run_id) -> int:
        """Delete the run's Jobs and pods (when the Kubernetes API is at hand); Jobs deleted."""
        if self.pods is None:
            return 0
        try:
            return self.pods.delete(str(flow_run_id))
        except Exception as e:  # noqa: BLE001 - the run is cancelled in Prefect either way; say why the Job is not
            self.log(f"{self.what}: could not delete the Job of flow run {flow_run_id}: {type(e).__name__}: {e}")
            return 0

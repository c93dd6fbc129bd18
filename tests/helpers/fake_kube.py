"""A fake Kubernetes API server whose every answer is checked against the API's own schemas.

No kube-apiserver can be installed here from the registries (docs/decisions/kubernetes-api-fake.md), so the
calls the project makes (flows/pods.py's KubernetesPods; prefect-kubernetes' worker creating a Job) go over
HTTP, through the real kubernetes_asyncio client, to this server on 127.0.0.1. It serves the REST paths those
calls use, with Kubernetes' behaviour where the tests depend on it:
  GET    /api/v1/namespaces/{ns}/pods?labelSelector=k=v[,k=v]      PodList
  GET    /apis/batch/v1/namespaces/{ns}/jobs?labelSelector=...     JobList
  POST   /apis/batch/v1/namespaces/{ns}/jobs                       Job (201); generateName; 409 AlreadyExists
  DELETE /apis/batch/v1/namespaces/{ns}/jobs/{name}                Status; the Job's pods go with it; 404 NotFound
Every Job posted is validated (strict) against the Kubernetes JSON schema of VERSION (kubernetes-validate) and
refused with 422 Invalid as the API server would; every object and list it answers with is validated too, so
a test cannot pass on a shape the API never returns (recorded in `errors`, answered 500). Anything else is
answered 404 and recorded in `unknown`.
The Job controller and the kubelet are the test: `add_pod` makes a Job's pod with a status, `set_pod_status`
moves it on, `delete_pod` deletes it (and fails its Job: backoffLimit 0 allows no second pod).
"""

from __future__ import annotations

import copy
import json
import re
import threading
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import kubernetes_validate

VERSION = "1.30.0"  # the oldest Kubernetes docs/kubernetes.md supports
_PATH = re.compile(r"^/(?:api/v1|apis/batch/v1)/namespaces/([^/]+)/(pods|jobs)(?:/([^/]+))?$")


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def check(obj: dict) -> dict:
    """The object, after kubernetes-validate found it valid for VERSION (strict: no unknown fields)."""
    if obj.get("kind") != "Status":
        kubernetes_validate.validate(obj, VERSION, strict=True)
        return obj
    # meta/v1 Status is served as apiVersion v1, a name kubernetes-validate does not map to its schema file
    # (status-meta-v1.json): the same check, by that file
    import jsonschema
    from kubernetes_validate.utils import schema_contents
    from referencing import Registry, Resource

    d = f"kubernetes-json-schema/v{VERSION}-local-strict"
    schema = schema_contents(f"{d}/status-meta-v1.json", VERSION)
    registry = Resource.from_contents(schema_contents(f"{d}/_definitions.json", VERSION)) @ (
        Resource.from_contents(schema) @ Registry())
    jsonschema.validators.Draft202012Validator(schema, registry=registry).validate(obj)
    return obj


def status(code: int, reason: str, message: str, **details) -> dict:
    return check({"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure" if code >= 400 else "Success",
                  "message": message, "reason": reason, "code": code, **({"details": details} if details else {})})


class FakeKubeApi:
    def __init__(self):
        self.jobs: dict[tuple[str, str], dict] = {}
        self.pods: dict[tuple[str, str], dict] = {}
        self.calls: list[str] = []  # "METHOD path" of every request
        self.unknown: list[str] = []
        self.errors: list[str] = []  # answers that failed their schema (a bug of this fake: tests assert none)
        self.lock = threading.Lock()
        self.version = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def kubeconfig(self, path: Path, namespace: str = "eagle3") -> Path:
        """A kubeconfig file for this server (what `kubectl` and kubernetes_asyncio read)."""
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}]}))
        return path

    # ----------------------------------------------------------------- the Job controller and kubelet (tests)

    def _meta(self, ns: str, name: str, labels: dict, **extra) -> dict:
        self.version += 1
        return {"name": name, "namespace": ns, "uid": str(uuid.uuid4()), "resourceVersion": str(self.version),
                "creationTimestamp": now(), "labels": labels, **extra}

    def add_pod(self, ns: str, job_name: str, pod_status: dict) -> str:
        """A pod for Job `job_name` from its template, as the Job controller makes it, with `pod_status`."""
        with self.lock:
            job = self.jobs[(ns, job_name)]
            tmpl = job["spec"]["template"]
            name = f"{job_name}-{uuid.uuid4().hex[:5]}"
            labels = {**(tmpl.get("metadata") or {}).get("labels", {}), "job-name": job_name,
                      "batch.kubernetes.io/job-name": job_name, "controller-uid": job["metadata"]["uid"]}
            owner = [{"apiVersion": "batch/v1", "kind": "Job", "name": job_name, "uid": job["metadata"]["uid"],
                      "controller": True, "blockOwnerDeletion": True}]
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": self._meta(ns, name, labels, ownerReferences=owner),
                   "spec": copy.deepcopy(tmpl["spec"]), "status": pod_status}
            self.pods[(ns, name)] = check(pod)
            job["status"] = {**job.get("status", {}), "active": 1, "startTime": now()}
            check(job)
            return name

    def set_pod_status(self, ns: str, name: str, pod_status: dict) -> None:
        with self.lock:
            self.pods[(ns, name)]["status"] = pod_status
            check(self.pods[(ns, name)])

    def delete_pod(self, ns: str, name: str) -> None:
        """`kubectl delete pod` (or an eviction) before the container ran: with backoffLimit 0 the Job fails."""
        with self.lock:
            pod = self.pods.pop((ns, name))
            job = self.jobs[(ns, pod["metadata"]["labels"]["job-name"])]
            job["status"] = {"failed": 1, "startTime": job["status"].get("startTime", now()), "conditions": [
                {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "lastProbeTime": now(),
                 "lastTransitionTime": now(), "message": "Job has reached the specified backoff limit"}]}
            check(job)

    # ----------------------------------------------------------------- the REST side

    def _list(self, kind: str, ns: str, query: dict) -> tuple[int, dict]:
        selector = (query.get("labelSelector") or [""])[0]
        want = {}
        for term in filter(None, selector.split(",")):
            k, sep, v = term.partition("=")
            if not sep or not k or "!" in k:
                return 400, status(400, "BadRequest", f"unsupported label selector {selector!r} (this fake: k=v)")
            want[k] = v
        store = self.pods if kind == "pods" else self.jobs
        items = [copy.deepcopy(o) for (n, _), o in sorted(store.items()) if n == ns
                 and all(o["metadata"].get("labels", {}).get(k) == v for k, v in want.items())]
        for o in items:  # a list's items carry no kind or apiVersion (as the API server sends them)
            o.pop("kind"), o.pop("apiVersion")
        return 200, check({"apiVersion": "v1" if kind == "pods" else "batch/v1",
                           "kind": "PodList" if kind == "pods" else "JobList",
                           "metadata": {"resourceVersion": str(self.version)}, "items": items})

    def _create_job(self, ns: str, body: dict) -> tuple[int, dict]:
        try:
            check(body)
        except kubernetes_validate.ValidationError as e:
            return 422, status(422, "Invalid", f"Job is invalid: {e}", kind="Job")
        meta = body.get("metadata") or {}
        name = meta.get("name") or (meta.get("generateName", "") + uuid.uuid4().hex[:5])
        if not meta.get("name") and not meta.get("generateName"):
            return 422, status(422, "Invalid", "Job is invalid: metadata.name: Required value", kind="Job")
        if (ns, name) in self.jobs:
            return 409, status(409, "AlreadyExists", f'jobs.batch "{name}" already exists', name=name, group="batch",
                               kind="jobs")
        job = copy.deepcopy(body)
        extra = {k: v for k, v in meta.items() if k not in ("name", "namespace", "labels")}
        job["metadata"] = self._meta(ns, name, meta.get("labels", {}), **extra)
        job["status"] = {}
        self.jobs[(ns, name)] = check(job)
        return 201, copy.deepcopy(job)

    def _delete_job(self, ns: str, name: str) -> tuple[int, dict]:
        job = self.jobs.pop((ns, name), None)
        if job is None:
            return 404, status(404, "NotFound", f'jobs.batch "{name}" not found', name=name, group="batch", kind="jobs")
        for key in [k for k, p in self.pods.items() if k[0] == ns and p["metadata"]["labels"].get("job-name") == name]:
            del self.pods[key]
        return 200, check({"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Success",
                           "details": {"name": name, "group": "batch", "kind": "jobs", "uid": job["metadata"]["uid"]}})

    def answer(self, method: str, raw_path: str, body: bytes) -> tuple[int, dict]:
        url = urlparse(raw_path)
        self.calls.append(f"{method} {url.path}")
        m = _PATH.match(url.path)
        kind_ok = m and (m.group(2) == "pods") == url.path.startswith("/api/v1/")
        with self.lock:
            if kind_ok and method == "GET" and not m.group(3):
                return self._list(m.group(2), m.group(1), parse_qs(url.query))
            if kind_ok and m.group(2) == "jobs" and method == "POST" and not m.group(3):
                return self._create_job(m.group(1), json.loads(body or b"{}"))
            if kind_ok and m.group(2) == "jobs" and method == "DELETE" and m.group(3):
                return self._delete_job(m.group(1), m.group(3))
        self.unknown.append(f"{method} {raw_path}")
        return 404, status(404, "NotFound", f"the fake API server does not serve {method} {url.path}")

    def _handler(self):
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self):
                n = int(self.headers.get("Content-Length") or 0)
                try:
                    code, out = api.answer(self.command, self.path, self.rfile.read(n) if n else b"")
                except Exception as e:  # noqa: BLE001 - a shape the API would never send: the test fails on it
                    api.errors.append(f"{self.command} {self.path}: {type(e).__name__}: {str(e)[:500]}")
                    code, out = 500, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 500}
                data = json.dumps(out).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = do_PATCH = do_PUT = _serve

            def log_message(self, *args):
                pass

        return Handler

"""The Kubernetes GPU work pool's job (infra/k8s-gpu-job-template.json), rendered by prefect-kubernetes'
own worker code for a sample `extract-group` flow run, the way a Kubernetes worker builds the Job it
submits (no cluster needed): the template must pass the worker's validation, and the Job must ask for
8 GPUs, give the pod a memory-backed /dev/shm, mount the run store and the models, and carry the
environment that makes every node share Prefect's task results. Skipped without the `k8s` extra
(`pip install -e '.[k8s]'`; `make test` installs it)."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from pathlib import Path

import pytest

pytest.importorskip("prefect_kubernetes", reason="prefect-kubernetes is not installed (pip install -e '.[k8s]')")

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "infra" / "k8s-gpu-job-template.json"


def render(job_variables: dict) -> dict:
    """The Job manifest a Kubernetes worker of pool `eagle3-gpu` submits for one flow run of the
    extract-group deployment with these job variables (KubernetesWorkerJobConfiguration is what
    `KubernetesWorker` builds from the pool's base job template before it creates the Job)."""
    from prefect.client.schemas.objects import Flow, FlowRun
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    template = json.loads(TEMPLATE.read_text())
    # No block or variable references in the template: the client is never called; a URL that is
    # not served keeps Prefect from starting a temporary server for it.
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        cfg = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(template, job_variables))
    flow = Flow(id=uuid.uuid4(), name="extract-group")
    run = FlowRun(id=uuid.uuid4(), name="crimson-otter", flow_id=flow.id,
                  parameters={"group": [2, 3]}, job_variables=job_variables)
    cfg.prepare_for_flow_run(run, None, flow)
    return cfg.job_manifest


def _container(job: dict) -> dict:
    (c,) = job["spec"]["template"]["spec"]["containers"]
    return c


def _env(job: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in _container(job)["env"]}


def _dockerfile_env(name: str) -> str:
    text = (ROOT / "infra" / "Dockerfile").read_text()
    m = re.search(rf"\b{name}=(\S+)", text)
    assert m, f"infra/Dockerfile sets no {name}"
    return m.group(1)


def test_default_job_gpus_shm_volumes_env():
    job = render({"image": "registry.example/eagle3-pipeline:1"})
    assert job["kind"] == "Job" and job["apiVersion"] == "batch/v1"
    assert job["metadata"]["namespace"] == "eagle3" and job["metadata"]["generateName"] == "eagle3-"
    assert job["metadata"]["labels"]["prefect.io/flow-name"] == "extract-group"
    spec = job["spec"]
    assert spec["backoffLimit"] == 0  # a failed group is retried by Prefect (cache), not by Kubernetes
    assert isinstance(spec["activeDeadlineSeconds"], int) and spec["activeDeadlineSeconds"] > 0
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}

    c = _container(job)
    assert c["image"] == "registry.example/eagle3-pipeline:1"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 8
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert c["args"] == ["prefect", "flow-run", "execute"]  # the worker's command for the flow run

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    shm = volumes[mounts["/dev/shm"]["name"]]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    store = volumes[mounts["/data"]["name"]]
    assert store["persistentVolumeClaim"] == {"claimName": "eagle3-store"}
    models = mounts["/models"]
    assert models.get("readOnly") is True
    assert volumes[models["name"]]["persistentVolumeClaim"] == {"claimName": "models"}

    env = _env(job)
    assert env["EAGLE3_PIPELINE_HOME"] == _dockerfile_env("EAGLE3_PIPELINE_HOME")  # the pull step's directory
    assert env["PREFECT_LOCAL_STORAGE_PATH"].startswith("/data/")  # on the shared store volume: every node
    assert env["HF_HUB_OFFLINE"] == "1"                            # sees the extract-group task results
    assert env["PREFECT__FLOW_RUN_ID"] == job["metadata"]["labels"]["prefect.io/flow-run-id"]


def test_job_variables_override_gpus_and_add_env_without_dropping_the_defaults():
    job = render({"image": "registry.example/eagle3-pipeline:1", "gpu_count": 4, "shm_size": "16Gi",
                  "env": {"HF_TOKEN_FILE": "/secrets/hf"}})
    c = _container(job)
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 4 == c["resources"]["limits"]["nvidia.com/gpu"]
    (shm,) = [v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["sizeLimit"] == "16Gi"
    env = _env(job)
    assert env["HF_TOKEN_FILE"] == "/secrets/hf"
    assert env["PREFECT_LOCAL_STORAGE_PATH"].startswith("/data/") and env["EAGLE3_PIPELINE_HOME"]

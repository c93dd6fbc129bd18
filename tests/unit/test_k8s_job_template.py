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
CPU_TEMPLATE = ROOT / "infra" / "k8s-cpu-job-template.json"
IMAGE = "registry.example/eagle3-pipeline@sha256:" + "0123456789abcdef" * 4


def render(job_variables: dict, template_path: Path = TEMPLATE, flow_name: str = "extract-group") -> dict:
    """The Job manifest a Kubernetes worker of pool `eagle3-gpu` submits for one flow run of the
    extract-group deployment with these job variables (KubernetesWorkerJobConfiguration is what
    `KubernetesWorker` builds from the pool's base job template before it creates the Job)."""
    from prefect.client.schemas.objects import Flow, FlowRun
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    template = json.loads(template_path.read_text())
    # No block or variable references in the template: the client is never called; a URL that is
    # not served keeps Prefect from starting a temporary server for it.
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        cfg = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(template, job_variables))
    flow = Flow(id=uuid.uuid4(), name=flow_name)
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
    job = render({"image": IMAGE})
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
    assert c["image"] == IMAGE
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
    assert volumes[models["name"]]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}

    env = _env(job)
    assert env["EAGLE3_PIPELINE_HOME"] == _dockerfile_env("EAGLE3_PIPELINE_HOME")  # the pull step's directory
    assert env["PREFECT_LOCAL_STORAGE_PATH"].startswith("/data/")  # on the shared store volume: every node
    assert env["HF_HUB_OFFLINE"] == "1"                            # sees the extract-group task results
    assert env["PREFECT__FLOW_RUN_ID"] == job["metadata"]["labels"]["prefect.io/flow-run-id"]


def test_job_variables_override_gpus_and_add_env_without_dropping_the_defaults():
    job = render({"image": IMAGE, "gpu_count": 4, "shm_size": "16Gi",
                  "env": {"HF_TOKEN_FILE": "/secrets/hf"}})
    c = _container(job)
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 4 == c["resources"]["limits"]["nvidia.com/gpu"]
    (shm,) = [v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["sizeLimit"] == "16Gi"
    env = _env(job)
    assert env["HF_TOKEN_FILE"] == "/secrets/hf"
    assert env["PREFECT_LOCAL_STORAGE_PATH"].startswith("/data/") and env["EAGLE3_PIPELINE_HOME"]


def _pod(job: dict) -> dict:
    return job["spec"]["template"]["spec"]


def test_pod_defaults_tolerate_the_gpu_taint_run_non_root_and_take_the_token_from_a_secret():
    job = render({"image": IMAGE})
    pod, c = _pod(job), _container(job)
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["serviceAccountName"] == "eagle3-job" and pod["automountServiceAccountToken"] is False
    assert pod["imagePullSecrets"] == []
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"  # never a recursive chown of the store
    assert c["imagePullPolicy"] == "IfNotPresent"  # the image is pinned by digest: a cached copy is the same bytes
    assert c["resources"]["requests"]["cpu"] == "64" and c["resources"]["requests"]["memory"] == "512Gi"
    assert "cpu" not in c["resources"]["limits"]  # no CPU limit unless given: no throttled engine/NCCL threads
    assert job["spec"]["parallelism"] == 1 and job["spec"]["completions"] == 1
    env = {e["name"]: e for e in c["env"]}
    assert env["EAGLE3_GPU_GATE"]["value"] == "pool"  # the pool's limit is the GPU gate before a pod exists
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf-token", "key": "token", "optional": True}}
    assert "value" not in env["HF_TOKEN"]


def test_every_new_variable_reaches_the_pod():
    job = render({"image": IMAGE, "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "eagle3",
                                                   "effect": "NoSchedule"}],
                  "cpu_request": "32", "memory_request": "256Gi", "cpu_limit": "48", "memory_limit": "300Gi",
                  "service_account_name": "runner", "image_pull_secrets": [{"name": "eagle3-registry"}],
                  "image_pull_policy": "Always", "hf_token_secret": "hub", "node_selector": {"pool": "h100"}})
    pod, c = _pod(job), _container(job)
    assert pod["tolerations"][0]["key"] == "dedicated" and pod["nodeSelector"] == {"pool": "h100"}
    assert c["resources"]["requests"] == {"cpu": "32", "memory": "256Gi", "nvidia.com/gpu": 8}
    assert c["resources"]["limits"] == {"cpu": "48", "memory": "300Gi", "nvidia.com/gpu": 8}
    assert pod["serviceAccountName"] == "runner" and pod["imagePullSecrets"] == [{"name": "eagle3-registry"}]
    assert c["imagePullPolicy"] == "Always"
    (tok,) = [e for e in c["env"] if e["name"] == "HF_TOKEN"]
    assert tok["valueFrom"]["secretKeyRef"]["name"] == "hub"


def test_image_is_required_and_pinned_by_digest():
    """No placeholder default (a pod that never pulls): the deployment must give a <repo>@sha256:<digest>."""
    props = json.loads(TEMPLATE.read_text())["variables"]
    assert "image" in props["required"] and "default" not in props["properties"]["image"]
    pattern = re.compile(props["properties"]["image"]["pattern"])
    assert pattern.search(IMAGE) and not pattern.search("registry.example/eagle3-pipeline:latest")


def test_cluster_job_variables_are_variables_of_both_templates():
    """What jobs.job_variables returns is exactly what the templates take (a misspelt key would be
    dropped silently by the worker), in the types they declare."""
    from eagle3_pipeline.core.config import load_config
    from eagle3_pipeline.pipeline.jobs import GPU_STAGES, job_variables

    cfg = load_config(ROOT / "configs" / "kimi-k2.5-tp8.yaml")
    types = {"integer": int, "string": str, "array": list, "object": dict}
    for path in (TEMPLATE, CPU_TEMPLATE):
        props = json.loads(path.read_text())["variables"]["properties"]
        for stage in GPU_STAGES:
            for k, v in job_variables(cfg, stage, 10).items():
                assert k in props, f"{path.name}: no variable {k}"
                assert isinstance(v, types[props[k]["type"]]), (path.name, k, v)


def test_cpu_template_renders_a_pod_without_gpus_for_verify():
    from eagle3_pipeline.core.config import load_config
    from eagle3_pipeline.pipeline.jobs import job_variables

    cfg = load_config(ROOT / "configs" / "kimi-k2.5-tp8.yaml")
    jv = {"image": IMAGE, **job_variables(cfg, "verify")}
    job = render(jv, CPU_TEMPLATE, "verify-stage")
    c, pod = _container(job), _pod(job)
    assert not any("nvidia.com/gpu" in r for r in c["resources"].values())
    assert c["resources"]["requests"]["memory"] == jv["memory_request"] == c["resources"]["limits"]["memory"]
    assert pod["tolerations"] == [] and pod["nodeSelector"] == {}
    assert job["spec"]["activeDeadlineSeconds"] == jv["deadline_seconds"]
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/data", "/models"} <= mounts  # the reference child streams the target from the models volume

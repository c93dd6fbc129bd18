"""The GPU pool's nodes and pods: the GPUs a stage's pod asks for (`stage_gpus`), how long a pod may take to start,
the config checked against the pool's nodes (their GPU product and count), a pod's state and values. A stage's
Job variables are pipeline/jobs.py's (it reads the registry, which the core cannot).

How it works, what it reads and writes, its test hooks: docs/internals.md, `core/cluster.py`.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

from eagle3_pipeline.core.config import PipelineConfig
from eagle3_pipeline.core.gpus import GFD_MEMORY_LABEL, GPU_MEMORY_GIB, NODE_LABELS, node_gpus, same_memory


def stage_gpus(config: PipelineConfig, stage: str) -> int:
    """GPUs one pod of a GPU stage (extract, verify, train, evaluate) asks for, from the config."""
    if stage == "extract":
        return config.extract.tensor_parallel_size
    if stage == "verify":
        return 0
    if stage == "train":
        t = config.train
        n = t.world_size if t.device == "cuda" else 0
        if t.mode == "online":  # the trainer's vLLM server runs the target at extract's TP on the same node
            n = max(n, config.extract.tensor_parallel_size)
        return n
    return config.evaluate.tensor_parallel_size


def start_deadline_s(config: PipelineConfig, gpu: bool, pulls: int = 1) -> float:
    """How long a stage's pod may take to start: its node's scale-up, then the image pull (one node's rate,
    or its share of the registry's when `pulls` nodes pull at once: an extract fan-out's groups), then the
    container's own start."""
    c = config.cluster
    rate = min(c.node_pull_gib_per_s, c.registry_gib_per_s / max(1, pulls))
    return (c.gpu_node_scale_up_s if gpu else c.cpu_node_scale_up_s) + c.image_gib / rate + c.start_margin_s


# ------------------------------------------------------------------------------- the GPU pool's nodes

# The GPU pool's placement as its pods see it: infra/k8s/place.py puts cluster.env's values into both pools' job
# templates, so the pipeline's own pod (CPU pool) runs preflight knowing the GPU pool's nodes.
NODE_SELECTOR_ENV = "EAGLE3_GPU_NODE_SELECTOR"
GPUS_PER_NODE_ENV = "EAGLE3_GPUS_PER_NODE"
SETTINGS = "infra/k8s/cluster.env"


def _stage_gpus(config: PipelineConfig) -> list[tuple[str, int]]:
    """(what the config sets, GPUs one pod of the stage asks for) of each stage that runs on the GPU pool."""
    e, t = config.extract, config.train
    out = [(f"extract.tensor_parallel_size {e.tensor_parallel_size}", stage_gpus(config, "extract")),
           (f"evaluate.tensor_parallel_size {config.evaluate.tensor_parallel_size}", stage_gpus(config, "evaluate"))]
    train = f"train.world_size {t.world_size}" + (
        f" (online: the server at extract.tensor_parallel_size {e.tensor_parallel_size})" if t.mode == "online" else "")
    return out + [(train, stage_gpus(config, "train"))]


def _gib(x: float) -> str:
    return f"{x:.1f}".removesuffix(".0")


def gpu_pool_problems(config: PipelineConfig, environ: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """The config against the GPU pool's nodes, known from `environ` (EAGLE3_GPU_NODE_SELECTOR: the pool's node
    selector as JSON; EAGLE3_GPUS_PER_NODE): (problems, warnings). A problem: a stage's `gpu_memory_gib` that is
    not the memory of the GPU product the selector names, or a stage asking one pod for more GPUs than one node
    has. A warning: a product not in core/gpus.py, a selector that names none, GPUs per node that nothing states.
    Neither variable set (not on the Kubernetes pools): nothing to check."""
    raw, per_node_raw = environ.get(NODE_SELECTOR_ENV, "").strip(), environ.get(GPUS_PER_NODE_ENV, "").strip()
    if not raw and not per_node_raw:
        return [], []
    problems: list[str] = []
    warnings: list[str] = []
    selector: dict = {}
    if raw:
        try:
            selector = json.loads(raw)
            if not isinstance(selector, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            return [f"{NODE_SELECTOR_ENV}={raw!r} is not the GPU pool's node selector as a JSON object ({e}): "
                    f"recreate the pools with infra/k8s/pools.sh"], []
    per_node = int(per_node_raw) if per_node_raw.isdigit() and int(per_node_raw) > 0 else None
    if per_node_raw and per_node is None:
        problems.append(f"{GPUS_PER_NODE_ENV}={per_node_raw!r} is not a number of GPUs ({SETTINGS})")
    gpus = node_gpus(selector)
    where = f"the GPU pool's nodes ({gpus.named_by})" if gpus else "the GPU pool's nodes"
    if gpus and gpus.gpus_per_node:
        if per_node and per_node != gpus.gpus_per_node:
            problems.append(f"{GPUS_PER_NODE_ENV} {per_node} ({SETTINGS}), but {where} have {gpus.gpus_per_node} "
                            f"GPUs each")
        per_node = gpus.gpus_per_node
    if gpus is None:
        warnings.append(f"the GPU pool's node selector {selector} names no GPU product (labels "
                        f"{', '.join([*NODE_LABELS, GFD_MEMORY_LABEL])}): the stages' gpu_memory_gib are not checked "
                        f"against the nodes")
    elif gpus.memory_gib is None:
        warnings.append(f"{gpus.named_by} is not a GPU product core/gpus.py knows (it knows "
                        f"{', '.join(GPU_MEMORY_GIB)}): the stages' gpu_memory_gib are not checked against it")
    else:
        product = f"{gpus.product + ' ' if gpus.product else ''}GPUs of {_gib(gpus.memory_gib)} GiB"
        for stage in ("extract", "evaluate"):
            have = getattr(config, stage).gpu_memory_gib
            if have is None:
                warnings.append(f"{stage}.gpu_memory_gib is not set: {where} have {product}; set it so preflight "
                                f"can tell whether the weights fit")
            elif not same_memory(have, gpus.memory_gib):
                problems.append(f"{stage}.gpu_memory_gib {_gib(have)} disagrees with {where}: {product}. Set "
                                f"{stage}.gpu_memory_gib: {_gib(gpus.memory_gib)}, or select nodes with "
                                f"{_gib(have)} GiB GPUs ({NODE_SELECTOR_ENV} in {SETTINGS}, then pools.sh)")
    if per_node is None:
        warnings.append(f"GPUs per node of the GPU pool unknown ({GPUS_PER_NODE_ENV} in {SETTINGS}): the "
                        f"stages' GPU counts are not checked against a node")
    else:
        for what, n in _stage_gpus(config):
            if n > per_node:
                problems.append(f"{what} asks one pod for {n} GPUs, but {where} have {per_node} GPUs each: a "
                                f"stage's Job runs on one node (docs/decisions/multi-node-engine.md); lower it to "
                                f"{per_node} or use nodes with {n} GPUs")
    return problems, warnings


# ------------------------------------------------------------------------------- a pod that has not started

# waiting reasons of a container that will not start by itself (the kubelet keeps retrying, the Job never fails)
STUCK_WAITING = ("ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull",
                 "CreateContainerConfigError", "CreateContainerError", "CrashLoopBackOff", "RunContainerError")


def pod_started(pod: dict) -> bool:
    """Whether the pod's container started (running or ran): past scheduling, scale-up and the image pull."""
    st = pod.get("status") or {}
    if st.get("phase") in ("Running", "Succeeded", "Failed"):
        return True
    return any("running" in (cs.get("state") or {}) or "terminated" in (cs.get("state") or {})
               for cs in st.get("containerStatuses") or [])


def pod_problem(pod: dict) -> str | None:
    """What keeps a pod that has not started from starting, in Kubernetes' own words ("Unschedulable: 0/4
    nodes are available: 4 Insufficient nvidia.com/gpu", "ImagePullBackOff: Back-off pulling image ..."),
    or None when nothing is wrong yet (being scheduled, pulling)."""
    st = pod.get("status") or {}
    name = (pod.get("metadata") or {}).get("name", "?")
    for cs in [*(st.get("initContainerStatuses") or []), *(st.get("containerStatuses") or [])]:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in STUCK_WAITING:
            return f"pod {name}: container {cs.get('name', '?')} {waiting['reason']}: {waiting.get('message', '')}".rstrip(": ")
    for cond in st.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("reason"):
            return f"pod {name}: {cond['reason']}: {cond.get('message', '')}".rstrip(": ")
    if st.get("reason"):  # Evicted, NodeLost, ... before the container ran
        return f"pod {name}: {st['reason']}: {st.get('message', '')}".rstrip(": ")
    return None


# Kubernetes' quantity grammar (resource.Quantity) and names: kubernetes-validate checks structure, not these
# values ("memory: 512GiB" and "cpu: sixty-four" pass its schemas, and the API server refuses the Job).
_QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$")
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$")


def value_problems(obj: Any, where: str = "") -> list[str]:
    """What a Kubernetes object (a manifest or a rendered Job) holds that its schema accepts but the API server
    or the kubelet would refuse: resource quantities, object and container names, image references."""
    out: list[str] = []
    if isinstance(obj, dict):
        for key, v in obj.items():
            at = f"{where}.{key}" if where else str(key)
            if key in ("requests", "limits") and isinstance(v, dict):
                out += [f"{at}.{k}: {q!r} is not a Kubernetes quantity (e.g. 512Gi, 64, 500m)"
                        for k, q in v.items() if not _QUANTITY.match(str(q))]
            elif key in ("name", "generateName") and isinstance(v, str) and where.split(".")[-1] in (
                    "metadata", "") + tuple(f"containers[{i}]" for i in range(16)):
                name = v.rstrip("-") if key == "generateName" else v
                if len(name) > 253 or not _DNS1123.match(name):
                    out.append(f"{at}: {v!r} is not a valid Kubernetes name (lower case, digits, '-', '.')")
            elif key == "image" and isinstance(v, str) and not _IMAGE.match(v):
                out.append(f"{at}: {v!r} is not an image reference")
            else:
                out += value_problems(v, at)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += value_problems(v, f"{where}[{i}]")
    return out

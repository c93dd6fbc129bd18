"""The Kubernetes Job of each stage that runs as its own (the registry's JOB_STAGES): its job variables (GPUs,
cores, memory, deadlines) derived from the config and reconciled with the stage's own deadlines and retries.

How it works: docs/internals.md, `pipeline/jobs.py`. The GPU pool's nodes and the pods: core/cluster.py.
"""

from __future__ import annotations

import math
from typing import Any

from eagle3_pipeline.core.cluster import stage_gpus, start_deadline_s
from eagle3_pipeline.core.config import PipelineConfig
from eagle3_pipeline.core.stage_spec import RETRY_JITTER
from eagle3_pipeline.pipeline import registry

GPU_STAGES = registry.JOB_STAGES  # the stages that run as their own Job (StageSpec.own_job)

CPU_PER_GPU = 8                  # cores requested per GPU (vLLM workers, tokenizer, torchrun ranks, loaders)
HOST_MEMORY_GIB_PER_GPU = 64     # host memory per GPU (engine workers, pinned buffers, the trainer's batches)
VERIFY_PARENT_MEMORY_GIB = 8     # the verify parent (record scan threads) beside the reference child
VERIFY_SCAN_S = 4 * 3600.0       # the record scan of a full dataset (not in the config: records x read rate)
JOB_MARGIN_S = 900               # flow start, imports, store writes, Prefect API calls around the child


def _check_stage(stage: str) -> None:
    if stage not in GPU_STAGES:
        raise ValueError(f"unknown stage {stage!r}: the stages that run as their own Kubernetes Job are "
                         f"{', '.join(GPU_STAGES)}")


def stage_deadline_s(config: PipelineConfig, stage: str, shards: int | None = None) -> float:
    """The stage's own deadline of one attempt, from the config (what the pipeline enforces itself)."""
    _check_stage(stage)
    if stage == "extract":
        e = config.extract
        if e.shard_timeout_s is None:
            return float(e.timeout_s)
        if shards is None or shards < 1:
            raise ValueError(f"extract: extract.shard_timeout_s is set, so the group's deadline depends on its "
                             f"shard count: pass shards >= 1 (got {shards!r})")
        return float(e.start_timeout_s + e.shard_timeout_s * shards)  # extract/stage.py group_deadline
    if stage == "verify":
        # the sampled rows' reference child, and a second one confirming rows flagged by learned checks
        # (verify/stage.py), then the scan of every record
        return 2 * config.verify.reference_timeout_s + VERIFY_SCAN_S
    if stage == "train":
        t = config.train
        return float(t.timeout_s + (t.online_start_timeout_s if t.mode == "online" else 0.0))
    return float(config.evaluate.timeout_s)


def _cpu_and_memory(config: PipelineConfig, stage: str, gpus: int) -> tuple[int, int]:
    """(cores, GiB) requested."""
    if gpus:
        return CPU_PER_GPU * gpus, HOST_MEMORY_GIB_PER_GPU * gpus
    if stage == "verify":
        v = config.verify
        return (v.workers or 8) + 1, math.ceil(v.reference_memory_gb) + VERIFY_PARENT_MEMORY_GIB
    if stage == "train":  # CPU training: gloo ranks, each with its loader workers
        t = config.train
        return max(2, t.world_size * (1 + t.num_workers)), 8 * t.world_size
    return 8, 32  # an engine stage at TP 0 cannot happen (tensor_parallel_size >= 1); kept total


def job_variables(config: PipelineConfig, stage: str, shards: int | None = None) -> dict[str, Any]:
    """Job variables of one stage's Kubernetes Job (`shards`: the extract group's shard count, needed
    when extract.shard_timeout_s is set; ignored by the other stages)."""
    _check_stage(stage)
    gpus = stage_gpus(config, stage)
    cpu, mem = _cpu_and_memory(config, stage, gpus)
    policy = registry.spec(stage).retry  # the in-pod attempts of the stage's task (its StageSpec's retry)
    retries, delay = policy.retries_in(config), policy.delay_s
    pulls = config.extract.parallel_groups if stage == "extract" else 1
    watch = start_deadline_s(config, gpus > 0, pulls)
    one = stage_deadline_s(config, stage, shards)
    deadline = watch + (1 + retries) * one + retries * delay * (1 + RETRY_JITTER) + JOB_MARGIN_S
    return {
        "gpu_count": gpus,
        "cpu_request": str(cpu),
        "memory_request": f"{mem}Gi",
        "memory_limit": f"{mem}Gi",
        "deadline_seconds": int(math.ceil(deadline)),
        "pod_watch_timeout_seconds": int(math.ceil(watch)),
        **(train_set_variables(config) if stage == "train" and config.train.nodes > 1 else {}),
    }


TRAIN_SERVICE = "eagle3-train"     # infra/k8s/train-service.yaml: the headless Service every train set's pods join
TRAIN_SET_LABEL = "eagle3.dev/train-set"  # its selector (the GPU job template labels a set's pods with it)
NODES_LAUNCHER = ["python", "-m", "eagle3_pipeline.train.nodes", "pod", "--"]  # before the flow-run command


def train_set_variables(config: PipelineConfig) -> dict[str, Any]:
    """The GPU job template's variables that make the train stage's Job a set of train.nodes pods: an Indexed Job
    (each pod's index is its node rank, its hostname <job>-<index>), in the headless Service's subdomain (pods reach
    node 0 as <job>-0.eagle3-train), one pod per node, started through train/nodes.py (node 0 runs the flow run,
    the others their torchrun agent), and failed whole at its first failed or disrupted pod. backoff_limit 1 and
    first_generation 1 never act (the failure policy fails the Job first; the API server sets generation 1 on
    create): prefect-kubernetes 0.7.11 accepts a Job only with two such values of 1 (docs/kubernetes.md)."""
    n = config.train.nodes
    return {
        "pods": n, "completion_mode": "Indexed", "subdomain": TRAIN_SERVICE, "pod_command": NODES_LAUNCHER,
        "pod_failure_policy": {"rules": [
            {"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [0]}},
            {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]},
        "backoff_limit": 1, "first_generation": 1,
        "spread": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
                    "labelSelector": {"matchLabels": {TRAIN_SET_LABEL: TRAIN_SERVICE}},
                    "matchLabelKeys": ["batch.kubernetes.io/job-name"]}],
    }

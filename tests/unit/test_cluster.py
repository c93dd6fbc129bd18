"""jobs.job_variables (pipeline/jobs.py): each stage's Kubernetes job variables follow the config (GPUs from TP / world
size, verify a CPU pod with the reference child's memory) and the Job's deadline is later than every
in-pod attempt of the stage's own deadline, on the production configs and the tiny default."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from eagle3_pipeline.core import cluster
from eagle3_pipeline.core.config import load_config
from eagle3_pipeline.pipeline import jobs, registry
from eagle3_pipeline.pipeline.jobs import GPU_STAGES, job_variables, stage_deadline_s

REPO = Path(__file__).parents[2]
KIMI, DEEPSEEK, TINY = (REPO / "configs" / f for f in ("kimi-k2.5-tp8.yaml", "deepseek-v3-tp8.yaml", "tiny-cpu.yaml"))


def _gib(q: str) -> int:
    assert q.endswith("Gi"), q
    return int(q[:-2])


@pytest.mark.parametrize("path", [KIMI, DEEPSEEK])
def test_production_configs_ask_for_a_whole_node_per_gpu_stage_and_a_cpu_pod_for_verify(path):
    cfg = load_config(path)
    shards = 25
    ext = job_variables(cfg, "extract", shards)
    assert ext["gpu_count"] == 8 == cfg.extract.tensor_parallel_size
    assert job_variables(cfg, "train")["gpu_count"] == 8 == cfg.train.world_size
    assert job_variables(cfg, "evaluate")["gpu_count"] == 8 == cfg.evaluate.tensor_parallel_size
    ver = job_variables(cfg, "verify")
    assert ver["gpu_count"] == 0
    assert _gib(ver["memory_request"]) >= cfg.verify.reference_memory_gb + 1  # the child's cap + the parent
    for stage in ("extract", "train", "evaluate"):
        v = job_variables(cfg, stage, shards)
        assert _gib(v["memory_request"]) == 8 * jobs.HOST_MEMORY_GIB_PER_GPU
        assert int(v["cpu_request"]) == 8 * jobs.CPU_PER_GPU
        assert v["memory_limit"] == v["memory_request"]
        pulls = cfg.extract.parallel_groups if stage == "extract" else 1
        assert v["pod_watch_timeout_seconds"] == math.ceil(cluster.start_deadline_s(cfg, True, pulls))


@pytest.mark.parametrize("path", [KIMI, DEEPSEEK, TINY])
@pytest.mark.parametrize("stage", GPU_STAGES)
def test_job_deadline_outlasts_every_attempt_of_the_stage_deadline(path, stage):
    cfg = load_config(path)
    v = job_variables(cfg, stage, 7)
    own = stage_deadline_s(cfg, stage, 7)
    retries = registry.spec(stage).retry.retries_in(cfg)  # config.extract.retries for extract
    assert isinstance(v["deadline_seconds"], int)
    assert v["deadline_seconds"] > v["pod_watch_timeout_seconds"] + (1 + retries) * own
    assert v["deadline_seconds"] - v["pod_watch_timeout_seconds"] - (1 + retries) * own >= jobs.JOB_MARGIN_S


def test_kimi_stage_deadlines_come_from_the_config():
    cfg = load_config(KIMI)
    # per shard: 1 h start-up + 30 min per shard; the group's count decides
    assert stage_deadline_s(cfg, "extract", 10) == 3600 + 1800 * 10
    assert job_variables(cfg, "extract", 20)["deadline_seconds"] > job_variables(cfg, "extract", 10)["deadline_seconds"]
    assert stage_deadline_s(cfg, "train") == cfg.train.timeout_s
    assert stage_deadline_s(cfg, "evaluate") == cfg.evaluate.timeout_s == 10800
    assert stage_deadline_s(cfg, "verify") >= cfg.verify.reference_timeout_s
    with pytest.raises(ValueError, match="shards"):
        job_variables(cfg, "extract")  # shard_timeout_s is set: the group's size is needed


def test_extract_deadline_matches_the_extract_childs_own():
    from eagle3_pipeline.extract.stage import group_deadline

    for path in (KIMI, DEEPSEEK, TINY):
        cfg = load_config(path)
        for n in (1, 3, 40):
            assert stage_deadline_s(cfg, "extract", n) == group_deadline(cfg.extract, n)


def test_tiny_cpu_config_trains_on_cpu_and_extracts_on_one_gpu():
    cfg = load_config(TINY)
    assert job_variables(cfg, "extract")["gpu_count"] == 1     # timeout_s, no shard_timeout_s: shards not needed
    assert job_variables(cfg, "extract")["deadline_seconds"] > 3 * cfg.extract.timeout_s
    assert job_variables(cfg, "train")["gpu_count"] == 0        # train.device cpu
    assert job_variables(cfg, "train")["pod_watch_timeout_seconds"] == math.ceil(cluster.start_deadline_s(cfg, False))
    assert job_variables(cfg, "evaluate")["gpu_count"] == 1
    two = load_config(TINY, ["train.world_size=2", "train.device=cuda"])
    assert job_variables(two, "train")["gpu_count"] == 2
    online = load_config(KIMI, ["train.mode=online"])
    assert stage_deadline_s(online, "train") == online.train.timeout_s + online.train.online_start_timeout_s


def test_unknown_stage_is_refused_naming_the_valid_ones():
    cfg = load_config(TINY)
    with pytest.raises(ValueError, match="extract, verify, train, evaluate"):
        job_variables(cfg, "prepare")


def test_the_jobs_retries_are_the_stages_own():
    """The Job must outlive the retries that happen inside the pod: it reads them from each stage's StageSpec, as
    the tasks do; a count set in the config (extract.retries) lengthens the Job."""
    cfg = load_config(KIMI)
    more = load_config(KIMI, [f"extract.retries={cfg.extract.retries + 2}"])
    own = stage_deadline_s(cfg, "extract", 7)
    assert job_variables(more, "extract", 7)["deadline_seconds"] - job_variables(cfg, "extract", 7)["deadline_seconds"] \
        >= 2 * own
    assert registry.spec("verify").retry.retries_in(cfg) == registry.spec("verify").retry.retries == 1


def test_the_start_deadline_comes_from_the_config():
    """Scale-up + the image pull at one node's rate, or its share of the registry's when many nodes pull at
    once (a fan-out's groups) + the container's start; a CPU pod's node scales up faster."""
    cfg = load_config(KIMI, ["cluster.image_gib=30", "cluster.node_pull_gib_per_s=0.1",
                             "cluster.registry_gib_per_s=0.4", "cluster.gpu_node_scale_up_s=600",
                             "cluster.start_margin_s=100"])
    assert cluster.start_deadline_s(cfg, True) == 600 + 300 + 100
    assert cluster.start_deadline_s(cfg, True, pulls=8) == 600 + 30 / 0.05 + 100  # the registry's share
    assert cluster.start_deadline_s(cfg, False) == cfg.cluster.cpu_node_scale_up_s + 300 + 100
    slow = load_config(KIMI, ["cluster.image_gib=60"])
    assert job_variables(slow, "train")["deadline_seconds"] > job_variables(load_config(KIMI), "train")["deadline_seconds"]


def _pod(phase="Pending", conditions=(), waiting=None, running=False, reason=None):
    cs = [{"name": "prefect-job", "state": {"waiting": waiting} if waiting else {"running": {}} if running else {}}]
    st = {"phase": phase, "conditions": list(conditions), "containerStatuses": cs}
    if reason:
        st["reason"] = reason
    return {"metadata": {"name": "extract-abc-xyz"}, "status": st}


@pytest.mark.parametrize("pod, problem", [
    (_pod(conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                       "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}]),
     "pod extract-abc-xyz: Unschedulable: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu."),
    (_pod(waiting={"reason": "ImagePullBackOff", "message": "Back-off pulling image \"r/e@sha256:1\""}),
     "container prefect-job ImagePullBackOff: Back-off pulling image"),
    (_pod(waiting={"reason": "CreateContainerConfigError", "message": "secret \"hf-token\" not found"}),
     "CreateContainerConfigError: secret \"hf-token\" not found"),
    (_pod(phase="Failed", reason="Evicted", waiting=None), "Evicted"),
])
def test_a_pod_that_will_not_start_is_named_with_its_reason(pod, problem):
    assert problem in cluster.pod_problem(pod)


def test_a_pod_on_its_way_is_neither_started_nor_a_problem():
    pulling = _pod(conditions=[{"type": "PodScheduled", "status": "True"}],
                   waiting={"reason": "ContainerCreating"})
    assert cluster.pod_problem(pulling) is None and not cluster.pod_started(pulling)
    assert cluster.pod_problem(_pod()) is None and not cluster.pod_started(_pod())
    assert cluster.pod_started(_pod(phase="Running", running=True))
    assert cluster.pod_started(_pod(phase="Pending", running=True))  # a container running in a pod still pending

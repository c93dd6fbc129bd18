"""cluster.job_variables: each stage's Kubernetes job variables follow the config (GPUs from TP / world
size, verify a CPU pod with the reference child's memory) and the Job's deadline is later than every
in-pod attempt of the stage's own deadline, on the production configs and the tiny default."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_pipeline import cluster
from eagle3_pipeline.cluster import GPU_STAGES, job_variables, stage_deadline_s
from eagle3_pipeline.config import load_config

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
        assert _gib(v["memory_request"]) == 8 * cluster.HOST_MEMORY_GIB_PER_GPU
        assert int(v["cpu_request"]) == 8 * cluster.CPU_PER_GPU
        assert v["memory_limit"] == v["memory_request"]
        assert v["pod_watch_timeout_seconds"] == cluster.POD_WATCH_GPU_S


@pytest.mark.parametrize("path", [KIMI, DEEPSEEK, TINY])
@pytest.mark.parametrize("stage", GPU_STAGES)
def test_job_deadline_outlasts_every_attempt_of_the_stage_deadline(path, stage):
    cfg = load_config(path)
    v = job_variables(cfg, stage, 7)
    own = stage_deadline_s(cfg, stage, 7)
    retries = cfg.extract.retries if stage == "extract" else cluster.STAGE_RETRIES[stage][0]
    assert isinstance(v["deadline_seconds"], int)
    assert v["deadline_seconds"] > v["pod_watch_timeout_seconds"] + (1 + retries) * own
    assert v["deadline_seconds"] - v["pod_watch_timeout_seconds"] - (1 + retries) * own >= cluster.JOB_MARGIN_S


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
    assert job_variables(cfg, "train")["pod_watch_timeout_seconds"] == cluster.POD_WATCH_CPU_S
    assert job_variables(cfg, "evaluate")["gpu_count"] == 1
    two = load_config(TINY, ["train.world_size=2", "train.device=cuda"])
    assert job_variables(two, "train")["gpu_count"] == 2
    online = load_config(KIMI, ["train.mode=online"])
    assert stage_deadline_s(online, "train") == online.train.timeout_s + online.train.online_start_timeout_s


def test_unknown_stage_is_refused_naming_the_valid_ones():
    cfg = load_config(TINY)
    with pytest.raises(ValueError, match="extract, verify, train, evaluate"):
        job_variables(cfg, "prepare")


def test_retry_counts_match_the_task_policies():
    """The Job must outlive the retries that happen inside the pod: cluster's copy of the counts is the
    policies' (tasks/ imports Prefect, the core cannot read them)."""
    pytest.importorskip("prefect")
    from tasks.stage_tasks import RETRY_POLICIES

    for stage, (retries, delay) in cluster.STAGE_RETRIES.items():
        pol = RETRY_POLICIES["extract-group" if stage == "extract" else stage]
        if retries is not None:
            assert pol.retries == retries, stage
        assert pol.delay_s == delay, stage

"""train.world_size: the number of training processes (torchrun ranks), on CPU (gloo) and CUDA alike.
The real two-process training: tests/integration/test_pipeline.py (the session's pipeline run)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from eagle3_pipeline.core.config import ConfigError, TrainConfig, load_config
from eagle3_pipeline.train.stage import WORKER, _argv

ROOT = Path(__file__).resolve().parents[2]


def test_world_size_on_cpu_and_the_num_gpus_alias():
    assert TrainConfig(device="cpu", world_size=2).world_size == 2
    assert TrainConfig(device="cuda", num_gpus=8).world_size == 8  # deprecated alias
    with pytest.raises(ValueError, match="contradicts"):
        TrainConfig(num_gpus=2, world_size=4)
    with pytest.raises(ValueError, match="world_size >= 2"):
        TrainConfig(device="cuda", fsdp=True)
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml", ["train.world_size=2"])
    assert cfg.train.world_size == 2
    with pytest.raises(ConfigError, match="world_size"):
        load_config(ROOT / "configs" / "tiny-cpu.yaml", ["train.world_size=0"])


def test_kimi_config_trains_on_eight_ranks():
    cfg = load_config(ROOT / "configs" / "kimi-k2.5-tp8.yaml")
    assert cfg.train.world_size == 8 and cfg.train.device == "cuda"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torchrun_starts_world_size_ranks(device, tmp_path):
    job = tmp_path / "job.json"
    argv = _argv(TrainConfig(device=device, world_size=2, attention="sdpa"), job)
    assert argv[:4] == [sys.executable, "-u", "-m", "torch.distributed.run"]
    assert "--nproc_per_node=2" in argv and argv[-3:] == ["-m", WORKER, str(job)][-3:]
    one = _argv(TrainConfig(device=device, world_size=2), job, distributed=False)  # the untrained draft
    assert "torch.distributed.run" not in one
    assert "torch.distributed.run" not in _argv(TrainConfig(device=device), job)


def test_the_sharding_choice_and_what_it_needs():
    """train.sharding: ddp by default; fsdp on 2+ ranks (one node's or several nodes'), cpu (gloo) or cuda;
    `fsdp: true/false` is the older spelling; one process has nothing to shard over."""
    assert TrainConfig().sharding == "ddp"
    assert TrainConfig(world_size=2, sharding="fsdp").sharding == "fsdp"  # cpu: gloo ranks
    assert TrainConfig(nodes=2, world_size=1, sharding="fsdp").ranks == 2  # one rank on each of two nodes
    assert TrainConfig(device="cuda", world_size=8, fsdp=True).sharding == "fsdp"
    assert TrainConfig(world_size=2, fsdp=False).sharding == "ddp"
    with pytest.raises(ValueError, match=r"needs 2 or more \(train.nodes x train.world_size = 1 x 1\)"):
        TrainConfig(sharding="fsdp")
    with pytest.raises(ValueError, match="fsdp .*deprecated.* says ddp, train.sharding says fsdp"):
        TrainConfig(world_size=2, fsdp=False, sharding="fsdp")
    with pytest.raises(ValueError, match="sharding"):
        TrainConfig(world_size=2, sharding="zero3")
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml", ["train.world_size=2", "train.sharding=fsdp"])
    assert cfg.train.sharding == "fsdp" and cfg.train.topology_problem() is None
    with pytest.raises(ConfigError, match="2 or more"):
        load_config(ROOT / "configs" / "tiny-cpu.yaml", ["train.sharding=fsdp"])
    assert load_config(ROOT / "configs" / "kimi-k2.5-tp8.yaml").train.sharding == "ddp"


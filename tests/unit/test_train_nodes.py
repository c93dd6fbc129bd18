"""Training past one node (train/topology.py, train/nodes.py, train/accumulate.py), the parts that need no trainer:
the topology's arithmetic, the agents' command lines, the train key, accumulation's row groups and gradients,
step checkpoints put in place, the duration estimate, and the local set's launcher. The trainer itself on two
nodes: tests/integration/test_train_nodes.py; one node killed: tests/chaos/test_chaos_train_nodes.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from eagle3_pipeline.core.config import ConfigError, TrainConfig, load_config
from eagle3_pipeline.train import nodes
from eagle3_pipeline.train.accumulate import STAGING_PREFIX, SUPERSEDED_PREFIX, GroupSampler, put_in_place, recover
from eagle3_pipeline.train.stage import NODES, _argv
from eagle3_pipeline.train.topology import (
    LOCAL_ADDR_ENV,
    NODE_RANK_ENV,
    RDZV_ENDPOINT_ENV,
    RDZV_ID_ENV,
    fit,
    topology,
    train_set,
)

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny-cpu.yaml"


def test_the_global_batch_is_held_by_accumulation():
    one = TrainConfig(global_batch_tokens=4096, max_seq_len=1024)
    two = TrainConfig(global_batch_tokens=4096, max_seq_len=1024, nodes=2)
    four = TrainConfig(global_batch_tokens=4096, max_seq_len=1024, nodes=2, world_size=2)
    assert [c.accumulation_steps for c in (one, two, four)] == [4, 2, 1]
    assert {c.batch_tokens for c in (one, two, four)} == {4096}
    assert topology(two).model_dump() == {"nodes": 2, "ranks_per_node": 1, "accumulation_steps": 2,
                                          "global_batch_tokens": 4096, "rows_per_step": 4,
                                          "sharding": "ddp"}
    assert TrainConfig(nodes=2, world_size=4).batch_tokens == 8 * 1024  # unset: one row per rank
    odd = TrainConfig(global_batch_tokens=4096, max_seq_len=1024, nodes=3)
    assert "not a multiple of nodes x world_size x max_seq_len = 3 x 1 x 1024 = 3072: node counts that divide it " \
           "at this world_size: [1, 2, 4]" in odd.topology_problem()
    with pytest.raises(ValueError, match="not a multiple"):
        odd.accumulation_steps
    fsdp = TrainConfig(device="cuda", world_size=2, sharding="fsdp", global_batch_tokens=4 * 1024, max_seq_len=1024)
    assert "accumulation" in fsdp.topology_problem() and one.topology_problem() is None
    with pytest.raises(ConfigError, match="nodes"):
        load_config(TINY, ["train.nodes=0"])


def test_kimi_holds_its_global_batch_on_any_node_count():
    kimi = load_config(ROOT / "configs" / "kimi-k2.5-tp8.yaml").train
    assert kimi.nodes == 4 and kimi.world_size == 8 and kimi.accumulation_steps == 1
    for n, a in ((1, 4), (2, 2), (4, 1)):
        assert kimi.model_copy(update={"nodes": n}).accumulation_steps == a


def test_one_node_keeps_its_command(tmp_path):
    cfg = TrainConfig(world_size=2)
    assert train_set(cfg, "job.json", {}) is None
    assert "--standalone" in _argv(cfg, tmp_path / "job.json")


def test_a_local_set_is_agents_on_127_0_0_1_meeting_through_c10d(tmp_path):
    cfg = TrainConfig(nodes=2, world_size=1)
    ts = train_set(cfg, str(tmp_path / "job.json"), {})
    assert ts.local and ts.nodes == 2 and ts.endpoint.startswith("127.0.0.1:")
    for i, argv in enumerate(ts.argv):
        assert argv[1:4] == ["-u", "-m", "torch.distributed.run"] and argv[-3:] == ["-m", nodes_worker(), str(tmp_path / "job.json")]
        assert {"--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={ts.endpoint}",
                f"--rdzv-id={ts.id}", f"--node-rank={i}", "--max-restarts=0", "--local-addr=127.0.0.1"} <= set(argv)
        assert f"--rdzv-conf=join_timeout=1800,is_host={int(i == 0)}" in argv  # node 0 hosts the store, always
    launcher = _argv(cfg, tmp_path / "job.json", tset=ts)
    assert launcher[-3:] == [NODES, "local", str(tmp_path / "train_set.json")]
    assert "torch.distributed.run" not in _argv(cfg, tmp_path / "job.json", distributed=False, tset=ts)


def nodes_worker() -> str:
    from eagle3_pipeline.train.topology import WORKER

    return WORKER


def test_a_cluster_set_is_told_by_the_job_template(tmp_path):
    cfg = TrainConfig(nodes=4, world_size=8, device="cuda")
    env = {RDZV_ENDPOINT_ENV: "train-abc-0.eagle3-train:29400", RDZV_ID_ENV: "train-abc", NODE_RANK_ENV: "2",
           LOCAL_ADDR_ENV: "10.0.0.7"}
    ts = train_set(cfg, "/data/x/train_job.json", env)
    assert not ts.local and ts.node_rank == 2 and ts.id == "train-abc" and len(ts.argv) == 4
    assert "--local-addr=10.0.0.7" in ts.argv[2] and not any(a.startswith("--local-addr") for a in ts.argv[0])
    assert "--rdzv-endpoint=train-abc-0.eagle3-train:29400" in ts.argv[0]
    assert _argv(cfg, Path("/data/x/train_job.json"), tset=ts) == ts.argv[2]
    follower = nodes._with_local_addr(ts.argv[1], "10.0.0.9")  # a pod of node 1 adds its own address
    assert follower[follower.index("-m", 3) - 1] == "--local-addr=10.0.0.9"


def test_the_train_key_names_the_global_batch_not_the_topology():
    from eagle3_pipeline.pipeline.stages import train_key
    from eagle3_pipeline.records.contracts import ModelDims
    from eagle3_pipeline.records.layout import ExtractVersion, plan_shards

    version = ExtractVersion(content_key="abc", dir="/store/x/abc", prepare_version="p", tokenized_dir="/store/x/tok",
                             layer_ids=[2, 4, 5, 8], rows=8, rows_per_shard=4, shards=plan_shards(8, 4), groups=[[0, 1]],
                             dims=ModelDims(num_layers=8, hidden_size=128, vocab_size=1024, head_dim=32,
                                            model_type="llama"))

    def key(*sets):
        return train_key(load_config(TINY, list(sets)), version)

    base = key()
    assert key("train.checkpoint_every_steps=5", "train.rdzv_timeout_s=60") == base
    assert key("train.nodes=2") != base  # one row per rank: twice the batch
    held = key("train.global_batch_tokens=2048")
    assert held != base and key("train.global_batch_tokens=2048", "train.nodes=2") == held
    assert key("train.global_batch_tokens=1024") == base  # the batch one node had anyway


def _sampler(replicas: int, rank: int, lengths):
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    return MultipackDistributedBatchSamplerV2(batch_max_length=512, lengths=lengths, num_replicas=replicas, rank=rank,
                                              seed=3)


@pytest.mark.parametrize("ranks,accumulation", [(1, 2), (1, 4), (2, 2)])
def test_accumulation_trains_on_the_rows_of_the_wider_set(ranks, accumulation):
    """Rank r with A micro-batches per step gets exactly the packed rows of ranks r*A .. r*A+A-1 of ranks x A
    ranks: a topology with the same global batch trains on the same rows, step for step, epoch for epoch."""
    lengths = np.random.default_rng(0).integers(20, 300, size=200)
    wide = [_sampler(ranks * accumulation, r, lengths) for r in range(ranks * accumulation)]
    for epoch in (0, 1):
        for r in range(ranks):
            groups = GroupSampler(_sampler(ranks, r, lengths), r, ranks, accumulation)
            groups.set_epoch(epoch)
            got = list(groups)
            want = list(zip(*(wide[r * accumulation + a]._generate_batches(epoch) for a in range(accumulation))))
            assert len(got) == len(want) > 0
            for g, w in zip(got, want):
                assert [list(x) for x in g] == [list(x) for x in w]


def test_a_save_is_put_in_place_whole(tmp_path):
    root = tmp_path / "checkpoints"

    def save(step: int, epoch: int = 0) -> Path:
        staged = root / f"{STAGING_PREFIX}{epoch}-{step}"
        (staged / str(epoch)).mkdir(parents=True)
        (staged / str(epoch) / "training_state.json").write_text(json.dumps({"global_step": step}))
        (staged / f"epoch{epoch}_step{step}").symlink_to(str(epoch))
        return staged

    put_in_place(root, save(4), 0)
    put_in_place(root, save(8), 0)
    assert json.loads((root / "0" / "training_state.json").read_text())["global_step"] == 8
    assert sorted(p.name for p in root.iterdir()) == ["0", "epoch0_step8"]

    save(12)  # killed while writing: dropped
    (root / "0").rename(root / f"{SUPERSEDED_PREFIX}0")  # killed between the two renames: put back
    lines = []
    recover(root, lines.append)
    assert sorted(p.name for p in root.iterdir() if not p.is_symlink()) == ["0"]
    assert json.loads((root / "0" / "training_state.json").read_text())["global_step"] == 8
    assert len(lines) == 2


def test_the_duration_is_estimated_against_the_deadline():
    cfg = TrainConfig(timeout_s=3600.0, max_seq_len=1024, global_batch_tokens=8192)
    ok = fit(cfg, tokens_per_s=8192.0, step_s=1.0, steps_left=1000, elapsed_s=60.0)
    assert ok.fits and ok.nodes_to_fit is None and ok.estimated_s == 1060.0
    late = fit(cfg, tokens_per_s=1024.0, step_s=8.0, steps_left=1000, elapsed_s=100.0)  # 8000 s of training in 3500 s
    assert not late.fits and late.nodes_to_fit == 3
    assert fit(cfg.model_copy(update={"nodes": 2}), 1024.0, 8.0, 1000, 100.0).nodes_to_fit == 5


def test_the_local_launcher_ends_the_set_when_one_agent_fails():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    failing = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    t0 = time.monotonic()
    assert nodes.wait_all([sleeper, failing], poll_s=0.05) == 1
    assert sleeper.poll() is not None and time.monotonic() - t0 < 20
    ok = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(2)]
    assert nodes.wait_all(ok, poll_s=0.05) == 0


def test_a_pod_of_node_one_follows_node_zero(tmp_path, monkeypatch):
    """It runs its agent for each attempt node 0 publishes and ends when node 0 says done."""
    ts = train_set(TrainConfig(nodes=2), "job.json", {RDZV_ENDPOINT_ENV: "h-0.s:29400", RDZV_ID_ENV: "h"})
    ts = ts.model_copy(update={"argv": [[sys.executable, "-c", "pass"]] * 2})
    nodes.publish(ts, tmp_path)
    runs = []
    real_call = subprocess.call

    def call(argv):
        runs.append(argv)
        nodes.publish(ts, tmp_path, "done")
        return real_call(argv)

    monkeypatch.setattr(nodes.subprocess, "call", call)
    assert nodes.follow(1, nodes.set_record(tmp_path, "h"), wait_s=10) == 0
    assert len(runs) == 1
    assert nodes.follow(1, tmp_path / "none.json", wait_s=0.1) == 1  # node 0 never published


ACCUMULATION_SCRIPT = r"""
import os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from eagle3_pipeline.train.accumulate import MICRO_KEY, Accumulator

class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 1)
    def forward(self, hidden_states, target, **kw):
        loss = ((self.lin(hidden_states) - target) ** 2).mean()
        return None, loss, {"loss_sum": loss.detach(), "loss_total": torch.tensor(1.0)}

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo")
g = torch.Generator().manual_seed(1)
micro = [{"hidden_states": torch.randn(8, 4, generator=g), "target": torch.randn(8, 1, generator=g)} for _ in range(2 * world)]
ref = Toy()
sum(ref(**m)[1] for m in micro).div(len(micro)).backward()  # the mean over every micro-batch of every rank
model = Toy()
Accumulator(model, 2)
ddp = DistributedDataParallel(model)
mine = micro[2 * rank: 2 * rank + 2]
for step in range(2):  # twice: the second step must start from zeroed gradients
    _, loss, metrics = ddp(**mine[1], **{MICRO_KEY: [mine[0]]})
    loss.backward()
    assert abs(metrics["loss_total"].item() - 2.0) < 1e-6
for p, q in zip(model.parameters(), ref.parameters()):
    assert torch.allclose(p.grad, q.grad, atol=1e-6), (p.grad, q.grad)
print("OK", rank, flush=True)
dist.destroy_process_group()
from eagle3_pipeline.core.proc import exit_child
exit_child(0)  # as the train worker ends: torch's teardown of gloo and DDP aborted 3 exits in 20 (SIGABRT)
"""


def test_accumulated_gradients_are_the_mean_over_every_micro_batch_under_ddp(tmp_path):
    """Two gloo ranks, DDP, two micro-batches each: the backward inside DDP's forward does not all-reduce, the
    loop's backward all-reduces the sum, and the gradient is the mean over all four micro-batches."""
    script = tmp_path / "acc.py"
    script.write_text(ACCUMULATION_SCRIPT)
    for _ in range(2):  # once more only when the port torchrun chose was taken meanwhile (another test's server)
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                              str(script)], capture_output=True, text=True, timeout=240)
        if out.returncode == 0 or not any(s in out.stderr for s in ("EADDRINUSE", "Address already in use")):
            break
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("OK") == 2


def test_a_set_started_by_node_zero_alone_is_given_up_at_the_start_deadline():
    """Gang start: node 0's pod runs the flow (Running), but a set is started only when all its pods are; past the
    start deadline with one still Pending the run is given up (its Job, every pod of the set, is then deleted)."""
    from types import SimpleNamespace

    from flows.pods import StartWatch

    def pod(i, phase, reason=None):
        st = {"phase": phase}
        if reason:
            st["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                 "message": reason}]
        return {"metadata": {"name": f"train-abc-{i}"}, "status": st}

    class Pods:
        found = [pod(0, "Running"), pod(1, "Running"), pod(2, "Running"),
                 pod(3, "Pending", "0/9 nodes are available: 9 Insufficient nvidia.com/gpu")]

        def of(self, _):
            return self.found

    running = SimpleNamespace(is_pending=lambda: False, is_running=lambda: True, timestamp=None)
    lines = []
    watch = StartWatch("train", 600.0, Pods(), lines.append, expected=4)
    assert watch.give_up("run", running, now=1000.0) is None  # within the deadline
    assert "Insufficient nvidia.com/gpu" in lines[0]
    why = watch.give_up("run", running, now=1700.0)
    assert why and "did not start within 600s" in why
    Pods.found[3] = pod(3, "Running")
    late = StartWatch("train", 600.0, Pods(), lines.append, expected=4)
    assert late.give_up("run", running, now=1000.0) is None and late.all_started
    assert late.give_up("run", running, now=5000.0) is None  # started once: not watched again
    single = StartWatch("evaluate", 600.0, Pods(), lines.append)
    assert single.give_up("run", running, now=5000.0) is None  # a one-pod run that runs has started


def test_a_pod_of_a_set_finds_node_zero_by_its_job_name():
    cfg = TrainConfig(nodes=2, rdzv_port=29411)
    ts = train_set(cfg, "/data/j.json", {RDZV_ID_ENV: "train-xyz", NODE_RANK_ENV: "0"})
    assert ts.endpoint == "train-xyz-0.eagle3-train:29411" and ts.node_rank == 0 and not ts.local
    with pytest.raises(RuntimeError, match="Indexed Job"):
        train_set(cfg, "/data/j.json", {RDZV_ID_ENV: "train-xyz"})  # a set's pod outside an Indexed Job


def test_preflight_states_what_training_asks_of_the_store_and_the_network():
    from eagle3_pipeline.preflight.stage import train_traffic

    kimi = load_config(ROOT / "configs" / "kimi-k2.5-tp8.yaml")
    line = train_traffic(kimi, 57 * 10**12, 7168)  # 1B tokens of bf16 records
    assert "10 time(s)" in line and "per node over 4 node(s)" in line and "fp32 gradients between the nodes" in line
    rate = float(line.split("at least ")[1].split(" MiB/s")[0])
    assert rate == pytest.approx(57e12 * 10 / 86400 / 2**20, rel=0.01)
    assert "between the nodes" not in train_traffic(load_config(TINY), 10**6, 64)


def test_a_run_that_will_not_fit_its_deadline_is_said_after_its_first_steps():
    """The stage times the first train.estimate_after_steps logged steps (the very first, warm-up, left out) and
    warns, naming the node count that would fit, long before the deadline; the record keeps the estimate."""
    from eagle3_pipeline.train.stage import _Timing

    cfg = TrainConfig(timeout_s=600.0, estimate_after_steps=3, global_batch_tokens=2048, max_seq_len=1024)
    lines: list[str] = []
    timing = _Timing(cfg, lines.append)
    timing.on_event({"kind": "start", "train_batches_per_epoch": 100, "epochs": 2})
    for step in range(4):
        timing.on_event({"kind": "train_step", "step": step, "tokens": 2000, "step_s": 30.0 if step else 99.0})
    f = timing.fit
    assert f is not None and not f.fits and f.steps_left == 196 and f.nodes_to_fit == 10
    assert f.tokens_per_s == pytest.approx(3 * 2000 / 90.0, abs=0.1)  # steps 1-3: 6000 tokens in 90 s
    assert len(lines) == 1 and "WARNING it will not finish in time; train.nodes=10 would fit" in lines[0]
    timing.on_event({"kind": "train_step", "step": 4, "tokens": 2000, "step_s": 30.0})
    assert len(lines) == 1  # said once

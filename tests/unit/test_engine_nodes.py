"""engine/nodes.py: one engine over several nodes. The split of the Kimi config's TP 8 engine over two nodes (TP 8 x
PP 2, or TP 16), each node's place in vLLM's multi-node multiprocessing executor, the headless workers' command as
vLLM 0.32's own `vllm serve` parser reads it, node 0's arguments as vLLM's EngineArgs takes them, and a pod of node
r > 0 following node 0's published engines until done. The manifests: tests/unit/test_k8s_manifests.py."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from eagle3_pipeline.core.config import load_config
from eagle3_pipeline.engine import nodes

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kimi():
    return load_config(ROOT / "configs" / "kimi-k2.5-tp8.yaml")


def test_two_nodes_split_the_engine_by_pipeline_or_tensor_parallel(kimi):
    pp = nodes.engine_set(kimi, "extract", 2, "pp", master_addr="set-0.eagle3-engine")
    assert (pp.tensor_parallel_size, pp.pipeline_parallel_size, pp.gpus_per_node, pp.gpus) == (8, 2, 8, 16)
    tp = nodes.engine_set(kimi, "evaluate", 2, "tp")
    assert (tp.tensor_parallel_size, tp.pipeline_parallel_size, tp.gpus) == (16, 1, 16)
    assert nodes.node_kwargs(pp, 1) == {
        "tensor_parallel_size": 8, "pipeline_parallel_size": 2, "distributed_executor_backend": "mp",
        "nnodes": 2, "node_rank": 1, "master_addr": "set-0.eagle3-engine", "master_port": 29501}
    assert nodes.leader_kwargs(pp)["node_rank"] == 0


@pytest.mark.parametrize("stage,n,split,said", [
    ("train", 2, "pp", "runs no engine"), ("verify", 2, "pp", "runs no engine"),
    ("extract", 1, "pp", "2 nodes or more"), ("extract", 2, "dp", "split 'dp'")])
def test_a_set_that_cannot_be_is_refused_naming_why(kimi, stage, n, split, said):
    with pytest.raises(ValueError, match=said):
        nodes.engine_set(kimi, stage, n, split)


def test_node_ranks_outside_the_set_and_a_headless_leader_are_refused(kimi):
    es = nodes.engine_set(kimi, "extract", 2)
    with pytest.raises(ValueError, match="not one of the set's 2 nodes"):
        nodes.node_kwargs(es, 2)
    with pytest.raises(ValueError, match="node 0 is the leader"):
        nodes.follower_argv(es, 0, {"model": "/models/Kimi-K2.5"})
    with pytest.raises(ValueError, match="no model"):
        nodes.follower_argv(es, 1, {"dtype": "bfloat16"})


ENGINE = {"model": "/models/Kimi-K2.5", "dtype": "bfloat16", "trust_remote_code": True, "seed": 0,
          "tensor_parallel_size": 8, "gpu_memory_utilization": 0.9, "enforce_eager": False, "max_model_len": 4096,
          "speculative_config": {"method": "extract_hidden_states", "num_speculative_tokens": 1},
          "kv_transfer_config": {"kv_connector": "Eagle3HiddenStatesConnector", "kv_role": "kv_producer",
                                 "kv_connector_module_path": "eagle3_pipeline.extract.connector",
                                 "kv_connector_extra_config": {"shared_storage_path": "/data/scratch"}}}


def test_vllms_own_serve_parser_reads_the_headless_workers_command(kimi, tmp_path):
    """`vllm serve --headless` as vLLM 0.32's own parser reads it (engine/nodes.py `serve` runs it as vLLM's CLI does): node 0's engine arguments, this node's place (the set's
    split wins over the one-node TP node 0 published), no API server."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs

    es = nodes.engine_set(kimi, "extract", 2, "pp", master_addr="eagle3-abc-0.eagle3-engine")
    model = str(tmp_path)  # a local directory: vLLM resolves names on the hub when offline
    argv = nodes.follower_argv(es, 1, {**ENGINE, "model": model})
    assert argv[:6] == [sys.executable, "-u", "-m", "eagle3_pipeline.engine.nodes", "serve", model]
    args = nodes.serve_parser().parse_args(argv[4:])  # vLLM's own `vllm serve` options
    assert args.headless is True and args.model_tag == model
    args.model = args.model_tag  # what `vllm serve` does first (ServeSubcommand.cmd)
    e = EngineArgs.from_cli_args(args)
    assert (e.nnodes, e.node_rank, e.master_addr, e.master_port) == (2, 1, "eagle3-abc-0.eagle3-engine", 29501)
    assert (e.tensor_parallel_size, e.pipeline_parallel_size, e.distributed_executor_backend) == (8, 2, "mp")
    assert e.kv_transfer_config.kv_connector == "Eagle3HiddenStatesConnector"
    assert e.kv_transfer_config.kv_connector_extra_config == {"shared_storage_path": "/data/scratch"}
    assert e.speculative_config["method"] == "extract_hidden_states" and e.trust_remote_code is True
    assert e.enforce_eager is False and e.gpu_memory_utilization == 0.9
    leader = EngineArgs(model=model, **nodes.leader_kwargs(es))  # node 0's build_llm overrides
    assert (leader.nnodes, leader.node_rank, leader.pipeline_parallel_size) == (2, 0, 2)


def _wait_for(pred, what: str, bound_s: float = 60.0) -> None:
    end = time.monotonic() + bound_s
    while not pred():
        assert time.monotonic() < end, f"never: {what}"
        time.sleep(0.02)


def test_a_follower_runs_each_engine_node_0_publishes_until_done(kimi, tmp_path):
    """Node 1 joins node 0's first engine, then (node 0's task retried) its next one, and ends when node 0 says
    done; its command is this node's place in the published set."""
    es = nodes.engine_set(kimi, "extract", 2, master_addr="set-0.eagle3-engine")
    ran = tmp_path / "ran.txt"

    def argv_of(s, rank, engine):
        line = f"{rank} {s.nodes} {s.pipeline_parallel_size} {engine['attempt']}"
        return [sys.executable, "-c", f"open({str(ran)!r}, 'a').write({line!r} + '\\n')"]

    record = nodes.set_record(tmp_path / "sets", "set")
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(nodes.follow(1, record, 120.0, 0.02, argv_of)))
    t.start()
    lines = lambda: ran.read_text().splitlines() if ran.exists() else []  # noqa: E731
    nodes.publish(es, {"model": "m", "attempt": 1}, tmp_path / "sets", "set")
    _wait_for(lambda: len(lines()) == 1, "node 1 ran node 0's first engine")
    nodes.publish(es, {"model": "m", "attempt": 2}, tmp_path / "sets", "set")
    _wait_for(lambda: len(lines()) == 2, "node 1 joined the retried engine")
    nodes.publish(es, {"model": "m"}, tmp_path / "sets", "set", state="done")
    t.join(60)
    assert out == [0] and lines() == ["1 2 2 1", "1 2 2 2"]


def test_a_follower_that_hears_nothing_gives_up_and_a_pod_without_its_set_is_refused(tmp_path, monkeypatch):
    assert nodes.follow(1, tmp_path / "none.json", 0.0, 0.01) == 1
    monkeypatch.setenv(nodes.NODE_RANK_ENV, "1")
    monkeypatch.delenv(nodes.SET_ID_ENV, raising=False)
    assert nodes.run_pod(["true"]) == 2

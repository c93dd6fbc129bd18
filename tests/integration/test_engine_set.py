"""One vLLM CPU engine over two local "nodes" (engine/nodes.py): node 0 `vllm serve` with `leader_kwargs`, node 1 the
headless workers `follower_argv` builds, meeting at 127.0.0.1 through vLLM's multiprocessing executor (no Ray), the
split `tp` (tensor parallel 2, one rank per node). The leader serves a completion that needed both. (The `pp` split
forms the set too but vLLM 0.32's CPU runner fails its first step on PP rank 1: docs/decisions/multi-node-engine.md.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from eagle3_pipeline.core.config import EngineConfig, load_config
from eagle3_pipeline.engine import nodes
from eagle3_pipeline.engine.build import cli_flag, engine_env

pytest.importorskip("vllm")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _end(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_two_local_nodes_serve_one_tensor_parallel_engine(tiny_target, tmp_path):
    cfg = load_config(os.path.join(ROOT, "configs", "tiny-cpu.yaml"), ["extract.tensor_parallel_size=1"])
    es = nodes.engine_set(cfg, "extract", 2, "tp", master_addr="127.0.0.1", master_port=_port())
    engine = {"model": str(tiny_target), "dtype": "float32", "gpu_memory_utilization": 0.2, "max_model_len": 512,
              "enforce_eager": True, "seed": 0, "max_num_seqs": 4}
    http = _port()
    leader = [sys.executable, "-u", "-m", "eagle3_pipeline.engine.nodes", "serve", str(tiny_target),
              "--host", "127.0.0.1", "--port", str(http)]
    for k, v in {**{k: v for k, v in engine.items() if k != "model"}, **nodes.leader_kwargs(es)}.items():
        leader += cli_flag(k, v)
    env = {**os.environ, **engine_env(EngineConfig(tensor_parallel_size=2, engine_in_process=False)),
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    cores = sorted(os.sched_getaffinity(0))
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    procs = []
    try:
        for i, argv in enumerate([leader, nodes.follower_argv(es, 1, engine)]):
            procs.append(subprocess.Popen(argv, env={**env, "VLLM_CPU_OMP_THREADS_BIND": str(cores[i % len(cores)])},
                                          stdout=logs[i].open("w"), stderr=subprocess.STDOUT))
        end = time.monotonic() + 900
        while True:
            assert all(p.poll() is None for p in procs), [lg.read_text()[-3000:] for lg in logs]
            assert time.monotonic() < end, "the two nodes' engine never came up"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=5)
                break
            except OSError:
                time.sleep(2)
        req = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions", headers={
            "Content-Type": "application/json"}, data=json.dumps({"model": str(tiny_target), "prompt": "Hello",
                                                                  "max_tokens": 4, "temperature": 0}).encode())
        out = json.loads(urllib.request.urlopen(req, timeout=300).read())
        assert out["choices"][0]["finish_reason"] in ("length", "stop") and out["usage"]["completion_tokens"] >= 1
    finally:
        _end(procs)
    follower = logs[1].read_text()
    assert "headless multiproc executor" in follower and f"127.0.0.1:{es.master_port}" in follower
    assert "world_size=2 rank=1" in follower  # node 1's rank of the one engine

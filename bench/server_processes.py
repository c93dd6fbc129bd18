"""A vLLM server of the tiny target on the CPU build, started the way online training starts one (engine/build.py
server_argv and server_env) with vLLM's own executor choice against the one-process executor by class name
(build.cpu_executor_kwargs), alternating in one run.

vLLM swaps the executor "uni" for its multiprocessing one on the CPU build whenever the engine core has a process
of its own, which a server's has: one more process that imports vLLM and torch and holds the model. Per way: the
seconds until the server answers /v1/models, the CPU seconds of its whole process tree by then, and its processes.

Usage: .venv/bin/python bench/server_processes.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

from bench_results import record, spread, spread_table  # bench/ is sys.path[0] when run as a script
from eagle3_pipeline.core.config import ExtractConfig, TargetConfig
from eagle3_pipeline.engine.build import server_argv, server_env, vllm_is_cpu_build
from eagle3_pipeline.train.online import free_port

ROOT = Path(__file__).resolve().parents[1]


def one(way: str) -> dict:
    cfg = ExtractConfig()
    port = free_port()
    # "vllm": no executor option, vLLM decides (overrides win in server_argv; None drops the option)
    extra = {"distributed_executor_backend": None} if way == "vllm" else {}
    argv = server_argv(cfg, TargetConfig(model=str(ROOT / ".cache" / "tiny-target"), dtype="float32"),
                       max_model_len=512, port=port, **extra)
    env = {**os.environ, **server_env(cfg), "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                sys.exit(f"bench: the {way} server exited with {proc.returncode}: {' '.join(argv)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                    break
            except OSError:
                time.sleep(0.2)
        wall = time.perf_counter() - t0
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        cpu = 0.0
        for p in tree:
            t = p.cpu_times()
            cpu += t.user + t.system + t.children_user + t.children_system
        return {"wall_s": wall, "cpu_s": cpu, "processes": len(tree)}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if not vllm_is_cpu_build():
        sys.exit("bench: the CPU build's executor rule; this machine has a GPU build of vLLM")
    one("one")  # warm-up: the page cache
    ways: dict[str, list[dict]] = {"vllm": [], "one": []}
    for i in range(args.rounds):
        for way in (("one", "vllm") if i % 2 else ("vllm", "one")):
            ways[way].append(one(way))
    v, o = ways["vllm"], ways["one"]
    out = {"rounds": args.rounds, "vllm_processes": v[0]["processes"], "one_processes": o[0]["processes"],
           "vllm_cpu_s": spread([r["cpu_s"] for r in v]), "one_cpu_s": spread([r["cpu_s"] for r in o]),
           "cpu_ratio": spread([b["cpu_s"] / a["cpu_s"] for a, b in zip(v, o)]),
           "vllm_wall_s": spread([r["wall_s"] for r in v]), "one_wall_s": spread([r["wall_s"] for r in o]),
           "wall_ratio": spread([b["wall_s"] / a["wall_s"] for a, b in zip(v, o)])}
    title = (f"a CPU server of the tiny target until it answers, {args.rounds} alternating rounds: median "
             f"(min-max); processes: vLLM's choice {out['vllm_processes']}, one-process executor "
             f"{out['one_processes']}")
    cols = {"vllm_cpu_s": "vLLM's choice CPU (s)", "one_cpu_s": "one-process CPU (s)", "cpu_ratio": "one ÷ vLLM (CPU)",
            "vllm_wall_s": "vLLM's choice wall (s)", "one_wall_s": "one-process wall (s)",
            "wall_ratio": "one ÷ vLLM (wall)"}
    spread_table(title, cols, out)
    record("servers", out)


if __name__ == "__main__":
    main()

"""What a fork server would save each child the pipeline starts: a fresh `python -c <imports>` against a fork of
a process that made the same imports once (docs/testing.md, "the import tax"). In a suite run 283 of its 482
Python processes import torch, 152 vLLM and 73 speculators; this bench measures one start of each kind.

Two ways of reaching "the child's imports are done", alternating in one run (the machine's noise is shared):
  spawn  a new interpreter makes the imports, then `os._exit(0)` (as `core/proc.exit_child` ends an engine child)
  fork   a server that made the imports once forks a child that ends at once with `os._exit(0)`
Per way: wall seconds from the request to the child's end, and the child's own CPU seconds (its rusage). Only
the start is measured, not what a forked child would do next (a child forked after torch's import inherits its
thread settings and environment: what a real fork server has to handle, docs/testing.md).
Import sets: "engine" what an extract or evaluate child imports before building its vllm.LLM; "trainer" what the
train worker imports (speculators' draft model and trainer pieces, torch.distributed).

Usage: .venv/bin/python bench/child_start.py [--rounds 5] [--sets engine,trainer]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench_results import record, spread  # bench/ is sys.path[0] when run as a script

ROOT = Path(__file__).resolve().parents[1]
IMPORTS = {
    "engine": "import torch, transformers; from vllm import LLM; import vllm.v1.engine.core",
    "trainer": "import torch, torch.distributed; from speculators.models.eagle3 import Eagle3DraftModel; "
               "import speculators.train.checkpointer, speculators.train.distributed; "
               "from speculators.train.cli import create_transformer_layer_config",
}
# the fork server: makes the imports, says "ready", then per line on stdin forks a child that ends at once and
# answers with the wall and the child's CPU seconds
SERVER = textwrap.dedent("""
    import json, os, sys, time
    exec(sys.argv[1])
    print("ready", flush=True)
    for _ in sys.stdin:
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        _, status, ru = os.wait4(pid, 0)
        print(json.dumps({"wall_s": time.perf_counter() - t0, "cpu_s": ru.ru_utime + ru.ru_stime,
                          "status": status}), flush=True)
""")


def spawned(code: str) -> tuple[float, float]:
    """(wall, CPU) of a fresh interpreter making the imports."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"{code}; import os; os._exit(0)"], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


class ForkServer:
    def __init__(self, code: str):
        t0 = time.perf_counter()
        self.p = subprocess.Popen([sys.executable, "-c", SERVER, code], cwd=ROOT, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if self.p.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the fork server did not start (exit {self.p.wait()})")
        self.ready_s = time.perf_counter() - t0

    def forked(self) -> tuple[float, float]:
        self.p.stdin.write("fork\n")
        self.p.stdin.flush()
        ans = json.loads(self.p.stdout.readline())
        if ans["status"] != 0:
            raise RuntimeError(f"a forked child ended with status {ans['status']}")
        return ans["wall_s"], ans["cpu_s"]

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=60)


def measure(code: str, rounds: int) -> dict:
    spawned(code)  # warm-up: the page cache
    server = ForkServer(code)
    try:
        sw, sc, fw, fc = [], [], [], []
        for i in range(rounds):
            order = ("fork", "spawn") if i % 2 else ("spawn", "fork")
            for way in order:
                wall, cpu = spawned(code) if way == "spawn" else server.forked()
                (sw if way == "spawn" else fw).append(wall)
                (sc if way == "spawn" else fc).append(cpu)
        return {"server_ready_s": server.ready_s, "spawn_wall_s": spread(sw), "fork_wall_s": spread(fw),
                "spawn_cpu_s": spread(sc), "fork_cpu_s": spread(fc),
                "wall_ratio": spread([f / s for f, s in zip(fw, sw)]),
                "cpu_saved_s": spread([s - f for f, s in zip(fc, sc)])}
    finally:
        server.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sets", default=",".join(IMPORTS))
    args = ap.parse_args()
    out: dict = {"rounds": args.rounds, "sets": {name: measure(IMPORTS[name], args.rounds)
                                                 for name in args.sets.split(",")}}
    t = Table(title=f"a child's start to its imports done, {args.rounds} alternating rounds: median (min-max)")
    cols = {"spawn_wall_s": "spawn wall (s)", "fork_wall_s": "fork wall (s)", "wall_ratio": "fork ÷ spawn (wall)",
            "spawn_cpu_s": "spawn CPU (s)", "fork_cpu_s": "fork CPU (s)", "cpu_saved_s": "CPU saved per child (s)"}
    t.add_column("imports")
    for c in cols.values():
        t.add_column(c)
    t.add_column("server ready once (s)")
    for name, d in out["sets"].items():
        t.add_row(name, *(f"{d[k]['median']:.3f} ({d[k]['min']:.3f}-{d[k]['max']:.3f})" for k in cols),
                  f"{d['server_ready_s']:.2f}")
    Console(width=170).print(t)
    record("children", out)


if __name__ == "__main__":
    main()

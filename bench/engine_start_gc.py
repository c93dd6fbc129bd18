"""An engine start of the tiny target with the heap frozen first (core/heap.freeze, as engine/build.build_llm does)
against without, alternating in one run, each in a fresh Python process that has made an engine child's imports
(engine/build.ENGINE_PRELOAD) as a fork server's child has them.

vLLM collects the whole heap three times while it starts an engine; frozen first, those collections pass over only
what the start made. Per way: the CPU seconds of `build_llm` in the child (its own rusage: the engine runs in
process), the freeze's own share of them, and the child's wall seconds for it.

Usage: .venv/bin/python bench/engine_start_gc.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench_results import record, spread, spread_table  # bench/ is sys.path[0] when run as a script
from eagle3_pipeline.core.config import EngineConfig
from eagle3_pipeline.engine.build import engine_env

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import importlib, json, resource, sys, time
from eagle3_pipeline.core.config import EngineConfig, TargetConfig
from eagle3_pipeline.engine import build
for name in build.ENGINE_PRELOAD:
    importlib.import_module(name)
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
frozen = sys.argv[2] == "frozen"
own = build.heap.freeze
took = []
def timed():
    c = cpu()
    own()
    took.append(cpu() - c)
build.heap.freeze = timed if frozen else (lambda: None)
c, t = cpu(), time.perf_counter()
llm = build.build_llm(EngineConfig(), TargetConfig(model=sys.argv[1], dtype="float32"), max_model_len=1024)
print("BENCH " + json.dumps({"cpu_s": cpu() - c, "wall_s": time.perf_counter() - t, "freeze_s": sum(took)}))
"""


def one(way: str) -> dict:
    # an engine child's environment, as the stages give it (engine_env), with the suite's 1 GiB KV cache
    env = {**os.environ, **engine_env(EngineConfig()), "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(ROOT / ".cache" / "tiny-target"), way], env=env,
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("BENCH ")]
    if out.returncode != 0 or not lines:
        sys.exit(f"bench: the {way} child failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("BENCH "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    one("plain")  # warm-up: the page cache
    ways: dict[str, list[dict]] = {"plain": [], "frozen": []}
    for i in range(args.rounds):
        for way in (("frozen", "plain") if i % 2 else ("plain", "frozen")):
            ways[way].append(one(way))
    p, f = ways["plain"], ways["frozen"]
    out = {"rounds": args.rounds, "plain_cpu_s": spread([r["cpu_s"] for r in p]),
           "frozen_cpu_s": spread([r["cpu_s"] for r in f]), "freeze_cpu_s": spread([r["freeze_s"] for r in f]),
           "cpu_ratio": spread([b["cpu_s"] / a["cpu_s"] for a, b in zip(p, f)]),
           "cpu_saved_s": spread([a["cpu_s"] - b["cpu_s"] for a, b in zip(p, f)]),
           "plain_wall_s": spread([r["wall_s"] for r in p]), "frozen_wall_s": spread([r["wall_s"] for r in f])}
    title = (f"an engine start of the tiny target after an engine child's imports, {args.rounds} alternating "
             "rounds: median (min-max)")
    cols = {"plain_cpu_s": "plain CPU (s)", "frozen_cpu_s": "frozen CPU (s)", "freeze_cpu_s": "of it the freeze (s)",
            "cpu_ratio": "frozen ÷ plain (CPU)", "cpu_saved_s": "CPU saved (s)", "plain_wall_s": "plain wall (s)",
            "frozen_wall_s": "frozen wall (s)"}
    spread_table(title, cols, out)
    record("engine_start_gc", out)


if __name__ == "__main__":
    main()

"""Process start-up with and without the venv's bytecode: what the install's `compileall` in the Makefile
buys every child the pipeline starts (engine children, the trainer, the verify reference, the CLI).

With PYTHONDONTWRITEBYTECODE set (these machines' environment) Python never writes `__pycache__/*.pyc`,
so every process compiled each module it imported from source again. Two ways of starting the same
imports, alternating in one run (the machine's noise is shared):
  source    PYTHONDONTWRITEBYTECODE=1 and `-X pycache_prefix=<an empty directory>`: no bytecode is found
            or written, as every process of a venv that was never allowed to keep any
  bytecode  the venv's `__pycache__` (written by one warm-up import before the rounds)
Import sets: "engine" what an engine child imports before it builds its vllm.LLM (torch, transformers,
vllm's LLM and engine core), "cli" what `eagle3 run` imports before its flow starts (Prefect, the flows).

Usage: .venv/bin/python bench/startup_bytecode.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench_results import record, spread  # bench/ is sys.path[0] when run as a script

ROOT = Path(__file__).resolve().parents[1]
IMPORTS = {
    "engine": "import torch, transformers; from vllm import LLM; import vllm.v1.engine.core",
    "cli": "import flows.cli, flows.pipeline",
}


def timed(code: str, source: bool, empty: str) -> float:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    argv = [sys.executable, "-c", code]
    if source:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        argv = [sys.executable, "-X", f"pycache_prefix={empty}", "-c", code]
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    out: dict = {"rounds": args.rounds, "sets": {}}
    with tempfile.TemporaryDirectory() as empty:
        for name, code in IMPORTS.items():
            timed(code, False, empty)  # warm-up: writes this set's bytecode, fills the page cache
            src, pyc = [], []
            for i in range(args.rounds):
                pair = [(False, pyc), (True, src)] if i % 2 else [(True, src), (False, pyc)]
                for source, acc in pair:
                    acc.append(timed(code, source, empty))
            out["sets"][name] = {"source_s": spread(src), "bytecode_s": spread(pyc),
                                 "ratio": spread([b / s for b, s in zip(pyc, src)]),
                                 "saved_s": spread([s - b for b, s in zip(pyc, src)])}
    t = Table(title=f"process start-up, {args.rounds} alternating rounds: median (min-max)")
    for c in ("imports", "from source (s)", "with bytecode (s)", "bytecode ÷ source", "saved per process (s)"):
        t.add_column(c)
    for name, d in out["sets"].items():
        t.add_row(name, *(f"{d[k]['median']:.2f} ({d[k]['min']:.2f}-{d[k]['max']:.2f})"
                          for k in ("source_s", "bytecode_s", "ratio", "saved_s")))
    Console().print(t)
    record("startup", out)


if __name__ == "__main__":
    main()

"""The install's bytecode pass: `infra/bytecode.py` (each process given a whole share of the files) against
`python -m compileall -j 0` (its pool handed one file at a time), alternating in one run, on a copy of the .py files
of the venv's largest packages (torch, vllm, transformers, prefect: ~8,500 files) with no bytecode, each way
`-f` as the install runs it; then each way's pass over the same files compiled already (what `make test`'s second
pass mostly finds). Wall seconds and the CPU seconds of the whole pass (its children's rusage).

Usage: .venv/bin/python bench/bytecode_compile.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench_results import record, spread  # bench/ is sys.path[0] when run as a script

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torch", "vllm", "transformers", "prefect")
WAYS = {"compileall": [sys.executable, "-m", "compileall", "-qq", "-j", "0", "--invalidation-mode", "timestamp"],
        "shares": [sys.executable, str(ROOT / "infra" / "bytecode.py")]}


def copy_sources(dest: Path) -> int:
    site = Path(sysconfig.get_paths()["purelib"])
    n = 0
    for pkg in PACKAGES:
        for f in (site / pkg).rglob("*.py"):
            to = dest / f.relative_to(site)
            to.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, to)  # the mtime too: the pycs are timestamp-checked
            n += 1
    return n


def drop_bytecode(root: Path) -> None:
    for d in list(root.rglob("__pycache__")):
        shutil.rmtree(d)


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def one(way: str, root: Path, force: bool) -> dict:
    argv = [*WAYS[way], *(["-f"] if force else []), str(root)]
    c, t = children_cpu(), time.perf_counter()
    subprocess.run(argv, capture_output=True, timeout=1800)  # rc 1: a file that does not compile (kept without pyc)
    return {"wall_s": time.perf_counter() - t, "cpu_s": children_cpu() - c, "pycs": sum(1 for _ in root.rglob("*.pyc"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bytecode-bench-") as tmp:
        root = Path(tmp)
        files = copy_sources(root)
        runs: dict[str, list[dict]] = {f"{w} {p}": [] for w in WAYS for p in ("fresh", "compiled")}
        for i in range(args.rounds):
            for way in (("shares", "compileall") if i % 2 else ("compileall", "shares")):
                drop_bytecode(root)
                runs[f"{way} fresh"].append(one(way, root, force=True))
                runs[f"{way} compiled"].append(one(way, root, force=False))
        pycs = {k: {r["pycs"] for r in v} for k, v in runs.items()}
        if len({n for s in pycs.values() for n in s}) != 1:
            sys.exit(f"bench: the ways left different numbers of pycs: {pycs}")
    out = {"rounds": args.rounds, "files": files, "pycs": next(iter(pycs["shares fresh"]))}
    for k, v in runs.items():
        out[k.replace(" ", "_") + "_wall_s"] = spread([r["wall_s"] for r in v])
        out[k.replace(" ", "_") + "_cpu_s"] = spread([r["cpu_s"] for r in v])
    for p in ("fresh", "compiled"):
        out[f"{p}_wall_ratio"] = spread([b["wall_s"] / a["wall_s"] for a, b in
                                         zip(runs[f"compileall {p}"], runs[f"shares {p}"])])
        out[f"{p}_cpu_ratio"] = spread([b["cpu_s"] / a["cpu_s"] for a, b in
                                        zip(runs[f"compileall {p}"], runs[f"shares {p}"])])
    t = Table(title=f"bytecode of {files} files ({out['pycs']} compile), {args.rounds} alternating rounds: "
                    "median (min-max)")
    for c in ("pass", "compileall -j 0 wall (s)", "shares wall (s)", "shares ÷ compileall (wall)",
              "compileall CPU (s)", "shares CPU (s)", "shares ÷ compileall (CPU)"):
        t.add_column(c)

    def f(d: dict) -> str:
        return f"{d['median']:.2f} ({d['min']:.2f}-{d['max']:.2f})"
    for p, label in (("fresh", "no bytecode, -f (the install)"), ("compiled", "all compiled (a second pass)")):
        t.add_row(label, f(out[f"compileall_{p}_wall_s"]), f(out[f"shares_{p}_wall_s"]), f(out[f"{p}_wall_ratio"]),
                  f(out[f"compileall_{p}_cpu_s"]), f(out[f"shares_{p}_cpu_s"]), f(out[f"{p}_cpu_ratio"]))
    Console(width=170).print(t)
    record("bytecode_compile", out)


if __name__ == "__main__":
    main()

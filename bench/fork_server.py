"""A whole extract child of the tiny default, spawned against forked by a fork server (core/forkserver.py,
docs/decisions/fork-server.md), alternating in one run.

Both run the same job (the tiny default's extraction, every shard, written to a scratch copy) through
`core/proc.run_child`, as the extract stage does; the only difference is EAGLE3_FORK_SERVER. The server is started
and makes its imports before the rounds (its first child: "server's first"), so the rounds compare a spawn with a
fork from a warm server. Per way: the wall seconds of run_child, and the machine's busy CPU seconds over it
(/proc/stat: a forked child is the server's, not ours, so our rusage cannot count it; other load on the machine
counts too, so run it on a quiet one).

Usage: .venv/bin/python bench/fork_server.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench_results import record, spread, tiny_default_data  # bench/ is sys.path[0] when run as a script
from eagle3_pipeline.core import forkserver
from eagle3_pipeline.core.proc import python_child, run_child
from eagle3_pipeline.engine.build import engine_env
from eagle3_pipeline.extract.worker import ExtractJob


def busy_s() -> float:
    """The machine's busy CPU seconds since boot (user, nice, system, irq, softirq, steal)."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(f) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


def scratch_job(work: Path) -> tuple[Path, dict]:
    """The tiny default's extract job, its outputs moved under `work/out`, and the engine child's environment."""
    data = tiny_default_data(work)
    (src,) = Path(data["version"].dir).glob("jobs/extract-*.json")
    job = json.loads(src.read_text())
    for key in ("hidden_states_dir", "scratch_dir", "fingerprints_dir"):
        if job.get(key):
            job[key] = str(work / "out" / key)
    path = work / "job.json"
    path.write_text(json.dumps(job))
    return path, engine_env(ExtractJob.model_validate(job).engine)


def one(job: Path, env: dict, servers: Path | None) -> tuple[float, float]:
    if servers is None:
        os.environ.pop(forkserver.ENV, None)
    else:
        os.environ[forkserver.ENV] = str(servers)
    shutil.rmtree(job.parent / "out", ignore_errors=True)
    b, t0 = busy_s(), time.perf_counter()
    run_child(python_child("eagle3_pipeline.extract.worker", str(job)), name="bench-extract", timeout_s=900, env=env)
    return time.perf_counter() - t0, busy_s() - b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-fork-") as tmp:
        work = Path(tmp)
        job, env = scratch_job(work)
        servers = work / "servers"
        servers.mkdir()
        (servers / forkserver.OWNER_FILE).write_text(str(os.getpid()))
        one(job, env, None)  # warm-up: the page cache
        first = one(job, env, servers)  # the server starts and imports for its first child
        ways: dict[str, list[tuple[float, float]]] = {"spawn": [], "fork": []}
        for i in range(args.rounds):
            for way in (("fork", "spawn") if i % 2 else ("spawn", "fork")):
                ways[way].append(one(job, env, servers if way == "fork" else None))
        (servers / forkserver.OWNER_FILE).unlink()
        logs = "".join(p.read_text() for p in servers.glob("*.log"))
    if (forked := logs.count(" forked, pid ")) != args.rounds + 1:
        sys.exit(f"bench: {forked} children forked, not {args.rounds + 1}; the server's log:\n{logs}")
    sw, sc = zip(*ways["spawn"])
    fw, fc = zip(*ways["fork"])
    out = {"rounds": args.rounds, "server_first": {"wall_s": first[0], "cpu_s": first[1]},
           "spawn_wall_s": spread(list(sw)), "fork_wall_s": spread(list(fw)), "spawn_cpu_s": spread(list(sc)),
           "fork_cpu_s": spread(list(fc)), "wall_ratio": spread([f / s for f, s in zip(fw, sw)]),
           "cpu_saved_s": spread([s - f for f, s in zip(fc, sc)])}
    t = Table(title=f"an extract child of the tiny default, {args.rounds} alternating rounds: median (min-max)")
    cols = {"spawn_wall_s": "spawn wall (s)", "fork_wall_s": "fork wall (s)", "wall_ratio": "fork ÷ spawn (wall)",
            "spawn_cpu_s": "spawn CPU (s)", "fork_cpu_s": "fork CPU (s)", "cpu_saved_s": "CPU saved per child (s)"}
    for c in cols.values():
        t.add_column(c)
    t.add_column("server's first (s)")
    t.add_row(*(f"{out[k]['median']:.2f} ({out[k]['min']:.2f}-{out[k]['max']:.2f})" for k in cols),
              f"{first[0]:.1f} wall, {first[1]:.1f} CPU")
    Console(width=170).print(t)
    record("fork_server", out)


if __name__ == "__main__":
    main()

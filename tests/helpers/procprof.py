"""Where a command's CPU goes, machine-wide, by kind of process: `python -m tests.helpers.procprof OUT.json -- CMD...`
runs CMD and, every second, reads every process's CPU seconds, command line and (once) its PYTEST_CURRENT_TEST and
PYTEST_XDIST_WORKER. It counts what the tree-based tests.helpers.cputime cannot: fork-server children, detached
servers and their sessions. Writes OUT.json (one entry a process) and prints the table. Never loaded by `make test`;
docs/testing.md, "Suite time"."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil

EVERY_S = 1.0
# (kind, pattern on the command line), first match wins. Not counted: a process's last second before it ends (the
# samples are a second apart), and one that lives under a second unless its parent reaps it (then in the parent's
# children times, which are not read): the header's machine-wide busy seconds say how much the table covers
KINDS = (("pytest worker", r"execnet|-c import sys;exec"), ("pytest", r"-m pytest"), ("postgres", r"postgres"),
         ("prefect server", r"prefect server start|uvicorn.*prefect"), ("fork server + its children", r"forkserver"),
         ("torchrun", r"torchrun|torch\.distributed\.run"), ("vllm serve", r"vllm\.entrypoints\.openai"),
         ("eagle3 CLI", r"bin/eagle3 "), ("prefect worker", r"prefect worker"), ("prefect flow run", r"prefect\.engine"),
         ("engine/rank (multiprocessing)", r"multiprocessing"),
         ("spawned stage worker", r"-m eagle3_pipeline\.\S+"),
         ("install/build", r"\buv\b|compileall|bytecode\.py|pip|make|cmake"),
         ("kernel threads", r"^$"))


def kind_of(cmd: str) -> str:
    return next((k for k, pat in KINDS if re.search(pat, cmd)), "other")


def _busy_jiffies() -> int:
    f = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return sum(int(x) for x in (f[1], f[2], f[3], f[6], f[7], f[8]))


def _pytest_env(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    keep = (b"PYTEST_CURRENT_TEST", b"PYTEST_XDIST_WORKER")
    return {k.decode(): v.decode(errors="replace") for k, _, v in (x.partition(b"=") for x in raw) if k in keep}


def sample(seen: dict, t0: float) -> None:
    """Each process's CPU seconds since `t0` (a process older than t0 counts from its first sample)."""
    for p in psutil.process_iter(["pid", "ppid", "create_time"]):
        key = (p.pid, p.info["create_time"])
        try:
            t = p.cpu_times()
            if key not in seen:
                before = t.user + t.system if p.info["create_time"] < t0 else 0.0
                seen[key] = {"pid": p.pid, "ppid": p.info["ppid"], "start": p.info["create_time"], "cpu0": before,
                             "cmd": " ".join(p.cmdline())[:300], **_pytest_env(p.pid)}
        except psutil.Error:
            continue
        seen[key] |= {"cpu_s": t.user + t.system - seen[key]["cpu0"], "last": time.time()}


def table(procs: list[dict], busy_s: float, wall_s: float) -> str:
    by: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    cmd_of = {p["pid"]: p["cmd"] for p in procs}
    for p in procs:  # a forked child shows its own command line (core/forkserver.py): its parent says it was forked
        forked = "forkserver" in cmd_of.get(p["ppid"], "")
        row = by["fork server + its children" if forked else kind_of(p["cmd"])]
        row[0] += p.get("cpu_s", 0.0)
        row[1] += 1
    counted = sum(r[0] for r in by.values())
    lines = [f"wall {wall_s:.0f} s, machine busy {busy_s:.0f} CPU s ({busy_s / wall_s:.2f} cores); "
             f"{counted:.0f} CPU s in {len(procs)} sampled processes", "| kind | CPU s | share | processes |",
             "|---|---|---|---|"]
    lines += [f"| {k} | {c:.0f} | {c / counted:.0%} | {n} |" for k, (c, n) in sorted(by.items(), key=lambda x: -x[1][0])]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    out, cmd = Path(argv[0]), argv[argv.index("--") + 1:]
    seen: dict = {}
    b0, t0 = _busy_jiffies(), time.time()
    sample(seen, t0)
    proc = subprocess.Popen(cmd)
    timeline, last = [], (t0, b0)  # [seconds since t0, cores busy machine-wide since the sample before]
    while proc.poll() is None:
        sample(seen, t0)
        time.sleep(EVERY_S)
        now = (time.time(), _busy_jiffies())
        timeline.append([round(now[0] - t0, 1),
                         round((now[1] - last[1]) / os.sysconf("SC_CLK_TCK") / (now[0] - last[0]), 2)])
        last = now
    busy_s, wall_s = (_busy_jiffies() - b0) / os.sysconf("SC_CLK_TCK"), time.time() - t0
    procs = list(seen.values())
    out.write_text(json.dumps({"wall_s": wall_s, "busy_cpu_s": busy_s, "rc": proc.returncode, "procs": procs,
                                "busy_timeline": timeline}))
    print(table(procs, busy_s, wall_s))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

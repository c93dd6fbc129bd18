"""A pytest plugin that writes each test phase's wall and CPU seconds (the whole process tree) to a file:
`pytest -p tests.helpers.cputime ...` with EAGLE3_CPUTIME_OUT=<path> (JSON lines; default cputime.jsonl).
The CPU is this process's own and its reaped children's (getrusage) plus every living descendant's
(psutil, their own reaped children included), read before and after the phase, so a server or worker a
fixture started counts for the phases it worked in. A phase whose CPU is far below its wall waited.
On a loaded machine the CPU seconds understate what the tree would use alone (it also waits for a core),
so a thread sampler adds `demand_s`: every 0.5 s, the tree's threads that are running or runnable (state
R, which counts a thread waiting for a core too), summed over time: the core-seconds it asked for.
Never loaded by `make test`; docs/testing.md, "Suite time"."""

from __future__ import annotations

import json
import os
import resource
import threading
import time
from pathlib import Path

import psutil
import pytest


def tree_cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    for p in psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def runnable_threads() -> int:
    """Threads of this process and its descendants in state R (running or waiting for a core)."""
    n = 0
    for pid in [os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))]:
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            try:
                n += stat.read_text().rsplit(")", 1)[1].split()[0] == "R"
            except (OSError, IndexError):
                pass
    return n


class _Sampler:
    def __init__(self, every: float = 0.5):
        self.every, self.demand = every, 0.0
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            time.sleep(self.every)
            try:
                self.demand += self.every * max(runnable_threads() - 1, 0)  # less the sampler itself
            except psutil.Error:
                pass


_SAMPLER: list[_Sampler] = []


def _record(nodeid: str, phase: str, start: float, cpu: float, demand: float) -> None:
    line = {"test": nodeid, "phase": phase, "wall_s": round(time.time() - start, 1), "cpu_s": round(cpu, 1),
            "demand_s": round(demand, 1), "start": round(start, 1),  # with the worker: each worker's timeline
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}
    with open(os.environ.get("EAGLE3_CPUTIME_OUT", "cputime.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")


def _measured(item, phase: str):
    if not _SAMPLER:
        _SAMPLER.append(_Sampler())
    t0, c0, d0 = time.time(), tree_cpu(), _SAMPLER[0].demand
    yield
    _record(item.nodeid, phase, t0, tree_cpu() - c0, _SAMPLER[0].demand - d0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _measured(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _measured(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _measured(item, "teardown")

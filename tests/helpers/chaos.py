"""Shared pieces of the chaos suite (tests/chaos/): how many seeded trials, the gpu-gate run after
every kill, and a thread that SIGKILLs a process at a seeded random moment.

Trials: env EAGLE3_CHAOS_TRIALS = "a,b,c" (engine-child kills, parent kills, trainer kills; default
"4,3,3", what CI runs) or one number for all three; EAGLE3_CHAOS_SEED shifts every trial's seed
(default 0), so a failure is replayed with the same seed and other kill points are drawn with another.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable

from tests.helpers.store import processes_with_env

TAG_ENV = "EAGLE3_TEST_TAG"  # inherited by every child, engine and trainer a trial starts


def _trials() -> tuple[int, int, int]:
    raw = os.environ.get("EAGLE3_CHAOS_TRIALS", "4,3,3").replace(" ", "")
    parts = [int(x) for x in raw.split(",")]
    if len(parts) == 1:
        parts *= 3
    if len(parts) != 3 or min(parts) < 0:
        raise ValueError(f"EAGLE3_CHAOS_TRIALS={raw!r}: expected 'a,b,c' or one number")
    return parts[0], parts[1], parts[2]


ENGINE_TRIALS, PARENT_TRIALS, TRAINER_TRIALS = _trials()
SEED = int(os.environ.get("EAGLE3_CHAOS_SEED", "0"))


def trial_rng(kind: str, trial: int) -> random.Random:
    return random.Random(f"{kind}-{SEED + trial}")


def child_running(marker: str, tag: str) -> Callable[[], int | None]:
    """A finder for DelayedKill: the pid of a process of this trial (`tag` in its environment) whose command line
    contains `marker` (the engine worker or trainer module), or None while there is none. By what /proc shows, as
    the gpu-gate finds ours: a child forked by a fork server is no descendant of this process, but shows its own
    command line and environment there as a spawned one does (core/forkserver.py `_show`)."""
    def find() -> int | None:
        import psutil

        for pid in processes_with_env(TAG_ENV, tag):
            try:
                if marker in " ".join(psutil.Process(pid).cmdline()):
                    return pid
            except psutil.Error:
                pass
        return None
    return find


def gate_after_kill(tag: str, log: Callable[[str], None] = print):
    """Run the real gpu-gate and check that no engine or trainer process of this trial survives it.
    Leftovers that are not this trial's and not this test session's (another session on a shared
    machine) stop the test instead of being ended by it."""
    import psutil

    from eagle3_pipeline.gpu.stage import find_leftovers, gpu_gate

    foreign = []
    run_uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # set in every worker of one xdist session
    for p, desc in find_leftovers():
        try:
            env = p.environ()
            same_session = run_uid is not None and env.get("PYTEST_XDIST_TESTRUNUID") == run_uid
            if env.get(TAG_ENV) != tag and not same_session:  # another worker's leftover is the gate's to end
                foreign.append(desc)
        except psutil.Error:
            pass
    assert not foreign, f"leftover engine processes not started by this trial; not ending them: {foreign}"
    before = processes_with_env(TAG_ENV, tag)
    res = gpu_gate(log=log)
    assert res.passed
    survivors = processes_with_env(TAG_ENV, tag)
    assert survivors == [], f"processes of this trial outlived the gpu-gate: {survivors} (before it: {before})"
    return res, before


class DelayedKill:
    """SIGKILLs a process `delay` seconds after `trigger` is set, or as soon as `latest` is set if that comes
    first (a phase's end: the kill still lands before the work it targets is done, however fast this start
    was). `target()` returns the pid (or the process group id, with `group=True`) to kill, or None while it
    does not exist yet (polled). `early` says whether `latest` cut the delay short."""

    def __init__(self, target: Callable[[], int | None], delay: float, group: bool = False):
        self.trigger, self.latest = threading.Event(), threading.Event()
        self.target, self.delay, self.group = target, delay, group
        self.killed: int | None = None
        self.early = False
        self.at: str = "not killed"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self.trigger.wait(0.05):
            if self._stop.is_set():
                return
        self.early = self.latest.wait(self.delay)
        while not self._stop.is_set():
            pid = self.target()
            if pid is not None:
                try:
                    (os.killpg if self.group else os.kill)(pid, signal.SIGKILL)
                    self.killed = pid
                except ProcessLookupError:
                    pass
                return
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

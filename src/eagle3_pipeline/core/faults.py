"""Test hook: one transient fault per named stage, so tests can watch a stage's retry succeed.

With `EAGLE3_TEST_FAIL_ONCE=prepare,verify,vocab,train,evaluate` (any subset of FAULT_POINTS) and
`EAGLE3_TEST_FAIL_ONCE_DIR=<dir>`, the first attempt of each named stage fails the way a real
transient failure would, and leaves the marker file `<dir>/<stage>`; every later attempt (the retry)
finds the marker and runs normally. Like the extract worker's EAGLE3_TEST_FAIL_SHARDS. Where each
fault happens (the place a real one would):
- prepare, verify, vocab: `fail_once` at the start of the core stage (pipeline/stages.py) raises InjectedFault,
  an OSError (what a lost mount, a hub timeout or a reset connection raises);
- train: the train worker SIGKILLs itself after the first logged step of its last epoch (an OOM kill
  or a lost node mid-training: the retry resumes from the last complete epoch checkpoint);
- evaluate: the evaluate child exits before building its engines (a failed engine start), which the
  parent sees as ChildFailed.
Unset, nothing happens and nothing is read. Reads and writes only `<dir>`.
"""

from __future__ import annotations

import os
from pathlib import Path

FAIL_ONCE_ENV = "EAGLE3_TEST_FAIL_ONCE"
FAIL_ONCE_DIR_ENV = "EAGLE3_TEST_FAIL_ONCE_DIR"
FAULT_POINTS = ("prepare", "verify", "vocab", "train", "evaluate")


class InjectedFault(OSError):
    """A transient fault injected by FAIL_ONCE_ENV (an OSError, so retried as one)."""


def take_fault(stage: str) -> bool:
    """True exactly once per marker dir when FAIL_ONCE_ENV names `stage` (the marker is made here)."""
    wanted = {s.strip() for s in os.environ.get(FAIL_ONCE_ENV, "").split(",") if s.strip()}
    if stage not in wanted:
        return False
    unknown = wanted - set(FAULT_POINTS)
    if unknown:
        raise ValueError(f"{FAIL_ONCE_ENV}: unknown stages {sorted(unknown)} (known: {', '.join(FAULT_POINTS)})")
    d = os.environ.get(FAIL_ONCE_DIR_ENV)
    if not d:
        raise ValueError(f"{FAIL_ONCE_ENV} is set but {FAIL_ONCE_DIR_ENV} (the dir of its one-shot markers) is not")
    Path(d).mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(Path(d) / stage, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # one attempt wins, even in parallel
    except FileExistsError:
        return False
    os.close(fd)
    return True


def fail_once(stage: str) -> None:
    """Raise InjectedFault on the first attempt of `stage` (see the module docstring)."""
    if take_fault(stage):
        raise InjectedFault(f"injected transient fault in {stage} ({FAIL_ONCE_ENV}; the retry will pass)")

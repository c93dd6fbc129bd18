"""Test hook: one transient fault per named stage, so tests can watch a stage's retry succeed.

More: docs/internals.md, "core/faults.py".
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

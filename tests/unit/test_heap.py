"""core/heap.py: our garbage-collector thresholds where a process's are lower, and a freeze that collects first."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from pathlib import Path

from eagle3_pipeline.core import heap

ROOT = Path(__file__).resolve().parents[2]


class Node:
    def __init__(self):
        self.me = self  # a cycle: only a collection frees it


def test_tune_raises_the_thresholds_and_keeps_higher_ones():
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)  # Python's defaults
        heap.tune()
        assert gc.get_threshold() == heap.THRESHOLDS
        gc.set_threshold(200_000, 5, 5)  # a caller's own, higher
        heap.tune()
        assert gc.get_threshold() == (200_000, 5, 5)
    finally:
        gc.set_threshold(*before)


def test_freeze_collects_the_garbage_first_and_keeps_what_is_alive():
    kept, dropped = Node(), Node()
    dead = weakref.ref(dropped)
    del dropped
    assert dead() is not None  # a cycle waits for a collection
    frozen = gc.get_freeze_count()
    try:
        heap.freeze()
        assert dead() is None  # collected, not frozen
        assert gc.get_freeze_count() > frozen and kept.me is kept
    finally:
        gc.unfreeze()


def test_the_eagle3_command_and_flow_runs_tune_through_the_flows_package():
    out = subprocess.run([sys.executable, "-c", "import gc, flows; print(list(gc.get_threshold()))"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(list(heap.THRESHOLDS))

"""core/heap.py: our garbage-collector thresholds where a process's are lower, and a freeze that collects first."""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import sysconfig
import weakref
from pathlib import Path

from eagle3_pipeline.core import heap
from tests.conftest import TEST_GC_ENV

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


def _thresholds(code: str, **env: str) -> list[int]:
    """gc's thresholds after `code` in a fresh interpreter of the venv, without the suite's EAGLE3_TEST_GC unless
    given."""
    base = {k: v for k, v in os.environ.items() if k != TEST_GC_ENV}
    out = subprocess.run([sys.executable, "-c", f"import gc; {code}; print(list(gc.get_threshold()))"], cwd=ROOT,
                         env={**base, **env}, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_the_eagle3_command_and_flow_runs_tune_through_the_flows_package():
    assert _thresholds("pass") == [700, 10, 10]  # Python's own: nothing else set them
    assert _thresholds("import flows") == list(heap.THRESHOLDS)


def test_the_suites_processes_get_the_thresholds_from_their_start_and_only_the_suites():
    """tests/helpers/eagle3_test_gc.pth, which `make test` copies into the venv: every Python process whose
    environment says EAGLE3_TEST_GC=1 (the suite's: tests/conftest.py) starts with our thresholds, vLLM's and
    Prefect's processes included; any other (and one run with EAGLE3_TEST_GC=0) keeps Python's."""
    pth = ROOT / "tests" / "helpers" / "eagle3_test_gc.pth"
    assert [int(x) for x in re.search(r"set_threshold\((\d+), (\d+), (\d+)\)", pth.read_text()).groups()] == \
        list(heap.THRESHOLDS)
    installed = Path(sysconfig.get_paths()["purelib"]) / pth.name
    assert installed.is_file() and installed.read_text() == pth.read_text(), \
        f"{installed} is missing or stale: `make test` (or `make test-fast`) copies {pth} there"
    assert _thresholds("pass", **{TEST_GC_ENV: "1"}) == list(heap.THRESHOLDS)
    assert _thresholds("pass", **{TEST_GC_ENV: "0"}) == [700, 10, 10]
    assert _thresholds("pass") == [700, 10, 10]

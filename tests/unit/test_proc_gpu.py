"""Child processes die as a group on deadline; the gpu-gate finds and ends leftovers of ours."""

import os
import subprocess
import sys
import time

import psutil
import pytest

from eagle3_pipeline.core.proc import CHILD_MARKER_ENV, LAUNCHER_ENV, ChildFailed, run_child
from eagle3_pipeline.gpu.stage import find_leftovers, gpu_gate

GRANDCHILD = """
import subprocess, sys, time
p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print("grandchild", p.pid, flush=True)
print('@@eagle3-event {"kind": "started", "pid": %d}' % p.pid, flush=True)
time.sleep(120)
"""


def test_deadline_kills_the_whole_group_and_reports_output(tmp_path):
    lines, events = [], []
    with pytest.raises(ChildFailed, match="deadline") as err:
        run_child([sys.executable, "-c", GRANDCHILD], name="sleepy", timeout_s=3, log_path=tmp_path / "c.log",
                  on_line=lines.append, on_event=events.append)
    assert "grandchild" in str(err.value)  # the tail of the output is in the error
    assert events and events[0]["kind"] == "started"
    time.sleep(0.5)
    assert not psutil.pid_exists(events[0]["pid"]) or psutil.Process(events[0]["pid"]).status() == psutil.STATUS_ZOMBIE
    assert "grandchild" in (tmp_path / "c.log").read_text()


def test_nonzero_exit_carries_the_traceback():
    with pytest.raises(ChildFailed) as err:
        run_child([sys.executable, "-c", "raise ValueError('layer 3 expected [4, 8], found [4]')"], name="bad", timeout_s=60)
    assert "ValueError: layer 3 expected [4, 8], found [4]" in str(err.value)


def test_gpu_gate_ends_a_leftover_engine_of_ours():
    # an orphan, as a crashed attempt leaves it: its launcher is gone, it carries our marker
    env = {**os.environ, CHILD_MARKER_ENV: "extract-test"}
    out = subprocess.run(["bash", "-c", f"{sys.executable} -c 'import time; time.sleep(120)' >/dev/null 2>&1 & echo $!"],
                         env=env, capture_output=True, text=True, check=True)
    pid = int(out.stdout.strip())
    try:
        # an orphan once its launching shell has exited: on a loaded core that can take longer than a fixed pause
        deadline = time.monotonic() + 30
        while not (found := pid in {p.pid for p, _ in find_leftovers()}) and time.monotonic() < deadline:
            time.sleep(0.25)
        assert found
        res = gpu_gate(log=lambda m: None)
        assert pid in res.killed and res.passed
        time.sleep(0.5)
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        if psutil.pid_exists(pid):
            psutil.Process(pid).kill()


def test_gpu_gate_leaves_live_pipelines_and_other_processes_alone():
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    # an engine of a sibling pipeline: marked, and its launcher (here `other`) is alive
    env = {**os.environ, CHILD_MARKER_ENV: "extract-sibling", LAUNCHER_ENV: str(other.pid)}
    out = subprocess.run(["bash", "-c", f"{sys.executable} -c 'import time; time.sleep(30)' >/dev/null 2>&1 & echo $!"],
                         env=env, capture_output=True, text=True, check=True)
    sibling = int(out.stdout.strip())
    try:
        time.sleep(0.5)
        res = gpu_gate(log=lambda m: None)
        assert other.poll() is None and other.pid not in res.killed
        assert sibling not in res.killed and psutil.pid_exists(sibling)
    finally:
        other.kill()
        psutil.Process(sibling).kill()

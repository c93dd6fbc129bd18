"""A local run killed with SIGKILL while it holds the GPU slot does not block the runs after it.

Local runs (no PREFECT_API_URL) each start Prefect's temporary server on PREFECT_HOME's database, which
counts the slot; the temporary server keeps the slot's lease in its own memory and revokes no expired
lease. Before tasks/gpu_lease.node_lock, a run killed holding the slot left the count at 1 and every
later run on that PREFECT_HOME waited at its first GPU stage forever, printing nothing (found on this
machine: `make run` hung at verify for 10 minutes after a run killed the day before).

Here a process takes the slot through `gpu_slot()` and its whole process group (it and its temporary
server) is SIGKILLed; the next process must take the slot and say that it released an orphaned one; a
third, after the second ended normally, finds nothing to release. Three temporary servers, no engine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers.chaos import TAG_ENV
from tests.helpers.store import processes_with_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)

HOLD = textwrap.dedent("""
    import sys, time
    from tasks.gpu_lease import gpu_slot
    with gpu_slot():
        print("slot held", flush=True)
        if sys.argv[1] == "hang":
            time.sleep(600)
""")
ORPHAN = "slot(s) counted but held by no live run"


def _start(home: Path, mode: str, tag: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}  # a temporary server
    env |= {"PREFECT_HOME": str(home), "PREFECT_LOCAL_STORAGE_PATH": str(home / "storage"), TAG_ENV: tag,
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", HOLD, mode], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(p: subprocess.Popen) -> str:
    try:
        out, _ = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"no slot within 240 s (the orphaned slot was not released):\n{out[-3000:]}")
    assert p.returncode == 0, out[-3000:]
    assert "slot held" in out, out[-3000:]
    return out


def test_a_slot_held_by_a_killed_local_run_is_released_by_the_next(tmp_path):
    tag = f"orphan-slot-{uuid.uuid4().hex[:8]}"
    home = tmp_path / "prefect-home"
    holder = _start(home, "hang", tag)
    lines = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = holder.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "slot held" in line:
            break
    else:
        os.killpg(holder.pid, signal.SIGKILL)
    assert lines and "slot held" in lines[-1], "".join(lines)[-3000:]
    assert (home / "gpu-node.lock").read_text().split()[0] == str(holder.pid)  # the node lock's holder

    os.killpg(holder.pid, signal.SIGKILL)  # the run and its temporary server, nothing released
    holder.wait()
    for _ in range(50):
        if not processes_with_env(TAG_ENV, tag):
            break
        time.sleep(0.1)
    assert not processes_with_env(TAG_ENV, tag)

    out = _finish(_start(home, "release", tag))
    assert f"gpu-node: 1 {ORPHAN}" in out, out[-3000:]
    out = _finish(_start(home, "release", tag))  # the second one released its own slot
    assert ORPHAN not in out, out[-3000:]

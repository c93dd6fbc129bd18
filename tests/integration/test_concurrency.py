"""Two pipeline runs on the same dataset version at once: they never interleave writes; the second
waits for the first (store.file_lock) and then finds the work done.

The lock itself is tested across real processes (a waiter blocks until the holder releases it, and
a SIGKILLed holder releases it). Then two real processes run prepare -> preflight -> extract on one
config and one fresh store at the same moment: every shard group must have been extracted by exactly
one engine child, the other process must have waited and reused it, and the store must hold the same
bytes as one clean run (the session's `small_reference`, tests/conftest.py). Engine starts: two
(one per group), plus the reference's when no other test computed it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from tests.helpers.store import (
    manifest_content,
    processes_with_env,
    same_records,
    scratch_left,
    small_overrides,
    temporaries,
)

ROOT = Path(__file__).resolve().parents[2]

PY = sys.executable

HOLDER = """
import sys
from eagle3_pipeline.core.store import file_lock
with file_lock(sys.argv[1], "test lock", log=print):
    print("held", flush=True)
    sys.stdin.readline()  # until the test says so
    with open(sys.argv[2], "a") as f:
        f.write("holder releasing\\n")
"""
WAITER = """
import sys
from pathlib import Path
from eagle3_pipeline.core.store import file_lock
with file_lock(sys.argv[1], "test lock", log=lambda m: print(m, flush=True)):
    with open(sys.argv[2], "a") as f:
        f.write("waiter acquired\\n")
    print("lock file says: " + Path(sys.argv[1]).read_text().strip(), flush=True)
"""


def _start(code: str, *args: str, stdin=None) -> subprocess.Popen:
    return subprocess.Popen([PY, "-c", code, *args], stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)


def _read_until(proc: subprocess.Popen, needle: str) -> list[str]:
    """Lines of `proc` up to and including the first one containing `needle` (fails at EOF)."""
    seen = []
    for line in proc.stdout:
        seen.append(line.rstrip("\n"))
        if needle in line:
            return seen
    raise AssertionError(f"process {proc.pid} ended without printing {needle!r}; it printed {seen}")


@pytest.mark.timeout(120)
def test_second_process_waits_until_the_holder_releases(tmp_path):
    lock, order = tmp_path / "x" / ".lock", tmp_path / "order.txt"
    holder = _start(HOLDER, str(lock), str(order), stdin=subprocess.PIPE)
    try:
        _read_until(holder, "held")
        assert lock.read_text().split()[0] == str(holder.pid)  # the holder's pid is in the lock file
        waiter = _start(WAITER, str(lock), str(order))
        lines = _read_until(waiter, "waiting for")
        assert f"waiting for test lock held by pid {holder.pid}" in lines[-1]
        assert not order.exists()  # the waiter has not got in while the holder holds it
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert holder.wait(timeout=60) == 0
        out = waiter.communicate(timeout=60)[0]
        assert waiter.returncode == 0, out
    finally:
        holder.kill()
    assert order.read_text().splitlines() == ["holder releasing", "waiter acquired"]
    assert f"lock file says: {waiter.pid} " in out
    assert lock.read_text() == ""  # released: nobody named as holder


@pytest.mark.timeout(120)
def test_killed_holder_releases_the_lock(tmp_path):
    lock, order = tmp_path / ".lock", tmp_path / "order.txt"
    holder = _start(HOLDER, str(lock), str(order), stdin=subprocess.PIPE)
    try:
        _read_until(holder, "held")
        waiter = _start(WAITER, str(lock), str(order))
        _read_until(waiter, f"held by pid {holder.pid}")
        os.kill(holder.pid, signal.SIGKILL)  # dies holding it: no cleanup code runs
        assert holder.wait(timeout=60) == -signal.SIGKILL
        out = waiter.communicate(timeout=60)[0]
    finally:
        holder.kill()
    assert waiter.returncode == 0, out
    assert order.read_text().splitlines() == ["waiter acquired"]
    assert f"lock file says: {waiter.pid} " in out


def test_lock_is_reentrant_in_one_thread_and_names_its_holder(tmp_path):
    from eagle3_pipeline.core.store import dir_lock, lock_holder

    lines: list[str] = []
    with dir_lock(tmp_path, "outer", lines.append) as p:
        with dir_lock(tmp_path, "inner", lines.append):  # a stage that calls another: no self-deadlock
            assert lock_holder(p) == f"pid {os.getpid()}"
        assert p.read_text().split()[0] == str(os.getpid())  # still held after the inner exit
    assert lines == []  # nobody waited


RUNNER = """
import sys
from eagle3_pipeline.pipeline import stages
from eagle3_pipeline.core.config import load_config
say = lambda m: print(m, flush=True)
cfg = load_config(sys.argv[1])
prep = stages.stage_prepare(cfg, log=say)
pre = stages.stage_preflight(cfg, prep, log=say)
version = stages.plan_extract(cfg, prep, pre)
ext = stages.stage_extract(cfg, version, log=say)
print("RESULT " + ext.model_dump_json(), flush=True)
"""


@pytest.mark.timeout(900)
def test_two_runs_at_once_extract_each_group_once(small_reference, tiny_target, tmp_path):
    from eagle3_pipeline.core.config import load_config

    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml",
                      small_overrides(tiny_target, tmp_path / "store") + ["extract.shards_per_group=3"])
    cfg_path = tmp_path / "small.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    tag = f"concurrency-{uuid.uuid4().hex}"
    env = {**os.environ, "EAGLE3_TEST_TAG": tag}
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = []
    try:
        for log in logs:  # the same command twice, at the same moment
            with open(log, "w") as f:
                procs.append(subprocess.Popen([PY, "-u", "-c", RUNNER, str(cfg_path)], stdout=f,
                                              stderr=subprocess.STDOUT, env=env, cwd=ROOT))
        codes = [p.wait(timeout=800) for p in procs]
    finally:
        for p in procs:
            p.kill()
    out = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n\n".join(x[-3000:] for x in out)
    assert processes_with_env("EAGLE3_TEST_TAG", tag) == []

    results = [json.loads(next(x for x in o.splitlines() if x.startswith("RESULT "))[7:]) for o in out]
    assert results[0]["dir"] == results[1]["dir"] and results[0]["shards_published"] == 6
    ext_dir = Path(results[0]["dir"])
    groups = [[0, 1, 2], [3, 4, 5]]

    # prepare: one process assembled the version; the other found it complete
    assert sum("rows in," in o for o in out) == 1, out
    # extract: one engine child per group, each shard extracted once ...
    m = json.loads((ext_dir / "manifest.json").read_text())
    assert sorted(c["shards"] for c in m["children"]) == groups
    assert [c["status"] for c in m["children"]] == ["ok", "ok"]
    assert [s["attempts"] for s in m["shards"]] == [1] * 6
    # ... by exactly one of the two processes; the other reused it without starting an engine
    for g in groups:
        ran = [i for i, o in enumerate(out) if f"for shards {g} (log" in o]
        reused = [i for i, o in enumerate(out) if f"extract: shards {g} published (from the store or the record pool); no engine started" in o]
        assert len(ran) == 1 and reused == [1 - ran[0]], (g, ran, reused)
    # the loser waited on the winner's lock instead of writing beside it
    waits = [(i, line) for i, o in enumerate(out) for line in o.splitlines() if line.startswith("waiting for extract shard")]
    print("\n".join(f"process {'ab'[i]} (pid {procs[i].pid}): {line}" for i, o in enumerate(out)
                     for line in o.splitlines() if line.startswith(("waiting for", "extract: child", "extract: shards"))))
    assert waits, "neither run waited for the other's shard lock"
    for i, line in waits:
        assert f"held by pid {procs[1 - i].pid}" in line, line

    # the same records as one clean run (store.same_records), and nothing half-written left behind
    same_records(ext_dir, small_reference.dir)
    assert manifest_content(ext_dir, ignore_config=("shards_per_group",), file_hashes=False) == \
        manifest_content(small_reference.dir, ignore_config=("shards_per_group",), file_hashes=False)
    assert temporaries(tmp_path / "store") == []
    assert scratch_left(ext_dir) == []

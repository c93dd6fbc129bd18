"""Fork servers (core/forkserver.py): a forked child is started, watched, timed out and reported as a spawned one is,
with its own session, directory, environment and cores; a server forks only what it can fork safely and says why
it spawned the rest. Real servers, real forks, through core/proc.run_child."""

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import psutil
import pytest

from eagle3_pipeline.core import forkserver, heap
from eagle3_pipeline.core.proc import (
    CHILD_MARKER_ENV,
    LAUNCHER_ENV,
    ChildFailed,
    ChildTimedOut,
    python_child,
    run_child,
)
from tests.conftest import TEST_GC_ENV

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def servers(tmp_path, monkeypatch):
    """A fork-server directory owned by this process, our test workers allowed; its servers end with the test."""
    root = tmp_path / "forks"
    root.mkdir()
    (root / forkserver.OWNER_FILE).write_text(str(os.getpid()))
    monkeypatch.setenv(forkserver.ENV, str(root))
    monkeypatch.delenv(TEST_GC_ENV, raising=False)  # the thresholds a child has are then the server's own (heap.tune)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the test workers, from any directory
    monkeypatch.setattr(forkserver, "PACKAGES", (*forkserver.PACKAGES, "tests.helpers."))
    yield root
    (root / forkserver.OWNER_FILE).unlink()
    for sock in root.glob("*.sock"):
        if not sock.with_suffix(".failed").exists():  # an ended server's socket stays
            _wait_gone(sock)


def _wait_gone(path, s=10.0):
    end = time.monotonic() + s
    while path.exists() and time.monotonic() < end:
        time.sleep(0.1)
    assert not path.exists(), f"{path}: the server did not end with its owner"


def _said(lines) -> dict:
    (line,) = [x for x in lines if "fork child: {" in x]
    return json.loads(line.split("fork child: ", 1)[1])


def _run(*args, env=None, **kw):
    lines = []
    res = run_child(python_child("tests.helpers.fork_child", *args), name="fc", timeout_s=kw.pop("timeout_s", 120),
                    on_line=lines.append, env=env, **kw)
    return res, _said(lines)


def test_a_forked_child_runs_as_a_spawned_one_would(servers, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cpus = sorted(os.sched_getaffinity(0))
    _, first = _run("0", env={"EAGLE3_TEST_PROBE": "one"})
    res, second = _run("0", "extra", env={"EAGLE3_TEST_PROBE": "two"})
    assert res.returncode == 0
    (sock,) = servers.glob("*.sock")  # one server, started by the first child's request
    server = psutil.Process(first["ppid"])
    assert "eagle3_pipeline.core.forkserver" in " ".join(server.cmdline())
    assert second["ppid"] == first["ppid"] != os.getpid()  # both forked by it, not spawned by us
    for said, probe in ((first, "one"), (second, "two")):
        assert said["sid"] == said["pgid"] == said["pid"]  # its own session and process group, as spawned
        assert said["cwd"] == str(tmp_path) and said["probe"] == probe and said["cpus"] == cpus
        assert said["main"] == "tests.helpers.fork_child"
    assert second["argv"] == ["0", "extra"]
    # the server's imports frozen before its first fork, and its collector thresholds, are the child's (core/heap.py)
    assert first["gc_frozen"] > 1000 and first["gc_threshold"] == list(heap.THRESHOLDS)
    assert first["path"][0] == str(tmp_path)  # `python -m`'s first import path: the child's directory
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    _, third = _run("0")
    assert third["ppid"] == first["ppid"] and third["cwd"] == third["path"][0] == str(elsewhere)  # not the server's


def test_a_forked_child_reads_in_proc_as_a_spawned_one(servers, capfd):
    """The gpu-gate finds our leftovers, and the chaos tests their trials' processes, by their command line and
    environment in /proc: a forked child's are its own (written into the room its server keeps), not the server's."""
    _, forked = _run("0", env={"EAGLE3_TEST_PROBE": "proc"})
    _, spawned = _run("0", env={"EAGLE3_TEST_PROBE": "proc", forkserver.ENV: ""})
    assert forked["ppid"] != os.getpid() == spawned["ppid"]
    for said in (forked, spawned):
        assert said["proc_cmdline"] == [sys.executable, "-u", "-m", "tests.helpers.fork_child", "0"]
        assert dict(x.split("=", 1) for x in said["proc_environ"]) == said["env"]
        assert said["env"][CHILD_MARKER_ENV] == "fc" and said["env"][LAUNCHER_ENV] == str(os.getpid())
    server = psutil.Process(forked["ppid"])  # its own reads true too: the room blanked
    assert server.cmdline()[:4] == [sys.executable, "-u", "-m", "eagle3_pipeline.core.forkserver"]
    assert not any("..." in x for x in server.cmdline()) and forkserver.ROOM_VAR not in server.environ()
    # in a session of its own and no descendant of its starter: what it forks is spared by no gpu-gate as its own
    assert server.pid not in {c.pid for c in psutil.Process().children(recursive=True)}
    assert os.getsid(server.pid) == server.pid
    res, big = _run("0", env={"EAGLE3_TEST_BIG": "x" * forkserver.ROOM_ENV})
    assert res.returncode == 0 and big["ppid"] == os.getpid()  # spawned, and said why
    assert "fork server: tests.helpers.fork_child spawned instead: its environment (" in capfd.readouterr().err


def test_exit_codes_tracebacks_and_deadlines_of_a_forked_child(servers):
    with pytest.raises(ChildFailed, match="exited with code 3"):
        _run("3")
    with pytest.raises(ChildFailed) as err:
        _run("raise")
    assert "ValueError: layer 3 expected [4, 8], found [4]" in str(err.value)  # the traceback reached the parent
    lines = []
    t0 = time.monotonic()
    with pytest.raises(ChildTimedOut):
        run_child(python_child("tests.helpers.fork_child", "sleep"), name="fc", timeout_s=3, on_line=lines.append)
    assert time.monotonic() - t0 < 60
    said = _said(lines)
    assert said["ppid"] != os.getpid()  # forked
    assert not psutil.pid_exists(said["pid"])  # killed with its group and reaped by its server


def test_another_import_environment_gets_its_own_server(servers):
    _, a = _run("0")
    other = "7" if os.environ.get("OMP_NUM_THREADS") != "7" else "5"  # not this process's own (a test worker's may be 1)
    _, b = _run("0", env={"OMP_NUM_THREADS": other})  # read by OpenMP when torch loads: not the first server's
    _, c = _run("0", env={"EAGLE3_TEST_PROBE": "x"})  # read at run time: the first server's
    assert len(list(servers.glob("*.sock"))) == 2
    assert a["ppid"] == c["ppid"] != b["ppid"]


def test_a_child_imports_from_its_own_directory_and_pythonpath(servers, tmp_path, monkeypatch, capfd):
    """PYTHONPATH is not part of a server's name: a child with another one is forked with the import path `python -m`
    would give it, unless an entry of it holds a module the server imported from elsewhere (then it is spawned)."""
    extra, shadow = tmp_path / "extra", tmp_path / "shadow"
    extra.mkdir()
    shadow.mkdir()
    (shadow / "json.py").write_text("raise SystemExit('the shadowing json')\n")  # fork_child preloads the real one
    _, a = _run("0")
    pythonpath = os.pathsep.join([str(ROOT), "extra", ""])  # a relative entry, and an empty one: the directory
    for cwd in (ROOT, tmp_path):
        monkeypatch.chdir(cwd)
        _, forked = _run("0", env={"PYTHONPATH": pythonpath})
        _, spawned = _run("0", env={"PYTHONPATH": pythonpath, forkserver.ENV: ""})
        assert forked["ppid"] == a["ppid"] != os.getpid() == spawned["ppid"]
        assert forked["path"] == spawned["path"] and forked["path"][:3] == [str(cwd), str(ROOT), str(cwd / "extra")]
    assert len(list(servers.glob("*.sock"))) == 1
    with pytest.raises(ChildFailed, match="the shadowing json"):  # what a spawned child does
        _run("0", env={"PYTHONPATH": os.pathsep.join([str(shadow), str(ROOT)])})
    err = capfd.readouterr().err
    assert "fork server: tests.helpers.fork_child spawned instead: its import path would take json from " \
           f"{shadow / 'json.py'}" in err, err


def test_what_cannot_be_forked_is_spawned_and_said(servers, capfd):
    _, forked = _run("0")
    # a module that does not say what to preload
    run_child(python_child("tests.helpers.thread_at_import"), name="fc", timeout_s=120)
    err = capfd.readouterr().err
    assert "fork server: tests.helpers.thread_at_import spawned instead: " in err and "has no FORK_PRELOAD" in err
    # one whose preload leaves a thread in the server: a fork keeps only the forking thread (a pool another thread
    # holds, OpenMP's, would hang the child); the server forks nothing from then on, and says why each time
    for module in ("tests.helpers.fork_child_threads", "tests.helpers.fork_child"):
        lines = []
        run_child(python_child(module, "0"), name="fc", timeout_s=120, on_line=lines.append)
        err = capfd.readouterr().err
        assert f"fork server: {module} spawned instead: the server runs " in err, err
        assert "2 threads (python) after importing tests.helpers.fork_child, tests.helpers.thread_at_import" in err
    assert _said(lines)["ppid"] == os.getpid()  # spawned by us
    assert forked["ppid"] != os.getpid()


def test_no_directory_no_fork(monkeypatch):
    monkeypatch.delenv(forkserver.ENV, raising=False)
    assert forkserver.start(python_child("eagle3_pipeline.extract.worker", "job.json"), dict(os.environ)) is None
    assert forkserver.module_of([sys.executable, "-u", "-m", "vllm.entrypoints.openai.api_server"]) is None
    assert forkserver.module_of(["torchrun", "-m", "eagle3_pipeline.train.worker"]) is None


def test_a_server_that_does_not_answer_is_ended_and_not_asked_again(servers, monkeypatch, capfd):
    monkeypatch.setattr(forkserver, "START_S", 3.0)
    t0 = time.monotonic()
    lines = []
    run_child(python_child("tests.helpers.fork_child_slow"), name="fc", timeout_s=120, on_line=lines.append)
    assert time.monotonic() - t0 < 25  # not the 30 s of the server's import
    assert "fork server: tests.helpers.fork_child_slow spawned instead: the server did not answer in 3 s" in \
        capfd.readouterr().err
    assert lines == ["[fc] fork child: spawned"]
    (failed,) = servers.glob("*.failed")
    pid = int(failed.with_suffix(".pid").read_text())
    with contextlib.suppress(psutil.NoSuchProcess):  # killed: gone already when this process reaped it meanwhile
        psutil.Process(pid).wait(timeout=10)  # ended (it raises while the server runs)
    assert not psutil.pid_exists(pid)
    # not asked again: spawned, and said
    run_child(python_child("tests.helpers.fork_child_slow"), name="fc", timeout_s=120)
    assert "spawned instead: its server failed" in capfd.readouterr().err


def test_a_server_is_idle_only_with_no_child_running(servers, monkeypatch):
    monkeypatch.setattr(forkserver, "IDLE_S", 1.0)  # given to the server when it starts
    res, said = _run("nap")  # 4 s: longer than the server may idle
    assert res.returncode == 0 and said["ppid"] != os.getpid()  # forked, and its exit reported, not lost
    (pid,) = (int(p.read_text()) for p in servers.glob("*.pid"))
    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(pid).wait(timeout=10)  # then idle: ended (it raises while the server runs)

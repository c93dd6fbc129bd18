"""Termination signals: `signals.raise_on_termination` turns SIGTERM into `Terminated` (so finally
blocks and atexit handlers run, exit code 128 + signal), leaves an ignored signal ignored, and
`proc.kill_group` ends a child's group on SIGTERM without waiting out its grace period on the
child's own unreaped zombie. (The whole thing, `eagle3 run`/`extract` with engines and Prefect's
temporary server: tests/chaos/test_signals.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import atexit, sys, time
    from eagle3_pipeline.core.signals import Terminated, raise_on_termination
    atexit.register(lambda: open(sys.argv[1], "a").write("atexit\\n"))
    try:
        with raise_on_termination():
            print("ready", flush=True)
            time.sleep(120)
    except Terminated as e:
        open(sys.argv[1], "a").write(f"terminated {e.signum}\\n")
        sys.exit(e.exit_code)
    finally:
        open(sys.argv[1], "a").write("finally\\n")
""")


def _start(marker, **kw) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(marker)], stdout=subprocess.PIPE, text=True, **kw)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_sigterm_unwinds_and_exits_143(tmp_path):
    marker = tmp_path / "marker"
    p = _start(marker)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 128 + signal.SIGTERM
    assert marker.read_text().splitlines() == [f"terminated {int(signal.SIGTERM)}", "finally", "atexit"]


def test_an_ignored_sigterm_stays_ignored(tmp_path):
    marker = tmp_path / "marker"
    def ignore_sigterm():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # not inherited ignored from a background job

    p = _start(marker, preexec_fn=ignore_sigterm)
    p.send_signal(signal.SIGTERM)
    p.send_signal(signal.SIGINT)  # KeyboardInterrupt, Python's default: still works
    assert p.wait(timeout=60) != 0
    assert "terminated" not in marker.read_text()


def test_kill_group_reaps_its_leader_instead_of_waiting_for_the_grace_period(monkeypatch):
    """A child that dies on SIGTERM is never SIGKILLed: kill_group reaps it and sees the group gone.
    (An unreaped zombie leader still counts as a group member; before, every kill waited the whole
    grace and then sent SIGKILL to the zombie.)"""
    from eagle3_pipeline.core import proc as proc_mod

    child = subprocess.Popen(["sleep", "300"], start_new_session=True)
    sent = []
    real_killpg = os.killpg

    def spy(pgid, sig):
        sent.append(sig)
        return real_killpg(pgid, sig)

    monkeypatch.setattr(proc_mod.os, "killpg", spy)
    proc_mod.kill_group(child.pid, grace_s=30, leader=child)
    assert child.returncode == -signal.SIGTERM
    assert signal.SIGKILL not in sent, sent


def test_kill_group_returns_when_no_member_is_left_running():
    """CI once found an online server's engine processes alive right after the server was ended: SIGKILL
    is asynchronous, and a member with a large address space is still running its exit for a moment.
    kill_group returns only when every member of the group is gone or a zombie. Here a grandchild that
    ignores SIGTERM holds 1 GiB of touched memory, so its exit takes a while after SIGKILL."""
    import psutil

    from eagle3_pipeline.core import proc as proc_mod

    hold = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "b = b'x' * (1 << 30); print('ready', flush=True); time.sleep(300)")
    leader = subprocess.Popen(["bash", "-c", f'{sys.executable} -c "{hold}"; sleep 300'],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert leader.stdout.readline().strip() == "ready"
    members = [c.pid for c in psutil.Process(leader.pid).children(recursive=True)]
    proc_mod.kill_group(leader.pid, grace_s=0.5, leader=leader)
    left = []
    for pid in members:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    assert left == [], left
    assert leader.poll() is not None

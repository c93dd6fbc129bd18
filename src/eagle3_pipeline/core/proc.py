"""Child processes with a deadline: the way every engine (vLLM, trainer) is run.

Owns `run_child(argv, ...)`: start a command in its own process group, forward each output line
(stdout and stderr merged) to `on_line` and to a log file as it arrives, enforce a wall-clock
deadline, and on deadline, cancel (KeyboardInterrupt/SystemExit in the parent) or any error kill the
whole process group (SIGTERM, then SIGKILL). Accelerator memory is only reliably released when the
engine process exits, so engines never run inside the orchestrating process.
Lines starting with EVENT_PREFIX are parsed as JSON and passed to `on_event` as well.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from eagle3_pipeline.core import forkserver
from eagle3_pipeline.core.errors import StageTimeout

EVENT_PREFIX = "@@eagle3-event "
# Which of a child's lines reach the console and the run log (the log file gets every line, and a failure's
# message carries the last ones): the pipeline's own ("extract worker: ...", "reference: layer 7 ...", lower-case
# words and a colon, our convention) and anything that reads as an error. vLLM's, torch's and the trainer's own
# INFO/WARNING chatter (hundreds of lines per engine start) stays in the file named on screen.
OWN_LINE = re.compile(r"^[a-z][a-z0-9_ -]{0,40}: ")
ERROR_LINE = re.compile(r"Traceback|[A-Za-z]+Error\b|\bERROR\b|Exception|Killed|[Ff]ailed|FAIL|[Ii]njected")
VERBOSE_ENV = "EAGLE3_CHILD_OUTPUT"  # "all": every line of every child to the console too


def console_line(line: str) -> bool:
    """Whether a child's output line is shown (to `on_line`), not only written to its log file: the pipeline's
    own lines, those its vLLM plugins and connector log through vLLM's logger ("eagle3 ..."), errors."""
    return (bool(OWN_LINE.match(line) or "eagle3 " in line or ERROR_LINE.search(line))
            or os.environ.get(VERBOSE_ENV) == "all")


# CHILD_MARKER_ENV, in every child's environment: how the gpu-gate finds leftovers of ours; LAUNCHER_ENV, the pid of
# the process that launched the child: a child whose launcher is gone is a leftover
CHILD_MARKER_ENV, LAUNCHER_ENV = forkserver.MARKERS


class ChildFailed(RuntimeError):
    """A child exited non-zero or ran past its deadline; the message carries the tail of its output."""


class ChildTimedOut(ChildFailed, StageTimeout):
    """A child ran past its deadline (and was killed); exit code TIMEOUT."""


@dataclass
class ChildResult:
    returncode: int
    seconds: float
    events: list[dict] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)


def emit_event(**payload) -> None:
    """Called inside a child: report a structured event to the parent (one line on stdout)."""
    sys.stdout.write(EVENT_PREFIX + json.dumps(payload) + "\n")
    sys.stdout.flush()


def exit_child(rc: int):
    """Called at the very end of a child, after its results are on disk: flush the output and end the
    process now, skipping the interpreter's teardown (vLLM's atexit engine shutdown, torch and OpenMP
    finalisation, seconds per engine child: docs/benchmarks.md), paid by every extract group and
    every evaluate. Safe because every file a child writes is complete and closed (records: atomic
    and fsynced) before it says so, and `run_child` ends the child's whole process group afterwards."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def child_main(main: Callable[[list[str]], int]) -> None:
    """The whole `if __name__ == "__main__":` of an engine child: run `main(sys.argv[1:])`; on any failure
    print the whole traceback (the parent needs the whole story, whatever it was) and exit 1, otherwise
    exit with main's code through `exit_child` (no interpreter teardown)."""
    try:
        rc = main(sys.argv[1:])
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    exit_child(rc)


def kill_group(pgid: int, grace_s: float = 10.0, leader: subprocess.Popen | forkserver.ForkedChild | None = None) -> None:
    """SIGTERM the process group, wait up to `grace_s`, then SIGKILL whatever is left. `leader`: the
    group's leader when it is our child; it is reaped while waiting (an unreaped zombie still counts
    as a member of its group, so without it every kill waited the whole grace period)."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.time() + grace_s
    while time.time() < deadline:
        if leader is not None:
            leader.poll()
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    # SIGKILL is asynchronous: a member with a large address space can still be running its exit for a
    # moment. Wait until only zombies (or nothing) are left, so a caller that returns says the truth.
    deadline = time.time() + 10.0
    while (live := _live_members(pgid, leader)) and time.time() < deadline:
        time.sleep(0.1)
    if live:

        logging.getLogger("eagle3_pipeline").warning("process group %d: %s still running 10 s after SIGKILL", pgid, live)


def _live_members(pgid: int, leader: subprocess.Popen | forkserver.ForkedChild | None) -> list[int]:
    """Pids of the group's members that are not zombies (reaping the leader when it is our child)."""
    if leader is not None:
        leader.poll()
    live = []
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(p.pid) == pgid:
                live.append(p.pid)
        except (psutil.Error, OSError):
            pass
    return live


def exit_code(rc: int | None) -> str:
    """'code 1', or for a child ended by a signal 'code -4 (SIGILL)'."""
    if rc is not None and rc < 0:
        try:
            return f"code {rc} ({signal.Signals(-rc).name})"
        except ValueError:
            pass
    return f"code {rc}"


def python_child(module: str, *args: str) -> list[str]:
    """argv that runs `python -m module args...` with this interpreter."""
    return [sys.executable, "-u", "-m", module, *args]


def run_child(
    argv: list[str],
    *,
    name: str,
    timeout_s: float,
    log_path: Path | None = None,
    on_line: Callable[[str], None] | None = None,
    on_event: Callable[[dict], None] | None = None,
    env: dict[str, str] | None = None,
    check: bool = True,
    tail_lines: int = 60,
) -> ChildResult:
    """Run `argv` to completion under a deadline. Raises ChildFailed (with the output tail) on a
    non-zero exit or timeout when `check`; the process group is always gone when this returns."""
    proc, reader, tail, events, log_f = _spawn(argv, name, log_path, on_line, on_event, env, tail_lines)
    t0 = time.time()
    pgid = proc.pid
    timed_out = False
    try:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_group(pgid, leader=proc)
            proc.wait()
    except BaseException:
        kill_group(pgid, leader=proc)
        proc.wait()
        raise
    finally:
        kill_group(pgid, grace_s=2.0, leader=proc)  # grandchildren (engine workers) must not outlive the attempt
        reader.join(timeout=5)
        if log_f:
            log_f.close()
    res = ChildResult(proc.returncode, time.time() - t0, events, list(tail))
    if check and (timed_out or proc.returncode != 0):
        why = f"ran past its deadline of {timeout_s:.0f}s" if timed_out else f"exited with {exit_code(proc.returncode)}"
        where = f" (full log: {log_path})" if log_path else ""
        raise (ChildTimedOut if timed_out else ChildFailed)(f"{name} {why}{where}; last output:\n" + "\n".join(tail))
    return res


def _spawn(argv: list[str], name: str, log_path: Path | None, on_line: Callable[[str], None] | None,
           on_event: Callable[[dict], None] | None, env: dict[str, str] | None, tail_lines: int):
    """Start `argv` in its own process group with a thread that forwards its output (see run_child);
    returns (proc, reader thread, tail, events, log file)."""
    full_env = {**os.environ, **(env or {}), CHILD_MARKER_ENV: name, LAUNCHER_ENV: str(os.getpid()),
                "PYTHONUNBUFFERED": "1"}
    full_env.setdefault("PYTHONFAULTHANDLER", "1")  # a child killed by SIGSEGV / SIGILL logs its Python stack
    if log_path:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    log_f = open(log_path, "a", buffering=1) if log_path else None  # noqa: SIM115
    tail: deque[str] = deque(maxlen=tail_lines)
    events: list[dict] = []
    proc = forkserver.start(argv, full_env) or subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env, start_new_session=True, text=True,
        errors="replace", bufsize=1)

    def pump():
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            if line.startswith(EVENT_PREFIX):
                try:
                    ev = json.loads(line[len(EVENT_PREFIX):])
                except json.JSONDecodeError:
                    ev = None
                if ev is not None:
                    events.append(ev)
                    if on_event:
                        on_event(ev)
                    if log_f:
                        log_f.write(line + "\n")
                    continue
            tail.append(line)
            if log_f:
                log_f.write(line + "\n")
            if on_line and console_line(line):
                on_line(f"[{name}] {line}")

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    return proc, reader, tail, events, log_f


class BackgroundChild:
    """A long-running child (a server) in its own process group, its output forwarded like run_child's.
    Use as a context manager: the whole group is ended (SIGTERM, then SIGKILL) on exit, whatever
    happened inside; `alive()` and `tail` tell a waiting caller whether and why it died."""

    def __init__(self, argv: list[str], *, name: str, log_path: Path | None = None,
                 on_line: Callable[[str], None] | None = None, env: dict[str, str] | None = None,
                 tail_lines: int = 60):
        self.argv, self.name, self.log_path = argv, name, log_path
        self._args = (on_line, env, tail_lines)
        self.proc: subprocess.Popen | forkserver.ForkedChild | None = None

    def __enter__(self) -> BackgroundChild:
        on_line, env, tail_lines = self._args
        self.proc, self._reader, self.tail, self.events, self._log_f = _spawn(
            self.argv, self.name, self.log_path, on_line, None, env, tail_lines)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def describe_exit(self) -> str:
        """Exit code, the first exception line of the whole log (vLLM re-raises an engine process's
        failure as a generic one at the end, so the first names the cause) and the last lines."""
        where = f" (full log: {self.log_path})" if self.log_path else ""
        rc = self.proc.poll() if self.proc else None
        first = first_exception_line(self.log_path) if self.log_path else None
        cause = f"; first error in the log: {first}" if first else ""
        return f"{self.name} exited with {exit_code(rc)}{where}{cause}; last output:\n" + "\n".join(self.tail)

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        kill_group(self.proc.pid, grace_s=10.0, leader=self.proc)
        self.proc.wait()
        self._reader.join(timeout=5)
        if self._log_f:
            self._log_f.close()


# An exception line anywhere in a child's output, also one prefixed by vLLM's "(Worker pid=..) ERROR ..]".
EXCEPTION_LINE = re.compile(r"\b([A-Z]\w*(?:Error|Exception)): (.+)$")


def first_exception_line(log_path: Path) -> str | None:
    """The first `SomeError: message` in a log file (None: none, or no file); lines logged as warnings
    are not errors (vLLM warns "... like `OSError: [Errno 24] Too many open files` ..." at start-up)."""
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                if " WARNING " in line or "Warning:" in line:
                    continue
                m = EXCEPTION_LINE.search(line.rstrip("\n"))
                if m:
                    return m.group(0)
    except FileNotFoundError:
        return None
    return None


def next_generation(path: Path, seen: str | None, wait_s: float, poll_s: float = 2.0) -> dict | None:
    """A node set's record (JSON at `path`, written by node 0) once its `generation` differs from `seen` or its
    `state` is "done"; None after `wait_s`. How the other nodes of a train set or an engine set follow node 0."""
    end = time.monotonic() + wait_s
    while True:
        try:
            rec = json.loads(path.read_text())
            if rec.get("state") == "done" or rec.get("generation") != seen:
                return rec
        except (OSError, ValueError):
            pass
        if time.monotonic() >= end:
            return None
        time.sleep(poll_s)

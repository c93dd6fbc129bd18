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
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_pipeline.errors import StageTimeout

EVENT_PREFIX = "@@eagle3-event "
# Marker put in the environment of every child so that gpu-gate can find leftovers of ours.
CHILD_MARKER_ENV = "EAGLE3_PIPELINE_CHILD"
# The pid of the process that launched the child: a child whose launcher is gone is a leftover.
LAUNCHER_ENV = "EAGLE3_PIPELINE_LAUNCHER"


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
    finalisation): 3-9 s per engine child on 2 CPU cores, measured, paid by every extract group and
    every evaluate. Safe because every file a child writes is complete and closed (records: atomic
    and fsynced) before it says so, and `run_child` ends the child's whole process group afterwards."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def kill_group(pgid: int, grace_s: float = 10.0, leader: subprocess.Popen | None = None) -> None:
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
        pass


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
    full_env = {**os.environ, **(env or {}), CHILD_MARKER_ENV: name, LAUNCHER_ENV: str(os.getpid()),
                "PYTHONUNBUFFERED": "1"}
    if log_path:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    log_f = open(log_path, "a", buffering=1) if log_path else None  # noqa: SIM115
    t0 = time.time()
    tail: deque[str] = deque(maxlen=tail_lines)
    events: list[dict] = []
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env,
                            start_new_session=True, text=True, errors="replace", bufsize=1)
    pgid = proc.pid

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
            if on_line:
                on_line(f"[{name}] {line}")

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
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
        why = f"ran past its deadline of {timeout_s:.0f}s" if timed_out else f"exited with code {proc.returncode}"
        where = f" (full log: {log_path})" if log_path else ""
        raise (ChildTimedOut if timed_out else ChildFailed)(f"{name} {why}{where}; last output:\n" + "\n".join(tail))
    return res

"""Termination signals of the `eagle3` command: SIGTERM (and SIGHUP) become an exception, so every
`finally`, context manager and atexit handler runs, as they do for Ctrl-C (SIGINT ->
KeyboardInterrupt, Python's own default, left as it is).

Why this is needed: Python's default action for SIGTERM ends the process on the spot, with no
`finally` and no atexit. While a flow runs, Prefect's engine turns SIGTERM into `TerminationSignal`
(prefect.utilities.engine.capture_sigterm), which unwinds the flow (run_child kills the engine or
trainer child's process group, the pipeline writes its report), but then restores the handler it
found and sends the signal to its own process again. With the default handler, the process dies
right there: before the flow run is marked crashed and before the atexit handler that stops
Prefect's temporary server (`uvicorn ... prefect.server.api.server`, started when no
PREFECT_API_URL is set) has run, so that server was left running, re-parented to init. With
`raise_on_termination()` installed before the flow starts, Prefect finds our handler and re-sends
the signal to it: `Terminated` is raised, the flow run is marked crashed, the command exits with
128 + the signal number (docs/operations.md, "Exit codes") and atexit stops the server. Without a flow
(`eagle3 extract`), the same exception unwinds through run_child, which ends the child.

Only the first signal raises; one that arrives while the process is already stopping is ignored
(SIGKILL still ends everything; the gpu-gate then cleans up after it). A signal that was ignored
when the command started (`nohup`) stays ignored.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

TERMINATION_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(BaseException):
    """The process received a termination signal. A BaseException (like KeyboardInterrupt), so
    `except Exception` does not swallow it; `exit_code` is 128 + the signal number."""

    def __init__(self, signum: int):
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


@contextmanager
def raise_on_termination(signals: tuple[int, ...] = TERMINATION_SIGNALS) -> Iterator[None]:
    """While active (main thread only), `signals` raise `Terminated` in the main thread."""
    state = {"stopping": False}

    def handler(signum, frame):  # noqa: ARG001
        if state["stopping"]:
            print(f"{signal.Signals(signum).name}: already stopping", file=sys.stderr, flush=True)
            return
        state["stopping"] = True
        raise Terminated(signum)

    previous = {}
    for sig in signals:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        if not state["stopping"]:  # once stopping, keep ignoring: the process is on its way out (atexit)
            for sig, old in previous.items():
                signal.signal(sig, old)

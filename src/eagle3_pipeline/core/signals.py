"""Termination signals of the `eagle3` command: SIGTERM (and SIGHUP) become an exception, so every
`finally`, context manager and atexit handler runs, as they do for Ctrl-C (SIGINT ->
KeyboardInterrupt, Python's own default, left as it is).

More: docs/internals.md, "core/signals.py".
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

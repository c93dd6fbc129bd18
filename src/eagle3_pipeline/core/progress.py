"""Progress lines from inside a long engine call, so that a run's log (and the Prefect UI) tells work
from a hang.

Owns `LineProgress`: a stand-in for the tqdm bar that vLLM's `LLM.generate(use_tqdm=...)` accepts (it
wraps the prompts it adds, then calls the factory with `total=` and `update(n)` per finished request and sets `postfix` to its
speed estimate). Instead of redrawing a bar it prints one line at most every `every_s` seconds (and
one at the end when the call took longer than that): requests done of total, tokens done of total
where known, tokens/s. `EAGLE3_PROGRESS_S` overrides the interval (tests).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable

DEFAULT_EVERY_S = 30.0
_SPEED = re.compile(r"input: ([\d.]+) toks/s, output: ([\d.]+) toks/s")


def interval() -> float:
    return float(os.environ.get("EAGLE3_PROGRESS_S") or DEFAULT_EVERY_S)


class _Bar:
    def __init__(self, owner: LineProgress, total: int):
        self.owner, self.total, self.n = owner, total, 0
        self.t0 = self.last = time.monotonic()
        self.postfix = ""

    @property
    def format_dict(self) -> dict:
        return {"elapsed": max(time.monotonic() - self.t0, 1e-9)}

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.owner.every_s:
            self.last = now
            self.owner.out(self.line())

    def line(self) -> str:
        elapsed = self.format_dict["elapsed"]
        m = _SPEED.search(self.postfix or "")
        tok_in, tok_out = (float(m.group(1)), float(m.group(2))) if m else (0.0, 0.0)
        tokens = f"; ~{tok_in * elapsed:,.0f}" + (f" of {self.owner.total_tokens:,}" if self.owner.total_tokens else "")
        tokens += f" prompt tokens, {tok_in:,.0f} tok/s" + (f", {tok_out:,.0f} generated tok/s"
                                                           if tok_out and self.owner.generates else "")
        return f"{self.owner.what}: {self.n} of {self.total} requests done ({elapsed:.0f} s){tokens if m else ''}"

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        if time.monotonic() - self.t0 >= self.owner.every_s:
            self.owner.out(self.line())


class LineProgress:
    """`use_tqdm=LineProgress("extract: shard 3", total_tokens=...)` in an `LLM.generate` call."""

    def __init__(self, what: str, total_tokens: int | None = None, every_s: float | None = None,
                 out: Callable[[str], None] = lambda s: print(s, flush=True), generates: bool = True):
        self.what, self.total_tokens, self.generates = what, total_tokens, generates
        self.every_s = interval() if every_s is None else every_s
        self.out = out

    def __call__(self, iterable=None, total: int = 0, **_tqdm_kwargs):
        """vLLM calls it as tqdm: over the prompts it adds (passed through: adding is quick), then as the
        bar of finished requests."""
        return iterable if iterable is not None else _Bar(self, total)

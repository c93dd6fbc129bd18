"""The garbage collector in our processes, whose heaps are mostly imports: vLLM's, torch's and Prefect's, ~0.2-1 M
objects. By default Python collects the whole heap each time a quarter more of it has survived, so a process that
imports vLLM makes about seven full collections on the way, and vLLM makes three more while it starts an engine.
`tune` makes the young collections rarer (a full one is considered every ~10 M allocations, not every 70,000);
`freeze` moves what is alive to the permanent generation, which no collection passes over. Measured on 2 cores:
docs/testing.md, "Suite time" (stop 63)."""

from __future__ import annotations

import gc

# (generation 0, 1, 2): Python's defaults are (700, 10, 10)
THRESHOLDS = (50_000, 20, 10)


def tune() -> None:
    """Our thresholds, where this process's are lower (a caller's own higher ones stay): at the start of our
    processes (the `eagle3` command and the flow runs through `flows`, the worker children, the fork servers)."""
    if gc.get_threshold()[0] < THRESHOLDS[0]:
        gc.set_threshold(*THRESHOLDS)


def freeze() -> None:
    """Collect once, then move every object alive to the permanent generation (`gc.freeze`): later collections
    pass over only what was made after it. Nothing alive is freed by it, and what was garbage is collected first.
    Before each engine start (engine/build.build_llm) and after each of a fork server's preloads (core/forkserver.py)."""
    gc.collect()
    gc.freeze()

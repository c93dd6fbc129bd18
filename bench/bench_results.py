"""How every bench hands its numbers to `bench/run_all.py`: `record(name, data)` writes
`$EAGLE3_BENCH_OUT/<name>.json` when that variable is set (run_all sets it) and does nothing otherwise,
so each script still runs on its own and prints its own table."""

from __future__ import annotations

import json
import os
from pathlib import Path


def record(name: str, data: dict) -> None:
    out = os.environ.get("EAGLE3_BENCH_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(data, indent=2, default=float))


def spread(values: list[float]) -> dict:
    """Median with min and max of a bench's per-round values (what every ratio row shows)."""
    import statistics

    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)} \
        if values else {"median": None, "min": None, "max": None, "n": 0}

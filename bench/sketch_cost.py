"""What the state sketch (state_sketch.py) costs, side by side in one process, alternating every round:
- engine: the extract engine's per-step work (`stored` + `project` of a step's [N, L, H] states, bf16 records)
  against the lm_head product [N, H] x [H, V] the fingerprint computes for the same tokens anyway;
- verify: scan.reduce_batch over one batch of records with the sketch's projections and without.
Sizes: SmolLM2-135M (H 576, V 49,152), the 602M bench target (H 1,536, V 32,000) and a 1T MoE's dims
(H 7,168, V 163,840; lm_head rows scaled down 8x here to fit, the ratio scaled back), 4 captured layers.
Usage: .venv/bin/python bench/sketch_cost.py [--rounds 7] [--tokens 2048]
Prints a table of ratios (median and min-max over the rounds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

SIZES = [("SmolLM2-135M", 576, 49152, 1), ("602M bench", 1536, 32000, 1), ("1T MoE dims", 7168, 163840, 8)]


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _batch(n: int, L: int, H: int):
    """A scan.Batch of one record of n tokens (bf16 states) in its arenas."""
    import numpy as np
    import torch

    from eagle3_pipeline.records.contracts import RecordSpec
    from eagle3_pipeline.verify import scan

    spec = RecordSpec(L, H, "bf16")
    ar = scan.Arenas(spec, n)
    x = torch.randn(n, L, H).to(torch.bfloat16)
    ar.hs[:] = x.view(torch.uint8).reshape(-1).numpy()
    item = scan.Item(row=0, path="-", input_ids=np.zeros(n, dtype=np.int64), sample_id=None)
    entry = scan.FileEntry(item=item, tokens=n, offset=0, sketch=True)
    return spec, scan.Batch(files=[entry], arenas=ar, tokens=n)


def measure(name: str, H: int, V: int, shrink: int, n: int, rounds: int) -> dict:
    import torch

    from eagle3_pipeline.engine import state_sketch as sk
    from eagle3_pipeline.verify import scan

    L = 4
    states = torch.randn(n, L, H).to(torch.bfloat16)
    final = states[:, -1]
    w = torch.randn(V // shrink, H).to(torch.bfloat16)
    spec, batch = _batch(n, L, H)
    bufs: dict = {}
    arms = {
        "engine sketch": lambda: sk.project(sk.stored(states, "bf16"), H),
        "lm_head": lambda: torch.matmul(final, w.T),
        "verify": lambda: scan.reduce_batch(batch, spec, False, bufs, sketch=False),
        "verify + sketch": lambda: scan.reduce_batch(batch, spec, False, bufs, sketch=True),
    }
    for f in arms.values():  # first use
        f()
    t: dict[str, list[float]] = {a: [] for a in arms}
    names = list(arms)
    for r in range(rounds):
        for a in names[r % len(names):] + names[:r % len(names)]:
            t[a].append(_timed(arms[a]))
    eng = [s / (lm * shrink) for s, lm in zip(t["engine sketch"], t["lm_head"])]
    ver = [b / a for a, b in zip(t["verify"], t["verify + sketch"])]
    return {"size": name, "H": H, "V": V, "engine ÷ lm_head": eng, "verify with ÷ without": ver}


def main() -> None:
    import torch
    from rich.console import Console
    from rich.table import Table

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t = Table(title=f"state sketch cost, {args.tokens} tokens x 4 layers, 1 thread, {args.rounds} alternating rounds: "
                    "median (min-max)")
    for c in ("size", "H", "engine sketch ÷ lm_head of the same tokens", "verify arithmetic: with sketch ÷ without"):
        t.add_column(c, justify="right")
    f = lambda v: f"{statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})"  # noqa: E731
    for name, H, V, shrink in SIZES:
        r = measure(name, H, V, shrink, args.tokens, args.rounds)
        t.add_row(name, str(H), f(r["engine ÷ lm_head"]), f(r["verify with ÷ without"]))
    Console(width=160).print(t)


if __name__ == "__main__":
    main()

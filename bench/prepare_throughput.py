"""Prepare throughput: rows/s and tokens/s on the tiny corpus scaled x100, with 1 and 2 processes.

Usage: .venv/bin/python bench/prepare_throughput.py [--scale 100] [--target .cache/tiny-target]
Each configuration tokenizes into a fresh store (no chunk reuse); the table prints ratios against
the single-process run measured in the same invocation.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench_results import record  # bench/ is sys.path[0] when run as a script
from eagle3_pipeline.core.config import PrepareConfig, SourceConfig, TargetConfig
from eagle3_pipeline.prepare.stage import prepare


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=".cache/tiny-target")
    ap.add_argument("--scale", type=int, default=100)
    args = ap.parse_args()
    corpus = Path(args.target) / "corpus"
    with tempfile.TemporaryDirectory() as tmp:
        big = Path(tmp) / "scaled.jsonl"
        with big.open("w") as out:
            for k in range(args.scale):  # ids made unique per copy so nothing is a duplicate
                for name in ("sharegpt.jsonl", "openai.jsonl"):
                    for line in (corpus / name).read_text().splitlines():
                        rec = json.loads(line)
                        rec["id"] = f"{rec['id']}-x{k}"
                        out.write(json.dumps(rec) + "\n")
        rows = []
        for procs in (1, 2):
            cfg = PrepareConfig(sources=[SourceConfig(path=str(big))], heldout_rows=0, num_proc=procs, chunk_rows=5000)
            t0 = time.perf_counter()
            res = prepare(cfg, TargetConfig(model=args.target), Path(tmp) / f"store-{procs}", log=lambda m: None)
            dt = time.perf_counter() - t0
            rows.append((procs, res.rows_in, res.tokens, dt))
    base = rows[0][1] / rows[0][3]
    t = Table(title=f"prepare throughput, tiny corpus x{args.scale}")
    for c in ("processes", "rows", "tokens", "seconds", "rows/s", "tokens/s", "ratio vs 1 process"):
        t.add_column(c, justify="right")
    for procs, n, toks, dt in rows:
        t.add_row(str(procs), f"{n:,}", f"{toks:,}", f"{dt:.1f}", f"{n / dt:,.0f}", f"{toks / dt:,.0f}", f"{n / dt / base:.2f}")
    Console().print(t)
    record("prepare", {"scale": args.scale, "runs": [{"processes": p, "rows": n, "tokens": k, "seconds": d}
                                                     for p, n, k, d in rows],
                       "ratio_2_over_1": rows[1][1] / rows[1][3] / base})


if __name__ == "__main__":
    main()

"""Online vs offline training: the same train stage (`train.train_draft`), same data and settings, once
reading the stored records (offline) and once asking a running vLLM server of the target for every row
(online, train/online.py), alternating which goes first each round, in one run.

Data: the tiny default (configs/tiny-cpu.yaml: prepare -> extract -> vocab, content-addressed in --work,
so a second run reuses it). One server for the whole bench (its start-up is printed, not in the ratio).
Each round trains a fresh draft for --max-steps steps both ways. Prints per run and the ratio
online ÷ offline (median over rounds with min-max) of
  median step tok/s:  median over steps of tokens / step time (fetch + forward + backward + optimizer)
  e2e tok/s:          tokens / wall time of the whole train call (child start, model build, saves)
  fetch ms:           median time the step waited for its batch (the server round trips online)
and the peak bytes of hidden states on disk online (the server's scratch dir) vs the stored records.
Same seed and data => both report the same losses when the server's states equal the stored ones.
Usage: .venv/bin/python bench/online_vs_offline.py [--rounds 5] [--max-steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench_results import record, spread, tiny_default_data  # bench/ is sys.path[0] when run as a script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
console = Console(width=160)


def run(d: dict, out: Path, args, online) -> dict:
    from eagle3_pipeline.train.stage import train_draft

    cfg = d["cfg"].train.model_copy(update={"epochs": 1, "max_steps": args.max_steps})
    t0 = time.time()
    res = train_draft(cfg, d["cfg"].target, d["version"], Path(d["voc"].dir), out, log=lambda _: None, online=online)
    wall = time.time() - t0
    rows = [json.loads(x) for x in res.metrics.read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "train_step"]
    return {"steps": len(steps), "tokens": sum(r["tokens"] for r in steps), "wall_s": wall,
            "median_step": statistics.median(r["tokens"] / r["step_s"] for r in steps if r["step_s"] > 0),
            "fetch_ms": statistics.median(r["fetch_ms"] for r in steps), "final_loss": res.final_loss}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-steps", type=int, default=20)
    ap.add_argument("--work", default=str(ROOT / ".cache" / "bench-online"))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from eagle3_pipeline.data.tokenized import load_tokenized
    from eagle3_pipeline.train.online import HiddenStateServer

    work = Path(args.work)
    d = tiny_default_data(work)
    version, cfg = d["version"], d["cfg"]
    ds = load_tokenized(version.tokenized_dir)
    stored = sum(p.stat().st_size for p in version.hidden_states_dir.glob("hs_*.safetensors"))
    runs_dir = work / "runs"
    shutil.rmtree(runs_dir, ignore_errors=True)
    results: list[tuple[int, str, dict]] = []
    with HiddenStateServer(cfg.extract, cfg.target, version, work / "server", max_model_len=int(max(ds["seq_len"])) + 1,
                           start_timeout_s=1800, log=console.print) as srv:
        from eagle3_pipeline.train.job import OnlineSource

        online = OnlineSource(endpoint=srv.endpoint, model=srv.model, request_timeout_s=600.0,
                              max_in_flight=max(1, min(cfg.extract.max_num_seqs, 16)))
        for rnd in range(args.rounds):
            order = ["offline", "online"] if rnd % 2 == 0 else ["online", "offline"]
            for name in order:
                r = run(d, runs_dir / f"{rnd}-{name}", args, online if name == "online" else None)
                results.append((rnd, name, r))
                console.print(f"round {rnd} {name}: {r['steps']} steps, {r['tokens']} tokens, median step "
                              f"{r['median_step']:.0f} tok/s, e2e {r['tokens'] / r['wall_s']:.0f} tok/s, fetch "
                              f"{r['fetch_ms']:.0f} ms, loss {r['final_loss']:.4f}")
        peak = srv.scratch_peak()
    console.print(f"server start-up {srv.start_s:.1f}s; hidden states on disk: online peak {peak / 1e6:.2f} MB in flight, "
                  f"offline {stored / 1e6:.1f} MB stored ({d['prep'].rows_out} rows)")

    table = Table(title="train stage, online ÷ offline (same data, settings, seed; median over rounds, min-max)")
    for col in ("metric", "offline", "online", "ratio median", "min", "max", "rounds"):
        table.add_column(col, justify="right")
    out = {}
    for label, val in (("median step tok/s", lambda r: r["median_step"]), ("e2e tok/s", lambda r: r["tokens"] / r["wall_s"]),
                       ("fetch ms", lambda r: r["fetch_ms"])):
        by = {(k, n): val(r) for k, n, r in results}
        ratios = [by[k, "online"] / by[k, "offline"] for k in range(args.rounds)]
        s = spread(ratios)
        off = statistics.median(by[k, "offline"] for k in range(args.rounds))
        on = statistics.median(by[k, "online"] for k in range(args.rounds))
        table.add_row(label, f"{off:.0f}", f"{on:.0f}", f"{s['median']:.3f}", f"{s['min']:.3f}", f"{s['max']:.3f}",
                      str(s["n"]))
        out[label] = {"offline": off, "online": on, "ratio_spread": s}
    console.print(table)
    losses = {n: sorted({round(r["final_loss"], 4) for _, m, r in results if m == n}) for n in ("offline", "online")}
    console.print(f"final losses: {losses}")
    record("online", out | {"online_peak_bytes": peak, "offline_bytes": stored, "server_start_s": srv.start_s,
                            "rounds": args.rounds, "max_steps": args.max_steps, "losses": losses})


if __name__ == "__main__":
    main()

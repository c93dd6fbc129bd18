"""Prefect's orchestration overhead on the extract stage: a 32-shard run whose shards are already
published (the fast path: manifest read + sha256 of every file, no engine), through

  direct       the core calls the flow makes for one planned ExtractVersion (stage_extract_group per
               group, stage_extract_summary), no Prefect
  executed     the real `extract` flow (one `extract-group` task per shard, the GPU slot, result
               persisted), its task results cleared first so every task runs
  cached       the same flow again: every group answered from Prefect's cache (a retried run)
  no-op        a flow of 32 tasks that do nothing (Prefect's floor per task run)
  empty flow   a flow with no task: the fixed cost of a flow run (~1 s: Prefect's heartbeat thread sleeps
               in 1-s steps and is joined when the flow ends), paid once per flow, not per group
  slot/task    a flow of 8 tasks each taking and releasing the GPU slot (tasks.stage_tasks.gpu_slot:
               the strict global concurrency limit with its lease): what every group paid before the
               extract flow took one slot for all its groups (gpu_slot_scope); per task

against a temporary Prefect server (prefect_test_harness, SQLite). `--repeats` rounds (default 5)
alternate the paths; every number is the median over the rounds with min-max, and the overhead per
group is (path - direct - empty flow) / groups within each round. Also set against the one real extraction of the
same shards this script does first (one engine start).

Where the time went before (2 CPU cores, SQLite): a strict slot per group (acquire, a lease-renewal
thread that renews at once and is joined on release; ~0.3 s, ~2 s when SQLite answers `database is
locked` (HTTP 503) and the client retries), the task's `gpu` tag (a tagged task run takes a slot of
Prefect's tag concurrency limits: one more API call per group, cached or not), a progress artifact
created per group even when nothing was extracted, and Prefect walking the config and the shard plan
of every call for futures (quote() now).

Usage: .venv/bin/python bench/prefect_overhead.py [--target .cache/tiny-target] [--shards 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=str(ROOT / ".cache" / "tiny-target"))
    ap.add_argument("--shards", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="prefect-overhead-"))
    os.environ.update(PREFECT_HOME=str(tmp / "prefect"), PREFECT_LOCAL_STORAGE_PATH=str(tmp / "results"),
                      PREFECT_SERVER_ANALYTICS_ENABLED="false", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args, tmp: Path) -> None:
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE
    from prefect.testing.utilities import prefect_test_harness
    from rich.console import Console
    from rich.table import Table

    from bench_results import record, spread  # bench/ is sys.path[0] when run as a script
    from eagle3_pipeline.core.config import load_config
    from eagle3_pipeline.pipeline import stages
    from flows.extract import extract
    from tasks.stage_tasks import gpu_slot

    corpus = Path(args.target) / "corpus"
    rows_per_shard = 2
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml", [
        f"store={tmp / 'store'}", f"target.model={args.target}",
        f"prepare.sources=[{{path: {corpus / 'openai.jsonl'}, limit: {args.shards * rows_per_shard + 4}}}]",
        "prepare.heldout_rows=4", f"extract.rows_per_shard={rows_per_shard}", "extract.shards_per_group=1",
        "extract.retries=0"])
    quiet = lambda *_: None  # noqa: E731
    prep = stages.stage_prepare(cfg, log=quiet)
    pre = stages.stage_preflight(cfg, prep, log=quiet)
    version = stages.plan_extract(cfg, prep, pre)
    groups = version.groups
    t0 = time.perf_counter()
    stages.stage_extract_group(cfg, version, [k for g in groups for k in g], log=quiet)  # one engine, all shards
    engine_s = time.perf_counter() - t0
    print(f"{len(groups)} shards ({prep.rows_out} rows, {prep.tokens} tokens) extracted for real in "
          f"{engine_s:.1f}s (one engine start); now timing the fast path")

    def direct() -> None:
        for g in version.groups:
            stages.stage_extract_group(cfg, version, g, log=quiet)
        stages.stage_extract_summary(version)

    def executed() -> None:
        shutil.rmtree(tmp / "results", ignore_errors=True)  # no persisted task results: every task runs
        extract(cfg, version)

    def cached() -> None:
        extract(cfg, version)

    def flow_of(name: str, body, n: int):
        """A flow of `n` tasks, each running `body(k)`: the no-op floor and the per-task GPU slot."""
        body_task = task(body, name=f"{name}-task", cache_policy=NO_CACHE)

        @flow(name=name)
        def run_all(n: int) -> None:
            for k in range(n):
                body_task(k)

        return lambda: run_all(n)

    def take_slot(k: int) -> int:
        with gpu_slot():
            return k

    n, n_slot = len(groups), 8
    paths = {"direct": direct, "executed": executed, "cached": cached, "no-op": flow_of("noop", lambda k: k, n),
             "empty flow": flow_of("empty", lambda k: k, 0), "slot/task": flow_of("gpu-slot", take_slot, n_slot)}
    times: dict[str, list[float]] = {k: [] for k in paths}
    with prefect_test_harness(server_startup_timeout=120):
        executed()  # warm-up: imports, the GPU limit, the first flow run
        for _ in range(args.repeats):
            for name, fn in paths.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)

    per = {k: n_slot if k == "slot/task" else max(1, n if k != "empty flow" else 1) for k in paths}
    ms = {k: [1000 * s / per[k] for s in v] for k, v in times.items()}  # per group (per task)
    # A flow run costs ~1 s whatever it runs: Prefect's flow-run heartbeat thread sleeps in 1-s steps and
    # the engine joins it when the flow ends (prefect/flow_engine.py `_send_heartbeats`; heartbeats are
    # what detects crashed runs, so they stay on). That is per flow run, not per group: the per-group
    # overhead is (path - direct - empty flow) / groups, and the fixed cost is its own row.
    over = {k: [1000 * (s - d - e) / n for s, d, e in zip(times[k], times["direct"], times["empty flow"])]
            for k in ("executed", "cached", "no-op")}
    tab = Table(title=f"Prefect overhead, extract stage, {n} published shards (fast path), {args.repeats} "
                      f"alternating rounds: median (min-max)")
    for col in ("path", "seconds", "ms per group", "overhead ms per group", "goal", "overhead ÷ one real extraction"):
        tab.add_column(col, justify="right" if col != "path" else "left")
    goals = {"executed": "<= 200", "cached": "<= 30"}
    for k, v in times.items():
        o = over.get(k)
        tab.add_row(k, _fmt(spread(v), ".2f"), _fmt(spread(ms[k]), ".1f") + (" per task" if k == "slot/task" else ""),
                    _fmt(spread(o), ".0f") if o else "-", goals.get(k, ""),
                    f"{n * spread(o)['median'] / 1000 / engine_s:.1%}" if o else "-")
    Console().print(tab)
    record("prefect", {"groups": n, "rounds": args.repeats, "engine_s": engine_s, "seconds": times,
                       "flow_run_fixed_s": spread(times["empty flow"]),
                       "seconds_spread": {k: spread(v) for k, v in times.items()},
                       "ms_per_group": {k: spread(v) for k, v in ms.items()},
                       "overhead_ms_per_group": {k: spread(v) | {"values": v} for k, v in over.items()}})
    print(f"per-group Prefect overhead: executed {spread(over['executed'])['median']:.0f} ms, cached "
          f"{spread(over['cached'])['median']:.0f} ms (direct {spread(ms['direct'])['median']:.1f} ms/group); "
          f"a GPU slot per task would cost {spread(ms['slot/task'])['median']:.0f} ms each; every flow run costs "
          f"{spread(times['empty flow'])['median']:.2f} s fixed (Prefect's heartbeat thread, joined at the end)")


def _fmt(sp: dict, f: str) -> str:
    return f"{sp['median']:{f}} ({sp['min']:{f}}-{sp['max']:{f}})"


if __name__ == "__main__":
    main()

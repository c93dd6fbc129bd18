"""What the fingerprint costs the extraction, by vLLM's score mode, on the bench targets of
bench/extract_vs_prefill.py.

The fingerprint (contracts.py) is vLLM's top-2 next-token scores at every prompt token: the engine
computes full-vocabulary logits for every prompt token ([T, V]), then per request the scores (with
`logprobs_mode` raw_logprobs, vLLM's default: a log-softmax over [T, V] in fp32; with raw_logits: a
cast to fp32), the top-2 and the scored token's rank (one comparison pass over [T, V]). The verify
check uses the margin of the two scores, the same in both modes (engine.FINGERPRINT_ENGINE_KWARGS).

Per size and mode, one engine (plain prefill: no speculation, no connector, so nothing but the
fingerprint differs) prefills the same rows, per shard-sized call as the extract worker does, five ways
that alternate call by call in each of `--rounds` rounds (bench/fingerprint_child.py): plain; plain plus
lm_head over every scored prompt token, request by request as vLLM's prompt-logprobs path computes it
(the engine's own compute_logits, discarded: the floor of vLLM's fingerprint, measured); the same logits
in the lean path's row groups (the floor of the pipeline's); with prompt logprobs scored as the extract
engine scores them (prompt_scores.py's lean path); and scored by vLLM's own step. Prints per mode each
one's share of the time with it (1 - plain / with, per round: median with min-max), the fingerprint's
points above vLLM's floor and above its own (per round), the part of the latter spent inside the
engine's prompt-scores step (timed there: the scoring work itself, which the noise of whole calls on
shared cores hides; the rest is output bookkeeping and noise), vLLM's own step against its floor, and
the floor as multiply-adds estimate it (lm_head's ÷ the rest of the model's, per token).
Usage: .venv/bin/python bench/fingerprint_cost.py [--sizes small,large] [--rounds 6] [--rows 400] [--rows-large 96]
       [--modes raw_logprobs,raw_logits]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench_results import record, spread  # noqa: E402  (bench/ is sys.path[0])
from extract_vs_prefill import build_bench_target, lm_head_share  # noqa: E402

MODES = ("raw_logprobs", "raw_logits")
ARMS = ("lm_head", "lm_head_groups", "fingerprint", "fingerprint_vllm")  # timed against "plain" (fingerprint_child.py)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="small,large")
    ap.add_argument("--rows", type=int, default=400, help="rows of the small size")
    ap.add_argument("--rows-large", type=int, default=96, help="rows of the large size")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--modes", default=",".join(MODES), help="vLLM score modes to measure (raw_logits: the pipeline's)")
    ap.add_argument("--work", default=str(ROOT / ".cache" / "bench"))
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from eagle3_pipeline.core.config import ExtractConfig, PrepareConfig, SourceConfig, TargetConfig
    from eagle3_pipeline.core.proc import run_child
    from eagle3_pipeline.engine.build import FINGERPRINT_ENGINE_KWARGS, engine_env
    from eagle3_pipeline.engine.prompt_scores import RAW_MODES
    from eagle3_pipeline.prepare.stage import prepare

    work, tiny = Path(args.work), ROOT / ".cache" / "tiny-target"
    t = Table(title=f"fingerprint cost: share of prefill time, {args.rounds} alternating rounds, median (min-max)")
    for c in ("target", "vLLM scores", "tokens", "plain s", "lm_head share", "in groups", "fingerprint share",
              "above lm_head", "above in groups", "in the step", "vLLM's own step: share", "above lm_head",
              "in the step", "MAC estimate"):
        t.add_column(c, justify="right")
    out: dict = {"rounds": args.rounds, "pipeline_mode": FINGERPRINT_ENGINE_KWARGS["logprobs_mode"], "sizes": {}}
    for size in args.sizes.split(","):
        rows = args.rows if size == "small" else args.rows_large
        model = build_bench_target(work / ("bench-target" if size == "small" else f"bench-target-{size}"), tiny, size)
        prep = prepare(PrepareConfig(sources=[SourceConfig(path=str(tiny / "corpus" / "sharegpt.jsonl"), limit=rows // 2),
                                              SourceConfig(path=str(tiny / "corpus" / "openai.jsonl"), limit=rows - rows // 2)],
                                     heldout_rows=0), TargetConfig(model=str(model)), work / f"store-{size}", log=lambda m: None)
        cfg = ExtractConfig(rows_per_shard=max(1, prep.rows_out // 4), gpu_memory_utilization=0.2)
        floor = lm_head_share(model)
        out["sizes"][size] = {"lm_head_share": floor, "modes": {}}
        for mode in args.modes.split(","):
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump({"model": str(model), "tokenized": prep.tokenized, "rows": prep.rows_out,
                           "max_num_seqs": cfg.max_num_seqs, "rows_per_call": cfg.rows_per_shard,
                           "engine": cfg.engine().model_dump(), "rounds": args.rounds, "logprobs_mode": mode}, f)
            env = engine_env(cfg) | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the lm_head arm hooks this process's engine
            res = run_child([sys.executable, "-u", str(ROOT / "bench" / "fingerprint_child.py"), f.name],
                            name=f"bench-fingerprint-{mode}", timeout_s=3600, env=env)
            ev = next(e for e in res.events if e.get("kind") == "fingerprint_cost")
            s = ev["seconds"]
            share = {arm: [1 - p / w for p, w in zip(s["plain"], s[arm])] for arm in ARMS}
            # the lean fingerprint above its own floor (lm_head in groups) and vLLM's (request by request);
            # in a mode the lean path does not take (prompt_scores.RAW_MODES) the fingerprint arm is vLLM's step
            lean = ev["lean"] and mode in RAW_MODES
            floor_of = {"fingerprint": "lm_head_groups" if lean else "lm_head", "fingerprint_vllm": "lm_head"}
            above = {arm: [f - h for f, h in zip(share[arm], share["lm_head"])] for arm in ARMS[1:]}
            above["groups"] = [f - h for f, h in zip(share["fingerprint"], share["lm_head_groups"])]
            st = ev["in_step"]  # seconds inside the prompt-scores step: the arms' own work, little noise
            in_step = {arm: [(a - h) / w for a, h, w in zip(st[arm], st[floor_of[arm]], s[arm])] for arm in floor_of}
            sp, ab = {arm: spread(v) for arm, v in share.items()}, {arm: spread(v) for arm, v in above.items()}
            ins = {arm: spread(v) for arm, v in in_step.items()}
            out["sizes"][size]["modes"][mode] = {
                "tokens": ev["tokens"], "seconds": s, "lean_prompt_scores": lean,
                "share": sp["fingerprint"] | {"values": share["fingerprint"]},
                "share_vllm_own": sp["fingerprint_vllm"] | {"values": share["fingerprint_vllm"]},
                "lm_head_measured": sp["lm_head"] | {"values": share["lm_head"]},
                "lm_head_groups_measured": sp["lm_head_groups"] | {"values": share["lm_head_groups"]},
                "points_above_lm_head": ab["fingerprint"] | {"values": above["fingerprint"]},
                **({"points_above_lm_head_groups": ab["groups"] | {"values": above["groups"]}} if lean else {}),
                "points_above_lm_head_vllm_own": ab["fingerprint_vllm"] | {"values": above["fingerprint_vllm"]},
                "in_step_seconds": st,
                f"in_step_points_above_{floor_of['fingerprint']}": ins["fingerprint"] | {"values": in_step["fingerprint"]},
                "in_step_points_above_lm_head_vllm_own": ins["fingerprint_vllm"] | {"values": in_step["fingerprint_vllm"]}}
            pct = lambda d: f"{d['median']:.1%} ({d['min']:.1%}-{d['max']:.1%})"  # noqa: E731
            pts = lambda d: f"{d['median'] * 100:+.1f} ({d['min'] * 100:+.1f} to {d['max'] * 100:+.1f})"  # noqa: E731
            t.add_row(size, mode + (" (pipeline)" if mode == out["pipeline_mode"] else ""), f"{ev['tokens']:,}",
                      f"{spread(s['plain'])['median']:.2f}", pct(sp["lm_head"]), pct(sp["lm_head_groups"]),
                      pct(sp["fingerprint"]) + ("" if lean else " (vLLM's step)"), pts(ab["fingerprint"]),
                      pts(ab["groups"]) if lean else "-", pts(ins["fingerprint"]), pct(sp["fingerprint_vllm"]),
                      pts(ab["fingerprint_vllm"]), pts(ins["fingerprint_vllm"]), f"{floor:.1%}")
    Console().print(t)
    record("fingerprint", out)


if __name__ == "__main__":
    main()

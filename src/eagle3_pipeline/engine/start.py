"""vLLM's deterministic start-up refusals, told apart from accidents, and the memory an engine needs.

More: docs/internals.md, "engine/start.py".
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import psutil
from pydantic import BaseModel

from eagle3_pipeline.core.config import EngineConfig, TargetConfig
from eagle3_pipeline.core.errors import ConfigError, ExitCode
from eagle3_pipeline.core.gpus import GPU_MEMORY_GIB
from eagle3_pipeline.engine import build as builds
from eagle3_pipeline.records.families import kv_bytes_per_token, text_config

GIB = 2 ** 30
# vLLM CPU worker: what the engine process holds besides the KV cache is ~0.6 GiB of runtime (torch,
# vLLM; the tiny target: 0.64 GiB), the weights once more as loaded (mmap), and the warm-up's rows of
# fp32 logits (SmolLM2-135M, 4,096 rows: 1.63 GiB in all plain, 1.57 GiB as the extract engine; the
# estimate, 1.85 GiB, errs high)
CPU_RUNTIME_BYTES = int(0.6 * GIB)
CPU_DEFAULT_BATCHED_TOKENS = 4096


class EngineStartRefused(ConfigError):
    """vLLM refused to start with these settings; the message says which key to change."""


def _round_up(x: float, step: float = 0.05) -> float:
    return round(math.ceil(x / step - 1e-9) * step, 2)


def _round_down(x: float, step: float = 0.05) -> float:
    return round(math.floor(x / step + 1e-9) * step, 2)


def _machine_gib(node: int = 0) -> float:
    """The memory vLLM's CPU worker takes its gpu_memory_utilization of: the NUMA node's total (its
    first CPU's node; this machine: 16.3 of 23.4 GiB), else the machine's."""
    try:
        with open(f"/sys/devices/system/node/node{node}/meminfo") as f:
            for line in f:
                parts = line.split()
                if parts[2] == "MemTotal:":
                    return int(parts[3]) * 1024 / GIB
    except (OSError, IndexError, ValueError):
        pass

    return psutil.virtual_memory().total / GIB


_KV = re.compile(r"max seq len \((\d+)\), \(([\d.]+) GiB KV cache is needed, which is larger than the available KV "
                 r"cache memory \(([\d.]+) GiB\)\.(?: Based on the available memory, the estimated maximum model "
                 r"length is (\d+)\.)?")
_STARTUP = re.compile(r"Available memory on node \d+ \(([\d.]+)/([\d.]+) GiB\) on startup is less than desired CPU "
                      r"memory utilization \(([\d.]+), ([\d.]+) GiB\)")
_KV_ALLOC = re.compile(r"Available memory on node \d+ \(([\d.]+)/([\d.]+) GiB\) on kv cache allocation is less than "
                       r"requested memory for kv \((-?[\d.]+)/([\d.]+) GiB\)")
_MAX_LEN = re.compile(r"User-specified max_model_len \((\d+)\) is greater than the derived max_model_len "
                      r"\((\w+)=(\d+)")
_ARCH = re.compile(r"Model architectures (\[.*?\]) are not supported for now")
_HEAD = re.compile(r"Head dimension (\d+) is not supported by (\w+)")


class RunnerRefused(EngineStartRefused):
    """The engine runs a model runner our hooks are not on, or a hook never ran (engine/runner.py): the
    machine's vLLM, not the config; no retry can help."""
    exit_code = ExitCode.ENVIRONMENT


_HOOKS = re.compile(r"HooksNotLive: (.+)")


def start_refusal(text: str, stage: str, engine: EngineConfig, max_len_key: str) -> EngineStartRefused | None:
    """The refusal in an engine child's output `text`, or None. `stage` is the config section whose
    engine settings were used ("extract", "evaluate", ...); `max_len_key` the key that sets the
    engine's max_model_len (e.g. "prepare.max_length")."""
    if m := _HOOKS.search(text):
        return RunnerRefused(m.group(1))
    util_key = f"{stage}.gpu_memory_utilization"
    util = engine.gpu_memory_utilization
    if m := _KV.search(text):
        length, need, have = int(m.group(1)), float(m.group(2)), float(m.group(3))
        fits = m.group(4)
        total = _machine_gib() if _cpu() else None
        raise_to = (f"{util_key}: {_round_up(util + (need - have) / total + 0.01)} (now {util}, of {total:.1f} GiB)"
                    if total else f"{util_key} above {util} by at least {need - have:.2f} GiB of the device's memory")
        shorter = f", or {max_len_key} below {fits} (vLLM's estimate of what fits)" if fits else ""
        if _cpu() and os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # it overrides the utilization on CPU
            raise_to = (f"VLLM_CPU_KVCACHE_SPACE above {os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB (it sets the CPU "
                        f"KV cache instead of {util_key})")
        return EngineStartRefused(
            f"{stage}: vLLM refused to start: one sequence of {length} tokens needs {need} GiB of KV cache and "
            f"{have} GiB is left after the weights and the runtime. Set {raise_to}{shorter}")
    if m := _STARTUP.search(text):
        free, total = float(m.group(1)), float(m.group(2))
        return EngineStartRefused(
            f"{stage}: vLLM refused to start: {util_key} {util} reserves {m.group(4)} GiB of this machine's "
            f"{total} GiB, but only {free} GiB is free. Set {util_key}: {_round_down(free / total * 0.95)} or "
            f"less, or stop what else holds the memory")
    if m := _KV_ALLOC.search(text):
        for_kv, reserved = float(m.group(3)), float(m.group(4))
        if for_kv <= 0:
            total = _machine_gib()
            used = reserved - for_kv
            return EngineStartRefused(
                f"{stage}: vLLM refused to start: {util_key} {util} reserves {reserved} GiB, but the engine "
                f"process already uses {used:.2f} GiB (weights and runtime), leaving none for the KV cache. Set "
                f"{util_key}: {_round_up((used + 0.5) / total)} or more (of {total:.1f} GiB)")
        return EngineStartRefused(
            f"{stage}: vLLM refused to start: {for_kv} GiB of KV cache requested but not free on this machine. "
            f"Set {util_key} below {util}, or stop what else holds the memory")
    if "No available memory for the cache blocks" in text:
        return EngineStartRefused(f"{stage}: vLLM refused to start: nothing is left for the KV cache after the "
                                  f"weights and the runtime. Raise {util_key} (now {util})")
    if m := _MAX_LEN.search(text):
        return EngineStartRefused(
            f"{stage}: vLLM refused to start: max_model_len {m.group(1)} is beyond the model's {m.group(2)}="
            f"{m.group(3)}. Set {max_len_key} so that the engine's length stays within {m.group(3)}")
    if m := _ARCH.search(text):
        return EngineStartRefused(f"{stage}: vLLM refused to start: the installed vLLM has no model class for the "
                                  f"architectures {m.group(1)} of target.model")
    if m := _HEAD.search(text):
        return EngineStartRefused(f"{stage}: vLLM refused to start: head dimension {m.group(1)} is not supported by "
                                  f"{m.group(2)} on this build (target.model's attention shape)")
    if re.search(r"OutOfMemoryError|CUDA out of memory", text) and re.search(r"load_weights|load_model", text):
        return EngineStartRefused(
            f"{stage}: the weights do not fit the device while loading: raise {stage}.tensor_parallel_size "
            f"(now {engine.tensor_parallel_size}) or use a quantized checkpoint")
    return None


def refusal_of(err: Exception, log_path: Path | None, stage: str, engine: EngineConfig,
               max_len_key: str) -> EngineStartRefused | None:
    """`start_refusal` over a failed child's message and its whole log (with several engine processes
    the root cause may lie far above the last lines), chained to `err`."""
    text = str(err)
    if log_path is not None and Path(log_path).is_file():
        with open(log_path, errors="replace") as f:
            f.seek(max(0, Path(log_path).stat().st_size - (4 << 20)))
            text = f.read() + "\n" + text
    refused = start_refusal(text, stage, engine, max_len_key)
    if refused is not None:
        refused.__cause__ = err
    return refused


def _cpu() -> bool:
    return builds.vllm_is_cpu_build()


# ---------------------------------------------------------------- preflight's memory estimate

_DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "half": 2, "fp16": 2}


class MemoryPlan(BaseModel):
    """Bytes one engine rank needs and has; `fits` False means vLLM would refuse to start."""
    stage: str
    device: str                 # "cpu" or "gpu"
    device_bytes: int | None    # the machine's memory (CPU) or the accelerator's (None: unknown here)
    reserved_bytes: int | None  # gpu_memory_utilization x device_bytes
    weights_bytes: int          # per rank
    runtime_bytes: int          # per rank, besides weights and KV (estimate)
    kv_bytes: int               # one max_model_len sequence's KV cache + the capture's cache, per rank
    max_model_len: int
    fits: bool | None           # None: device memory unknown
    min_utilization: float | None  # the smallest gpu_memory_utilization that fits (rounded up to 0.05)


def _text_config(model_dir: Path) -> dict:
    return text_config(json.loads((model_dir / "config.json").read_text()))


def _weights_bytes(model_dir: Path) -> int:
    files = list(model_dir.glob("*.safetensors")) or list(model_dir.glob("*.bin"))
    return sum(f.stat().st_size for f in files)


def memory_plan(stage: str, engine: EngineConfig, target: TargetConfig, *, max_model_len: int,
                captured_layers: int = 0) -> MemoryPlan | None:
    """The estimate for a local model directory (None for a hub name: no files to size here). `engine`
    is the stage's config: its max_num_batched_tokens, where it has one, sizes the CPU engine's warm-up
    (rows of fp32 logits)."""
    model_dir = Path(target.model)
    if not (model_dir / "config.json").is_file():
        return None
    c = _text_config(model_dir)
    dtype = target.dtype if target.dtype not in (None, "auto") else str(c.get("torch_dtype") or c.get("dtype") or "bfloat16")
    nbytes = _DTYPE_BYTES.get(dtype.replace("torch.", ""), 2)
    tp = engine.tensor_parallel_size
    weights = _weights_bytes(model_dir) // tp
    hidden = int(c.get("hidden_size", 0))
    per_token = kv_bytes_per_token(c, nbytes, tp) + captured_layers * hidden * nbytes
    kv = per_token * max_model_len
    cpu = _cpu()
    if cpu:
        device = int(_machine_gib() * GIB)
        rows = getattr(engine, "max_num_batched_tokens", None) or max(CPU_DEFAULT_BATCHED_TOKENS, max_model_len)
        runtime = CPU_RUNTIME_BYTES + weights + rows * int(c.get("vocab_size", 0)) * 4
    else:
        device, runtime = gpu_bytes(engine), int(2 * GIB)  # activations and CUDA graphs: vLLM profiles them; a floor
    reserved = int(engine.gpu_memory_utilization * device) if device else None
    need = weights + runtime + kv
    fits = None if reserved is None else reserved >= need
    min_util = _round_up(need * 1.1 / device) if device else None
    return MemoryPlan(stage=stage, device="cpu" if cpu else "gpu", device_bytes=device, reserved_bytes=reserved,
                      weights_bytes=weights, runtime_bytes=runtime, kv_bytes=kv, max_model_len=max_model_len,
                      fits=fits, min_utilization=min_util)


# The GPU types named in what fits where the configured GPUs do not (core/gpus.py holds their memory).
GPU_TYPES = {name: GPU_MEMORY_GIB[name] for name in ("A100-80GB", "H100", "H200", "B200", "GB200", "MI300X")}


def gpu_bytes(engine: EngineConfig) -> int | None:
    """One GPU's memory for `engine`: its `gpu_memory_gib`, else the smallest GPU nvidia-smi lists here, else None."""
    if engine.gpu_memory_gib:
        return int(engine.gpu_memory_gib * GIB)

    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        mib = [int(x) for x in out.split() if x.strip().isdigit()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return min(mib) * 2 ** 20 if mib else None


def what_fits(plan: MemoryPlan, engine: EngineConfig) -> str:
    """Where a plan that does not fit one GPU would: the GPU types that hold it at this tensor parallel size,
    and the tensor parallel size this GPU would need (over more than one node past 8)."""
    need = plan.weights_bytes + plan.runtime_bytes + plan.kv_bytes  # per rank at this TP
    util = engine.gpu_memory_utilization
    types = [f"{engine.tensor_parallel_size} x {name} ({gib} GiB)" for name, gib in GPU_TYPES.items()
             if util * gib * GIB >= need]
    total, tp = plan.weights_bytes * engine.tensor_parallel_size, engine.tensor_parallel_size  # the whole model
    while tp < 64 and total / tp + plan.runtime_bytes + plan.kv_bytes > util * (plan.device_bytes or 0):
        tp *= 2
    more = (f"tensor_parallel_size {tp} on these GPUs"
            + (" (more than one node: docs/decisions/multi-node-engine.md)" if tp > 8 else ""))
    return (", ".join(types) + " or " if types else "") + more


def describe(plan: MemoryPlan) -> str:
    g = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    have = (f"reserves {g(plan.reserved_bytes)} of {g(plan.device_bytes)}" if plan.reserved_bytes is not None
            else "device memory unknown here")
    return (f"{plan.stage}: weights {g(plan.weights_bytes)} + runtime ~{g(plan.runtime_bytes)} + KV for one "
            f"{plan.max_model_len}-token sequence {g(plan.kv_bytes)} per rank; {have}")

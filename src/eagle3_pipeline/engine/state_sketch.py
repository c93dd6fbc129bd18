"""State sketches: every captured state of every token, projected on a few fixed directions by the extract
engine from the states its model computed, before they enter the hidden-states KV cache and the connector.

More: docs/internals.md, "engine/state_sketch.py".
"""

from __future__ import annotations

import inspect
import logging
import os
from functools import lru_cache

import numpy as np

from eagle3_pipeline.engine import runner as engine_runner
from eagle3_pipeline.engine.surface import V1, V2
from eagle3_pipeline.records.contracts import dequantise, save_safetensors, to_record

ENV = "EAGLE3_STATE_SKETCH_DIR"  # set: the engine's processes write sketches into this directory
STORAGE_ENV = "EAGLE3_STATE_SKETCH_STORAGE"  # the records' storage dtype (bf16, fp8): how the states are rounded
KEY = "state_sketch"              # the fingerprint sidecar's key: fp32 [T, L, DIM]
DIM = 4                           # directions per state
SEED = 20261204                   # of the directions (numpy's PCG64: the same stream on every platform)
TOLERANCE = 2.0 ** -12            # largest |stored projection - engine projection| ÷ the state's norm
CHUNK_BYTES = 64 << 20            # the engine rounds and projects a step's states this many fp32 bytes at a time
_STATE = {"installed": False}


@lru_cache(maxsize=8)
def directions(hidden_size: int) -> np.ndarray:
    """float32 [H, DIM]: DIM unit vectors of R^H, the same for every process and platform."""
    g = np.random.Generator(np.random.PCG64(SEED + int(hidden_size)))
    d = g.standard_normal((DIM, int(hidden_size)))  # float64
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    return np.ascontiguousarray(d.T.astype(np.float32))


def stored(states, storage_dtype: str):
    """fp32 [n, L, H]: `states` [n, L, H] (any float dtype, any device) as the record stores and verify reads
    them: bf16 widened, or fp8 e4m3 times its per-token scale (contracts.to_record, contracts.dequantise)."""
    import torch


    rec = to_record(states, torch.zeros(states.shape[0], dtype=torch.int64, device=states.device), storage_dtype)
    return dequantise(rec)


def project(values, hidden_size: int):
    """fp32 [n, L, DIM]: `values` fp32 [n, L, H] on the directions (same device)."""
    import torch

    d = torch.from_numpy(directions(hidden_size)).to(values.device)
    return torch.matmul(values, d)


def deviation(got, expected, norms):
    """[n, L]: |got - expected| over the DIM projections ÷ the state's norm (inf where it is not finite or the
    expected sketch is missing; 0 for an all-zero state projected to zeros)."""
    import torch

    diff = torch.linalg.vector_norm(got - expected, dim=-1)
    out = diff / norms.clamp_min(torch.finfo(torch.float32).tiny)
    out[(diff == 0)] = 0.0
    return torch.nan_to_num(out, nan=float("inf"), posinf=float("inf"))


def file_name(req) -> str:
    """The name of the sketch file of a runner's request (vLLM's CachedRequestState): the name of the file the
    connector is asked to write (kv_transfer_params.hidden_states_path), else its default `<req id>.safetensors`."""
    sp = getattr(req, "sampling_params", None)
    params = ((getattr(sp, "extra_args", None) or {}).get("kv_transfer_params") or {}) if sp is not None else {}
    path = params.get("hidden_states_path")
    return os.path.basename(path) if path else f"{req.req_id}.safetensors"


def missing(kind: str | None = None) -> list[str]:
    """What the installed vLLM lacks of what the hook of runner `kind` reads (default: the engine's; empty: it
    can run)."""

    try:
        if (kind or engine_runner.expected()) == V1:
            from vllm.v1.worker.gpu_model_runner import GPUModelRunner as Hooked
            method, wants = "propose_draft_token_ids", ("aux_hidden_states",)
        else:
            from vllm.v1.worker.gpu.spec_decode.extract_hidden_states import ExtractHiddenStatesSpeculator as Hooked
            method, wants = "propose", ("input_batch", "aux_hidden_states")
    except ImportError as e:
        return [f"import: {e}"]
    own = getattr(Hooked, method, None)
    if not callable(own):
        return [f"{Hooked.__name__}.{method}"]
    params = inspect.signature(own).parameters
    return [f"{Hooked.__name__}.{method}({w}=...)" for w in wants if w not in params]


def install() -> bool:
    """Put the adapter of the engine's runner in place in this process when asked (EAGLE3_STATE_SKETCH_DIR set)
    and possible; idempotent. Returns whether the hook is in place. A vLLM general plugin (pyproject)."""
    out_dir = os.environ.get(ENV)
    if not out_dir:
        return False
    if _STATE["installed"]:
        return True

    kind = engine_runner.expected()
    lacks = missing(kind)
    if lacks:

        logging.getLogger("eagle3_pipeline").warning("state sketches: not written (this vLLM lacks %s)", ", ".join(lacks))
        return False
    _ADAPTERS[kind](out_dir)
    _STATE["installed"] = True
    print(f"eagle3 state_sketch: sketches of the captured states in place ({kind} runner, pid {os.getpid()}, into "
          f"{out_dir})", flush=True)
    return True


def _install_v1(out_dir: str) -> None:
    """Wrap V1's `GPUModelRunner.propose_draft_token_ids`: the step's states before the drafter caches them."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner


    own = GPUModelRunner.propose_draft_token_ids
    sig = inspect.signature(own)

    def propose_draft_token_ids(self, *args, **kwargs):
        engine_runner.mark_live("state_sketch", self)
        got = sig.bind(self, *args, **kwargs).arguments
        aux = got.get("aux_hidden_states")
        if aux is not None:
            _sketch_step(self, got["scheduler_output"], aux, out_dir)
        return own(self, *args, **kwargs)

    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids


_NEW: dict[str, tuple[str, int]] = {}  # V2: req id -> (sketch file name, prompt length), from add_requests


def _install_v2(out_dir: str) -> None:
    """Wrap V2's `GPUModelRunner.add_requests` (each new request's file name and prompt length: V2's request
    state keeps no sampling parameters) and `ExtractHiddenStatesSpeculator.propose` (the step's states before it
    writes them into the capture's KV cache)."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.spec_decode.extract_hidden_states import ExtractHiddenStatesSpeculator


    own_add = GPUModelRunner.add_requests

    def add_requests(self, scheduler_output):
        for new in scheduler_output.scheduled_new_reqs:
            if new.prompt_token_ids is not None:
                _NEW[new.req_id] = (file_name(new), len(new.prompt_token_ids))
        return own_add(self, scheduler_output)

    own = ExtractHiddenStatesSpeculator.propose
    sig = inspect.signature(own)

    def propose(self, *args, **kwargs):
        engine_runner.mark_live("state_sketch", self)
        got = sig.bind(self, *args, **kwargs).arguments
        aux = got.get("aux_hidden_states")
        if aux is not None and not got.get("dummy_run") and not got.get("skip_attn_for_dummy_run"):
            _sketch_step_v2(self, got["input_batch"], aux, out_dir)
        return own(self, *args, **kwargs)

    GPUModelRunner.add_requests = add_requests
    ExtractHiddenStatesSpeculator.propose = propose


def _rank_zero() -> bool:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() == 0
    except Exception:  # noqa: BLE001 - no distributed state (a single process): it is rank 0
        return True


def _sketch_step(runner, scheduler_output, aux: list, out_dir: str) -> None:
    """V1: this step's sketches of every request whose prompt is being computed, kept on the runner until the
    prompt is complete, then written."""
    if not _rank_zero():
        return
    plan = []  # (req id, file name, first position, rows, prompt length, first row in the step)
    for req_id, n in scheduler_output.num_scheduled_tokens.items():
        req = runner.requests.get(req_id)
        if req is None or req.prompt_token_ids is None:
            continue
        first, T = req.num_computed_tokens, len(req.prompt_token_ids)
        m = min(int(n), T - first)
        if m <= 0:
            continue
        at = int(runner.query_start_loc.np[runner.input_batch.req_id_to_index[req_id]])
        plan.append((req_id, file_name(req), first, m, T, at))
    kv = getattr(getattr(runner, "cache_config", None), "cache_dtype", "auto")  # the hidden-states cache's rounding
    _sketch_rows(runner.__dict__.setdefault("_eagle3_sketches", {}), plan, aux, kv, out_dir)


def _sketch_step_v2(speculator, input_batch, aux: list, out_dir: str) -> None:
    """V2: as `_sketch_step`, the rows from the step's InputBatch (batch order), the names from add_requests."""
    if not _rank_zero():
        return
    plan = []
    for i, req_id in enumerate(input_batch.req_ids):
        if (new := _NEW.get(req_id)) is None:
            continue
        name, T = new
        first = int(input_batch.num_computed_tokens_np[i])
        m = min(int(input_batch.num_scheduled_tokens[i]), T - first)
        if m > 0:
            plan.append((req_id, name, first, m, T, int(input_batch.query_start_loc_np[i])))
    config = getattr(getattr(speculator, "vllm_config", None), "cache_config", None)
    keep = speculator.__dict__.setdefault("_eagle3_sketches", {})
    for req_id in _sketch_rows(keep, plan, aux, getattr(config, "cache_dtype", "auto"), out_dir):
        _NEW.pop(req_id, None)


def _sketch_rows(keep: dict, plan: list, aux: list, kv: str, out_dir: str) -> list[str]:
    """The sketches of `plan`'s rows of `aux` (one [n, H] tensor per captured layer), rounded as a KV cache of
    dtype `kv` and as the record stores them, into `keep` (req id -> fp32 numpy [T, L, DIM]); a request whose
    prompt is complete is written and dropped. Returns the requests written."""
    import torch

    if not plan:
        return []
    storage = os.environ.get(STORAGE_ENV, "bf16")
    idx = torch.cat([torch.arange(at, at + m) for _, _, _, m, _, at in plan]).to(aux[0].device)
    L, H = len(aux), aux[0].shape[-1]
    cast = getattr(torch, kv) if kv in ("bfloat16", "float16") else None
    step = max(1, CHUNK_BYTES // (L * H * 4))  # fp32 copies of at most CHUNK_BYTES at a time (GPU memory)
    sk = []
    for a in range(0, len(idx), step):
        x = torch.stack([h[idx[a:a + step]] for h in aux], dim=1)  # [n, L, H]
        sk.append(project(stored(x if cast is None else x.to(cast), storage), H).cpu().numpy())
    sk = np.concatenate(sk)  # [N, L, DIM]
    o, written = 0, []
    for req_id, name, first, m, T, _ in plan:
        buf = keep.get(req_id)
        if buf is None or buf.shape[0] != T:
            buf = keep[req_id] = np.full((T, sk.shape[1], DIM), np.nan, dtype=np.float32)
        buf[first:first + m] = sk[o:o + m]
        o += m
        if first + m >= T:
            _write(os.path.join(out_dir, name), keep.pop(req_id))
            written.append(req_id)
    return written


_ADAPTERS = {V1: _install_v1, V2: _install_v2}  # runner kind -> its adapter


def _write(path: str, sketch: np.ndarray) -> None:
    import torch


    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    save_safetensors(tmp, {KEY: torch.from_numpy(np.ascontiguousarray(sketch))})
    os.replace(tmp, path)


def read(path: str):
    """The sketch file at `path` as fp32 [T, L, DIM], or None when it is missing."""
    from safetensors.torch import load_file

    if not os.path.exists(path):
        return None
    return load_file(path)[KEY]

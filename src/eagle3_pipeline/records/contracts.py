"""Data contracts written once: layer ids, model dims, and the hidden-state record format.

More: docs/internals.md, "records/contracts.py".
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict

from eagle3_pipeline.core.config import TargetConfig, hub_token
from eagle3_pipeline.core.digest import row_hash as row_hash  # the record format's name for it
from eagle3_pipeline.core.errors import InputError
from eagle3_pipeline.core.store import atomic_write
from eagle3_pipeline.records.families import (
    head_dim,
    is_latent_attention,
    is_moe,
    logit_transform,
    read_text_config,
    text_config,
    unmodelled_output,
)

HS_KEY, TOKENS_KEY, SCALES_KEY = "hidden_states", "token_ids", "hidden_states_scales"
STORAGE_DTYPES = {"bf16": "BF16", "fp8": "F8_E4M3"}  # safetensors dtype names
FP8_MAX = 448.0
FP_IDS_KEY, FP_LOGPROBS_KEY = "top_ids", "top_logprobs"  # the fingerprint sidecar of a record
FP_TOP = 2  # next-token candidates kept per position
RECORD_META_KEY = "eagle3_record"  # safetensors metadata: {"layer_ids": [...], "storage_dtype": ...}


class ContractError(InputError):
    """A record or a layer list that breaks the contract; the message names file, sample, layer, shapes."""


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's choice `[2, N//2, N-3]` (low, middle, high) where those are distinct and in range
    (N >= 7; Kimi-K2.5's 61 layers give [2, 30, 58]); on shallower models three (or as many as there
    are) distinct ids spread evenly over [1, N-1] (N=6 gives [1, 3, 5], N=4 [1, 2, 3], N=2 [1])."""
    eagle = [2, num_layers // 2, num_layers - 3]
    if all(0 <= a < b < num_layers for a, b in zip(eagle, eagle[1:])):
        return eagle
    lo, hi = (1, num_layers - 1) if num_layers >= 2 else (0, 0)
    count = min(3, hi - lo + 1)
    return sorted({lo + (hi - lo) * i // max(1, count - 1) for i in range(count)})


def resolve_layer_ids(num_layers: int, aux_layer_ids: list[int] | None) -> list[int]:
    """All captured layer ids: the aux ids (default `[2, N//2, N-3]`) then the final layer N.
    Raises ContractError for ids out of range, duplicated or not ascending."""
    aux = list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(num_layers)
    if not aux:
        raise ContractError("layer ids: at least one auxiliary layer id is required")
    bad = [k for k in aux if not 0 <= k < num_layers]
    if bad:
        raise ContractError(f"layer ids {aux}: {bad} out of range [0, {num_layers - 1}] for a {num_layers}-layer model")
    if len(set(aux)) != len(aux):
        raise ContractError(f"layer ids {aux}: duplicates (a {num_layers}-layer model needs distinct ids)")
    if aux != sorted(aux):
        raise ContractError(f"layer ids {aux}: must be ascending")
    return aux + [num_layers]


FP8_FROM_HIDDEN = 4096  # extract.storage_dtype auto: fp8 records for targets at least this wide


def storage_dtype_for(setting: str, hidden_size: int) -> tuple[str, str]:
    """(the records' storage dtype, why) for extract.storage_dtype `setting` and the target's hidden size: an explicit
    bf16 or fp8 wins; `auto` is fp8 from FP8_FROM_HIDDEN up (half the bytes; FP8 states cost <= 0.02 τ at k=3 on
    Qwen3-8B, speculators#491), bf16 below (small targets: bytes are cheap, bf16 is exact)."""
    if setting in STORAGE_DTYPES:
        return setting, f"extract.storage_dtype {setting} (set in the config)"
    if setting != "auto":
        raise ContractError(f"extract.storage_dtype {setting!r}: expected 'auto', 'bf16' or 'fp8'")
    if hidden_size >= FP8_FROM_HIDDEN:
        return "fp8", (f"extract.storage_dtype auto: fp8, the default for targets with hidden size >= {FP8_FROM_HIDDEN} "
                       f"(this one: {hidden_size}): half the bytes of bf16")
    return "bf16", (f"extract.storage_dtype auto: bf16, the default for targets with hidden size < {FP8_FROM_HIDDEN} "
                    f"(this one: {hidden_size})")


@dataclass(frozen=True)
class RecordSpec:
    """What one record must look like, as a function of model dims and storage."""
    num_layers_captured: int  # L
    hidden_size: int          # H
    storage_dtype: str = "bf16"

    def shape(self, num_tokens: int) -> tuple[int, int, int]:
        return (num_tokens, self.num_layers_captured, self.hidden_size)  # [T, L, H]

    @property
    def st_dtype(self) -> str:
        return STORAGE_DTYPES[self.storage_dtype]


class ModelDims(BaseModel):
    """The target's language-model dims (the `text_config` of a multimodal wrapper such as Kimi-K2.5)."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    num_layers: int   # N decoder layers
    hidden_size: int  # H
    vocab_size: int   # V
    head_dim: int     # the attention kernel's head size (MLA: kv_lora_rank + qk_rope_head_dim)
    model_type: str
    architectures: list[str] = []
    mla: bool = False          # multi-head latent attention (DeepSeek-V2/V3, Kimi-K2)
    moe: bool = False          # routed experts
    norm_eps: float = 1e-6     # the final RMSNorm's epsilon


def model_dims(target) -> ModelDims:
    """Dims of `target` (a TargetConfig, or a model directory) from its config.json; hub names go
    through AutoConfig. Never loads weights."""
    if isinstance(target, (str, Path)):

        target = TargetConfig(model=str(target))
    local = Path(target.model) / "config.json"
    if local.is_file():
        try:
            cfg = json.loads(local.read_text())
        except json.JSONDecodeError as e:
            raise ContractError(f"{local}: not valid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise ContractError(f"{local}: expected a JSON object, found {type(cfg).__name__}")
    elif Path(target.model).is_dir():
        found = sorted(p.name for p in Path(target.model).iterdir())[:10]
        raise ContractError(f"model directory {target.model}: no config.json (found {found})")
    else:
        from transformers import AutoConfig  # lazy: hub names only


        cfg = AutoConfig.from_pretrained(target.model, revision=target.revision,
                                         trust_remote_code=target.trust_remote_code, token=hub_token(target)).to_dict()
    text = text_config(cfg)
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if k not in text]
    if missing:
        raise ContractError(f"{target.model}: model config has no {missing}; cannot place layer ids")
    return ModelDims(num_layers=int(text["num_hidden_layers"]), hidden_size=int(text["hidden_size"]),
                     vocab_size=int(text["vocab_size"]), head_dim=head_dim(text),
                     model_type=str(text.get("model_type", "?")),
                     architectures=list(cfg.get("architectures") or text.get("architectures") or []),
                     mla=is_latent_attention(text), moe=is_moe(text),
                     norm_eps=float(text.get("rms_norm_eps") or text.get("layer_norm_epsilon") or 1e-6))


# ---------------------------------------------------------------- the record: name, write, read, compare

def record_name(row: int) -> str:
    """The file name of row `row`'s record (speculators' offline layout: row index = file index)."""
    return f"hs_{row}.safetensors"


def to_record(hidden_states, token_ids, storage_dtype: str) -> dict:
    """Our record from vLLM's tensors: `hidden_states` [T, L, H] (any float dtype), `token_ids` [T].
    bf16: hidden_states bf16[T, L, H]. fp8: float8_e4m3fn[T, L, H] + hidden_states_scales fp32[T, 1, 1]
    with scale = per-token absmax / 448 (`dequantise` multiplies it back)."""
    import torch

    rec = {TOKENS_KEY: token_ids.to(torch.int64).contiguous()}  # [T]
    if storage_dtype == "bf16":
        rec[HS_KEY] = hidden_states.to(torch.bfloat16).contiguous()  # [T, L, H]
    elif storage_dtype == "fp8":
        x = hidden_states.float()  # [T, L, H]
        absmax = x.abs().amax(dim=(1, 2), keepdim=True)  # [T, 1, 1]
        scales = (absmax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # [T, 1, 1]
        rec[HS_KEY] = (x / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).contiguous()  # [T, L, H]
        rec[SCALES_KEY] = scales.contiguous()
    else:
        raise ContractError(f"storage dtype {storage_dtype!r}: expected 'bf16' or 'fp8'")
    return rec


_ST_CODES = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4), "float64": ("F64", 8),
             "float8_e4m3fn": ("F8_E4M3", 1), "int64": ("I64", 8), "int32": ("I32", 4), "uint8": ("U8", 1)}


def save_safetensors(path: str | Path, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (contiguous CPU tensors) as a safetensors file, byte for byte what
    `safetensors.torch.save_file` writes (tensors ordered by dtype size, largest first, then name;
    compact JSON header padded with spaces to 8 bytes), with one `writev` straight from the tensors'
    memory: the library first serialises the whole file into a buffer of its own, which in the
    engine's step (the connector) cost 2-4x the write itself."""
    import torch

    order = sorted(tensors.items(), key=lambda kv: (-_ST_CODES[str(kv[1].dtype).split(".")[-1]][1], kv[0]))
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    views, off = [], 0
    for name, t in order:
        if not t.is_contiguous():
            raise ValueError(f"tensor {name!r} is not contiguous")
        code, size = _ST_CODES[str(t.dtype).split(".")[-1]]
        n = t.numel() * size
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [off, off + n]}
        views.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()) if n else memoryview(b""))
        off += n
    blob = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    blob += b" " * (-len(blob) % 8)
    bufs = [memoryview(len(blob).to_bytes(8, "little")), memoryview(blob), *views]
    fd = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while bufs:
            n = os.writev(fd, bufs[:1024])
            while bufs and n >= len(bufs[0]):
                n -= len(bufs[0])
                bufs.pop(0)
            if bufs and n:
                bufs[0] = bufs[0][n:]
    finally:
        os.close(fd)


def record_metadata(layer_ids: list[int], storage_dtype: str) -> dict[str, str]:
    """The safetensors metadata of a record. One key only: safetensors orders several keys at random
    (a Rust HashMap), and a record's bytes must not depend on the process that wrote it."""
    return {RECORD_META_KEY: json.dumps({"layer_ids": list(layer_ids), "storage_dtype": storage_dtype}, sort_keys=True)}


def write_record(path: Path, record: dict, layer_ids: list[int], storage_dtype: str, tag: str = "0",
                 durable: bool = True) -> Path:
    """Write a `to_record` dict atomically (store.atomic_write; `durable=False`: written to the returned
    temporary name, the caller fsyncs and renames it with store.durable_replace)."""
    meta = record_metadata(layer_ids, storage_dtype)
    return atomic_write(Path(path), lambda p: save_safetensors(p, record, meta), tag=tag, durable=durable)


def record_file_problem(path: str | Path, token_ids, layer_ids: list[int], hidden_size: int,
                        storage_dtype: str) -> str | None:
    """None when the file at `path` is already a record of `token_ids` ([T] ints) as `write_record`
    writes it: our metadata for these layer ids and storage dtype, exactly the record's keys, token
    ids equal, hidden states [T, L, H] of the storage dtype (fp8: scales fp32 [T, 1, 1]), the data
    section exactly its tensors; else what differs. Reads the header and the token ids only (two
    preads: no memory map, whose unmapping interrupts every other thread of the process), not the
    hidden states."""
    T, L = len(token_ids), len(layer_ids)
    fd = os.open(str(path), os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 4096, 0)
        if len(head) < 8:
            return f"{size} bytes: no safetensors header"
        n = int.from_bytes(head[:8], "little")
        if 8 + n > size:
            return f"header of {n} bytes does not fit in {size} bytes"
        raw = head[8:8 + n] if 8 + n <= len(head) else os.pread(fd, n, 8)
        try:
            header = json.loads(raw)
        except ValueError as e:
            return f"header is not JSON ({e})"
        if not isinstance(header, dict):
            return "header is not a JSON object"
        meta = header.pop("__metadata__", None)
        if meta != record_metadata(layer_ids, storage_dtype):
            return f"metadata {meta!r} is not a record's"
        want = {TOKENS_KEY: ("I64", [T]), HS_KEY: (STORAGE_DTYPES[storage_dtype], [T, L, hidden_size])}
        if storage_dtype == "fp8":
            want[SCALES_KEY] = ("F32", [T, 1, 1])
        if set(header) != set(want):
            return f"keys {sorted(header)}, a record has {sorted(want)}"
        itemsize = {"I64": 8, "F32": 4, "BF16": 2, "F8_E4M3": 1}
        end = 0
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            code, shape = want[name]
            a, b = info["data_offsets"]
            if info["dtype"] != code or list(info["shape"]) != shape or a != end or \
                    b - a != itemsize[code] * int(np.prod(shape)):
                return f"{name} {info['dtype']} {info['shape']} at {info['data_offsets']}, expected {code} {shape}"
            end = b
        if 8 + n + end != size:
            return f"{size} bytes, the header describes {8 + n + end}"
        a, b = header[TOKENS_KEY]["data_offsets"]
        tok = np.frombuffer(os.pread(fd, b - a, 8 + n + a), dtype="<i8")
    finally:
        os.close(fd)
    if len(tok) != T or not np.array_equal(tok, np.asarray(token_ids, dtype=np.int64)):
        return f"token_ids [{len(tok)}] differ from the row's [{T}]"
    return None


def read_record(path: Path) -> dict:
    """The tensors of a record file (safetensors only: no pickle is ever read)."""
    from safetensors.torch import load_file

    return load_file(str(path), device="cpu")


def dequantise(record: dict):
    """fp32 hidden states [T, L, H] of a record: bf16 widened; fp8 times its per-token scales."""
    x = record[HS_KEY].float()  # [T, L, H]
    return x * record[SCALES_KEY].float() if SCALES_KEY in record else x


class LayerDiff(BaseModel):
    """One layer of a record against a reference of the same tokens."""
    layer_id: int
    rel_err: float         # ||got - ref|| / ||ref|| over all tokens
    min_cosine: float      # worst token
    mean_cosine: float
    frac_below: float      # fraction of tokens whose cosine is below `cos_bound`
    first_below: int | None  # first such token


def compare_layers(got, ref, layer_ids: list[int], cos_bound: float) -> list[LayerDiff]:
    """Per-layer comparison of fp32 [T, L, H] tensors of the same shape (checked by the caller)."""
    import torch

    out = []
    for li, lid in enumerate(layer_ids):
        g, r = got[:, li].float(), ref[:, li].float()  # [T, H]
        cos = torch.nn.functional.cosine_similarity(g, r, dim=-1)  # [T]
        below = (cos < cos_bound).nonzero()
        out.append(LayerDiff(layer_id=lid, rel_err=float((g - r).norm() / r.norm().clamp_min(1e-12)),
                             min_cosine=float(cos.min()), mean_cosine=float(cos.mean()),
                             frac_below=float((cos < cos_bound).float().mean()),
                             first_below=int(below[0, 0]) if len(below) else None))
    return out


# ---------------------------------------------------------------- the fingerprint sidecar of a record
# `fingerprints/fp_{i}.safetensors`, written in the same extraction pass from vLLM's own logits:
#   top_ids       int64[T, 2]   the target's two most likely next tokens after position t
#   top_logprobs  fp32[T, 2]    their scores: raw logits (engine.FINGERPRINT_ENGINE_KWARGS; sidecars of
#                               earlier extractions hold log-probabilities: the check is the same)
# (t < T-1 from vLLM's prompt logprobs of position t+1; t = T-1 from the one generated token's).
# Verify recomputes the logit margin top1 - top2 from the stored final-layer state with the final
# norm and the two lm_head rows alone (a log-softmax normaliser would cancel): every row, every token.

# ---------------------------------------------------------------- batch invariance (extract's engine, online training)

MAX_SHIFT = 4  # shifts tried when explaining a mismatch


def invariance_rows(seq_lens: list[int], count: int, avoid: set[int] = frozenset()) -> list[int]:
    """Indices into `seq_lens` worth re-extracting alone: the longest, then indices spread evenly,
    each moved off the positions in `avoid` (the first request of each batch)."""
    n = len(seq_lens)
    if n == 0 or count <= 0:
        return []
    cands = [i for i in range(n) if i not in avoid] or list(range(n))
    picks = [max(cands, key=seq_lens.__getitem__)]
    step = max(1, n // count)
    for i in range(step // 2, n, step):
        j = i + 1 if i in avoid and i + 1 < n else i
        if j not in picks and j not in avoid:
            picks.append(j)
    for j in cands:
        if len(picks) >= count:
            break
        if j not in picks:
            picks.append(j)
    return sorted(picks[:count])


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def shift_explaining(stored, alone, rel_err: float) -> int | None:
    """The token shift s (|s| <= MAX_SHIFT) for which stored[t] == alone[t+s] explains a mismatch
    (stored, alone: fp32 [T, H] of one layer), or None."""
    T = stored.shape[0]
    for s in sorted(range(-MAX_SHIFT, MAX_SHIFT + 1), key=abs):
        if s == 0 or T - abs(s) < 2:
            continue
        a, b = (stored[:T - s], alone[s:]) if s > 0 else (stored[-s:], alone[:T + s])
        if _rel(a, b) <= min(0.05, rel_err / 4):
            return s
    return None


def invariance_entry(stored, alone, layer_ids: list[int]) -> dict:
    """One row's batch-invariance numbers, as the verify gate judges them (verify/invariance.py): the
    per-layer differences of the stored record and the same row prefilled alone (fp32 [T, L, H]), and
    for a layer that differs, the token shift that explains it."""
    diffs = compare_layers(stored, alone, layer_ids, cos_bound=0.9)
    shifts = {d.layer_id: shift_explaining(stored[:, li], alone[:, li], d.rel_err)
              for li, d in enumerate(diffs) if d.mean_cosine < 0.99}
    return {"layers": [d.model_dump() for d in diffs], "shifts": {str(k): v for k, v in shifts.items() if v is not None}}


def fingerprint_name(row: int) -> str:
    return f"fp_{row}.safetensors"


def fingerprint_blocker(target, dims) -> str | None:
    """Why verify's final-layer fingerprint check (final_layer.py) cannot run for `target`, from its
    config alone (preflight asks before any engine)."""
    model_dir = Path(target.model)
    if not model_dir.is_dir():
        return f"target {target.model} is not a local directory: its lm_head cannot be read here"
    if why := unmodelled_output(read_text_config(model_dir) or {"model_type": dims.model_type}):
        return why
    scaled = logit_transform(model_dir)
    if scaled:
        return f"{model_dir}: {scaled}, which the fingerprint (RMSNorm + lm_head margins) does not model"
    return None


def fingerprint_from_logprobs(prompt_logprobs: list, last_logprobs: dict | None, num_tokens: int) -> dict:
    """The sidecar tensors from vLLM's `RequestOutput.prompt_logprobs` (a list of {token id: Logprob},
    entry 0 None) and the generated token's logprobs dict (`outputs[0].logprobs[0]`). Only ranks 1..FP_TOP
    count: the prompt token's own entry carries its rank, or prompt_scores.NOT_COUNTED (-1) from the lean path."""
    import torch

    ids = torch.full((num_tokens, FP_TOP), -1, dtype=torch.int64)  # [T, 2]
    lps = torch.full((num_tokens, FP_TOP), float("nan"), dtype=torch.float32)  # [T, 2]
    entries = list(prompt_logprobs[1:num_tokens]) + [last_logprobs]
    for t, entry in enumerate(entries):
        if not entry:
            continue
        top = sorted((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank is not None and 1 <= lp.rank <= FP_TOP)
        for j, (_, tid, lp) in enumerate(top[:FP_TOP]):
            ids[t, j], lps[t, j] = tid, lp
    return {FP_IDS_KEY: ids.contiguous(), FP_LOGPROBS_KEY: lps.contiguous()}


PER_TOKEN_CHECKS = ("fingerprint", "state_sketch")  # the checks extract.fingerprints false turns off together


def fingerprints_off_problem(fingerprints: bool, allow_skip) -> str | None:
    """The problem of records extracted without fingerprint sidecars (no fingerprint and no state sketch: no
    per-token check against the target) unless verify.allow_skip names both checks; None otherwise."""
    missing = [c for c in PER_TOKEN_CHECKS if c not in allow_skip]
    if fingerprints or not missing:
        return None
    return ("extract.fingerprints is false: no record carries the target's logits or the engine's state sketch, so "
            "no token's final or aux layers can be checked against what the target computed; set "
            "extract.fingerprints: true (re-extracts), or name both checks to go on without them: verify.allow_skip: "
            f"[{', '.join(PER_TOKEN_CHECKS)}] (now missing: {', '.join(missing)}; the report lists them skipped)")


def fingerprint_from_flat(prompt_logprobs, last_logprobs, num_tokens: int) -> dict:
    """The sidecar tensors from vLLM's flat logprobs (`SamplingParams(flat_logprobs=True)`: a
    `FlatLogprobs` with parallel `token_ids` / `logprobs` / `ranks` lists and per-position
    `start_indices` / `end_indices`; position 0 of the prompt's is empty) of the prompt and of the
    generated token: the same tensors as `fingerprint_from_logprobs`, without a Python object per
    position. vLLM gives each position (the scored token, its rank) and then ranks 1..k in order."""
    import torch

    k = FP_TOP + 1
    ids = np.full((num_tokens, FP_TOP), -1, dtype=np.int64)  # [T, 2]
    lps = np.full((num_tokens, FP_TOP), np.nan, dtype=np.float32)  # [T, 2]
    for flat, first_pos, row0 in ((prompt_logprobs, 1, 0), (last_logprobs, 0, num_tokens - 1)):
        if flat is None or len(flat.start_indices) <= first_pos:
            continue
        n = min(len(flat.start_indices) - first_pos, num_tokens - row0)
        starts = np.asarray(flat.start_indices[first_pos:first_pos + n], dtype=np.int64)
        ends = np.asarray(flat.end_indices[first_pos:first_pos + n], dtype=np.int64)
        a, b = int(starts[0]), int(ends[-1])
        tok = np.asarray(flat.token_ids[a:b], dtype=np.int64)
        lp = np.asarray(flat.logprobs[a:b], dtype=np.float32)
        rank = np.asarray([-1 if r is None else r for r in flat.ranks[a:b]], dtype=np.int64)
        if b - a == n * k and (ends - starts == k).all():  # vLLM's layout: k entries at every position
            tok, lp, rank = tok.reshape(n, k)[:, 1:], lp.reshape(n, k)[:, 1:], rank.reshape(n, k)[:, 1:]
            ok = rank == np.arange(1, k)  # [n, 2]: the entry of rank j+1 is where it should be
            rows, cols = np.nonzero(ok)
            ids[row0 + rows, cols], lps[row0 + rows, cols] = tok[rows, cols], lp[rows, cols]
            continue
        for j in range(FP_TOP):  # any other layout: the entry of rank j+1 of each position, if there
            at = starts - a + 1 + j
            ok = (at < ends - a) & (rank[np.minimum(at, len(rank) - 1)] == j + 1)
            rows = row0 + np.flatnonzero(ok)
            ids[rows, j], lps[rows, j] = tok[at[ok]], lp[at[ok]]
    return {FP_IDS_KEY: torch.from_numpy(ids), FP_LOGPROBS_KEY: torch.from_numpy(lps)}


def write_fingerprint(path: Path, fingerprint: dict, tag: str = "0", durable: bool = True) -> Path:
    return atomic_write(Path(path), lambda p: save_safetensors(p, fingerprint), tag=tag, durable=durable)

"""Structural verification of every hidden-state record against the contract (contracts.py).

Reads `tokenized/` (the rows) and `hidden_states/hs_{i}.safetensors`. Checks per file: readable,
keys present, `token_ids` equal the row's input_ids, `hidden_states` rank 3 with [T, L, H] matching
the row length, configured layer count and model hidden size, storage dtype, all values finite, no
layer identically zero, no two layers identical. Returns a record with every problem (file, sample,
layer, expected vs found) and per-layer statistics; it never raises for bad data (the gate decides).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from eagle3_pipeline.data.prepare import load_tokenized
from eagle3_pipeline.contracts import HS_KEY, SCALES_KEY, TOKENS_KEY, RecordSpec


class LayerStats(BaseModel):
    layer_id: int
    mean: float
    std: float
    min: float
    max: float
    mean_token_norm: float


class StructureResult(BaseModel):
    files_checked: int
    tokens_checked: int
    problems: list[str]
    bad_rows: list[int]
    layer_stats: list[LayerStats]

    @property
    def passed(self) -> bool:
        return not self.problems and self.files_checked > 0


def _fmt(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def check_record(path: Path, row: int, sample_id: str, input_ids: list[int], spec: RecordSpec,
                 layer_ids: list[int]) -> tuple[list[str], object | None]:
    """Problems of one record (empty when it is good) and its hidden states as fp32 [T, L, H]."""
    import torch
    from safetensors import safe_open

    name = f"{path.name} (row {row}, sample {sample_id})"
    if not path.exists():
        return [f"{name}: file missing"], None
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            tensors = {k: f.get_tensor(k) for k in keys}
    except Exception as e:  # truncated or not a safetensors file
        return [f"{name}: unreadable ({type(e).__name__}: {e})"], None
    problems = []
    for k in (HS_KEY, TOKENS_KEY) + ((SCALES_KEY,) if spec.storage_dtype == "fp8" else ()):
        if k not in keys:
            problems.append(f"{name}: key {k!r} missing (found {sorted(keys)})")
    if problems:
        return problems, None
    tok, hs = tensors[TOKENS_KEY], tensors[HS_KEY]
    T = len(input_ids)
    if tok.dtype != torch.int64 or tok.shape != (T,):
        problems.append(f"{name}: token_ids expected int64 [{T}], found {str(tok.dtype).split('.')[-1]} {_fmt(tok.shape)}")
    elif not torch.equal(tok, torch.tensor(input_ids, dtype=torch.int64)):
        first = int((tok != torch.tensor(input_ids)).nonzero()[0, 0])
        problems.append(f"{name}: token_ids differ from the tokenized row from position {first} "
                        f"(expected {input_ids[first:first + 5]}, found {tok[first:first + 5].tolist()})")
    expected = spec.shape(T)
    if tuple(hs.shape) != expected:
        detail = ""
        if hs.dim() == 3 and hs.shape[1] != expected[1]:
            detail = f" ({hs.shape[1]} layers captured, {expected[1]} configured: ids {layer_ids})"
        elif hs.dim() != 3:
            detail = f" (rank {hs.dim()}, expected rank 3 [T, L, H])"
        problems.append(f"{name}: hidden_states expected {_fmt(expected)}, found {_fmt(hs.shape)}{detail}")
        return problems, None
    want_dtype = torch.bfloat16 if spec.storage_dtype == "bf16" else torch.float8_e4m3fn
    if hs.dtype != want_dtype:
        problems.append(f"{name}: hidden_states dtype expected {want_dtype}, found {hs.dtype}")
        return problems, None
    x = hs.float()  # [T, L, H]
    if spec.storage_dtype == "fp8":
        x = x * tensors[SCALES_KEY].float()
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        for li, lid in enumerate(layer_ids):
            bad = (~finite[:, li]).any(dim=-1).nonzero()
            if len(bad):
                problems.append(f"{name}: layer {lid}: {int((~finite[:, li]).sum())} non-finite values "
                                f"(first at token {int(bad[0, 0])})")
        return problems, None
    for li, lid in enumerate(layer_ids):
        if not bool(x[:, li].any()):
            problems.append(f"{name}: layer {lid}: all zeros")
    for a in range(len(layer_ids)):
        for b in range(a + 1, len(layer_ids)):
            if torch.equal(x[:, a], x[:, b]):
                problems.append(f"{name}: layers {layer_ids[a]} and {layer_ids[b]} are identical")
    return problems, x


def verify_structure(tokenized_dir: Path, hidden_states_dir: Path, layer_ids: list[int], hidden_size: int,
                     storage_dtype: str = "bf16", rows: list[int] | None = None, log=print) -> StructureResult:
    """Check every record (or `rows`) and gather per-layer statistics over the good ones."""
    import torch
    ds = load_tokenized(tokenized_dir)
    spec = RecordSpec(len(layer_ids), hidden_size, storage_dtype)
    rows = list(range(len(ds))) if rows is None else rows
    problems: list[str] = []
    bad_rows: list[int] = []
    L = len(layer_ids)
    s1 = torch.zeros(L, dtype=torch.float64)
    s2 = torch.zeros(L, dtype=torch.float64)
    lo = torch.full((L,), float("inf"))
    hi = torch.full((L,), float("-inf"))
    norm_sum = torch.zeros(L, dtype=torch.float64)
    n_tok = n_val = 0
    extra = sorted(int(p.stem.split("_")[1]) for p in Path(hidden_states_dir).glob("hs_*.safetensors")
                   if int(p.stem.split("_")[1]) >= len(ds))
    for i in extra:
        problems.append(f"hs_{i}.safetensors: no tokenized row {i} (dataset has {len(ds)} rows)")
    for i in rows:
        rec = ds[i]
        probs, x = check_record(Path(hidden_states_dir) / f"hs_{i}.safetensors", i, rec["sample_id"],
                                rec["input_ids"], spec, layer_ids)
        if probs:
            problems += probs
            bad_rows.append(i)
            continue
        n_tok += x.shape[0]
        n_val += x.shape[0] * x.shape[2]
        s1 += x.sum(dim=(0, 2)).double()
        s2 += (x.double() ** 2).sum(dim=(0, 2))
        lo = torch.minimum(lo, x.amin(dim=(0, 2)))
        hi = torch.maximum(hi, x.amax(dim=(0, 2)))
        norm_sum += x.norm(dim=-1).sum(dim=0).double()
    stats = []
    if n_tok:
        mean = s1 / n_val
        std = (s2 / n_val - mean ** 2).clamp_min(0).sqrt()
        stats = [LayerStats(layer_id=lid, mean=float(mean[k]), std=float(std[k]), min=float(lo[k]),
                            max=float(hi[k]), mean_token_norm=float(norm_sum[k] / n_tok))
                 for k, lid in enumerate(layer_ids)]
    log(f"verify: {len(rows)} files, {n_tok} tokens, {len(problems)} problems")
    return StructureResult(files_checked=len(rows), tokens_checked=n_tok, problems=problems,
                           bad_rows=bad_rows, layer_stats=stats)

"""Structural verification of every hidden-state record against the contract (contracts.py), plus
per-layer statistics and per-layer norm bounds learned from the first good files.

Reads `tokenized/` (the rows) and `hidden_states/hs_{i}.safetensors`. Checks per file: readable,
keys present, `token_ids` equal the row's input_ids, `hidden_states` rank 3 with [T, L, H] matching
the row length, configured layer count and model hidden size, storage dtype, all values finite, no
layer identically zero and no token whose hidden state is all zeros, no two layers identical, and each layer's mean token norm inside bounds
learned (median/MAD of log norms) from the first `norm_samples` good files. Returns a record with
every problem (file, sample, layer, expected vs found) and per-layer statistics over the good files
(tokens, mean, std, min, max, mean token norm, the learned norm bounds); it never raises for bad data
(the gate decides).

Speed (bench/verify_throughput.py; profile-driven): worker threads (one OpenMP thread each) take
batches of files. A file is read with one `readinto` into the thread's reused buffer and its
safetensors header parsed and validated here (zero-copy views; the library's `load` copied every byte
again into fresh memory, and page faults of fresh buffers cost more than the checks). Its values are
converted once into a reused fp32 buffer that stays in cache, and four reductions over H (sum, L2
norm, min, max) per token give everything: finiteness (sums and extrema propagate NaN/Inf), all-zero
layers (min == max == 0), candidate identical layers (equal extrema and sums, then confirmed or
cleared by an exact comparison) and the statistics (per file by segment reductions over the batch's
per-token values, in float64). Only a suspect file is read again with the safetensors library for the
exact diagnosis that names the layer and the first bad token.
"""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, Field

from eagle3_pipeline.contracts import HS_KEY, SCALES_KEY, TOKENS_KEY, RecordSpec, record_name
from eagle3_pipeline.data.prepare import load_tokenized
from eagle3_pipeline.verify.fingerprint import FingerprintSummary
from eagle3_pipeline.verify.identity import TokenQuantities

BATCH_BYTES = 32 << 20  # a batch (one task of a worker thread): files up to this many bytes ...
BATCH_FILES = 256       # ... or this many files
MIN_NORM_FILES = 8      # fewer good files than this: no norm bounds (noted in the result)
MAD_TO_SIGMA = 1.4826   # MAD of a normal distribution x this = its standard deviation


class LayerStats(BaseModel):
    layer_id: int
    files: int             # good files the statistics cover
    tokens: int
    mean: float
    std: float
    min: float
    max: float
    mean_token_norm: float
    norm_lo: float | None = None   # bounds of a file's mean token norm (None: not checked)
    norm_hi: float | None = None
    norm_median: float | None = None
    norm_outliers: int = 0         # files outside [norm_lo, norm_hi]


class StructureResult(BaseModel):
    files_checked: int
    tokens_checked: int   # tokens of the good files
    bytes_read: int
    seconds: float
    problems: list[str]
    bad_rows: list[int]
    layer_stats: list[LayerStats]
    norm_bounds_files: int = 0            # the first good files the norm bounds were learned from
    norm_bounds_skipped: str | None = None
    fingerprint: FingerprintSummary = FingerprintSummary()
    identity_files: int = 0               # good records the layer profiles were learned from
    identity_skipped: str | None = None
    results: list = Field(default_factory=list, exclude=True)  # per-file results of the records read (verify cache)

    @property
    def passed(self) -> bool:
        return not self.problems and self.files_checked > 0


def _fmt(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


@dataclass
class _Item:
    row: int
    path: str
    input_ids: object  # int64 numpy [T]
    sample_id: object


@dataclass
class _FileResult:
    row: int
    problems: list[str] = field(default_factory=list)
    tokens: int = 0
    nbytes: int = 0
    stats: object = None  # float64 numpy [5, L]: sum, sum of squares, min, max, sum of token norms
    sig: object = None    # float32 numpy [L, F]: the layer-identity signature (verify/identity.py)
    agreement: float | None = None  # final-layer fingerprint agreement (None: no fingerprint)


@dataclass
class _Extras:
    """What the scan computes besides structure: identity signatures, the final-layer check."""
    identity: bool = False         # compute layer-identity signatures (verify/identity.py)
    final: object = None           # fingerprint.FinalLayerCheck or None
    fingerprints_dir: str | None = None
    fingerprints_required: bool = False
    min_agreement: float = 0.9


def _name(it: _Item) -> str:
    return f"{os.path.basename(it.path)} (row {it.row}, sample {it.sample_id})"


_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn",
              "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
              "BOOL": "bool"}


def _read_safetensors(path: str) -> tuple[dict, int]:
    """Tensors of a safetensors file as zero-copy views into this thread's read buffer (valid until the
    thread reads the next file), and the file size. Validates like the safetensors library: header
    length, JSON, known dtypes, each tensor's byte size, offsets contiguous and covering the data.
    Raises FileNotFoundError, or ValueError naming what is malformed."""
    import json

    import torch

    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        buf = _buffer("read", size, torch.uint8)
        view = memoryview(buf.numpy())[:size]
        got = f.readinto(view)
    if got != size:
        raise ValueError(f"read {got} of {size} bytes")
    if size < 8:
        raise ValueError(f"{size} bytes: shorter than the 8-byte header length")
    n = int.from_bytes(view[:8], "little")
    if 8 + n > size:
        raise ValueError(f"header of {n} bytes does not fit in the file of {size} bytes")
    header = json.loads(bytes(view[8:8 + n]))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    header.pop("__metadata__", None)
    data_start, data_len = 8 + n, size - 8 - n
    tensors, spans = {}, []
    for name, info in header.items():
        dtype = getattr(torch, _ST_DTYPES.get(info.get("dtype"), ""), None)
        if dtype is None:
            raise ValueError(f"tensor {name!r}: unknown dtype {info.get('dtype')!r}")
        shape, (a, b) = [int(d) for d in info["shape"]], info["data_offsets"]
        numel = math.prod(shape)
        itemsize = dtype.itemsize
        if not 0 <= a <= b <= data_len or b - a != numel * itemsize:
            raise ValueError(f"tensor {name!r}: data_offsets [{a}, {b}] for {numel} x {itemsize} bytes in a data "
                             f"section of {data_len} bytes")
        spans.append((a, b))
        raw = buf[data_start + a:data_start + b]
        if (data_start + a) % itemsize:  # legal but unaligned: a copy can be viewed as `dtype`
            raw = raw.clone()
        tensors[name] = raw.view(dtype).view(shape)
    end = 0
    for a, b in sorted(spans):
        if a != end:
            raise ValueError(f"data section: bytes [{end}, {a}) belong to no tensor")
        end = b
    if end != data_len:
        raise ValueError(f"data section of {data_len} bytes, tensors cover {end}")
    return tensors, size


def _parse(it: _Item, spec: RecordSpec, layer_ids: list[int]) -> tuple[list[str], dict | None, int]:
    """Read and parse one file and check everything but the values: (problems, tensors, bytes).
    The tensors are views into the thread's read buffer: use them before the next `_parse`."""
    import torch

    name = _name(it)
    try:
        tensors, nbytes = _read_safetensors(it.path)
    except FileNotFoundError:
        return [f"{name}: file missing"], None, 0
    except Exception as e:  # truncated or not a safetensors file
        return [f"{name}: unreadable ({type(e).__name__}: {e})"], None, 0
    problems = []
    keys = set(tensors)
    for k in (HS_KEY, TOKENS_KEY) + ((SCALES_KEY,) if spec.storage_dtype == "fp8" else ()):
        if k not in keys:
            problems.append(f"{name}: key {k!r} missing (found {sorted(keys)})")
    if problems:
        return problems, None, nbytes
    tok, hs = tensors[TOKENS_KEY], tensors[HS_KEY]
    expect = torch.from_numpy(it.input_ids)  # [T]
    T = expect.shape[0]
    if tok.dtype != torch.int64 or tok.shape != (T,):
        problems.append(f"{name}: token_ids expected int64 [{T}], found {str(tok.dtype).split('.')[-1]} "
                        f"{_fmt(tok.shape)}")
    elif not torch.equal(tok, expect):
        first = int((tok != expect).nonzero()[0, 0])
        problems.append(f"{name}: token_ids differ from the tokenized row from position {first} "
                        f"(expected {expect[first:first + 5].tolist()}, found {tok[first:first + 5].tolist()})")
    expected = spec.shape(T)
    if tuple(hs.shape) != expected:
        detail = ""
        if hs.dim() == 3 and hs.shape[1] != expected[1]:
            detail = f" ({hs.shape[1]} layers captured, {expected[1]} configured: ids {layer_ids})"
        elif hs.dim() != 3:
            detail = f" (rank {hs.dim()}, expected rank 3 [T, L, H])"
        problems.append(f"{name}: hidden_states expected {_fmt(expected)}, found {_fmt(hs.shape)}{detail}")
        return problems, None, nbytes
    want_dtype = torch.bfloat16 if spec.storage_dtype == "bf16" else torch.float8_e4m3fn
    if hs.dtype != want_dtype:
        problems.append(f"{name}: hidden_states dtype expected {want_dtype}, found {hs.dtype}")
        return problems, None, nbytes
    if spec.storage_dtype == "fp8":
        sc = tensors[SCALES_KEY]
        if tuple(sc.shape) != (T, 1, 1) or sc.dtype != torch.float32:
            problems.append(f"{name}: {SCALES_KEY} expected float32 [{T}, 1, 1], found "
                            f"{str(sc.dtype).split('.')[-1]} {_fmt(sc.shape)}")
    return problems, (None if problems else tensors), nbytes


def _diagnose_values(name: str, x, layer_ids: list[int]) -> list[str]:
    """Exact value checks of one record `x` fp32 [T, L, H] (the slow path, only for suspects)."""
    import torch

    problems = []
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        for li, lid in enumerate(layer_ids):
            bad = (~finite[:, li]).any(dim=-1).nonzero()
            if len(bad):
                problems.append(f"{name}: layer {lid}: {int((~finite[:, li]).sum())} non-finite values "
                                f"(first at token {int(bad[0, 0])})")
        return problems
    for li, lid in enumerate(layer_ids):
        if not bool(x[:, li].any()):
            problems.append(f"{name}: layer {lid}: all zeros")
            continue
        zero = (~x[:, li].any(dim=-1)).nonzero()  # [Z, 1]: tokens whose whole hidden state is 0
        if len(zero):
            problems.append(f"{name}: layer {lid}: {len(zero)} of {x.shape[0]} tokens are all zeros (first at token "
                            f"{int(zero[0, 0])}; a residual stream is never exactly 0: unwritten cache slots?)")
    for a in range(len(layer_ids)):
        for b in range(a + 1, len(layer_ids)):
            if torch.equal(x[:, a], x[:, b]):
                problems.append(f"{name}: layers {layer_ids[a]} and {layer_ids[b]} are identical")
    return problems


def _file_stats(x):
    """float64 numpy [5, L] of one record x fp32 [T, L, H], computed in float64 (slow path)."""
    import torch

    xd = x.double()
    return torch.stack([xd.sum(dim=(0, 2)), (xd ** 2).sum(dim=(0, 2)), xd.amin(dim=(0, 2)), xd.amax(dim=(0, 2)),
                        xd.norm(dim=-1).sum(dim=0)]).numpy()


_local = threading.local()


def _buffer(kind: str, numel: int, dtype=None):
    """This thread's scratch buffer `kind` of at least `numel` elements, reused across files (fresh
    allocations for every file cost more in page faults than the checks themselves)."""
    import torch

    dtype = dtype or torch.float32
    b = getattr(_local, kind, None)
    if b is None or b.numel() < numel:
        b = torch.empty(max(numel, 1 << 20), dtype=dtype)
        setattr(_local, kind, b)
    return b


def _values(tensors: dict, spec: RecordSpec, out, lo: int = 0, hi: int | None = None, layer=slice(None)):
    """Tokens lo..hi of the record's hidden states (slots `layer`) as fp32 in `out` (fp8: times the
    per-token scales)."""
    out.copy_(tensors[HS_KEY][lo:hi, layer])
    if spec.storage_dtype == "fp8":
        out.mul_(tensors[SCALES_KEY][lo:hi, 0 if isinstance(layer, int) else slice(None)])
    return out


# fp32 values converted and checked per block of tokens, so that the checks' several passes over them
# run in cache, not from memory: ~1 MB blocks made the statistics 2.7x faster on [512, 4, 4096] records
# (8.0 -> 2.9 ms a record, 2 cores) than one fp32 copy of the whole record; small records are one block.
BLOCK_FLOATS = 1 << 18
SMALL_RECORD_BYTES = 4 << 20  # records smaller than this on average are scanned by one thread


def _scan_batch(items: list[_Item], spec: RecordSpec, layer_ids: list[int], extras: _Extras | None = None) -> list[_FileResult]:
    """Check a batch of records; per-file problems and statistics (plus, with `extras`, the identity
    signature and the final-layer fingerprint agreement of each file, from the same read)."""
    import numpy as np
    import torch

    out = [_FileResult(row=it.row) for it in items]
    L, H = spec.num_layers_captured, spec.hidden_size
    # per token and layer: sum, L2 norm, min, max over H, for the good files one after the other;
    # each file goes through a reused fp32 buffer right after it is read (it stays in cache)
    per_tok = torch.empty((4, sum(len(it.input_ids) for it in items), L), dtype=torch.float32)  # [4, sum T, L]
    good, lengths, o = [], [], 0
    pending_fp: list[tuple] = []  # (file index, final slot fp32 [T, H], fingerprint) for the batched check
    for k, it in enumerate(items):
        probs, tensors, nbytes = _parse(it, spec, layer_ids)
        out[k].nbytes = nbytes
        if probs:
            out[k].problems = probs
            continue
        n = tensors[HS_KEY].shape[0]
        q = TokenQuantities(n, L) if extras is not None and extras.identity and L >= 2 else None
        halo = 1 if q is not None else 0  # the identity features look at each token's neighbours
        step = max(1, BLOCK_FLOATS // (L * H))
        for a in range(0, n, step):
            b = min(n, a + step)
            lo, hi = max(0, a - halo), min(n, b + halo)
            y = _values(tensors, spec, _buffer("values", (hi - lo) * L * H)[:(hi - lo) * L * H].view(hi - lo, L, H),
                        lo, hi)  # [hi - lo, L, H] fp32
            x = y[a - lo:b - lo]
            torch.sum(x, dim=-1, out=per_tok[0, o + a:o + b])
            torch.linalg.vector_norm(x, dim=-1, out=per_tok[1, o + a:o + b])
            torch.amin(x, dim=-1, out=per_tok[2, o + a:o + b])
            torch.amax(x, dim=-1, out=per_tok[3, o + a:o + b])
            if q is not None:
                q.add(y, a, b, lo)
        if extras is not None:
            if q is not None:
                out[k].sig = q.features()
            if (fp := _fingerprint(items[k], out[k], extras)) is not None:  # the final slot, checked below
                final = _values(tensors, spec, torch.empty((n, H)), layer=L - 1)  # [T, H]
                pending_fp.append((k, final, fp))
        good.append(k)
        lengths.append(n)
        o += n
    if extras is not None:
        _final_layer_checks(items, out, pending_fp, extras)
    if not good:
        return out
    d = per_tok[:, :o].double()
    lens = torch.tensor(lengths)
    sums = torch.segment_reduce(torch.stack([d[0], d[1] * d[1], d[1]], dim=1), "sum", lengths=lens,
                                axis=0)  # [files, 3, L]: sum, sum of squares, sum of token norms
    lo = torch.segment_reduce(d[2], "min", lengths=lens, axis=0)  # [files, L]
    hi = torch.segment_reduce(d[3], "max", lengths=lens, axis=0)
    min_norm = torch.segment_reduce(d[1], "min", lengths=lens, axis=0).numpy()  # [files, L]: a zero token
    stats = torch.stack([sums[:, 0], sums[:, 1], lo, hi, sums[:, 2]], dim=1).numpy()  # [files, 5, L]
    # suspects: non-finite (sums and extrema propagate NaN/Inf), an all-zero layer (min == max == 0),
    # two layers with equal extrema and sums (confirmed or cleared by an exact comparison)
    suspect = ~np.isfinite(stats).all(axis=(1, 2)) | ((stats[:, 2] == 0) & (stats[:, 3] == 0)).any(axis=1) \
        | (min_norm == 0).any(axis=1)
    for a in range(L):
        for b in range(a + 1, L):
            suspect |= ((stats[:, 2, a] == stats[:, 2, b]) & (stats[:, 3, a] == stats[:, 3, b])
                        & np.isclose(stats[:, 0, a], stats[:, 0, b], rtol=1e-5, atol=1e-6)
                        & np.isclose(stats[:, 1, a], stats[:, 1, b], rtol=1e-5, atol=0))
    for j, (k, n) in enumerate(zip(good, lengths)):
        out[k].tokens = n
        if not suspect[j]:
            out[k].stats = stats[j]
            continue
        from safetensors.torch import load_file  # the slow path reads the file again, with the library

        rec = _values(load_file(items[k].path), spec, torch.empty((n, L, H)))
        out[k].problems = _diagnose_values(_name(items[k]), rec, layer_ids)
        if not out[k].problems:  # a false alarm (e.g. fp32 overflow of a square): exact float64 stats
            out[k].stats = _file_stats(rec)
    return out


def _fingerprint(it: _Item, res: _FileResult, extras: _Extras) -> dict | None:
    """The fingerprint sidecar of one good record, or None (a missing or unreadable one is a problem
    of the record when fingerprints are required)."""
    from eagle3_pipeline.contracts import fingerprint_name

    if extras.final is None or not extras.fingerprints_dir:
        return None
    fp_path = os.path.join(extras.fingerprints_dir, fingerprint_name(it.row))
    if not os.path.exists(fp_path):
        if extras.fingerprints_required:
            res.problems.append(f"{_name(it)}: fingerprint {fingerprint_name(it.row)} missing (the extract pass "
                                f"writes one per record): the final layer cannot be checked")
        return None
    from safetensors.torch import load_file

    try:
        return load_file(fp_path)
    except Exception as e:  # noqa: BLE001 - a damaged sidecar is a problem of this record
        res.problems.append(f"{_name(it)}: fingerprint {fingerprint_name(it.row)} unreadable ({type(e).__name__}: {e})")
        return None


def _final_layer_checks(items: list[_Item], out: list[_FileResult], pending: list[tuple], extras: _Extras) -> None:
    """Fingerprint agreement of the final slots in `pending` [(file index, final slot fp32 [T, H],
    fingerprint)], computed for all of them at once."""
    if not pending:
        return
    for (k, _, _), (agree, n, first) in zip(pending, extras.final.agreement_many([(h, fp) for _, h, fp in pending])):
        out[k].agreement = agree
        if n and agree < extras.min_agreement:
            out[k].problems.append(
                f"{_name(items[k])}: final layer does not reproduce the target's logits: {agree:.0%} of {n} tokens "
                f"agree with the fingerprint vLLM wrote in the same pass (min {extras.min_agreement:.0%}; first "
                f"disagreeing token {first}): another request's or another depth's states, or a corrupted record")


@contextmanager
def _torch_threads(n: int):
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _mean_tokens(ds, rows: list[int], sample: int = 256) -> float:
    """Mean tokens per row over an even sample of `rows` (the `input_ids` lengths, from Arrow)."""
    import pyarrow.compute as pc

    if not rows:
        return 0.0
    pick = rows[:: max(1, len(rows) // sample)][:sample]
    return float(pc.mean(pc.list_value_length(ds.with_format("arrow")[pick].column("input_ids"))).as_py())


def _row_items(ds, rows: list[int], hidden_states_dir: Path):
    """Items for `rows` in batches of consecutive dataset rows (token ids straight from Arrow)."""
    import numpy as np

    tbl = ds.with_format("arrow")
    has_sid = "sample_id" in ds.column_names
    for a in range(0, len(rows), 1024):
        chunk = rows[a:a + 1024]
        t = tbl[chunk]
        col = t.column("input_ids").combine_chunks()
        offsets = col.offsets.to_numpy()
        values = col.values.to_numpy(zero_copy_only=False).astype(np.int64)  # a writable copy
        sids = t.column("sample_id").to_pylist() if has_sid else [None] * len(chunk)
        for j, r in enumerate(chunk):
            yield _Item(r, os.path.join(hidden_states_dir, record_name(r)), values[offsets[j]:offsets[j + 1]],
                        sids[j])


def _batches(items, row_bytes):
    batch, size = [], 0
    for it in items:
        batch.append(it)
        size += row_bytes(it)
        if size >= BATCH_BYTES or len(batch) >= BATCH_FILES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def learn_norm_bounds(mean_norms, n_samples: int, factor: float, min_ratio: float):
    """Per-layer bounds of a file's mean token norm from the first `n_samples` rows of `mean_norms`
    (numpy [files, L], files in row order): median x/÷ exp(max(factor * 1.4826 * MAD, log(min_ratio)))
    of the log norms. Returns (median [L], lo [L], hi [L], files used)."""
    import numpy as np

    first = np.log(np.maximum(mean_norms[:n_samples], 1e-30))
    med = np.median(first, axis=0)
    mad = np.median(np.abs(first - med), axis=0)
    half = np.maximum(factor * MAD_TO_SIGMA * mad, math.log(min_ratio))
    return np.exp(med), np.exp(med - half), np.exp(med + half), len(first)


def scan_records(ds, hidden_states_dir: Path, layer_ids: list[int], hidden_size: int, storage_dtype: str,
                 rows: list[int], *, workers: int | None = None, extras: _Extras | None = None) -> list[_FileResult]:
    """Read and check the records of `rows` once each (worker threads over batches of files): per-file
    problems, statistics and, with `extras`, identity signatures and fingerprint agreement."""
    spec = RecordSpec(len(layer_ids), hidden_size, storage_dtype)
    bytes_per_token = len(layer_ids) * hidden_size * (2 if storage_dtype == "bf16" else 1)
    items = _row_items(ds, rows, str(hidden_states_dir))
    batches = _batches(items, lambda it: len(it.input_ids) * bytes_per_token)
    if not workers:
        # threads pay off on large records only: on small ones the per-file Python work holds the GIL and
        # two threads were slower than one (1568 tiny records: 1.77 s vs 0.96 s; [512, 4, 4096] records:
        # 0.33 s vs 0.38 s; bench/verify_throughput.py)
        mean_bytes = _mean_tokens(ds, rows) * bytes_per_token
        workers = min(8, len(os.sched_getaffinity(0))) if mean_bytes >= SMALL_RECORD_BYTES else 1
    results: list[_FileResult] = []
    # one OpenMP thread per worker: torch's intra-op threads on small tensors (and on a busy machine)
    # cost more in barriers than they save; the parallelism is across batches of files
    with _torch_threads(1), ThreadPoolExecutor(workers, thread_name_prefix="verify") as pool:
        pending = []
        for b in batches:  # bounded read-ahead: at most 2 batches per worker in flight
            pending.append(pool.submit(_scan_batch, b, spec, layer_ids, extras))
            if len(pending) >= 2 * workers:
                results += pending.pop(0).result()
        for f in pending:
            results += f.result()
    return results


def verify_structure(tokenized_dir: Path, hidden_states_dir: Path, layer_ids: list[int], hidden_size: int,
                     storage_dtype: str = "bf16", rows: list[int] | None = None, log=print, *,
                     norm_samples: int = 64, norm_factor: float = 10.0, norm_min_ratio: float = 1.5,
                     workers: int | None = None, extras: _Extras | None = None,
                     identity_max_z: float | None = None, reused: list[_FileResult] = ()) -> StructureResult:
    """Check every record (or `rows`), learn per-layer norm bounds from the first `norm_samples` good
    files and flag files outside them, learn layer profiles and flag slots that do not look like their
    layer, and gather per-layer statistics over the remaining good files. `reused`: results of records
    checked by an earlier verify and unchanged since (not read again; they count in the learning)."""
    t0 = time.perf_counter()
    ds = load_tokenized(tokenized_dir)
    rows = list(range(len(ds))) if rows is None else list(rows)
    results = scan_records(ds, hidden_states_dir, layer_ids, hidden_size, storage_dtype, rows,
                           workers=workers, extras=extras)
    extra = sorted(int(p.stem.split("_")[1]) for p in Path(hidden_states_dir).glob("hs_*.safetensors")
                   if int(p.stem.split("_")[1]) >= len(ds))
    extra_problems = [f"{record_name(i)}: no tokenized row {i} (dataset has {len(ds)} rows)" for i in extra]
    res = judge_records(ds, sorted([*reused, *results], key=lambda r: r.row), layer_ids, hidden_size, log,
                        norm_samples=norm_samples, norm_factor=norm_factor, norm_min_ratio=norm_min_ratio,
                        identity_max_z=identity_max_z, extras=extras, extra_problems=extra_problems)
    dt = time.perf_counter() - t0
    nbytes = sum(r.nbytes for r in results)
    log(f"verify: {len(rows)} files read ({len(reused)} reused), {res.tokens_checked} tokens, {nbytes / 1e6:.1f} MB "
        f"in {dt:.2f}s ({nbytes / 1e6 / max(dt, 1e-9):.0f} MB/s), {len(res.problems)} problems")
    return res.model_copy(update={"bytes_read": nbytes, "seconds": round(dt, 4), "results": results})


def judge_records(ds, results: list[_FileResult], layer_ids: list[int], hidden_size: int, log, *,
                  norm_samples: int, norm_factor: float, norm_min_ratio: float, identity_max_z: float | None,
                  extras: _Extras | None, extra_problems: list[str] = ()) -> StructureResult:
    """Everything that needs all records at once: norm bounds, layer identity, per-layer statistics."""
    import numpy as np

    L = len(layer_ids)
    problems: dict[int, list[str]] = {}
    good = [r for r in results if not r.problems]
    for r in results:
        if r.problems:
            problems[r.row] = list(r.problems)
    fp_summary = _fingerprint_summary(results, extras)
    id_files, id_skipped = _identity(ds, good, layer_ids, identity_max_z, problems, log)
    good = [r for r in good if r.row not in problems]
    stats = np.stack([r.stats for r in good]) if good else np.zeros((0, 5, L))  # [files, 5, L]
    tokens = np.array([r.tokens for r in good], dtype=np.float64)  # [files]

    # norm bounds from the first good files, then every good file against them
    lo = hi = med = None
    n_learn, skipped = 0, None
    keep = np.ones(len(good), dtype=bool)
    outliers = np.zeros(L, dtype=int)
    if norm_samples <= 0:
        skipped = "norm_bounds_samples is 0"
    elif len(good) < MIN_NORM_FILES:
        skipped = f"only {len(good)} good files; norm bounds need at least {MIN_NORM_FILES}"
    else:
        mean_norm = stats[:, 4, :] / tokens[:, None]  # [files, L]
        med, lo, hi, n_learn = learn_norm_bounds(mean_norm, norm_samples, norm_factor, norm_min_ratio)
        out = (mean_norm < lo) | (mean_norm > hi)  # [files, L]
        outliers = out.sum(axis=0)
        for j in np.nonzero(out.any(axis=1))[0]:
            r = good[j]
            keep[j] = False
            it_name = f"{record_name(r.row)} (row {r.row}, sample {_sample_id(ds, r.row)})"
            problems[r.row] = [
                f"{it_name}: layer {layer_ids[li]}: mean token norm {mean_norm[j, li]:.4g} outside the bounds "
                f"[{lo[li]:.4g}, {hi[li]:.4g}] learned from the first {n_learn} good files "
                f"(median {med[li]:.4g}, factor {norm_factor:g})"
                for li in np.nonzero(out[j])[0]]
    if skipped and norm_samples > 0:
        log(f"verify: norm bounds skipped: {skipped}")

    layer_stats = []
    ks, kt = stats[keep], tokens[keep]
    n_tok = int(kt.sum())
    if n_tok:
        n_val = n_tok * hidden_size
        s1, s2 = ks[:, 0].sum(axis=0), ks[:, 1].sum(axis=0)
        mean = s1 / n_val
        std = np.sqrt(np.maximum(s2 / n_val - mean ** 2, 0))
        mn, mx, nsum = ks[:, 2].min(axis=0), ks[:, 3].max(axis=0), ks[:, 4].sum(axis=0)
        layer_stats = [LayerStats(layer_id=lid, files=int(keep.sum()), tokens=n_tok, mean=float(mean[k]),
                                  std=float(std[k]), min=float(mn[k]), max=float(mx[k]),
                                  mean_token_norm=float(nsum[k] / n_tok),
                                  norm_lo=None if lo is None else float(lo[k]),
                                  norm_hi=None if hi is None else float(hi[k]),
                                  norm_median=None if med is None else float(med[k]),
                                  norm_outliers=int(outliers[k]))
                       for k, lid in enumerate(layer_ids)]
    all_problems = list(extra_problems) + [p for r in sorted(problems) for p in problems[r]]
    return StructureResult(files_checked=len(results), tokens_checked=n_tok, bytes_read=0, seconds=0.0,
                           problems=all_problems, bad_rows=sorted(problems), layer_stats=layer_stats,
                           norm_bounds_files=n_learn, norm_bounds_skipped=skipped, fingerprint=fp_summary,
                           identity_files=id_files, identity_skipped=id_skipped)


def _fingerprint_summary(results: list[_FileResult], extras: _Extras | None) -> FingerprintSummary:
    if extras is None or extras.final is None:
        return FingerprintSummary(skipped="no final-layer check (no fingerprints or no readable lm_head)")
    agree = [r.agreement for r in results if r.agreement is not None]
    return FingerprintSummary(rows_checked=len(agree), rows_failed=sum(a < extras.min_agreement for a in agree),
                              rows_without=sum(r.agreement is None and r.sig is not None for r in results),
                              min_agreement=min(agree) if agree else None,
                              mean_agreement=sum(agree) / len(agree) if agree else None)


def _identity(ds, good: list[_FileResult], layer_ids: list[int], max_z: float | None, problems: dict,
              log) -> tuple[int, str | None]:
    """Learn layer profiles over the good records and add a problem for every slot that does not look
    like its own layer (verify/identity.py). Returns (records learned from, why skipped)."""
    import numpy as np

    from eagle3_pipeline.verify import identity

    sigs = [r for r in good if r.sig is not None]
    if max_z is None:
        return 0, "identity check off"
    if len(layer_ids) < 2:
        return 0, "one captured layer: nothing to tell apart"
    if len(sigs) < identity.MIN_FILES:
        log(f"verify: layer identity check skipped: {len(sigs)} good records, it needs {identity.MIN_FILES}")
        return 0, f"only {len(sigs)} good records; layer profiles need at least {identity.MIN_FILES}"
    arr = np.stack([r.sig for r in sigs])  # [files, F]
    med, scale = identity.learn(arr)
    found, worst = identity.problems_of(arr, med, scale, layer_ids, max_z)
    for f, msg in found:
        r = sigs[f]
        problems.setdefault(r.row, []).append(f"{record_name(r.row)} (row {r.row}, sample {_sample_id(ds, r.row)}): {msg}")
    log(f"verify: layer identity: profiles from {len(sigs)} records, largest deviation {worst:.1f} "
        f"(max {max_z:g}), {len(found)} records flagged")
    return len(sigs), None


def _sample_id(ds, row: int):
    return ds[row].get("sample_id") if "sample_id" in ds.column_names else None


def check_record(path: Path, row: int, sample_id: str, input_ids: list[int], spec: RecordSpec,
                 layer_ids: list[int]) -> list[str]:
    """Problems of one record (empty when it is good): every check but the norm bounds."""
    import numpy as np

    it = _Item(row, str(path), np.asarray(input_ids, dtype=np.int64), sample_id)
    return _scan_batch([it], spec, layer_ids)[0].problems

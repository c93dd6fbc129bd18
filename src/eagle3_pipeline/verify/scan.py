"""The one pass over the records that the verify gate makes: read every byte once, check it, reduce it.

More: docs/internals.md, "verify/scan.py".
"""

from __future__ import annotations

import json
import math
import os
import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from eagle3_pipeline.engine.state_sketch import DIM as SKETCH_DIM
from eagle3_pipeline.engine.state_sketch import KEY as SKETCH_KEY
from eagle3_pipeline.engine.state_sketch import directions
from eagle3_pipeline.records.contracts import (
    FP_IDS_KEY,
    FP_LOGPROBS_KEY,
    FP_TOP,
    HS_KEY,
    SCALES_KEY,
    TOKENS_KEY,
    RecordSpec,
    fingerprint_name,
)

BATCH_BYTES = 32 << 20  # a batch: files of up to this many hidden-state bytes ...
BATCH_FILES = 512       # ... or this many files
BLOCK_FLOATS = 1 << 20  # fp32 values converted and reduced at a time (1 MB: stays in cache)
FIRST_READ = 64 << 10   # the first read of a file: its header and, for small records, all of it
CHUNK = 1 << 20         # large tensors are read in pieces of this size (the kernel reads ahead)
AHEAD_BYTES = 8 << 20   # posix_fadvise(WILLNEED) this far ahead of the file being read
ST_DTYPES = {"BF16": ("bfloat16", 2), "F16": ("float16", 2), "F32": ("float32", 4), "F64": ("float64", 8),
             "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1), "I64": ("int64", 8),
             "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1), "BOOL": ("bool", 1)}


@dataclass
class Item:
    row: int
    path: str
    input_ids: object  # int64 numpy [T]
    sample_id: object
    fp_path: str | None = None  # its fingerprint sidecar (None: not looked for)


def item_name(it: Item) -> str:
    return f"{os.path.basename(it.path)} (row {it.row}, sample {it.sample_id})"


def _fmt(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


@dataclass
class FileEntry:
    """One file of a batch as the reader left it."""
    item: Item
    problems: list[str] = field(default_factory=list)
    nbytes: int = 0
    tokens: int = 0
    offset: int = -1         # first token in the batch arenas (-1: not in them)
    fingerprint: bool = False  # its fingerprint rows are in the arenas
    sketch: bool = False       # its state sketch (state_sketch.py) is in the arenas


class Arenas:
    """Reused memory of one batch in flight: hidden states [cap tokens, L, H] as raw bytes, token ids,
    fp8 scales, fingerprint ids / logprobs; grown when a single file needs more."""

    def __init__(self, spec: RecordSpec, tokens: int):
        self.spec = spec
        self.itemsize = 2 if spec.storage_dtype == "bf16" else 1
        self.token_bytes = spec.num_layers_captured * spec.hidden_size * self.itemsize
        self._alloc(max(1, tokens))

    def _alloc(self, tokens: int) -> None:
        self.cap = tokens
        self.hs = np.empty(tokens * self.token_bytes, dtype=np.uint8)
        self.tok = np.empty(tokens, dtype=np.int64)
        self.scales = np.empty(tokens, dtype=np.float32)
        self.fp_ids = np.empty((tokens, FP_TOP), dtype=np.int64)
        self.fp_lps = np.empty((tokens, FP_TOP), dtype=np.float32)
        self.sketch = np.empty((tokens, self.spec.num_layers_captured, SKETCH_DIM), dtype=np.float32)

    def ensure(self, tokens: int) -> None:
        if tokens > self.cap:
            self._alloc(tokens)


@dataclass
class Batch:
    files: list[FileEntry]
    arenas: Arenas
    tokens: int  # tokens in the arenas


class _Reader:
    """Reads the records of `items` into batches of arenas on its own thread (see the module doc)."""

    def __init__(self, items: Iterable[Item], spec: RecordSpec, arenas: list[Arenas], fingerprints_required: bool,
                 layer_ids: list[int] | None = None, sketch_required: bool = False):
        self.items, self.spec, self.layer_ids = iter(items), spec, layer_ids
        self.free: queue.Queue = queue.Queue()
        for a in arenas:
            self.free.put(a)
        self.out: queue.Queue = queue.Queue(maxsize=len(arenas))
        self.required = fingerprints_required
        self.sketch_required = sketch_required
        self.token_bytes = arenas[0].token_bytes
        self.first = bytearray(FIRST_READ)
        self.first_view = memoryview(self.first)
        self.ahead: dict[str, tuple[int, int]] = {}  # path -> (fd opened and advised ahead, bytes counted)
        self.ahead_order: list[Item] = []
        self.ahead_bytes = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="verify-reader", daemon=True)
        self.thread.start()

    # -- the thread
    def _run(self) -> None:
        try:
            pending: Item | None = None
            while True:
                arenas = self.free.get()
                if arenas is None:
                    return
                batch, pending = self._fill(arenas, pending)
                if batch is None:
                    self.out.put(None)
                    return
                self.out.put(batch)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            self.error = e
            self.out.put(None)
        finally:
            for fd, _ in self.ahead.values():
                os.close(fd)
            self.ahead.clear()

    def _next(self) -> Item | None:
        if self.ahead_order:
            return self.ahead_order.pop(0)
        return next(self.items, None)

    def _advise(self) -> None:
        """Open and posix_fadvise(WILLNEED) upcoming files until about AHEAD_BYTES are asked for."""
        while self.ahead_bytes < AHEAD_BYTES:
            it = next(self.items, None)
            if it is None:
                return
            self.ahead_order.append(it)
            est = len(it.input_ids) * self.token_bytes  # the record's size, near enough (no fstat)
            for path in (it.path, it.fp_path):
                if path is None or path in self.ahead:
                    continue
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError:
                    continue  # reported when it is read
                self.ahead[path] = (fd, est)
                self.ahead_bytes += est
                est = 0
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                except OSError:
                    pass

    def _open(self, path: str) -> int:
        got = self.ahead.pop(path, None)
        if got is None:
            return os.open(path, os.O_RDONLY)
        self.ahead_bytes -= got[1]
        return got[0]

    def _fill(self, arenas: Arenas, pending: Item | None) -> tuple[Batch | None, Item | None]:
        files: list[FileEntry] = []
        used = 0
        hs_bytes = 0
        while True:
            it = pending if pending is not None else self._next()
            pending = None
            if it is None:
                break
            T = len(it.input_ids)
            if files and (used + T > arenas.cap or hs_bytes + T * arenas.token_bytes > BATCH_BYTES
                          or len(files) >= BATCH_FILES):
                pending = it
                break
            if not files:
                arenas.ensure(T)
            entry = FileEntry(item=it)
            self._read_record(entry, arenas, used)
            if entry.offset >= 0:
                if it.fp_path is not None:
                    self._read_fingerprint(entry, arenas)
                used += entry.tokens
                hs_bytes += entry.tokens * arenas.token_bytes
            files.append(entry)
            self._advise()
        if not files:
            return None, None
        return Batch(files=files, arenas=arenas, tokens=used), pending

    def _header(self, fd: int, path: str) -> tuple[dict, int, int]:
        """(header, data start, file size) of a safetensors file whose first bytes are in `self.first`."""
        got = os.preadv(fd, [self.first_view], 0)
        size = got if got < FIRST_READ else os.fstat(fd).st_size  # a short read of a regular file: its end
        if size < 8:
            raise ValueError(f"{size} bytes: shorter than the 8-byte header length")
        n = int.from_bytes(self.first[:8], "little")
        if 8 + n > size:
            raise ValueError(f"header of {n} bytes does not fit in the file of {size} bytes")
        raw = bytes(self.first[8:8 + n]) if 8 + n <= got else os.pread(fd, n, 8)
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        header.pop("__metadata__", None)
        data_len, spans = size - 8 - n, []
        for name, info in header.items():
            dt = ST_DTYPES.get(info.get("dtype")) if isinstance(info, dict) else None
            if dt is None:
                raise ValueError(f"tensor {name!r}: unknown dtype {info.get('dtype') if isinstance(info, dict) else info!r}")
            shape, (a, b) = [int(d) for d in info["shape"]], info["data_offsets"]
            if not 0 <= a <= b <= data_len or b - a != math.prod(shape) * dt[1]:
                raise ValueError(f"tensor {name!r}: data_offsets [{a}, {b}] for {math.prod(shape)} x {dt[1]} bytes "
                                 f"in a data section of {data_len} bytes")
            spans.append((a, b))
        end = 0
        for a, b in sorted(spans):
            if a != end:
                raise ValueError(f"data section: bytes [{end}, {a}) belong to no tensor")
            end = b
        if end != data_len:
            raise ValueError(f"data section of {data_len} bytes, tensors cover {end}")
        return header, 8 + n, size

    def _copy(self, fd: int, start: int, stop: int, dest: memoryview) -> None:
        """File bytes [start, stop) into `dest`: what the first read already holds is copied, the rest read."""
        have = min(stop, FIRST_READ)
        if start < have:
            dest[:have - start] = self.first_view[start:have]
        o = max(start, have)
        while o < stop:
            n = os.preadv(fd, [dest[o - start:min(stop, o + CHUNK) - start]], o)
            if n <= 0:
                raise ValueError(f"file ended at byte {o} of {stop}")
            o += n

    def _read_record(self, entry: FileEntry, arenas: Arenas, at: int) -> None:
        it, spec = entry.item, self.spec
        name = item_name(it)
        try:
            fd = self._open(it.path)
        except FileNotFoundError:
            entry.problems.append(f"{name}: file missing")
            return
        except OSError as e:
            entry.problems.append(f"{name}: unreadable ({type(e).__name__}: {e})")
            return
        try:
            try:
                header, data, size = self._header(fd, it.path)
            except Exception as e:  # noqa: BLE001 - truncated or not a safetensors file
                entry.problems.append(f"{name}: unreadable ({type(e).__name__}: {e})")
                return
            entry.nbytes = size
            keys = set(header)
            for k in (HS_KEY, TOKENS_KEY) + ((SCALES_KEY,) if spec.storage_dtype == "fp8" else ()):
                if k not in keys:
                    entry.problems.append(f"{name}: key {k!r} missing (found {sorted(keys)})")
            if entry.problems:
                return
            T = len(it.input_ids)
            tok, hs = header[TOKENS_KEY], header[HS_KEY]
            if tok["dtype"] != "I64" or list(tok["shape"]) != [T]:
                entry.problems.append(f"{name}: token_ids expected int64 [{T}], found "
                                      f"{ST_DTYPES[tok['dtype']][0]} {_fmt(tok['shape'])}")
            expected = spec.shape(T)
            shape = tuple(int(d) for d in hs["shape"])
            if shape != expected:
                detail = ""
                if len(shape) == 3 and shape[1] != expected[1]:
                    detail = f" ({shape[1]} layers captured, {expected[1]} configured: ids {self.layer_ids})"
                elif len(shape) != 3:
                    detail = f" (rank {len(shape)}, expected rank 3 [T, L, H])"
                entry.problems.append(f"{name}: hidden_states expected {_fmt(expected)}, found {_fmt(shape)}{detail}")
                return
            want = spec.st_dtype
            if hs["dtype"] != want:
                entry.problems.append(f"{name}: hidden_states dtype expected torch.{ST_DTYPES[want][0]}, found "
                                      f"torch.{ST_DTYPES[hs['dtype']][0]}")
                return
            if spec.storage_dtype == "fp8":
                sc = header[SCALES_KEY]
                if list(sc["shape"]) != [T, 1, 1] or sc["dtype"] != "F32":
                    entry.problems.append(f"{name}: {SCALES_KEY} expected float32 [{T}, 1, 1], found "
                                          f"{ST_DTYPES[sc['dtype']][0]} {_fmt(sc['shape'])}")
            if entry.problems:
                return
            tb = arenas.token_bytes
            a, b = hs["data_offsets"]
            self._copy(fd, data + a, data + b, memoryview(arenas.hs)[at * tb:(at + T) * tb])
            a, b = tok["data_offsets"]
            self._copy(fd, data + a, data + b, memoryview(arenas.tok[at:at + T]).cast("B"))
            if spec.storage_dtype == "fp8":
                a, b = header[SCALES_KEY]["data_offsets"]
                self._copy(fd, data + a, data + b, memoryview(arenas.scales[at:at + T]).cast("B"))
        except Exception as e:  # noqa: BLE001 - shortened while being read, I/O error
            entry.problems.append(f"{name}: unreadable ({type(e).__name__}: {e})")
            return
        finally:
            os.close(fd)
        got = arenas.tok[at:at + T]
        if not np.array_equal(got, it.input_ids):
            first = int(np.flatnonzero(got != it.input_ids)[0])
            entry.problems.append(f"{name}: token_ids differ from the tokenized row from position {first} "
                                  f"(expected {it.input_ids[first:first + 5].tolist()}, found {got[first:first + 5].tolist()})")
            return
        entry.tokens, entry.offset = T, at

    def _read_fingerprint(self, entry: FileEntry, arenas: Arenas) -> None:
        """The record's fingerprint rows into the arenas (rows it lacks stay invalid: id -1)."""
        it, at, T = entry.item, entry.offset, entry.tokens
        ids, lps = arenas.fp_ids[at:at + T], arenas.fp_lps[at:at + T]
        ids.fill(-1)
        lps.fill(np.nan)
        try:
            fd = self._open(it.fp_path)
        except FileNotFoundError:
            if self.required:
                entry.problems.append(f"{item_name(it)}: fingerprint {fingerprint_name(it.row)} missing (the extract "
                                      f"pass writes one per record): the final layer cannot be checked")
            return
        except OSError as e:
            entry.problems.append(f"{item_name(it)}: fingerprint {fingerprint_name(it.row)} unreadable ({type(e).__name__}: {e})")
            return
        try:
            header, data, _ = self._header(fd, it.fp_path)
            for key, arr, code in ((FP_IDS_KEY, ids, "I64"), (FP_LOGPROBS_KEY, lps, "F32")):
                info = header.get(key)
                if info is None or info["dtype"] != code or len(info["shape"]) != 2 or info["shape"][1] != FP_TOP:
                    raise ValueError(f"{key}: expected {code} [T, {FP_TOP}], found {info!r}")
                n = min(int(info["shape"][0]), T)
                a = info["data_offsets"][0]
                self._copy(fd, data + a, data + a + n * FP_TOP * arr.itemsize, memoryview(arr[:n]).cast("B"))
            entry.fingerprint = True
            self._read_sketch(entry, arenas, fd, header, data)
        except Exception as e:  # noqa: BLE001 - a damaged sidecar is a problem of this record
            entry.problems.append(f"{item_name(it)}: fingerprint {fingerprint_name(it.row)} unreadable "
                                  f"({type(e).__name__}: {e})")
        finally:
            os.close(fd)

    def _read_sketch(self, entry: FileEntry, arenas: Arenas, fd: int, header: dict, data: int) -> None:
        """The record's state sketch (fp32 [T, L, DIM], state_sketch.py) from its fingerprint sidecar into the
        arenas; a missing one is a problem where the extraction wrote them."""
        it, at, T = entry.item, entry.offset, entry.tokens
        info = header.get(SKETCH_KEY)
        if info is None:
            if self.sketch_required:
                entry.problems.append(f"{item_name(it)}: {fingerprint_name(it.row)} has no {SKETCH_KEY} (the extract "
                                      f"pass writes one per record): its layers cannot be checked against the "
                                      f"states the target computed")
            return
        want = [T, self.spec.num_layers_captured, SKETCH_DIM]
        if info["dtype"] != "F32" or [int(d) for d in info["shape"]] != want:
            entry.problems.append(f"{item_name(it)}: {fingerprint_name(it.row)}: {SKETCH_KEY} expected float32 "
                                  f"{_fmt(want)}, found {ST_DTYPES[info['dtype']][0]} {_fmt(info['shape'])}")
            return
        a, b = info["data_offsets"]
        self._copy(fd, data + a, data + b, memoryview(arenas.sketch[at:at + T]).cast("B"))
        entry.sketch = True

    # -- the consumer
    def batches(self) -> Iterator[Batch]:
        while True:
            b = self.out.get()
            if b is None:
                if self.error is not None:
                    raise self.error
                return
            yield b

    def release(self, arenas: Arenas) -> None:
        self.free.put(arenas)

    def close(self) -> None:
        self.free.put(None)


@dataclass
class Reduced:
    """Per-token reductions of a batch (N tokens, L slots)."""
    sum: object    # fp32 [N, L]: sum over H
    min: object    # fp32 [N, L]
    max: object    # fp32 [N, L]
    gram: object   # fp32 [N, L, L]: x_t,a . x_t,b
    cross: object  # fp32 [N, L, L]: x_t,a . x_t-1,b (row 0: with zeros)
    final: object  # fp32 [N, H] (the last slot) or None
    proj: object = None  # fp32 [N, L, DIM]: every state on the sketch directions (state_sketch.py) or None


def reduce_batch(batch: Batch, spec: RecordSpec, keep_final: bool, buffers: dict, sketch: bool = False) -> Reduced:
    """The per-token reductions of every token in the batch's arenas, block by block in cache; with
    `sketch`, every state's projections on the state sketch's directions too."""
    import torch

    L, H, N = spec.num_layers_captured, spec.hidden_size, batch.tokens
    ar = batch.arenas
    dtype = torch.bfloat16 if spec.storage_dtype == "bf16" else torch.float8_e4m3fn
    hs = torch.from_numpy(ar.hs[:N * ar.token_bytes]).view(dtype).view(N, L, H)
    out = Reduced(sum=torch.empty(N, L), min=torch.empty(N, L), max=torch.empty(N, L),
                  gram=torch.empty(N, L, L), cross=torch.empty(N, L, L),
                  final=torch.empty(N, H) if keep_final else None,
                  proj=torch.empty(N, L, SKETCH_DIM) if sketch else None)
    dirs = torch.from_numpy(directions(H)) if sketch else None
    step = max(1, BLOCK_FLOATS // (L * H))
    stage = buffers.get("stage")
    if stage is None or stage.shape[0] < step + 1 or stage.shape[1:] != (L, H):
        stage = buffers["stage"] = torch.empty(step + 1, L, H)
    stage[0].zero_()  # the token before the batch: none (its cross products are masked anyway)
    scales = torch.from_numpy(ar.scales[:N]).view(N, 1, 1) if spec.storage_dtype == "fp8" else None
    for a in range(0, N, step):
        b = min(N, a + step)
        m = b - a
        if a:
            stage[0].copy_(stage[step])  # the previous block's last token: every block but the last is full
        x = stage[1:m + 1]
        x.copy_(hs[a:b])  # [m, L, H] fp32
        if scales is not None:
            x.mul_(scales[a:b])
        torch.sum(x, dim=-1, out=out.sum[a:b])
        torch.amin(x, dim=-1, out=out.min[a:b])
        torch.amax(x, dim=-1, out=out.max[a:b])
        torch.bmm(x, x.transpose(1, 2), out=out.gram[a:b])
        torch.bmm(x, stage[:m].transpose(1, 2), out=out.cross[a:b])
        if keep_final:
            out.final[a:b].copy_(x[:, L - 1])
        if sketch:
            torch.mm(x.view(m * L, H), dirs, out=out.proj[a:b].view(m * L, SKETCH_DIM))
    return out

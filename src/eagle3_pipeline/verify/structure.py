"""Structural verification of every hidden-state record against the contract (contracts.py), plus
per-layer statistics and per-layer norm bounds learned over the whole extraction.

More: docs/internals.md, "verify/structure.py".
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydantic import BaseModel, Field

from eagle3_pipeline.checks import layer_identity as identity
from eagle3_pipeline.data.tokenized import load_tokenized
from eagle3_pipeline.engine import state_sketch
from eagle3_pipeline.records.contracts import HS_KEY, SCALES_KEY, RecordSpec, fingerprint_name, record_name
from eagle3_pipeline.records.verification import LayerStats, VerifyChecks
from eagle3_pipeline.verify import prediction, scan
from eagle3_pipeline.verify.check import merge
from eagle3_pipeline.verify.learned import (
    FingerprintAgreement,
    LayerIdentity,
    NormBounds,
    Predictions,
    StateSketch,
    StructureRecords,
)

SMALL_RECORD_BYTES = 4 << 20  # records smaller than this on average are reduced by one compute thread
STAT_ROWS = 6           # rows of a file's stats (FileResult.stats)


class StructureResult(BaseModel):
    """The records' pass: what every record read showed, and the result of each check of the pass."""
    files_checked: int
    tokens_checked: int   # tokens of the good files
    bytes_read: int
    seconds: float
    problems: list[str]
    bad_rows: list[int]
    layer_stats: list[LayerStats]
    checks: VerifyChecks = VerifyChecks()  # structure, fingerprint, state_sketch, identity, prediction, norm_bounds
    learned_rows: list[int] = []          # rows flagged only by learned checks (identity, norm bounds, prediction)
    cleared: dict[int, list[str]] = {}    # of those, rows the target itself cleared (verify/stage.py) and their flags
    results: list = Field(default_factory=list, exclude=True)  # per-file results of the records read (verify cache)

    @property
    def passed(self) -> bool:
        return not self.problems and self.files_checked > 0


def _fmt(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


_Item = scan.Item


@dataclass
class FileResult:
    row: int
    problems: list[str] = field(default_factory=list)
    tokens: int = 0
    nbytes: int = 0
    stats: object = None  # float64 numpy [STAT_ROWS, L]: sum, sum of squares, min, max, sum of token norms,
                          # median token norm
    sig: object = None    # float32 numpy [L, F]: the layer-identity signature (layer_identity.py)
    agreement: float | None = None  # final-layer fingerprint agreement (None: no fingerprint)
    fp_margin: float | None = None  # its largest |margin error| / tolerance (1.0: at the tolerance)
    sketch_margin: float | None = None  # its largest state-sketch deviation / tolerance (None: no sketch)
    next_hits: int | None = None  # positions whose next token is among the fingerprint's top 2 (prediction.py)
    next_scored: int | None = None
    gaps: tuple | None = None     # (sum, sum of squares, count) of the next token's logit gaps (row_signal.py)


@dataclass
class Extras:
    """What the scan computes besides structure: identity signatures, the final-layer check."""
    identity: bool = False         # compute layer-identity signatures (layer_identity.py)
    final: object = None           # fingerprint.FinalLayerCheck or None
    fingerprints_dir: str | None = None
    fingerprints_required: bool = False
    min_agreement: float = 1.0
    sketch_required: bool = False  # every record's sidecar must carry its state sketch (state_sketch.py)


@dataclass(frozen=True)
class StructureCheck:
    """What `verify_structure` reads and how it learns: the records (tokenized rows, their hidden-state
    files, captured layers, hidden size, storage dtype) and the settings of the learned checks."""
    tokenized_dir: Path
    hidden_states_dir: Path
    layer_ids: list[int]
    hidden_size: int
    storage_dtype: str = "bf16"
    norm_samples: int = 64  # good files the per-layer norm bounds are learned from (0: no bounds)
    norm_factor: float = 10.0
    norm_min_ratio: float = 1.5
    identity_max_z: float | None = None  # None: no layer-identity check
    prediction_max_z: float | None = None  # None: no prediction check (prediction.py)
    prediction_cap: int | None = None      # at most this many rows flagged by it (verify.confirm_rows)
    surprise_max_z: float = 4.0            # the surprise signal's limit (row_signal.py), on with the prediction check
    workers: int | None = None  # compute threads (None: chosen from the mean record size)


_name = scan.item_name


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
    """float64 numpy [STAT_ROWS, L] of one record x fp32 [T, L, H], computed in float64 (slow path)."""
    import torch

    xd = x.double()
    tn = xd.norm(dim=-1)  # [T, L]
    return torch.stack([xd.sum(dim=(0, 2)), (xd ** 2).sum(dim=(0, 2)), xd.amin(dim=(0, 2)), xd.amax(dim=(0, 2)),
                        tn.sum(dim=0), tn.quantile(0.5, dim=0)]).numpy()


def _values(tensors: dict, spec: RecordSpec, out):
    """A record's hidden states as fp32 in `out` [T, L, H] (fp8: times the per-token scales)."""
    out.copy_(tensors[HS_KEY])
    if spec.storage_dtype == "fp8":
        out.mul_(tensors[SCALES_KEY])
    return out


_local = threading.local()


def _process(batch: scan.Batch, spec: RecordSpec, layer_ids: list[int], extras: Extras | None,
             release) -> list[FileResult]:
    """Per-file results of one batch the reader filled (then hands its arenas back with `release`)."""
    import torch

    L = spec.num_layers_captured
    out = [FileResult(row=e.item.row, problems=list(e.problems), nbytes=e.nbytes) for e in batch.files]
    inside = [k for k, e in enumerate(batch.files) if e.offset >= 0]
    if not inside:
        release(batch.arenas)
        return out
    final = extras is not None and extras.final is not None
    sketched = [j for j, k in enumerate(inside) if batch.files[k].sketch]
    buffers = _local.__dict__.setdefault("buffers", {})
    red = scan.reduce_batch(batch, spec, final, buffers, sketch=bool(sketched))
    ar = batch.arenas
    engine_sketch = torch.from_numpy(ar.sketch[:batch.tokens].copy()) if sketched else None
    starts = np.asarray([batch.files[k].offset for k in inside], dtype=np.int64)
    lengths = [batch.files[k].tokens for k in inside]
    fp_rows = None
    if final:  # the arenas are reused by the reader once released: copies of the fingerprint rows
        fp_rows = (torch.from_numpy(ar.fp_ids[:batch.tokens].copy()), torch.from_numpy(ar.fp_lps[:batch.tokens].copy()))
    release(batch.arenas)  # everything below reads the per-token arrays only

    stats, suspect, norm = _batch_stats(red, starts, lengths)
    if sketched:
        dev = state_sketch.deviation(red.proj, engine_sketch, norm.float()) / state_sketch.TOLERANCE
        dev = dev.numpy()  # [N, L]: 1.0 = at the tolerance
        _sketch_check([(batch.files[inside[j]], out[inside[j]]) for j in sketched], dev, layer_ids)
    sigs = None
    if extras is not None and extras.identity and L >= 2:
        sigs = identity.features(red.gram, red.cross, starts, lengths)  # [files, F]
    agree = _agreements(extras.final, red.final, fp_rows, list(zip(starts, lengths)), batch, inside) if final else {}
    for j, k in enumerate(inside):
        r, it = out[k], batch.files[k].item
        r.tokens = lengths[j]
        if sigs is not None:
            r.sig = sigs[j]
        if j in agree:
            a0 = starts[j]
            r.next_hits, r.next_scored = prediction.hits(fp_rows[0][a0:a0 + lengths[j]].numpy(), it.input_ids)
            _fingerprint_problems(r, it, agree[j], extras.min_agreement)
        if not suspect[j]:
            r.stats = stats[j]
            continue
        from safetensors.torch import load_file  # the slow path reads the file again, with the library

        rec = _values(load_file(it.path), spec, torch.empty((lengths[j], L, spec.hidden_size)))
        found = _diagnose_values(_name(it), rec, layer_ids)
        r.problems += found
        if not found:  # a false alarm (e.g. fp32 overflow of a square): exact float64 stats
            r.stats = _file_stats(rec)
    return out


def _batch_stats(red: scan.Reduced, starts, lengths: list[int]):
    """(stats float64 [files, STAT_ROWS, L], suspect bool [files], token norms [N, L]) of the records of a
    batch at `starts` with `lengths`, from the scan's per-token reductions."""
    import torch

    L = red.sum.shape[1]
    d = torch.diagonal(red.gram, dim1=1, dim2=2).double()  # [N, L] squared norms
    norm = d.clamp_min(0).sqrt()
    s = np.add.reduceat(red.sum.double().numpy(), starts, axis=0)  # [files, L]
    s2 = np.add.reduceat(d.numpy(), starts, axis=0)
    lo = np.minimum.reduceat(red.min.numpy(), starts, axis=0).astype(np.float64)
    hi = np.maximum.reduceat(red.max.numpy(), starts, axis=0).astype(np.float64)
    norm_np = norm.numpy()
    ns = np.add.reduceat(norm_np, starts, axis=0)
    min_norm = np.minimum.reduceat(norm_np, starts, axis=0)  # a zero token
    med = np.stack([np.median(norm_np[a:a + n], axis=0) for a, n in zip(starts, lengths)])  # [files, L]
    stats = np.stack([s, s2, lo, hi, ns, med], axis=1)  # [files, STAT_ROWS, L]
    # suspects: non-finite (sums and extrema propagate NaN/Inf), an all-zero layer (min == max == 0), a
    # zero token, two layers with equal extrema and sums (confirmed or cleared by an exact comparison)
    suspect = ~np.isfinite(stats).all(axis=(1, 2)) | ((stats[:, 2] == 0) & (stats[:, 3] == 0)).any(axis=1) \
        | (min_norm == 0).any(axis=1)
    for a in range(L):
        for b in range(a + 1, L):
            suspect |= ((stats[:, 2, a] == stats[:, 2, b]) & (stats[:, 3, a] == stats[:, 3, b])
                        & np.isclose(stats[:, 0, a], stats[:, 0, b], rtol=1e-5, atol=1e-6)
                        & np.isclose(stats[:, 1, a], stats[:, 1, b], rtol=1e-5, atol=0))
    return stats, suspect, norm


def _agreements(check, final, fp_rows, spans: list[tuple[int, int]], batch: scan.Batch, inside: list[int]
                ) -> dict[int, tuple]:
    """{j: the final-layer check's (agreement, scored tokens, bad positions, worst margin) and the next-token gap
    sums (`_gaps`)} of the records inside[j] of `batch` that have a fingerprint, from the batch's final-layer
    states `final` [N, H] and its fingerprint rows (`spans`: each record's first row and rows there): only those
    records' tokens are scored."""
    import torch

    with_fp = [j for j, k in enumerate(inside) if batch.files[k].fingerprint]
    if not with_fp:
        return {}
    starts, lengths = [a for a, _ in spans], [n for _, n in spans]
    h, ids, lps = final, fp_rows[0], fp_rows[1]
    if len(with_fp) < len(starts):  # only the tokens of records that have a fingerprint
        keep = np.zeros(final.shape[0], dtype=bool)
        for j in with_fp:
            keep[starts[j]:starts[j] + lengths[j]] = True
        idx = torch.from_numpy(np.flatnonzero(keep))
        h, ids, lps = h[idx], ids[idx], lps[idx]
    res = check.agreement_arrays(h, ids, lps, [lengths[j] for j in with_fp])
    gaps = _gaps(check, final, fp_rows[0], spans, [batch.files[k].item for k in inside], with_fp)
    return {j: (*r, gaps.get(j)) for j, r in zip(with_fp, res)}


def _gaps(check, final, top_ids, spans: list[tuple[int, int]], items: list, with_fp: list[int]) -> dict[int, tuple]:
    """{j: (sum, sum of squares, count) of the next-token logit gaps (FinalLayerCheck.next_gaps) of record j}
    for the records `with_fp`, from the batch's final-layer states and the fingerprint's first choices."""
    import torch

    if not with_fp:
        return {}
    idx, nxt = [], []
    for j in with_fp:
        ids = np.asarray(items[j].input_ids, dtype=np.int64)
        a, n = int(spans[j][0]), min(len(ids), int(spans[j][1]))
        idx.append(np.arange(a, a + n))
        nxt.append(np.concatenate([ids[1:n], [-1]]))
    at = torch.from_numpy(np.concatenate(idx))
    gap = check.next_gaps(final[at], top_ids[at, 0], torch.from_numpy(np.concatenate(nxt))).double().numpy()
    out, o = {}, 0
    for j, ix in zip(with_fp, idx):
        g = gap[o:o + len(ix)]
        g = g[np.isfinite(g)]
        out[j] = (float(g.sum()), float((g * g).sum()), int(len(g)))
        o += len(ix)
    return out


def _fingerprint_problems(r: FileResult, it: _Item, agreement: tuple, min_agreement: float) -> None:
    """Record one file's final-layer agreement on `r`, with a problem for a sidecar that scores no token or
    only some, and for an agreement under `min_agreement`."""
    a, n, bad, worst, r.gaps = agreement
    r.agreement, r.fp_margin = a, worst
    if not n and r.tokens:  # an empty or all-invalid sidecar: nothing was compared, nothing passed
        r.problems.append(f"{_name(it)}: its fingerprint has no usable token (top ids -1 or logprobs not "
                          f"finite at all {r.tokens}): the final layer cannot be checked")
    elif n < r.tokens:  # coverage: a sidecar that scores some tokens leaves the others unchecked
        missing = r.tokens - n
        r.problems.append(f"{_name(it)}: its fingerprint scores {n} of {r.tokens} tokens ({missing} without "
                          f"top ids or finite scores): every token's final layer must be checked")
    if n and a < min_agreement:
        n_bad = round((1 - a) * n)
        r.problems.append(
            f"{_name(it)}: final layer does not reproduce the target's logits at {n_bad} of {n} tokens "
            f"(positions {bad}{' ...' if n_bad > len(bad) else ''}; {a:.2%} agree with the fingerprint vLLM "
            f"wrote in the same pass, min {min_agreement:.0%}): another request's or another depth's "
            f"states, stale states of those tokens, or a corrupted record")


def _sketch_check(files: list[tuple[scan.FileEntry, FileResult]], dev, layer_ids: list[int]) -> None:
    """Every token's every stored state against the engine's sketch of the state it computed
    (state_sketch.py; `dev` [batch tokens, L]: deviation ÷ tolerance): each record's clean margin, and a
    problem naming the layers and positions where they differ."""

    for e, r in files:
        d = dev[e.offset:e.offset + e.tokens]  # [T, L]
        r.sketch_margin = float(d.max()) if d.size else 0.0
        bad = d > 1.0
        if not bad.any():
            continue
        where = []
        for li in np.flatnonzero(bad.any(axis=0)):
            pos = np.flatnonzero(bad[:, li])
            where.append(f"layer {layer_ids[li]} at {len(pos)} positions {pos[:8].tolist()}{' ...' if len(pos) > 8 else ''}")
        worst_t, worst_l = np.unravel_index(int(np.argmax(d)), d.shape)
        r.problems.append(
            f"{_name(e.item)}: stored states differ from the ones the target computed in the same pass (the engine's "
            f"state sketch): {'; '.join(where)} (of {e.tokens} tokens; largest deviation {d[worst_t, worst_l]:.3g}x the "
            f"tolerance, layer {layer_ids[worst_l]} position {worst_t}): stale or shifted cache slots, another "
            f"request's states, or a corrupted record")


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


def _row_items(ds, rows: list[int], hidden_states_dir: Path, fingerprints_dir: str | None = None):
    """Items for `rows` in batches of consecutive dataset rows (token ids straight from Arrow)."""

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
                        sids[j], os.path.join(fingerprints_dir, fingerprint_name(r)) if fingerprints_dir else None)


def scan_records(ds, check: StructureCheck, rows: list[int], *, extras: Extras | None = None) -> list[FileResult]:
    """Read and check the records of `rows` once each (verify/scan.py: a reader thread, `check.workers`
    compute threads over batches of files): per-file problems, statistics and, with `extras`, identity
    signatures and fingerprint agreement, in row order."""
    layer_ids, hidden_size, storage_dtype = check.layer_ids, check.hidden_size, check.storage_dtype
    workers = check.workers
    spec = RecordSpec(len(layer_ids), hidden_size, storage_dtype)
    bytes_per_token = len(layer_ids) * hidden_size * (2 if storage_dtype == "bf16" else 1)
    fp_dir = extras.fingerprints_dir if extras is not None and (extras.final is not None or extras.sketch_required) \
        else None
    items = _row_items(ds, rows, str(check.hidden_states_dir), fp_dir)
    if not workers:
        # a second compute thread pays off on large records only: on small ones the batch's Python work
        # holds the GIL (bench/verify_throughput.py)
        mean_bytes = _mean_tokens(ds, rows) * bytes_per_token
        workers = min(8, len(os.sched_getaffinity(0))) if mean_bytes >= SMALL_RECORD_BYTES else 1
    arenas = [scan.Arenas(spec, max(1, scan.BATCH_BYTES // bytes_per_token)) for _ in range(workers + 1)]
    reader = scan._Reader(items, spec, arenas, bool(extras and extras.fingerprints_required), layer_ids,
                          sketch_required=bool(extras and extras.sketch_required))
    results: list[FileResult] = []
    # one OpenMP thread per compute thread: torch's intra-op threads on small tensors (and on a busy
    # machine) cost more in barriers than they save; the parallelism is across batches of files
    try:
        with _torch_threads(1), ThreadPoolExecutor(workers, thread_name_prefix="verify") as pool:
            pending: deque = deque()
            for b in reader.batches():
                pending.append(pool.submit(_process, b, spec, layer_ids, extras, reader.release))
                while len(pending) >= workers:
                    results += pending.popleft().result()
            while pending:
                results += pending.popleft().result()
    finally:
        reader.close()
    return results


def verify_structure(check: StructureCheck, rows: list[int] | None = None, log=print, *,
                     extras: Extras | None = None, reused: list[FileResult] = ()) -> StructureResult:
    """Check every record (or `rows`), learn per-layer norm bounds from the first `check.norm_samples`
    good files and flag files outside them, learn layer profiles and flag slots that do not look like their
    layer, and gather per-layer statistics over the remaining good files. `reused`: results of records
    checked by an earlier verify and unchanged since (not read again; they count in the learning)."""
    t0 = time.perf_counter()
    ds = load_tokenized(check.tokenized_dir)
    rows = list(range(len(ds))) if rows is None else list(rows)
    results = scan_records(ds, check, rows, extras=extras)
    extra = sorted(int(p.stem.split("_")[1]) for p in Path(check.hidden_states_dir).glob("hs_*.safetensors")
                   if int(p.stem.split("_")[1]) >= len(ds))
    extra_problems = [f"{record_name(i)}: no tokenized row {i} (dataset has {len(ds)} rows)" for i in extra]
    res = judge_records(ds, sorted([*reused, *results], key=lambda r: r.row), check, log, extras=extras,
                        extra_problems=extra_problems)
    dt = time.perf_counter() - t0
    nbytes = sum(r.nbytes for r in results)
    log(f"verify: {len(rows)} files read ({len(reused)} reused), {res.tokens_checked} tokens, {nbytes / 1e6:.1f} MB "
        f"in {dt:.2f}s ({nbytes / 1e6 / max(dt, 1e-9):.0f} MB/s), {len(res.problems)} problems")
    res.checks.structure.bytes_read, res.checks.structure.scan_seconds = nbytes, round(dt, 4)
    return res.model_copy(update={"bytes_read": nbytes, "seconds": round(dt, 4), "results": results})


def judge_records(ds, results: list[FileResult], check: StructureCheck, log, *,
                  extras: Extras | None, extra_problems: list[str] = ()) -> StructureResult:
    """The checks of the records' pass (verify/learned.py), in order: those on each record alone (structure,
    fingerprint, state sketch), then those learned from the records still good (layer identity, predictions,
    norm bounds); then the per-layer statistics over the files every check kept."""
    final = extras.final if extras is not None else None
    min_agreement = extras.min_agreement if extras is not None else 1.0
    problems: dict[int, list[str]] = {}
    checks = VerifyChecks()
    for c in (StructureRecords(), StateSketch(),
              FingerprintAgreement(final, bool(extras and extras.fingerprints_required), min_agreement)):
        out = c.run(results)
        setattr(checks, c.name, out.result)
        merge(problems, out.flags)
    hard = set(problems)  # rows a check of the record alone failed; the rest below are learned judgements
    good = [r for r in results if r.row not in problems]
    norm = NormBounds(ds, check.layer_ids, check.norm_samples, check.norm_factor, check.norm_min_ratio, log)
    for c in (LayerIdentity(ds, check.layer_ids, check.identity_max_z, log),
              Predictions(ds, check.prediction_max_z, check.prediction_cap, check.surprise_max_z, log), norm):
        out = c.run(good)
        setattr(checks, c.name, out.result)
        merge(problems, out.flags)
        good = [r for r in good if r.row not in problems]
    layer_stats = _layer_stats(good, check.layer_ids, check.hidden_size, norm.bounds)
    checks.structure.tokens_checked = layer_stats[0].tokens if layer_stats else 0
    checks.structure.layer_stats = layer_stats
    all_problems = list(extra_problems) + [p for r in sorted(problems) for p in problems[r]]
    return StructureResult(files_checked=len(results), tokens_checked=checks.structure.tokens_checked, bytes_read=0,
                           seconds=0.0, problems=all_problems, bad_rows=sorted(problems), layer_stats=layer_stats,
                           checks=checks, learned_rows=sorted(set(problems) - hard))


def _layer_stats(kept: list[FileResult], layer_ids: list[int], hidden_size: int, bounds) -> list[LayerStats]:
    """Per-layer statistics over the files every check kept, with the norm bounds (None: not learned)."""

    L = len(layer_ids)
    ks = np.stack([r.stats for r in kept]) if kept else np.zeros((0, STAT_ROWS, L))  # [files, STAT_ROWS, L]
    n_tok = int(sum(r.tokens for r in kept))
    if not n_tok:
        return []
    med, lo, hi, margin, outliers = bounds or (None, None, None, None, np.zeros(L, dtype=int))
    n_val = n_tok * hidden_size
    s1, s2 = ks[:, 0].sum(axis=0), ks[:, 1].sum(axis=0)
    mean = s1 / n_val
    std = np.sqrt(np.maximum(s2 / n_val - mean ** 2, 0))
    mn, mx, nsum = ks[:, 2].min(axis=0), ks[:, 3].max(axis=0), ks[:, 4].sum(axis=0)
    return [LayerStats(layer_id=lid, files=len(kept), tokens=n_tok, mean=float(mean[k]), std=float(std[k]),
                       min=float(mn[k]), max=float(mx[k]), mean_token_norm=float(nsum[k] / n_tok),
                       norm_lo=None if lo is None else float(lo[k]), norm_hi=None if hi is None else float(hi[k]),
                       norm_median=None if med is None else float(med[k]), norm_outliers=int(outliers[k]),
                       norm_margin=None if margin is None else round(float(margin[k]), 4))
            for k, lid in enumerate(layer_ids)]

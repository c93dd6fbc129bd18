"""Batch invariance: samples extracted alone (a batch of one) must match the stored records, which the
extract stage wrote from inside large batches.

Reads the stored records `hidden_states/hs_{i}.safetensors`, the tokenized rows and the target model.
Runs ONE extract child (`extract/worker.py`: the same engine settings and the same connector as the
extract stage, `ExtractConfig.connector_*`) with `max_num_seqs=1` and one single-row shard per sample,
so that every sample is prefilled on its own. It writes into `work_dir` (removed afterwards); the
child's log goes to `log_path`. Compares per layer the relative L2 error and the per-token cosine with
bf16 tolerances (the kernels see different batch shapes, so bits may differ; values may not).

What it catches that structure checks cannot: token offsets that drift between the requests of a
batch, one request's rows written into another request's file, padding or stale cache slots read
as data. When the stored record equals the alone record shifted by a few tokens, the message says so.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path


from eagle3_pipeline.config import ExtractConfig, TargetConfig, VerifyConfig
from eagle3_pipeline.contracts import dequantise, read_record, record_name
from eagle3_pipeline.layout import ExtractVersion
from eagle3_pipeline.verify.reference import ReferenceResult

MAX_SHIFT = 4  # shifts tried when explaining a mismatch
FP8_SLACK = 4.0  # fp8 storage: tolerances this many times looser (3 mantissa bits instead of 7)


class InvarianceResult(ReferenceResult):
    """The same per-layer comparison as the reference check, against the batch-of-one extraction."""
    seconds: float = 0.0


def invariance_rows(seq_lens: list[int], count: int, rows_per_shard: int, good: set[int] | None = None) -> list[int]:
    """`count` rows worth re-extracting alone: the longest, then rows spread over the dataset, each
    moved off the first position of its shard (the first request of a batch is the one an offset bug
    spares)."""
    n = len(seq_lens)
    ok = (lambda r: r in good) if good is not None else (lambda r: True)
    cands = [r for r in range(n) if ok(r)]
    if not cands or count <= 0:
        return []
    picks = [max(cands, key=seq_lens.__getitem__)]
    step = max(1, n // count)
    for i in range(step // 2, n, step):
        r = i + 1 if i % rows_per_shard == 0 and i + 1 < n else i
        if ok(r) and r not in picks:
            picks.append(r)
    for r in cands:  # too few good rows in the spread: fill from the rest
        if len(picks) >= count:
            break
        if r not in picks:
            picks.append(r)
    return sorted(picks[:count])


def extract_rows(cfg: ExtractConfig, target: TargetConfig, tokenized_dir: Path, row_ranges: list[tuple[int, int]],
                 out_dir: Path, layer_ids: list[int], hidden_size: int, *, max_num_seqs: int | None = None,
                 log: Callable[[str], None] = print, log_path: Path | None = None) -> Path:
    """Run one extract child over `row_ranges` (each range is one shard: one `generate` call) into
    `out_dir/hidden_states/hs_{row}.safetensors`, with `cfg`'s engine and connector settings and at
    most `max_num_seqs` requests per batch. No manifest: the records are for comparison only.
    Returns the hidden-states dir; raises ChildFailed with the child's output tail."""
    from eagle3_pipeline.engine import engine_env
    from eagle3_pipeline.extract.shards import WORKER_MODULE, Shard, _job
    from eagle3_pipeline.proc import python_child, run_child
    from eagle3_pipeline.store import write_json

    out_dir = Path(out_dir)
    hs_dir, scratch = out_dir / "hidden_states", out_dir / ".scratch"
    shards = [Shard(index=k, row_start=a, row_end=b) for k, (a, b) in enumerate(row_ranges)]
    job = _job(cfg, target, Path(tokenized_dir), hs_dir, scratch, layer_ids, hidden_size, shards, attempt=1)
    job = job.model_copy(update={"connector_module": cfg.connector_module, "connector_name": cfg.connector_name,
                                 "max_num_seqs": max_num_seqs or cfg.max_num_seqs})
    job_path = write_json(out_dir / "job.json", job.model_dump())
    try:
        run_child(python_child(WORKER_MODULE, str(job_path)), name="verify-extract", timeout_s=cfg.timeout_s,
                  log_path=log_path or out_dir / "extract.log", on_line=log,
                  env=engine_env(cfg))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return hs_dir


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _explain(stored, alone, max_rel: float) -> str:
    """' (...)' naming a token shift that explains the difference, or ''."""
    T = stored.shape[0]
    for s in sorted(range(-MAX_SHIFT, MAX_SHIFT + 1), key=abs):
        if s == 0 or T - abs(s) < 2:
            continue
        a, b = (stored[:T - s], alone[s:]) if s > 0 else (stored[-s:], alone[:T + s])
        if _rel(a, b) <= max_rel:
            return (f"; it equals the alone extraction shifted by {s:+d} token{'s' if abs(s) > 1 else ''} "
                    f"(token t holds token t{s:+d}): an offset that moves between the requests of a batch")
    return ""


def compare_records(stored_path: Path, alone_path: Path, name: str, layer_ids: list[int],
                    max_rel: float, min_cos: float) -> tuple[list[str], dict[int, float], float]:
    """Problems of one stored record against its alone extraction, per-layer relative errors, min cosine."""
    import torch

    stored, alone = dequantise(read_record(stored_path)), dequantise(read_record(alone_path))  # [T, L, H]
    if stored.shape != alone.shape:
        return ([f"{name}: stored hidden_states {list(stored.shape)}, extracted alone {list(alone.shape)}"],
                {}, float("nan"))
    problems, rels, worst_cos = [], {}, 1.0
    for li, lid in enumerate(layer_ids):
        s, a = stored[:, li], alone[:, li]  # [T, H]
        rel = _rel(s, a)
        cos = torch.nn.functional.cosine_similarity(s, a, dim=-1)  # [T]
        rels[lid] = rel
        worst_cos = min(worst_cos, float(cos.min()))
        if rel > max_rel or float(cos.min()) < min_cos:
            bad = (cos < min_cos).nonzero()
            first = f", first differing token {int(bad[0, 0])} of {s.shape[0]}" if len(bad) else ""
            problems.append(f"{name}: layer {lid}: batched extraction differs from the same sample extracted "
                            f"alone (batch of one): relative error {rel:.4f} (max {max_rel:g}), min token cosine "
                            f"{float(cos.min()):.4f} (min {min_cos:g}){first}{_explain(s, a, max_rel)}")
    return problems, rels, worst_cos


def invariance_check(cfg: VerifyConfig, extract_cfg: ExtractConfig, target: TargetConfig, version: ExtractVersion,
                     rows: list[int], work_dir: Path, *, log: Callable[[str], None] = print,
                     log_path: Path | None = None) -> InvarianceResult:
    """Re-extract `rows` of `version` alone in one engine child and compare them with the stored records."""
    from eagle3_pipeline.data.prepare import load_tokenized
    from eagle3_pipeline.proc import ChildFailed

    t0 = time.time()
    tokenized_dir, layer_ids, storage_dtype = Path(version.tokenized_dir), version.layer_ids, version.storage_dtype
    if not rows:
        return InvarianceResult(samples_checked=[], max_rel_err=None, min_cosine=None, per_layer_max_rel_err={},
                                problems=[], skipped="no good records to re-extract")
    slack = FP8_SLACK if storage_dtype == "fp8" else 1.0
    max_rel, min_cos = cfg.invariance_max_rel_err * slack, 1 - (1 - cfg.invariance_min_cosine) * slack
    work_dir = Path(work_dir)
    try:
        log(f"verify invariance: re-extracting rows {rows} alone (batch of one, connector "
            f"{extract_cfg.connector_module}.{extract_cfg.connector_name})")
        alone_dir = extract_rows(extract_cfg, target, tokenized_dir, [(r, r + 1) for r in rows], work_dir,
                                 layer_ids, version.dims.hidden_size, max_num_seqs=1, log=log, log_path=log_path)
        ds = load_tokenized(tokenized_dir)
        problems, bad, worst, worst_cos = [], set(), {}, 1.0
        for r in rows:
            name = f"{record_name(r)} (row {r}, sample {ds[r].get('sample_id')})"
            probs, rels, cos = compare_records(version.record_path(r), alone_dir / record_name(r), name, layer_ids,
                                               max_rel, min_cos)
            for lid, v in rels.items():
                worst[lid] = max(worst.get(lid, 0.0), v)
            worst_cos = min(worst_cos, cos)
            if probs:
                problems += probs
                bad.add(r)
    except ChildFailed as e:
        return InvarianceResult(samples_checked=[], max_rel_err=None, min_cosine=None, per_layer_max_rel_err={},
                                problems=[f"invariance check could not run: the extract child failed: {e}"],
                                seconds=round(time.time() - t0, 2))
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    log(f"verify invariance: {len(rows)} samples, max relative error {max(worst.values(), default=0):.5f}, "
        f"min cosine {worst_cos:.5f} ({time.time() - t0:.1f}s)")
    return InvarianceResult(samples_checked=rows, max_rel_err=max(worst.values(), default=None),
                            min_cosine=worst_cos if worst else None, per_layer_max_rel_err=worst,
                            problems=problems, bad_rows=sorted(bad), seconds=round(time.time() - t0, 2))

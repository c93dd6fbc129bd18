"""Numeric reference: recompute hidden states of a few samples with Hugging Face transformers, one
decoder layer at a time in a child process, and compare them per layer with the stored records.

More: docs/internals.md, "verify/reference.py".
"""

from __future__ import annotations

import math
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from eagle3_pipeline.core.config import VerifyConfig
from eagle3_pipeline.core.errors import EnvironmentProblem
from eagle3_pipeline.core.proc import ChildFailed, exit_code, python_child, run_child
from eagle3_pipeline.core.progress import interval
from eagle3_pipeline.core.store import read_json, write_json
from eagle3_pipeline.data.tokenized import load_tokenized
from eagle3_pipeline.records.contracts import compare_layers, dequantise, read_record
from eagle3_pipeline.verify.worker import BUDGET_EXIT, RESULT_FILE, ReferenceJob, ReferenceOutput, ReferenceSample

# The pass/fail criteria (per record and layer) are settings: verify.reference_cos_bound,
# reference_min_mean_cosine, reference_max_frac_below and reference_max_rel_err (core/config.py VerifyConfig,
# each with its derivation); decided in `_row_problems` only. Per-layer criteria over a record's tokens, not its
# single worst token: MoE targets route near-ties differently in vLLM's kernels and in transformers, which moves a
# few tokens a lot, while a wrong layer, offset or request moves most of them (the calibration:
# docs/verification.md, "Calibration").
WORKER = "eagle3_pipeline.verify.worker"


class ReferenceBudgetExceeded(EnvironmentProblem):
    """The reference child's peak RSS went past `verify.reference_memory_gb` (message: budget, layer, RSS)."""


class ReferenceFailed(RuntimeError):
    """The reference child failed for another reason; the message carries its output's tail."""


class ReferenceResult(BaseModel):
    samples_checked: list[int]
    max_rel_err: float | None
    min_cosine: float | None
    per_layer_max_rel_err: dict[int, float]
    problems: list[str]
    bad_rows: list[int] = []
    skipped: str | None = None
    peak_rss_bytes: int | None = None  # of the reference child (ru_maxrss)
    # per layer id over the checked rows: max_rel_err, min_cosine, mean_cosine (the lowest row mean),
    # max_frac_below (fraction of a row's tokens with cosine < verify.reference_cos_bound, worst row)
    per_layer: dict[int, dict] = {}
    seconds: float | None = None


def miss_probability(n_rows: int, bad: int, sampled: int) -> float:
    """The chance that `sampled` rows drawn without replacement from `n_rows` miss all `bad` of them."""
    p = 1.0
    for i in range(sampled):
        if n_rows - i <= 0:
            return 0.0
        p *= max(0, n_rows - bad - i) / (n_rows - i)
    return p


def reference_size(n_rows: int, rate: float, power: float) -> int:
    """The fewest rows that catch a corruption of `rate` of `n_rows` (at least one bad row) with probability
    `power`: 59 for 1 in 20 at 95% on a large dataset, every row of a small one."""
    bad = max(1, math.ceil(rate * n_rows))
    n = 0
    while n < n_rows and 1.0 - miss_probability(n_rows, bad, n) < power:
        n += 1
    return n


def power_statement(n_rows: int, sampled: int, rate: float) -> dict:
    """What a reference sample of `sampled` rows could and could not have caught (the report says it)."""
    bad = max(1, math.ceil(rate * n_rows)) if n_rows else 0
    p = 1.0 - miss_probability(n_rows, bad, sampled) if n_rows else 0.0
    one = sampled / n_rows if n_rows else 0.0
    return {"rows": n_rows, "sampled": sampled, "rate": rate, "power": round(p, 4), "single_row": round(one, 4),
            "says": f"a corruption of {rate:.0%} of the rows ({bad} of {n_rows}) is caught with probability "
                    f"{p:.1%}; a single bad row with probability {one:.1%}"}


def choose_rows(seq_lens: list[int], count: int, rows_per_shard: int) -> list[int]:
    """`count` rows stratified over the dataset: the longest and the shortest, then every shard in turn (and so
    every group of shards), at offsets within the shard spread by the golden ratio (the k-th visit of a shard
    at frac(k * 0.618) of it), so the picks also cover every position of a request in the engine's batches."""
    n = len(seq_lens)
    if n == 0 or count <= 0:
        return []
    count = min(count, n)
    picks = {max(range(n), key=seq_lens.__getitem__), min(range(n), key=seq_lens.__getitem__)}
    shards = max(1, -(-n // max(1, rows_per_shard)))
    phi, i = (5 ** 0.5 - 1) / 2, 0
    while len(picks) < count:
        shard = i % shards
        lo, hi = shard * rows_per_shard, min(n, (shard + 1) * rows_per_shard)
        offset = int(((i // shards) * phi) % 1.0 * (hi - lo))
        row = lo + offset
        k = 0
        while row in picks and k < hi - lo:  # the next free row of that shard
            row, k = lo + (row - lo + 1) % (hi - lo), k + 1
        picks.add(row)
        i += 1
    return sorted(picks)[:max(count, min(2, n))]


def neighbour_layers(layer_ids: list[int], num_layers: int) -> list[int]:
    """The captured layer ids and their neighbours (k - 1, k + 1 within 0..N), ascending: what the
    reference streams so that each slot can be told from the layers beside it."""
    return sorted({n for k in layer_ids for n in (k - 1, k, k + 1) if 0 <= n <= num_layers})


def _layer_map_problems(got, every, layer_ids: list[int], at: dict[int, int]) -> list[str]:
    """Each captured slot must be nearer its own reference layer than the layers beside it. Adjacent
    layers of a deep model differ little (SmolLM2-135M, layer 15 vs 16: relative error 0.037, inside the
    per-layer tolerance), so an off-by-one or permuted layer map that every row shares passes the
    per-layer bounds; against the neighbours it does not (clean: 0.0024)."""
    out = []
    for j, k in enumerate(layer_ids):
        g = got[:, j].float()

        def rel(lid: int) -> float:
            r = every[:, at[lid]]
            return float((g - r).norm() / r.norm().clamp_min(1e-12))

        own = rel(k)
        near = [(rel(n), n) for n in (k - 1, k + 1) if n in at]
        better = [(e, n) for e, n in near if e < own]
        if better:
            e, n = min(better)
            out.append(f"layer slot {j} (layer {k}) is nearer the reference's layer {n} (relative error {e:.4f}) "
                       f"than its own (relative error {own:.4f}): the captured layers are off by one or permuted")
    return out


def _row_problems(diffs, cfg) -> list[str]:
    """The pass/fail decision for one record: a problem per layer (contracts.LayerDiff) that is off, under
    the thresholds of `cfg` (config.VerifyConfig)."""
    max_rel, min_mean = cfg.reference_max_rel_err, cfg.reference_min_mean_cosine
    max_frac, bound = cfg.reference_max_frac_below, cfg.reference_cos_bound
    return [f"layer {d.layer_id} differs from the reference: relative error {d.rel_err:.4f} (max {max_rel}), "
            f"mean token cosine {d.mean_cosine:.4f} (min {min_mean}), {d.frac_below:.1%} of tokens below "
            f"cosine {bound} (max {max_frac:.0%}; worst token {d.min_cosine:.4f})"
            + (f", first token below at {d.first_below}" if d.first_below is not None else "")
            for d in diffs if d.rel_err > max_rel or d.mean_cosine < min_mean or d.frac_below > max_frac]


def _skipped(note: str, log) -> ReferenceResult:
    log(note)
    return ReferenceResult(samples_checked=[], max_rel_err=None, min_cosine=None, per_layer_max_rel_err={},
                           problems=[], skipped=note)


_LAYER_LINE = re.compile(r"\] reference: layer (\d+) ")


def layer_cadence(log: Callable[[str], None], depth: int) -> Callable[[str], None]:
    """The reference child's lines, its per-layer ones at the extraction's cadence: the first layer, the last
    (`depth` - 1) and one at most every progress.interval() seconds between (61 of them for a Kimi-sized
    target); every line is in the child's log file."""
    every, shown = interval(), [float("-inf")]

    def on_line(line: str) -> None:
        m = _LAYER_LINE.search(line)
        if m:
            k, now = int(m.group(1)), time.monotonic()
            if k not in (0, depth - 1) and now - shown[0] < every:
                return
            shown[0] = now
        log(line)

    return on_line


def stream_reference(target, samples: dict[int, list[int]], layer_ids: list[int], work_dir: Path, *,
                     memory_gb: float, timeout_s: float, log: Callable[[str], None] = print,
                     log_path: Path | None = None):
    """Run the reference child (`verify.worker`) on `samples` (row -> token ids) and return
    (worker.ReferenceOutput, {row: [T, L, H] tensor in the model dtype}); the tensors are empty when
    the output says `skipped`. `work_dir` is created and removed. Raises ReferenceBudgetExceeded or
    ReferenceFailed (non-zero exit, deadline)."""
    from safetensors.torch import load_file

    work = Path(work_dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    job = ReferenceJob(target=target, layer_ids=list(layer_ids), out_dir=str(work.resolve()),
                       samples=[ReferenceSample(row=r, token_ids=list(ids)) for r, ids in samples.items()],
                       memory_budget_bytes=int(memory_gb * 2**30))
    job_path = write_json(work / "job.json", job.model_dump(mode="json"))
    where = f" (full log: {log_path})" if log_path else ""
    try:
        child = run_child(python_child(WORKER, str(job_path)), name="verify-reference", timeout_s=timeout_s,
                          log_path=log_path, on_line=layer_cadence(log, max(layer_ids)), check=False)
        raw = read_json(work / RESULT_FILE)
        out = ReferenceOutput(**raw) if raw is not None else None
        if child.returncode == BUDGET_EXIT and out is not None and out.error:
            raise ReferenceBudgetExceeded(out.error)
        if child.returncode != 0 or out is None:
            raise ReferenceFailed(f"verify reference child exited with {exit_code(child.returncode)}{where}; last output:\n"
                                  + "\n".join(child.tail[-30:]))
        if out.skipped:
            return out, {}
        refs = load_file(out.hidden_states_path)  # row_{i}: [T, L, H] in the model dtype
        return out, {r: refs[f"row_{r}"] for r in out.rows}
    except ChildFailed as e:  # only the deadline raises here (check=False)
        raise ReferenceFailed(str(e)) from e
    finally:
        shutil.rmtree(work, ignore_errors=True)


def reference_check(target, version, rows: list[int], *, log: Callable[[str], None] = print,
                    cfg=None) -> ReferenceResult:
    """Recompute `rows` of `version` (layout.ExtractVersion) with the target (config.TargetConfig) in a
    child that streams it layer by layer under `cfg.reference_memory_gb` (config.VerifyConfig; default
    VerifyConfig()), and compare them with the stored records. Raises ReferenceBudgetExceeded when the
    child went past its memory budget, ReferenceFailed when it failed otherwise."""
    cfg = cfg or VerifyConfig()
    t0 = time.time()
    layer_ids = list(version.layer_ids)
    if not rows:
        return _skipped("reference check skipped: no rows to check", log)
    ds = load_tokenized(version.tokenized_dir)
    streamed = neighbour_layers(layer_ids, version.dims.num_layers)  # the captured ids and the ones beside them
    out, refs = stream_reference(target, {i: ds[i]["input_ids"] for i in rows}, streamed,
                                 version.path / ".scratch" / f"verify-reference-{os.getpid()}",
                                 memory_gb=cfg.reference_memory_gb, timeout_s=cfg.reference_timeout_s, log=log,
                                 log_path=version.path / "logs" / "verify-reference.log")
    if out.skipped:
        res = _skipped(f"reference check skipped: {out.skipped}", log)
        res.peak_rss_bytes = out.peak_rss_bytes
        return res
    problems, bad_rows, per_layer = [], set(), {}
    at = {lid: j for j, lid in enumerate(streamed)}
    for i in rows:
        got = dequantise(read_record(version.record_path(i)))  # [T, L, H] fp32
        every = refs[i].float()  # [T, len(streamed), H]
        ref = every[:, [at[lid] for lid in layer_ids]]  # [T, L, H]
        if got.shape != ref.shape:
            bad_rows.add(i)
            problems.append(f"hs_{i} (sample {ds[i]['sample_id']}): hidden_states expected {list(ref.shape)} "
                            f"(tokens, layers {layer_ids}, hidden), found {list(got.shape)}")
            continue
        diffs = compare_layers(got, ref, layer_ids, cfg.reference_cos_bound)
        for d in diffs:
            s = per_layer.setdefault(d.layer_id, {"max_rel_err": 0.0, "min_cosine": 1.0, "mean_cosine": 1.0,
                                                  "max_frac_below": 0.0})
            s["max_rel_err"] = max(s["max_rel_err"], d.rel_err)
            s["min_cosine"] = min(s["min_cosine"], d.min_cosine)
            s["mean_cosine"] = min(s["mean_cosine"], d.mean_cosine)
            s["max_frac_below"] = max(s["max_frac_below"], d.frac_below)
        row_problems = _row_problems(diffs, cfg) + _layer_map_problems(got, every, layer_ids, at)
        if row_problems:
            bad_rows.add(i)
            problems += [f"hs_{i} (sample {ds[i]['sample_id']}): {p}" for p in row_problems]
    worst = {lid: s["max_rel_err"] for lid, s in per_layer.items()}
    min_cos = min((s["min_cosine"] for s in per_layer.values()), default=None)
    peak = f", peak RSS {out.peak_rss_bytes / 2**30:.2f} GiB" if out.peak_rss_bytes else ""
    log(f"verify reference: {len(rows)} samples, max relative error {max(worst.values(), default=0):.4f}, "
        f"min cosine {min_cos if min_cos is not None else float('nan'):.4f}{peak}")
    return ReferenceResult(samples_checked=list(rows), max_rel_err=max(worst.values(), default=None),
                           min_cosine=min_cos, per_layer_max_rel_err=worst, problems=problems,
                           bad_rows=sorted(bad_rows), peak_rss_bytes=out.peak_rss_bytes, per_layer=per_layer,
                           seconds=round(time.time() - t0, 2))

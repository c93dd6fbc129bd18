"""The verify gate: structure, statistics and norm bounds of every record, numeric reference (HF
transformers) and batch invariance (the same samples extracted alone) on samples; recorded per version.

Reads `tokenized/`, `hidden_states/`, the target model, and the extract config from the call or from
`manifest.json`. Writes `<extract-dir>/verify.json` holding the extract content key and the result
(including per-layer statistics and the learned norm bounds), and `logs/verify-invariance.log` (the
batch-of-one extract child). `require_verified` (called by train) refuses data whose current content
key has no passing record. Failing files are moved to `hidden_states_failed/` (never deleted) so that
a re-run of the failed shards re-extracts exactly them. Never cached: it runs every time.
Two verifies of one extract dir never overlap: each holds `<extract-dir>/locks/verify.lock`
(store.file_lock) from its first read to verify.json, so a second one waits and then checks again.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from pydantic import BaseModel

from eagle3_pipeline.config import ExtractConfig, TargetConfig, VerifyConfig
from eagle3_pipeline.data.prepare import load_tokenized
from eagle3_pipeline.errors import GateFailed
from eagle3_pipeline.layout import ExtractVersion
from eagle3_pipeline.store import file_lock, read_json, write_json
from eagle3_pipeline.verify.invariance import InvarianceResult, invariance_check, invariance_rows
from eagle3_pipeline.verify.reference import ReferenceResult, choose_rows, reference_check
from eagle3_pipeline.verify.structure import LayerStats, verify_structure


class VerifyFailed(GateFailed):
    """The gate found bad data; the message lists the problems (file, sample, layer, shapes)."""


class VerifyResult(BaseModel):
    content_key: str
    passed: bool
    samples_checked: int
    tokens_checked: int
    reference_max_rel_err: float | None
    reference_min_cosine: float | None
    reference_samples: list[int]
    reference_skipped: str | None
    problems: list[str]
    bad_rows: list[int]
    moved_files: list[str]
    layer_stats: list[LayerStats]
    # (defaults: verify.json files written before these fields existed still load)
    bytes_read: int = 0
    structure_seconds: float | None = None
    norm_bounds_files: int = 0
    norm_bounds_skipped: str | None = None
    invariance_samples: list[int] = []
    invariance_max_rel_err: float | None = None
    invariance_min_cosine: float | None = None
    invariance_skipped: str | None = None
    seconds: float | None = None


def _extract_config(extract_dir: Path, given: ExtractConfig | None) -> tuple[ExtractConfig | None, str | None]:
    """The extract config that produced the data: the one given, else the one in manifest.json."""
    if given is not None:
        return given, None
    m = read_json(Path(extract_dir) / "manifest.json")
    try:
        return ExtractConfig(**m["config"]["extract"]), None
    except Exception as e:  # noqa: BLE001 - no manifest, or one from an incompatible version
        return None, f"no extract config given and none usable in {extract_dir}/manifest.json ({type(e).__name__}: {e})"


def verify(cfg: VerifyConfig, target: TargetConfig, version: ExtractVersion, *, log=print,
           extract_cfg: ExtractConfig | None = None) -> VerifyResult:
    """Check everything, record the result in `verify.json`, and return it (the caller raises on failure).
    `extract_cfg` (engine and connector settings for the invariance re-extraction) defaults to the one
    recorded in the manifest. Holds the extract dir's verify lock throughout."""
    with file_lock(version.path / "locks" / "verify.lock", f"verify of {version.dir}", log):
        return _verify(cfg, target, version, log, extract_cfg)


def _verify(cfg: VerifyConfig, target: TargetConfig, version: ExtractVersion, log,
            extract_cfg: ExtractConfig | None) -> VerifyResult:
    t0 = time.time()
    extract_dir, tokenized_dir = version.path, Path(version.tokenized_dir)
    st = verify_structure(tokenized_dir, version.hidden_states_dir, version.layer_ids, version.dims.hidden_size,
                          version.storage_dtype, log=log, norm_samples=cfg.norm_bounds_samples,
                          norm_factor=cfg.norm_bounds_factor, norm_min_ratio=cfg.norm_bounds_min_ratio,
                          workers=cfg.workers)
    good = set(range(st.files_checked)) - set(st.bad_rows)
    seq_lens = load_tokenized(tokenized_dir)["seq_len"] if good else []
    ref = ReferenceResult(samples_checked=[], max_rel_err=None, min_cosine=None, per_layer_max_rel_err={},
                          problems=[], skipped="reference_samples is 0")
    if cfg.reference_samples > 0 and good:
        rows = [r for r in choose_rows(seq_lens, cfg.reference_samples, version.rows_per_shard) if r in good]
        ref = reference_check(target, version, rows, log=log)
    inv = InvarianceResult(samples_checked=[], max_rel_err=None, min_cosine=None, per_layer_max_rel_err={},
                           problems=[], skipped="invariance_samples is 0")
    if cfg.invariance_samples > 0:
        ecfg, why = _extract_config(extract_dir, extract_cfg)
        if ecfg is None:
            inv.skipped = why
        elif not good:
            inv.skipped = "no good records to re-extract"
        else:
            rows = invariance_rows(seq_lens, cfg.invariance_samples, version.rows_per_shard, good - set(ref.bad_rows))
            inv = invariance_check(cfg, ecfg, target, version, rows,
                                   extract_dir / ".scratch" / f"verify-invariance-{os.getpid()}", log=log,
                                   log_path=extract_dir / "logs" / "verify-invariance.log")
    if inv.skipped:
        log(f"verify: invariance check skipped: {inv.skipped}")
    problems = st.problems + ref.problems + inv.problems
    bad_rows = sorted(set(st.bad_rows) | set(ref.bad_rows) | set(inv.bad_rows))
    moved = []
    if problems and cfg.move_bad_files:
        failed_dir = extract_dir / "hidden_states_failed"
        for r in bad_rows:
            f = version.record_path(r)
            if f.exists():
                failed_dir.mkdir(exist_ok=True)
                shutil.move(str(f), str(failed_dir / f.name))
                moved.append(str(failed_dir / f.name))
        from eagle3_pipeline.extract.shards import mark_rows_failed

        shards = mark_rows_failed(extract_dir, bad_rows, "verify failed")
        log(f"verify: moved {len(moved)} files to {failed_dir}; shards {shards} marked failed for re-extraction")
    res = VerifyResult(
        content_key=version.content_key, passed=not problems and st.files_checked > 0, samples_checked=st.files_checked,
        tokens_checked=st.tokens_checked, reference_max_rel_err=ref.max_rel_err, reference_min_cosine=ref.min_cosine,
        reference_samples=ref.samples_checked, reference_skipped=ref.skipped, problems=problems, bad_rows=bad_rows,
        moved_files=moved, layer_stats=st.layer_stats, bytes_read=st.bytes_read, structure_seconds=st.seconds,
        norm_bounds_files=st.norm_bounds_files, norm_bounds_skipped=st.norm_bounds_skipped,
        invariance_samples=inv.samples_checked, invariance_max_rel_err=inv.max_rel_err,
        invariance_min_cosine=inv.min_cosine, invariance_skipped=inv.skipped, seconds=round(time.time() - t0, 2))
    write_json(version.verify_path, res.model_dump())
    return res


def check_verify_gate(res: VerifyResult, max_listed: int = 20) -> None:
    if res.passed:
        return
    if res.samples_checked == 0:
        raise VerifyFailed("verify: no records to check")
    shown = "\n  ".join(res.problems[:max_listed])
    more = f"\n  ... and {len(res.problems) - max_listed} more" if len(res.problems) > max_listed else ""
    raise VerifyFailed(f"verify failed: {len(res.problems)} problems in {len(res.bad_rows)} records "
                       f"(moved to hidden_states_failed/: {len(res.moved_files)}):\n  {shown}{more}")


def require_verified(version: ExtractVersion) -> VerifyResult:
    """Refuse to go on (train) with data whose current version did not pass verify."""
    rec = read_json(version.verify_path)
    if rec is None:
        raise VerifyFailed(f"{version.dir}: never verified; run the verify stage first")
    res = VerifyResult(**rec)
    if res.content_key != version.content_key:
        raise VerifyFailed(f"{version.dir}: verified content key {res.content_key} but the data is now "
                           f"{version.content_key}; verify again")
    if not res.passed:
        raise VerifyFailed(f"{version.dir}: the last verify of {version.content_key} failed ({len(res.problems)} problems)")
    return res

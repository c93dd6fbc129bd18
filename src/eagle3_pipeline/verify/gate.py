"""The verify gate: structure of every record + numeric reference on a sample, recorded per version.

Reads `tokenized/`, `hidden_states/`, the target model. Writes `<extract-dir>/verify.json` holding the
extract content key and the result; `require_verified` (called by train) refuses data whose current
content key has no passing record. Failing files are moved to `hidden_states_failed/` (never deleted)
so that a re-run of the failed shards re-extracts exactly them. Never cached: it runs every time.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from pydantic import BaseModel

from eagle3_pipeline.config import TargetConfig, VerifyConfig
from eagle3_pipeline.data.prepare import load_tokenized
from eagle3_pipeline.store import read_json, write_json
from eagle3_pipeline.verify.reference import ReferenceResult, choose_rows, reference_check
from eagle3_pipeline.verify.structure import LayerStats, verify_structure


class VerifyFailed(RuntimeError):
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


def verify(cfg: VerifyConfig, target: TargetConfig, tokenized_dir: Path, extract_dir: Path, layer_ids: list[int],
           hidden_size: int, storage_dtype: str, rows_per_shard: int, content_key: str, log=print) -> VerifyResult:
    """Check everything, record the result in `verify.json`, and return it (the caller raises on failure)."""
    hs_dir = Path(extract_dir) / "hidden_states"
    st = verify_structure(tokenized_dir, hs_dir, layer_ids, hidden_size, storage_dtype, log=log)
    ref = ReferenceResult(samples_checked=[], max_rel_err=None, min_cosine=None, per_layer_max_rel_err={},
                          problems=[], skipped="reference_samples is 0")
    if cfg.reference_samples > 0 and st.files_checked:
        good = set(range(st.files_checked)) - set(st.bad_rows)
        seq_lens = load_tokenized(tokenized_dir)["seq_len"]
        rows = [r for r in choose_rows(seq_lens, cfg.reference_samples, rows_per_shard) if r in good]
        ref = reference_check(target.model, tokenized_dir, hs_dir, layer_ids, rows, storage_dtype,
                              target.trust_remote_code, log=log)
    problems = st.problems + ref.problems
    bad_rows = sorted(set(st.bad_rows) | set(ref.bad_rows))
    moved = []
    if problems and cfg.move_bad_files:
        failed_dir = Path(extract_dir) / "hidden_states_failed"
        for r in bad_rows:
            f = hs_dir / f"hs_{r}.safetensors"
            if f.exists():
                failed_dir.mkdir(exist_ok=True)
                shutil.move(str(f), str(failed_dir / f.name))
                moved.append(str(failed_dir / f.name))
        from eagle3_pipeline.extract.shards import mark_rows_failed

        shards = mark_rows_failed(Path(extract_dir), bad_rows, "verify failed")
        log(f"verify: moved {len(moved)} files to {failed_dir}; shards {shards} marked failed for re-extraction")
    res = VerifyResult(
        content_key=content_key, passed=not problems and st.files_checked > 0, samples_checked=st.files_checked,
        tokens_checked=st.tokens_checked, reference_max_rel_err=ref.max_rel_err, reference_min_cosine=ref.min_cosine,
        reference_samples=ref.samples_checked, reference_skipped=ref.skipped, problems=problems, bad_rows=bad_rows,
        moved_files=moved, layer_stats=st.layer_stats)
    write_json(Path(extract_dir) / "verify.json", res.model_dump())
    return res


def check_gate(res: VerifyResult, max_listed: int = 20) -> None:
    if res.passed:
        return
    if res.samples_checked == 0:
        raise VerifyFailed("verify: no records to check")
    shown = "\n  ".join(res.problems[:max_listed])
    more = f"\n  ... and {len(res.problems) - max_listed} more" if len(res.problems) > max_listed else ""
    raise VerifyFailed(f"verify failed: {len(res.problems)} problems in {len(res.bad_rows)} records "
                       f"(moved to hidden_states_failed/: {len(res.moved_files)}):\n  {shown}{more}")


def require_verified(extract_dir: Path, content_key: str) -> VerifyResult:
    """Refuse to go on (train) with data whose current version did not pass verify."""
    rec = read_json(Path(extract_dir) / "verify.json")
    if rec is None:
        raise VerifyFailed(f"{extract_dir}: never verified; run the verify stage first")
    res = VerifyResult(**rec)
    if res.content_key != content_key:
        raise VerifyFailed(f"{extract_dir}: verified content key {res.content_key} but the data is now "
                           f"{content_key}; verify again")
    if not res.passed:
        raise VerifyFailed(f"{extract_dir}: the last verify of {content_key} failed ({len(res.problems)} problems)")
    return res

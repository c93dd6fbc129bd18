"""The versions of a dataset in the run store, newest first, and the lineage of a refresh.

Reads only small records: `<store>/<dataset>/<prepare version>/prepare.json`, each extract version's
`manifest.json` (content key, layer ids, `updated_at`) and its trained drafts'
`train/<train key>/train_result.json`. Writes nothing. Used by the train stage (`train.init:
previous` continues from the previous version's draft), the evaluate stage (that draft is evaluated
on the same held-out prompts) and `eagle3 gc` (which versions are the newest N).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from eagle3_pipeline.core.store import read_json
from eagle3_pipeline.records.shardrun import MANIFEST_NAME, ShardRun


class PreviousDraft(BaseModel):
    """The draft of the newest other extract version of the same dataset, model and layer ids."""
    extract_version: str   # its content key
    extract_dir: str
    prepare_version: str
    checkpoint: str        # checkpoint_best of its newest trained draft
    train_dir: str


def prepare_versions(dataset_dir: Path) -> list[Path]:
    """Complete prepare version dirs of a dataset (with prepare.json), newest first (prepare.json mtime)."""
    dataset_dir = Path(dataset_dir)
    if not dataset_dir.is_dir():
        return []
    found = [d for d in dataset_dir.iterdir() if d.is_dir() and (d / "prepare.json").is_file()]
    return sorted(found, key=lambda d: ((d / "prepare.json").stat().st_mtime_ns, d.name), reverse=True)


def _trained(extract_dir: Path) -> tuple[Path, str] | None:
    """(train dir, checkpoint_best) of the newest draft trained on an extract version dir."""
    best = None
    for rec in (extract_dir / "train").glob("*/train_result.json"):
        res = read_json(rec) or {}
        ckpt = res.get("checkpoint_best")
        if ckpt and Path(ckpt).exists():
            t = rec.stat().st_mtime_ns
            if best is None or t > best[0]:
                best = (t, rec.parent, str(ckpt))
    return (best[1], best[2]) if best else None


def previous_draft(version) -> PreviousDraft | None:
    """The newest other extract version (by its manifest's mtime) of `version`'s dataset, with the same
    model slug and layer ids, that has a trained draft; None when there is none."""
    here = version.path.resolve()
    model_slug = here.parent.name
    dataset_dir = here.parent.parent.parent
    cands = []
    for prep in prepare_versions(dataset_dir):
        for ex in (prep / model_slug).glob(f"*/{MANIFEST_NAME}"):
            d = ex.parent.resolve()
            if d == here:
                continue
            if ShardRun(d).read(missing_ok=True).layer_ids != list(version.layer_ids):
                continue
            trained = _trained(d)
            if trained:
                cands.append((trained[0].joinpath("train_result.json").stat().st_mtime_ns, d, prep, trained))
    if not cands:
        return None
    _, d, prep, (train_dir, ckpt) = max(cands, key=lambda c: c[0])
    return PreviousDraft(extract_version=d.name, extract_dir=str(d), prepare_version=prep.name, checkpoint=ckpt,
                         train_dir=str(train_dir))

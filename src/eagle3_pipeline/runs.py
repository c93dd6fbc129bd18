"""Run directories: `<output-dir>/<run-id>/` with `<output-dir>/latest` pointing at the newest.

Owns run ids (UTC time + short random suffix), the `latest` link, the run's config snapshot, and
the assembly of `report.json`'s record from the stage records (report.py writes it).
"""

from __future__ import annotations

import os
import secrets
from datetime import datetime, timezone
from pathlib import Path

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.report import build_report
from eagle3_pipeline.store import write_json


def new_run_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def create_run_dir(output_dir: Path, config: PipelineConfig) -> Path:
    """Make `<output_dir>/<run-id>/`, save the resolved config there, point `latest` at it."""
    output_dir = Path(output_dir).resolve()
    run = output_dir / new_run_id()
    run.mkdir(parents=True)
    write_json(run / "config.json", config.model_dump(mode="json"))
    latest = output_dir / "latest"
    tmp = output_dir / f".latest-{run.name}"
    tmp.symlink_to(run.name)
    os.replace(tmp, latest)
    return run


class RunDir:
    def __init__(self, path: Path):
        self.path = Path(path).resolve()
        self.run_id = self.path.name

    def report_record(self, config: PipelineConfig, recs: dict, versions: dict, error: str | None) -> dict:
        """report.json's record from the stages' typed records (pydantic models, by stage name)."""
        recs = {k: (v.model_dump(mode="json") if hasattr(v, "model_dump") else v) for k, v in recs.items()}
        prep, ext, voc, tr = (recs.get(k, {}) for k in ("prepare", "extract", "vocab", "train"))
        artifacts = {
            "tokenized": prep.get("tokenized"), "hidden_states": ext.get("hidden_states_dir"),
            "manifest": ext.get("manifest"), "vocab": voc.get("dir"), "checkpoint": tr.get("checkpoint_best"),
            "target_model": str(Path(config.target.model).resolve()) if Path(config.target.model).exists()
            else config.target.model,
        }
        status = "failed" if error else "completed"
        return build_report(self.run_id, config.model_dump(mode="json"), versions, recs,
                            {k: (str(v) if v is not None else None) for k, v in artifacts.items()}, status, error)

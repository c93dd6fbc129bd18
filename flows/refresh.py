"""The refresh flow (the scheduled deployment): re-prepare the sources; when that data and config
already have a trained draft, stop there; otherwise run the pipeline on it, which extracts only the
shards not yet published, verifies, trains and evaluates.

More: docs/internals.md, "flows/refresh.py".
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from eagle3_pipeline.core.config import PipelineConfig, SourceConfig, load_config
from eagle3_pipeline.core.store import read_json
from eagle3_pipeline.pipeline import stages
from eagle3_pipeline.records.layout import ExtractVersion
from flows.head import prepare_run
from flows.hub_auth import use_hub_secret
from flows.lease import rescheduled_on_lost_lease
from flows.pipeline import pipeline
from tasks import stage_tasks as t


@flow(name="refresh", log_prints=True)
def refresh(config_path: str = "configs/tiny-cpu.yaml", overrides: list[str] | None = None,
            sources: list[SourceConfig] | None = None, output_dir: str = "runs", retrain: bool = False) -> dict:
    with rescheduled_on_lost_lease():  # the refresh deployment has a concurrency limit: flows/lease.py
        config = load_config(config_path, overrides or [])
        if sources:
            config.prepare.sources = sources
        use_hub_secret(config)
        config.evaluate.compare_previous = True  # tau of the new draft next to the previous version's, same prompts
        if config.prepare.heldout_fraction is None:
            print("refresh: prepare.heldout_fraction is not set: the held-out set is the heldout_rows lowest hashes, "
                  "which added rows can shift; set it to keep held-out conversations out of training across refreshes")
        prepared = prepare_run(config)  # the store answers a version already done
        prep, version = prepared.prepare, prepared.version
        draft = trained_draft(config, version)
        t.record_refresh(config, prep, draft, changed=retrain or draft is None)
        if draft and not retrain:
            print(f"refresh: {config.prepare.dataset}@{prep.version} unchanged; its draft is {draft}")
            return {"changed": False, "version": prep.version, "draft": draft}
        rec = pipeline(config=config, output_dir=output_dir, prepared=prepared)  # goes on from this head
        t.record_refresh(config, prep, draft, changed=True, report=rec)
        ex = rec.stages.extract
        extracted, reused = (ex.rows_extracted, ex.rows_reused) if ex else (None, None)
        print(f"refresh: {config.prepare.dataset}@{prep.version}: {extracted} rows extracted, "
              f"{reused} linked from earlier versions (record pool)")
        return {"changed": True, "version": prep.version, "draft": rec.artifacts.checkpoint, "run_id": rec.run_id,
                "rows_extracted": extracted, "rows_reused": reused}


def trained_draft(config: PipelineConfig, version: ExtractVersion) -> str | None:
    """checkpoint_best of the draft already trained on exactly this data and config, if any (the train
    stage's own location: version.train_dir(stages.train_key(...)))."""
    res = read_json(version.train_dir(stages.train_key(config, version)) / "train_result.json")
    best = res and res.get("checkpoint_best")
    return str(best) if best and Path(best).exists() else None

"""Thin Prefect tasks around the stage functions of `eagle3_pipeline.stages`.

Each task is one core call plus what Prefect adds: logging through the run logger, retries, tags,
timeouts and artifacts. Gates (preflight, gpu-gate, verify, evaluate) use NO_CACHE: they must run
every time. Stages whose bytes are content-addressed (prepare, extract, vocab, train) answer repeated
work from the run store itself, which checks hashes; Prefect's cache is not trusted with that.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from eagle3_pipeline import stages
from eagle3_pipeline.config import PipelineConfig


def _log():
    return get_run_logger().info


@task(name="prepare", cache_policy=NO_CACHE, tags=["cpu"])
def prepare(cfg: PipelineConfig) -> dict:
    rec = stages.stage_prepare(cfg, log=_log())
    counts = [{"what": k, "value": rec[k]} for k in ("version", "rows_in", "rows_out", "rows_heldout", "rows_quarantined",
                                                      "rows_truncated", "turns_dropped", "tokens", "chunks_computed")]
    hist = [{"what": f"rows of {k} tokens", "value": v} for k, v in rec["length_histogram"].items()]
    reasons = [{"what": f"quarantined: {r['source']} row {r['row']}", "value": r["reason"]}
               for r in stages.first_quarantined(rec, 10)]
    create_table_artifact(key=f"prepare-{_k(cfg.prepare.dataset)}", table=counts + hist + reasons,
                          description=f"prepare of dataset {cfg.prepare.dataset}: counts, lengths, first quarantine reasons")
    return rec


@task(name="preflight", cache_policy=NO_CACHE)
def preflight(cfg: PipelineConfig, prep: dict) -> dict:
    return stages.stage_preflight(cfg, prep, log=_log())


@task(name="gpu-gate", cache_policy=NO_CACHE, task_run_name="gpu-gate-{where}")
def gpu_gate(where: str) -> dict:
    return stages.stage_gpu_gate(where, log=_log())


@task(name="extract-plan", cache_policy=NO_CACHE)
def extract_plan(cfg: PipelineConfig, prep: dict, pre: dict) -> dict:
    return stages.stage_extract_plan(cfg, prep, pre)


def _group_key(ctx, params) -> str:
    return "extract-group-" + stages.group_cache_key(params["plan"], params["shard_ids"])


@task(name="extract-group", cache_key_fn=_group_key, persist_result=True, result_serializer="json",
      tags=["gpu"], task_run_name="extract-shards-{shard_ids}")
def extract_group(cfg: PipelineConfig, prep: dict, plan: dict, shard_ids: list[int], force: bool = False) -> list[dict]:
    """One engine child for these shards; each shard is published (and counted in the progress
    artifact) the moment it is complete. Cached by content key + directory + shard ids; the flow
    refreshes the cache of any group with unpublished shards (stages.unpublished)."""
    progress = _Progress(plan, shard_ids)
    return stages.stage_extract_group(cfg, prep, plan, shard_ids, force, log=_log(), on_shard=progress.shard_done)


@task(name="extract-summary", cache_policy=NO_CACHE)
def extract_summary(plan: dict) -> dict:
    rec = stages.stage_extract_summary(plan)
    create_table_artifact(key=f"extract-manifest-{plan['content_key']}", table=[
        {k: rec[k] for k in ("shards_total", "shards_published", "tokens", "tokens_per_s", "bytes_on_disk")}],
        description=f"extract version {plan['content_key']} ({plan['dir']})")
    return rec


class _Progress:
    """A Prefect progress artifact per group, moved forward as shard_done events arrive (these come on
    the child-output thread, so failures to report are logged, never raised)."""

    def __init__(self, plan: dict, shard_ids: list[int]):
        from prefect.artifacts import create_progress_artifact

        self.total, self.done, self.tokens = len(shard_ids), 0, 0
        self.log = _log()
        self.id = create_progress_artifact(progress=0.0, description=f"extract shards {shard_ids} of {plan['dir']}")

    def shard_done(self, ev: dict) -> None:
        from prefect.artifacts import update_progress_artifact

        self.done += 1
        self.tokens += ev["tokens"]
        try:
            update_progress_artifact(self.id, progress=100.0 * self.done / self.total)
        except Exception as e:  # noqa: BLE001
            self.log(f"progress artifact not updated: {type(e).__name__}: {e}")


@task(name="verify", cache_policy=NO_CACHE)
def verify(cfg: PipelineConfig, prep: dict, pre: dict, ext: dict) -> dict:
    rec = stages.stage_verify(cfg, prep, pre, ext, log=_log())
    create_table_artifact(key=f"verify-stats-{ext['content_key']}", table=rec["layer_stats"],
                          description=f"per-layer statistics of {rec['tokens_checked']} tokens")
    return rec


@task(name="vocab", cache_policy=NO_CACHE)
def vocab(cfg: PipelineConfig, prep: dict, pre: dict, ext: dict) -> dict:
    return stages.stage_vocab(cfg, prep, pre, ext, log=_log())


@task(name="train", cache_policy=NO_CACHE, tags=["gpu"])
def train(cfg: PipelineConfig, prep: dict, pre: dict, ext: dict, voc: dict) -> dict:
    return stages.stage_train(cfg, prep, pre, ext, voc, log=_log())


@task(name="evaluate", cache_policy=NO_CACHE, tags=["gpu"])
def evaluate(cfg: PipelineConfig, prep: dict, pre: dict, voc: dict, tr: dict, run_dir: str) -> dict:
    rec = stages.stage_evaluate(cfg, prep, pre, voc, tr, run_dir, log=_log())
    create_markdown_artifact(key=f"evaluate-{_k(cfg.name)}", markdown=(
        f"τ = **{rec['acceptance_length']:.3f}** (untrained {rec.get('acceptance_length_untrained')}), "
        f"per position {rec['per_position_acceptance']}"), description="acceptance length")
    return rec


@task(name="report", cache_policy=NO_CACHE)
def report(run_dir: str, report_rec: dict, metrics_path: str | None) -> dict:
    from pathlib import Path

    from eagle3_pipeline.report import write_report

    paths = write_report(Path(run_dir), report_rec, Path(metrics_path) if metrics_path else None)
    create_markdown_artifact(key=f"report-{_k(report_rec['config']['name'])}",
                             markdown=Path(paths["report_md"]).read_text(), description=f"run {report_rec['run_id']}")
    return paths


def _k(s: str) -> str:
    """Artifact keys: lowercase letters, digits and dashes only."""
    return "".join(c if c.isalnum() else "-" for c in s.lower()).strip("-")

"""The Prefect tasks of the stages, one per registered stage, built from its StageSpec (`stage_task`, `TASKS`).

A task runs its stage through pipeline/stages.run_stage and adds what Prefect adds: the run logger, retries, a GPU
slot, artifacts and events. Why no Prefect cache, how GPU slots and retries work: docs/internals.md, "tasks/".
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prefect import Task, get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event
from prefect.runtime import flow_run
from pydantic import BaseModel

from eagle3_pipeline.core.config import PipelineConfig
from eagle3_pipeline.core.errors import is_transient
from eagle3_pipeline.core.stage_spec import RETRY_JITTER, Retry, StageSpec
from eagle3_pipeline.core.store import slug
from eagle3_pipeline.data.tokenized import PrepareResult
from eagle3_pipeline.extract.stage import ExtractInputs
from eagle3_pipeline.pipeline import registry, stages
from eagle3_pipeline.preflight.stage import PreflightResult
from eagle3_pipeline.records.layout import ExtractVersion
from eagle3_pipeline.records.shardrun import ShardRun
from eagle3_pipeline.report.record import RunReport
from eagle3_pipeline.report.stage import write_report
from tasks.gpu_lease import gpu_slot, run_logger
from tasks.gpu_lease import gpu_slot_scope as gpu_slot_scope  # re-exported: the flows call it as t.gpu_slot_scope

DATASET_PUBLISHED = "eagle3.dataset.published"
DRAFT_EXPORTED = "eagle3.draft.exported"
# `eagle3.dataset.published` carries `eagle3.training`: `in-run` from the flows that go on to train
# what they prepare (TRAINING_FLOWS), `no` from other flows (rerun-failed), and `wanted` from
# `python -m deployments.publish`, the one value the pipeline deployment's trigger (prefect.yaml)
# answers with a pipeline run: training on publication is asked for, never implied.
TRAINING_FLOWS = frozenset({"pipeline", "refresh"})


def _log():
    return get_run_logger().info


# ------------------------------------------------------------------ retry policies (the one place)


def _options(stage: str, policy: Retry, retries: int | None = None) -> dict:
    """Keyword arguments of @task / Task.with_options from a stage's Retry; `retries` overrides the count
    (extract: config.extract.retries)."""
    transient = policy.transient

    def retry_condition_fn(task, task_run, state) -> bool:  # Prefect calls plain functions only
        exc = state.data if isinstance(state.data, BaseException) else None
        retry = exc is not None and is_transient(exc, transient)
        run_logger().info(f"{stage}: {'retrying' if retry else 'not retrying'} after "
                       f"{type(exc).__name__ if exc else state.type}: "
                       + ("transient" if retry else "not a transient error (a gate, input, config or environment answer)"))
        return retry

    n = policy.retries if retries is None else retries
    return {"retries": n, "retry_delay_seconds": policy.delay_s if n else 0,
            "retry_jitter_factor": RETRY_JITTER if n and policy.delay_s else None,
            "retry_condition_fn": retry_condition_fn if n else None}


# Each stage's policy is its StageSpec's `retry` (in its stage.py), keyed here by its task's name in the registry's order
RETRY_POLICIES: dict[str, Retry] = {s.task_name: s.retry for s in registry.STAGES}


def retry_options(stage: str, retries: int | None = None) -> dict:
    """Prefect's retry options of the registered stage whose task is `stage` (read from the registry at call time,
    so a stage registered later, `registry.registered`, gets its own)."""
    return _options(stage, registry.spec(stage).retry, retries)


def stage_task_options(stage: str, **kw) -> dict:
    """@task options of a registered stage: its task's name and retry policy, and Prefect's cache off unless `kw`
    gives a cache key: a gate (registry.GATES) must run every time, and the content-addressed stages answer a
    repeat from the run store, which checks hashes."""
    name = registry.spec(stage).task_name
    return {"name": name, **({} if "cache_key_fn" in kw else {"cache_policy": NO_CACHE}), **retry_options(name), **kw}


def slot_for(spec: StageSpec) -> contextlib.AbstractContextManager:
    """What a stage's task holds while its entry runs: a GPU slot when it loads a model onto accelerators."""
    return gpu_slot() if spec.accelerators else contextlib.nullcontext()


def stage_task(stage: str, artifacts: Callable | None = None, before: Callable | None = None, **kw) -> Task:
    """The Prefect task of the registered stage `stage`, built from its StageSpec: `task(cfg, inputs)` runs
    `before(inputs)` (what the task adds to the inputs), the stage's entry through stages.run_stage under
    `slot_for(spec)`, then `artifacts(cfg, inputs, record)` (Prefect's tables and events), and returns the record."""
    spec = registry.spec(stage)

    def run(cfg: PipelineConfig, inputs: BaseModel):
        inputs = before(inputs) if before is not None else inputs
        with slot_for(spec):
            rec = stages.run_stage(spec.name, cfg, inputs, log=_log())
        if artifacts is not None:
            artifacts(cfg, inputs, rec)
        return rec

    run.__name__ = run.__qualname__ = spec.task_name.replace("-", "_")
    return task(**stage_task_options(stage, **kw))(run)


def _regenerate_table(cfg: PipelineConfig, inputs, rec) -> None:
    create_table_artifact(key=_record_key("regenerate", cfg), table=[{
        "regenerate_version": rec.version, **rec.model_dump(include={
            "rows_in", "rows_out", "rows_quarantined", "tokens_generated", "turns_regenerated", "rows_per_s",
            "tokens_per_s", "single_pass", "cached"}), "quarantine_kinds": str(rec.quarantine_kinds),
        "rows_dir": rec.rows_dir}],
        description=f"regenerated answers of {cfg.prepare.dataset} by {cfg.target.model}: {rec.single_pass_reason}")


def _prepare_table(cfg: PipelineConfig, inputs, rec: PrepareResult) -> None:
    counts = [{"what": k, "value": getattr(rec, k)}
              for k in ("version", "rows_in", "rows_out", "rows_heldout", "rows_quarantined", "rows_truncated",
                        "turns_dropped", "rows_trimmed", "turns_trimmed", "tokens", "chunks_computed")]
    counts += [{"what": f"turns trimmed: {why}", "value": n} for why, n in rec.trim_reasons.items()]
    counts += [{"what": "WARNING", "value": w} for w in rec.source_warnings]
    counts += [{"what": f"damaged source {d['source']}", "value": f"{d['records_complete']} complete records kept, "
                f"{d['bytes_lost']} bytes lost after byte {d['good_end']}"} for d in rec.damaged_sources]
    hist = [{"what": f"rows of {k} tokens", "value": v} for k, v in rec.length_histogram.items()]
    reasons = [{"what": f"quarantined: {r['source']} row {r['row']}", "value": r["reason"]}
               for r in stages.first_quarantined(rec, 10)]
    create_table_artifact(key=f"prepare-{_k(cfg.prepare.dataset)}", table=counts + hist + reasons,
                          description=f"prepare of dataset {cfg.prepare.dataset}: counts, lengths, first quarantine reasons")
    if not rec.cached:
        publish_dataset_event(cfg, rec)


@task(name="plan-extract", cache_policy=NO_CACHE)
def plan_extract(cfg: PipelineConfig, prep: PrepareResult, pre: PreflightResult) -> ExtractVersion:
    return stages.plan_extract(cfg, prep, pre)


def _group_key(ctx, params) -> str:
    inputs = ExtractInputs.model_validate(params["inputs"])
    return "extract-group-" + inputs.version.group_cache_key(inputs.shard_ids)


def _with_progress(inputs: ExtractInputs) -> ExtractInputs:
    """Each shard is counted in the group's progress artifact the moment it is published."""
    return inputs.model_copy(update={"on_shard": _Progress(inputs.version, inputs.shard_ids).shard_done})




@task(name="extract-summary", cache_policy=NO_CACHE)
def extract_summary(cfg: PipelineConfig, version: ExtractVersion, since: float | None = None):
    rec = stages.stage_extract_summary(version, since)
    shards = ShardRun(version.path).read().shards
    status = {st: sum(s.status == st for s in shards) for st in sorted({s.status for s in shards})}
    create_table_artifact(key=_record_key("extract", cfg), table=[{
        "extract_version": version.content_key,
        **{k: getattr(rec, k) for k in ("shards_total", "shards_published", "tokens", "tokens_per_s", "bytes_on_disk")},
        "attempts": sum(s.attempts for s in shards),
        "status": ", ".join(f"{k}: {v}" for k, v in status.items()), "manifest": rec.manifest}],
        description=f"extract manifest of {cfg.prepare.dataset} on {cfg.target.model} ({version.dir})")
    return rec


class _Progress:
    """A Prefect progress artifact per group, moved forward as shard_done events arrive (these come on
    the child-output thread, so failures to report are logged, never raised). Created at the first
    finished shard (a group answered from the store makes none) and updated at most every
    MIN_UPDATE_S and at the last shard: each call is a round trip to the API."""
    MIN_UPDATE_S = 2.0

    def __init__(self, version: ExtractVersion, shard_ids: list[int]):
        self.total, self.done, self.tokens = len(shard_ids), 0, 0
        self.what = f"extract shards {shard_ids} of {version.dir}"
        self.log = _log()
        self.id, self.updated = None, 0.0
        self.ctx = contextvars.copy_context()  # the task run's: the artifact is created on another thread
        self._pool, self._sending = None, None

    def shard_done(self, ev: dict) -> None:
        self.done += 1
        self.tokens += ev["tokens"]
        now = time.monotonic()
        if self.id is not None and self.done < self.total and now - self.updated < self.MIN_UPDATE_S:
            return
        self.updated, progress = now, 100.0 * self.done / self.total

        def send() -> None:
            try:
                if self.id is None:
                    self.id = self.ctx.run(create_progress_artifact, progress=progress, description=self.what)
                else:
                    update_progress_artifact(self.id, progress=progress)
            except Exception as e:  # noqa: BLE001
                self.log(f"progress artifact not updated: {type(e).__name__}: {e}")

        # on a thread of its own: while the API is away (a server restart) the client retries for a
        # minute, and the child-output thread must go on reading the child's events meanwhile
        if self._sending is not None and not self._sending.done() and self.done < self.total:
            return  # the previous update is still on its way: this one is skipped, the last one is not
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eagle3-progress")
        self._sending = self._pool.submit(send)


def _verify_table(cfg: PipelineConfig, inputs, rec) -> None:
    structure = rec.checks.structure
    create_table_artifact(key=_record_key("verify", cfg), table=[s.model_dump() for s in structure.layer_stats],
                          description=(
        f"per-layer statistics of {structure.tokens_checked} tokens of extract version {inputs.version.content_key}; "
        f"{rec.samples_checked} records checked, reference max rel err {rec.reference_max_rel_err}"))


def _train_table(cfg: PipelineConfig, inputs, rec) -> None:
    key, version = Path(rec.dir).name, inputs.version
    create_table_artifact(key=_record_key("train", cfg), table=[{
        "train_key": key, "extract_version": version.content_key,
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in rec.model_dump(include={
            "steps", "epochs_done", "first_loss", "final_loss", "val_loss", "final_acc", "tokens", "tokens_per_s",
            "resumed_from_epoch", "checkpoint_best"}).items()}}],
        description=f"draft training on {cfg.prepare.dataset} for {cfg.target.model}")
    _emit(DRAFT_EXPORTED, cfg, {"prefect.resource.id": f"eagle3.draft.{_k(cfg.prepare.dataset)}.{_model(cfg)}.{key}",
                                "prefect.resource.name": f"draft {key}", "eagle3.version": version.prepare_version,
                                "eagle3.extract-version": version.content_key},
          {"checkpoint": str(rec.checkpoint_best), "steps": rec.steps, "final_loss": rec.final_loss,
           "val_loss": rec.val_loss, "dir": rec.dir})


def _evaluate_table(cfg: PipelineConfig, inputs, rec) -> None:
    create_table_artifact(key=_record_key("evaluate", cfg), table=[{
        "run_dir": inputs.run_dir, "checkpoint": str(inputs.tr.checkpoint_best),
        **rec.model_dump(mode="json", include={"acceptance_length", "acceptance_length_untrained",
                                               "per_position_acceptance", "min_acceptance_length", "passed",
                                               "lossless_ok", "speedup", "acceptance_length_sampled",
                                               "sampling_temperature"}),
        **{f"tau[{c}]": round(v.acceptance_length, 3) for c, v in rec.per_category.items()
           if v.acceptance_length is not None and len(rec.per_category) > 1}}],
        description=(f"τ = {rec.acceptance_length:.3f} (untrained {rec.acceptance_length_untrained})"
                     + (f", speed-up {rec.speedup:.2f}x" if rec.speedup is not None else "")
                     + f" on {rec.trained.prompts} prompts of "
                     + (cfg.evaluate.prompts or f"{cfg.prepare.dataset} (held out)")))


# What a stage's task adds to the registry's (stage_task): Prefect artifacts and events, and task options. A new stage
# needs no line here: its task is built from its StageSpec alone.
ARTIFACTS: dict[str, Callable] = {"regenerate": _regenerate_table, "prepare": _prepare_table, "verify": _verify_table,
                                  "train": _train_table, "evaluate": _evaluate_table}
OPTIONS: dict[str, dict] = {
    "regenerate": {"tags": ["gpu"]}, "prepare": {"tags": ["cpu"]}, "train": {"tags": ["gpu"]}, "evaluate": {"tags": ["gpu"]},
    "gpu": {"task_run_name": "gpu-gate-{inputs.where}"},
    # One engine child for a group's shards. Not a gate: Prefect's cache answers a repeated group, keyed by content
    # + directory + shard ids; the flow refreshes the cache of any group with unpublished shards
    # (ExtractVersion.unpublished). No tags: a tagged task run takes a slot of Prefect's tag concurrency limits (one
    # more API round trip per group, ~50-200 ms on SQLite, cached or not); the GPU is guarded by the slot (slot_for).
    "extract": {"before": _with_progress, "cache_key_fn": _group_key, "persist_result": True,
                "result_serializer": "json", "task_run_name": "extract-shards-{inputs.shard_ids}"},
}
# One task per registered stage, built from its spec; the report's task writes the record the flow built (below)
TASKS = {s.name: stage_task(s.name, ARTIFACTS.get(s.name), **OPTIONS.get(s.name, {}))
         for s in registry.STAGES if s.name != "report"}
regenerate, prepare, preflight, gpu_gate, extract_group, verify, vocab, train, evaluate = (TASKS[n] for n in (
    "regenerate", "prepare", "preflight", "gpu", "extract", "verify", "vocab", "train", "evaluate"))


@task(**stage_task_options("report"))
def report(run_dir: str, rec: RunReport, metrics_path: str | None) -> dict:
    """report.json, report.md and the plots of the record the flow built (report/runs.py RunDir.report_record)."""
    paths = write_report(Path(run_dir), rec, Path(metrics_path) if metrics_path else None)
    create_markdown_artifact(key=f"report-{_k(rec.config['name'])}",
                             markdown=Path(paths["report_md"]).read_text(), description=f"run {rec.run_id}")
    cfg = rec.config
    links = {**rec.artifacts.model_dump(), "report_md": paths.get("report_md"), "run_dir": run_dir}
    create_markdown_artifact(
        key=f"store-{_k(cfg['prepare']['dataset'])}-{_k(slug(cfg['target']['model']))}",
        markdown="| what | where |\n|---|---|\n" + "\n".join(
            f"| {k} | [{v}]({_uri(v)}) |" for k, v in links.items() if isinstance(v, str) and v),
        description=f"run {rec.run_id} ({rec.status}): where its data and draft are")
    return paths


@task(name="record-refresh", cache_policy=NO_CACHE)
def record_refresh(cfg: PipelineConfig, prep: PrepareResult, draft: str | None, changed: bool,
                   report: RunReport | None = None) -> None:
    """What a refresh found (before the pipeline) and, with the run's `report` (after it), what it
    reused and what was new: rows linked from the record pool vs extracted, records verified before vs
    read, how the draft was initialised (lineage) and tau next to the previous version's draft."""
    row = {"version": prep.version, "new_version": not prep.cached, "rows_out": prep.rows_out,
           "tokens": prep.tokens, "existing_draft": draft, "trains": changed}
    if report:
        st = report.to_json()["stages"]
        ex, ve = st.get("extract") or {}, (st.get("verify") or {}).get("details") or {}
        tr, ev = (st.get("train") or {}).get("details") or {}, st.get("evaluate") or {}
        row |= {"rows_extracted_new": ex.get("rows_extracted"), "rows_reused": ex.get("rows_reused"),
                "records_verified_now": ve.get("rows_rechecked"), "records_verification_reused": ve.get("rows_reused"),
                "train_init": tr.get("init"), "previous_version": tr.get("previous_version"),
                "previous_draft": tr.get("previous_draft"), "tau": ev.get("acceptance_length"),
                "tau_previous_draft": (ev.get("details") or {}).get("acceptance_length_previous"),
                "run_id": report.run_id, "status": report.status}
    create_table_artifact(key=_record_key("refresh", cfg), table=[row],
                          description=f"refresh of {cfg.prepare.dataset} for {cfg.target.model}: " + (
                              f"run {report.run_id}: {row.get('rows_extracted_new')} rows extracted, "
                              f"{row.get('rows_reused')} reused from earlier versions" if report else
                              "training a draft" if changed else "unchanged, draft exists"))


def publish_dataset_event(cfg: PipelineConfig, prep: PrepareResult, training: str | None = None) -> None:
    """Emit `eagle3.dataset.published` for a prepared version; `training` (see TRAINING_FLOWS)
    defaults to `in-run` or `no` by the name of the running flow."""
    if training is None:
        training = "in-run" if flow_run.get_flow_name() in TRAINING_FLOWS else "no"
    _emit(DATASET_PUBLISHED, cfg, {
        "prefect.resource.id": f"eagle3.dataset.{_k(cfg.prepare.dataset)}.{prep.version}",
        "prefect.resource.name": f"{cfg.prepare.dataset}@{prep.version}", "eagle3.version": prep.version,
        "eagle3.training": training},
        {"config": cfg.model_dump(mode="json"), "dir": prep.dir, "tokenized": prep.tokenized,
         **prep.model_dump(include={"rows_in", "rows_out", "rows_quarantined", "tokens"})})


def _emit(event: str, cfg: PipelineConfig, resource: dict[str, str], payload: dict) -> None:
    emit_event(event=event, resource={**resource, "eagle3.dataset": cfg.prepare.dataset,
                                      "eagle3.model": cfg.target.model, "eagle3.config": cfg.name},
               payload=payload)


def _record_key(what: str, cfg: PipelineConfig) -> str:
    """One artifact key per record kind, dataset and target model: each run adds a version."""
    return f"{what}-{_k(cfg.prepare.dataset)}-{_model(cfg)}"


def _model(cfg: PipelineConfig) -> str:
    return _k(slug(cfg.target.model))


def _uri(v: str) -> str:
    return v if "://" in v else Path(v).resolve().as_uri()


def _k(s: str) -> str:
    """Artifact keys: lowercase letters, digits and dashes only."""
    return "".join(c if c.isalnum() else "-" for c in s.lower()).strip("-")

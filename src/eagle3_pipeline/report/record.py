"""report.json as a typed record: `RunReport`. Its keys are a contract (docs/operations.md, "Reading a run"):
keys are added, never renamed or removed; tests/unit/test_report.py holds the schema of every key so far.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, create_model

from eagle3_pipeline.data.tokenized import PrepareResult
from eagle3_pipeline.records.evaluation import EvaluateReport
from eagle3_pipeline.records.results import ExtractResult, RegenerateResult, TrainResult, VocabResult
from eagle3_pipeline.records.verification import VerifyResult
from eagle3_pipeline.report.decision import Decision
from eagle3_pipeline.report.loose import loose, loose_annotation


class StageEntry(BaseModel):
    """A stage's entry: its contract keys (None where the stage's record had none) and the rest of its record
    under `details`."""
    model_config = ConfigDict(extra="forbid")
    source: ClassVar[type[BaseModel] | None] = None  # the stage's own record model (entry_of)
    details: dict[str, Any] = {}

    def contract(self) -> dict[str, Any]:
        """The contract keys and their values, in report.json's order (details left out)."""
        return {k: getattr(self, k) for k in type(self).model_fields if k != "details"}

    def value(self, key: str) -> Any:
        """A number of the stage's record, whether a contract key or still among its details (None: neither)."""
        own = getattr(self, key) if key in type(self).model_fields and key != "details" else None
        return own if own is not None else self.details.get(key)

    def record(self) -> BaseModel:
        """The stage's record as its own model reads it, every field optional (`loose`): the contract keys and the
        details, typed, for report.md to read by attribute. A stage without a model: its details as they are."""
        model = loose(self.source) if self.source else None
        if model is None:
            raise TypeError(f"{type(self).__name__} has no record model")
        return model.model_validate({**self.details, **{k: v for k, v in self.contract().items() if v is not None}})


def entry_of(record: type[BaseModel], *keys: str) -> type[StageEntry]:
    """A stage's entry from the stage's own record model: its contract `keys` (fields or computed fields), typed as
    the record declares them (None where the stage's record had none; a nested model `loose`), and the rest of the
    record under `details`."""
    declared = {k: f.annotation for k, f in record.model_fields.items()}
    declared |= {k: f.return_type for k, f in record.model_computed_fields.items()}
    missing = [k for k in keys if k not in declared]
    if missing:
        raise TypeError(f"{record.__name__} has no field(s) {missing} for report.json's contract")
    fields: dict[str, Any] = {k: (loose_annotation(declared[k]) | None, None) for k in keys}
    name = record.__name__.removesuffix("Result").removesuffix("Report") + "Entry"
    entry = create_model(name, __base__=StageEntry, __module__=__name__, **fields)
    entry.source = record
    return entry


RegenerateEntry = entry_of(RegenerateResult, "version", "rows_in", "rows_out", "rows_quarantined", "tokens_generated")
PrepareEntry = entry_of(PrepareResult, "version", "rows_in", "rows_out", "rows_quarantined", "tokens")


class PreflightEntry(StageEntry):
    pass


ExtractEntry = entry_of(ExtractResult, "layer_ids", "shards_total", "shards_published", "tokens", "tokens_per_s",
                        "bytes_on_disk", "rows_extracted", "rows_reused")


VerifyEntry = entry_of(VerifyResult, "passed", "samples_checked", "reference_max_rel_err", "shards_rechecked",
                       "shards_reused", "reference_peak_rss_bytes")
VocabEntry = entry_of(VocabResult, "draft_vocab_size", "coverage")
TrainEntry = entry_of(TrainResult, "mode", "world_size", "steps", "final_loss", "tokens_per_s", "nodes", "ranks_per_node",
                      "accumulation_steps", "global_batch_tokens", "sharding")


EvaluateEntry = entry_of(EvaluateReport, "acceptance_length", "acceptance_length_untrained", "per_position_acceptance",
                         "per_category", "speedup", "baseline_ngram", "baseline_suffix", "baseline_suffix_unavailable")


class Stages(BaseModel):
    """One entry per stage that returned a record, in the order they run (pipeline/registry.py REPORTED: the architecture test
    checks this order against the registry's); a stage that did not is absent."""
    model_config = ConfigDict(extra="forbid")
    regenerate: RegenerateEntry | None = None
    prepare: PrepareEntry | None = None
    preflight: PreflightEntry | None = None
    extract: ExtractEntry | None = None
    verify: VerifyEntry | None = None
    vocab: VocabEntry | None = None
    train: TrainEntry | None = None
    evaluate: EvaluateEntry | None = None

    def entries(self) -> dict[str, StageEntry]:
        """The stages that returned a record, in run order."""
        return {k: getattr(self, k) for k in type(self).model_fields if getattr(self, k) is not None}


class StageTiming(BaseModel):
    """Wall seconds of a stage as the flow saw them, and how much of it was engine start-up (None: none)."""
    model_config = ConfigDict(extra="forbid")
    seconds: float
    engine_start_s: float | None = None
    baseline_ngram_s: float | None = None  # evaluate: the n-gram baseline's engine, inside evaluate's seconds
    baseline_ngram_engine_start_s: float | None = None
    baseline_suffix_s: float | None = None  # evaluate: the suffix decoding baseline's engine, inside evaluate's seconds
    baseline_suffix_engine_start_s: float | None = None


class Artifacts(BaseModel):
    """Where a run's data, draft and report are (absolute paths; None: the stage did not run)."""
    model_config = ConfigDict(extra="forbid")
    tokenized: str | None = None
    hidden_states: str | None = None
    manifest: str | None = None
    vocab: str | None = None
    checkpoint: str | None = None
    target_model: str | None = None
    regenerated: str | None = None
    report_md: str | None = None
    plots: list[str] = []


class RunReport(BaseModel):
    model_config = ConfigDict(extra="forbid")
    run_id: str
    status: str  # "completed" | "failed"
    error: str | None = None
    config: dict[str, Any]
    versions: dict[str, Any]
    timings: dict[str, StageTiming] = {}
    stages: Stages = Stages()
    artifacts: Artifacts = Artifacts()
    warnings: list[str] = []
    decision: Decision | None = None  # worth training? (report/decision.py)

    def to_json(self) -> dict:
        """report.json's content: every key, no entry for a stage that did not run, and the n-gram baseline's
        timing keys on evaluate's timing only."""
        out = self.model_dump(mode="json")
        out["stages"] = {k: v for k, v in out["stages"].items() if v is not None}
        out["timings"] = {k: t.model_dump(mode="json", exclude_unset=True) for k, t in self.timings.items()}
        return out

"""The stages, in the order a pipeline run meets them: `STAGES`, every stage's `StageSpec` once.

Every list that names stages is read from here (REPORTED, TASKS, GATES, JOB_STAGES, ACCELERATED); report/record.py
`Stages`, below it, is checked against it (docs/internals.md, "The pipeline room").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from eagle3_pipeline.core.stage_spec import StageSpec
from eagle3_pipeline.evaluate.stage import STAGE as EVALUATE
from eagle3_pipeline.extract.stage import STAGE as EXTRACT
from eagle3_pipeline.gpu.stage import STAGE as GPU
from eagle3_pipeline.preflight.stage import STAGE as PREFLIGHT
from eagle3_pipeline.prepare.stage import STAGE as PREPARE
from eagle3_pipeline.regenerate.stage import STAGE as REGENERATE
from eagle3_pipeline.report.stage import STAGE as REPORT
from eagle3_pipeline.train.stage import STAGE as TRAIN
from eagle3_pipeline.verify.stage import STAGE as VERIFY
from eagle3_pipeline.vocab.stage import STAGE as VOCAB

# DESIGN.md §1: [regenerate] -> prepare -> preflight -> gpu-gate -> extract -> verify -> vocab -> train -> evaluate -> report
STAGES: tuple[StageSpec, ...] = (REGENERATE, PREPARE, PREFLIGHT, GPU, EXTRACT, VERIFY, VOCAB, TRAIN, EVALUATE, REPORT)

NAMES = tuple(s.name for s in STAGES)
REPORTED = tuple(s.name for s in STAGES if s.reported)  # report.json `stages`, in this order
TASKS = tuple(s.task_name for s in STAGES)  # one Prefect task per stage, each with its retry policy
GATES = tuple(s.task_name for s in STAGES if s.gate)  # tasks that must run every time: never a cached answer
JOB_STAGES = tuple(s.name for s in STAGES if s.own_job)  # pipeline/jobs.py sizes their Jobs
ACCELERATED = tuple(s.name for s in STAGES if s.accelerators)  # their tasks hold a GPU slot


def spec(name: str) -> StageSpec:
    """The registered stage `name` (its package's name, or its task's: `gpu-gate`, `extract-group`)."""
    for s in STAGES:
        if name in (s.name, s.task_name):
            return s
    raise KeyError(f"no stage {name!r}: the stages are {', '.join(NAMES)}")


def _derive(stages: tuple[StageSpec, ...]) -> None:
    global STAGES, NAMES, REPORTED, TASKS, GATES, JOB_STAGES, ACCELERATED
    STAGES = stages
    NAMES = tuple(s.name for s in stages)
    REPORTED = tuple(s.name for s in stages if s.reported)
    TASKS = tuple(s.task_name for s in stages)
    GATES = tuple(s.task_name for s in stages if s.gate)
    JOB_STAGES = tuple(s.name for s in stages if s.own_job)
    ACCELERATED = tuple(s.name for s in stages if s.accelerators)


@contextlib.contextmanager
def registered(extra: StageSpec, before: str = "report") -> Iterator[StageSpec]:
    """`STAGES` with `extra` in its place before stage `before`, for the body only (the lists above follow it;
    `spec` and tasks/stage_tasks.py `stage_task` find it): how a test adds a stage without a package, and what
    a new stage's line in `STAGES` does for good. The production order is restored on exit."""
    if extra.name in NAMES or extra.task_name in TASKS:
        raise ValueError(f"stage {extra.name!r} (task {extra.task_name!r}) is already registered")
    names = ("STAGES", "NAMES", "REPORTED", "TASKS", "GATES", "JOB_STAGES", "ACCELERATED")
    saved = {n: globals()[n] for n in names}  # the very objects: what read them at import still holds them
    at = NAMES.index(before)
    _derive(STAGES[:at] + (extra,) + STAGES[at:])
    try:
        yield extra
    finally:
        globals().update(saved)

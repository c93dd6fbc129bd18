"""The one interface every stage implements: `STAGE = StageSpec(...)` in `<stage>/stage.py`.

A stage is a package: stage.py is its parent side (what pipeline/stages.py and the tasks call) and, when
the stage runs an engine or a trainer, worker.py is its child process.
`eagle3_pipeline.pipeline.registry.STAGES` lists every declaration in run order; the lists that name stages (the
report's, the tasks' retry policies and gates, the GPU Jobs, the architecture test's) are read from it.
tests/unit/test_architecture.py checks every declaration against its module (docs/README.md, "Adding a stage").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StageSpec:
    name: str  # the package's name: also the stage's name in report.json, the run store and the flows
    run: Callable[..., Any]  # the one entry the pipeline calls; its return annotation is `result`
    result: Any  # the typed record `run` returns (a pydantic model, or a list of them)
    failure: type[Exception] | None  # what `run` raises when its own check says no (None: it never refuses)
    worker: str | None = None  # the child process's module (`eagle3_pipeline.<name>.worker`), if it has one
    accelerators: bool = False  # it loads a model onto accelerators: in a child, and under a GPU slot (tasks/)
    gate: bool = False  # it may fail the run and is never answered from a cache (DESIGN.md §1)
    own_job: bool = False  # it runs as its own Kubernetes Job on a GPU node (pipeline/jobs.py sizes the Job)
    reported: bool = True  # it has an entry in report.json's `stages` (report/record.py `Stages`)
    task: str | None = None  # its Prefect task's name where that is not `name` (tasks/stage_tasks.py)

    @property
    def task_name(self) -> str:
        return self.task or self.name

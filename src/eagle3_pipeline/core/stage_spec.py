"""The one interface every stage implements: `STAGE = StageSpec(...)` in `<stage>/stage.py`, whose `run` is
`run(cfg, inputs, log) -> record` (docs/internals.md, "Adding a stage"; checked by tests/unit/test_architecture.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from eagle3_pipeline.core.proc import ChildFailed

IO = (OSError, TimeoutError)  # lost mounts, hub/network errors (requests' errors are OSErrors), timeouts
CHILD = (ChildFailed,)  # a child that crashed, was OOM-killed or timed out (ChildTimedOut); also wrapped
RETRY_JITTER = 0.2  # Prefect's retry_jitter_factor on every retry's delay
Log = Callable[[str], None]  # every stage entry's third parameter: where its lines go


@dataclass(frozen=True)
class Retry:
    """How a stage's task retries (tasks/stage_tasks.py turns it into Prefect's options; pipeline/jobs.py makes
    a stage's Job outlive every attempt). A retry happens only on a transient error (errors.is_transient), never
    on a failed gate, bad input, a bad config or an environment problem: those are answers."""
    retries: int  # attempts after the first
    delay_s: float  # before each retry (jittered by RETRY_JITTER)
    transient: tuple[type[BaseException], ...]  # errors that may pass on a retry
    why: str  # what fails transiently here, and what a retry redoes
    count: str | None = None  # the config key that sets `retries` instead (`extract.retries`)

    def retries_in(self, config) -> int:
        """The count for `config` (a PipelineConfig): its `count` key where there is one, else `retries`."""
        if self.count is None:
            return self.retries
        group, key = self.count.split(".")
        return int(getattr(getattr(config, group), key))


NO_RETRY = Retry(0, 0, (), "a gate or a check of seconds: its failure is the answer")


@dataclass(frozen=True)
class StageSpec:
    name: str  # the package's name: also the stage's name in report.json, the run store and the flows
    run: Callable[..., Any]  # the one entry: `run(cfg: PipelineConfig, inputs: <its inputs record>, log: Log) -> result`
    result: Any  # the typed record `run` returns (a pydantic model, or a list of them)
    failure: type[Exception] | None  # what `run` raises when its own check says no (None: it never refuses)
    worker: str | None = None  # the child process's module (`eagle3_pipeline.<name>.worker`), if it has one
    accelerators: bool = False  # it loads a model onto accelerators: in a child, and under a GPU slot (tasks/)
    gate: bool = False  # it may fail the run and is never answered from a cache (DESIGN.md §1)
    own_job: bool = False  # it runs as its own Kubernetes Job on a GPU node (pipeline/jobs.py sizes the Job)
    reported: bool = True  # it has an entry in report.json's `stages` (report/record.py `Stages`)
    task: str | None = None  # its Prefect task's name where that is not `name` (tasks/stage_tasks.py)
    retry: Retry = NO_RETRY  # how its task retries (tasks/stage_tasks.py), and so how long its Job may live
    store: bool = True  # it reads or writes the run store: pipeline/stages.py proves the store's contract first

    @property
    def task_name(self) -> str:
        return self.task or self.name

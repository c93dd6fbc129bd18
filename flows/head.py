"""The head every flow starts with: [regenerate → gpu-gate →] prepare → preflight → plan extract.

Its result, `Prepared`, is what the pipeline, refresh and rerun-failed flows go on from (refresh hands
its own to the pipeline instead of the pipeline preparing again).
"""

from __future__ import annotations

import contextlib
from typing import Any

from pydantic import BaseModel

from eagle3_pipeline.core.config import PipelineConfig, check_target
from eagle3_pipeline.data.tokenized import PrepareResult
from eagle3_pipeline.gpu.stage import GpuGateInputs
from eagle3_pipeline.preflight.stage import PreflightInputs, PreflightResult
from eagle3_pipeline.prepare.stage import PrepareInputs
from eagle3_pipeline.records.layout import ExtractVersion
from eagle3_pipeline.regenerate.stage import RegenerateInputs
from tasks import stage_tasks as t


class Prepared(BaseModel):
    regenerate: Any = None  # the RegenerateResult with regenerate.enabled
    prepare: PrepareResult
    preflight: PreflightResult
    version: ExtractVersion


def prepare_run(config: PipelineConfig, clock=None) -> Prepared:
    """Run the head; `clock` (runs.StageClock) times each stage when given."""
    timed = clock.stage if clock is not None else lambda name: contextlib.nullcontext()
    check_target(config)  # a missing model directory is named before any stage
    regen = None
    if config.regenerate.enabled:  # the target answers the sources' turns; prepare reads its rows
        with timed("regenerate"):
            regen = t.regenerate.with_options(**t.retry_options("regenerate", config.regenerate.retries))(
                config, RegenerateInputs())
        with timed("gpu-gate"):
            t.gpu_gate(config, GpuGateInputs(where="after-regenerate"))
    with timed("prepare"):
        prep = t.prepare(config, PrepareInputs(regenerated=regen))
    with timed("preflight"):
        pre = t.preflight(config, PreflightInputs(prep=prep))
        version = t.plan_extract(config, prep, pre)
    return Prepared(regenerate=regen, prepare=prep, preflight=pre, version=version)

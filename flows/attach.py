"""Stage and group runs keyed by what they compute, so that any controller run re-attaches to them.

More: docs/internals.md, "flows/attach.py".
"""

from __future__ import annotations

from typing import Any

from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId, FlowRunFilter, FlowRunFilterTags
from prefect.client.schemas.sorting import FlowRunSort

from eagle3_pipeline.core.store import content_key


def stage_base(stage: str, extract_key: str, params: dict[str, Any]) -> str:
    """A stage run's base key: its stage, its extract version and a hash of its parameters (the config, the
    records it reads), so a changed train setting is a new run, never an attach to the old one. Not the run
    directory evaluate writes into: each execution of a pipeline run makes a new one, and a rescheduled pipeline
    re-attaches to the evaluate run its first execution started (StageRuns reuses a completed run's record only
    for the same directory)."""
    return f"eagle3-{stage}-{extract_key}-{content_key({k: v for k, v in params.items() if k != 'run_dir'}, 16)}"


def group_base(extract_key: str, version_dir: str, shards: list[int]) -> str:
    """A group's base key: its extract version's content key, where that version lives (two stores of the same
    content are two extractions, never attached to each other's runs) and its shards."""
    return f"eagle3-extract-{extract_key}-{content_key(str(version_dir), 8)}-shards-{'.'.join(map(str, shards))}"


def attempt_of(run, base: str) -> int | None:
    """n of a run whose idempotency key is `<base>-<n>`, else None."""
    key = getattr(run, "idempotency_key", None) or ""
    head, _, n = key.rpartition("-")
    return int(n) if head == base and n.isdigit() else None


def runs_tagged(client, deployment_id, tag: str) -> list:
    """The newest 200 flow runs of a deployment that carry `tag` (one read: every group of an extract version)."""
    return client.read_flow_runs(
        flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag])),
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
        sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=200)


def latest(runs: list, base: str) -> tuple[int, Any]:
    """(n of the newest run made for `base`, that run), or (0, None) when none was."""
    found = sorted(((n, r) for r in runs if (n := attempt_of(r, base)) is not None), key=lambda x: x[0])
    return found[-1] if found else (0, None)


def going(run) -> bool:
    """Whether a run is still going (not final): a controller re-attaches to it instead of submitting anew."""
    return run is not None and run.state is not None and not run.state.is_final()

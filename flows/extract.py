"""The extract flow: for an ExtractVersion (layout.py: the planned shard groups), extract each group (one engine
child per group, published shard by shard), then summarise the manifest.

More: docs/internals.md, "flows/extract.py".
"""

from __future__ import annotations

import time

from prefect import flow
from prefect.utilities.annotations import quote

from eagle3_pipeline.core.config import PipelineConfig
from eagle3_pipeline.extract.stage import ExtractFailed, ExtractInputs
from eagle3_pipeline.records.layout import ExtractVersion
from flows.fanout import run_groups_as_deployments
from flows.lease import rescheduled_on_lost_lease
from tasks import stage_tasks as t


@flow(name="extract")
def extract(config: PipelineConfig, version: ExtractVersion, force_shards: list[int] | None = None):
    force = set(force_shards or [])
    t0 = time.time()  # the summary counts what this run did; earlier runs' shards are "from the store"
    if config.extract.parallel_groups > 1:
        with rescheduled_on_lost_lease():  # as a deployment run with a concurrency limit (flows/lease.py)
            failed = run_groups_as_deployments(config, version, force)
    else:
        failed = []
        unpublished = set(version.unpublished([k for g in version.groups for k in g]))  # one manifest read
        run = {refresh: t.extract_group.with_options(**t.retry_options("extract-group", config.extract.retries),
                                                     refresh_cache=refresh) for refresh in (False, True)}
        with t.gpu_slot_scope():  # one GPU slot for all groups, taken by the first that runs
            for group in version.groups:
                forced = bool(force & set(group))
                # quote: Prefect need not walk the config and the plan for futures (~10 ms per task)
                state = run[forced or bool(unpublished & set(group))](
                    quote(config), quote(ExtractInputs(version=version, shard_ids=group, force=forced)), return_state=True)
                if state.is_failed():
                    failed.append(f"shards {group}: {state.message}")
    if failed:
        raise ExtractFailed(f"{len(failed)} of {len(version.groups)} shard groups failed "
                            f"(their finished shards stay published; a re-run does the rest):\n  " + "\n  ".join(failed))
    return t.extract_summary(config, version, t0)

"""The extract-group flow: one group of shards, one engine child, on whichever node the work pool
places it (a Kubernetes job with 8 GPUs, or a local process worker). The unit the extract flow fans
out with `run_deployment` when `extract.parallel_groups > 1`; the task inside is the same cached
`extract-group` task the in-process path runs, with the same cache key and GPU slot."""

from __future__ import annotations

from prefect import flow

from eagle3_pipeline.core.config import PipelineConfig
from eagle3_pipeline.extract.stage import ExtractInputs
from eagle3_pipeline.records.layout import ExtractVersion
from flows.hub_auth import use_hub_secret
from tasks import stage_tasks as t


@flow(name="extract-group", log_prints=True)
def extract_group(config: PipelineConfig, version: ExtractVersion, shard_ids: list[int], force: bool = False) -> list:
    use_hub_secret(config)
    refresh = force or bool(version.unpublished(shard_ids))
    run = t.extract_group.with_options(**t.retry_options("extract-group", config.extract.retries), refresh_cache=refresh)
    return run(config, ExtractInputs(version=version, shard_ids=shard_ids, force=force))

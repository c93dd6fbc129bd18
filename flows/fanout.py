"""Multi-node extraction: shard groups as runs of the `extract-group` deployment.

Reads the extract manifest (layout.ExtractVersion.manifest_path) to pick the groups that still
hold unpublished shards (or forced ones): a re-run re-submits only those. Each group becomes a
flow run of EAGLE3_EXTRACT_GROUP_DEPLOYMENT (default `extract-group/extract-group`) linked to the
calling flow as a subflow; the work pool places it (Kubernetes: one 8-GPU job per group; locally:
one process worker per "node"). At most `extract.parallel_groups` are in flight; this waits for all
and returns one line per group that did not complete, naming its flow run and UI link.
"""

from __future__ import annotations

import os
import time
from uuid import UUID

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.settings import get_current_settings
from prefect.states import Cancelling

from eagle3_pipeline.config import PipelineConfig
from eagle3_pipeline.layout import ExtractVersion
from eagle3_pipeline.store import read_json

GROUP_DEPLOYMENT = os.environ.get("EAGLE3_EXTRACT_GROUP_DEPLOYMENT", "extract-group/extract-group")
POLL_S = float(os.environ.get("EAGLE3_FANOUT_POLL_S", "5"))


def groups_to_run(version: ExtractVersion, force: set[int]) -> list[list[int]]:
    """The planned groups holding a shard that the manifest does not list as published (all of them
    when there is no manifest yet, or it was made for another shard plan), plus forced ones."""
    m = read_json(version.manifest_path, default={}) or {}
    same_plan = (m.get("rows_per_shard") == version.rows_per_shard and len(m.get("shards", [])) == len(version.shards))
    return [g for g in version.groups if force & set(g) or not same_plan or version.unpublished(g)]


def flow_run_link(flow_run_id: UUID | str) -> str:
    ui = get_current_settings().ui_url
    return f"{ui}/runs/flow-run/{flow_run_id}" if ui else f"flow run {flow_run_id}"


def run_groups_as_deployments(config: PipelineConfig, version: ExtractVersion, force: set[int]) -> list[str]:
    log = get_run_logger()
    todo = groups_to_run(version, force)
    window = config.extract.parallel_groups
    log.info(f"extract: {len(todo)} of {len(version.groups)} shard groups to run as {GROUP_DEPLOYMENT} "
             f"flow runs, {window} at a time; the others are published")
    params = {"config": config.model_dump(mode="json"), "version": version.model_dump(mode="json")}
    running: dict[UUID, list[int]] = {}
    failed: list[str] = []
    with get_client(sync_client=True) as client:
        try:
            if todo:
                client.read_deployment_by_name(GROUP_DEPLOYMENT)
        except ObjectNotFound:
            raise RuntimeError(f"extract.parallel_groups={window} fans shard groups out to the deployment "
                               f"{GROUP_DEPLOYMENT!r}, which {get_current_settings().api.url or 'this server'} does "
                               f"not have: `prefect deploy --all` (prefect.yaml), or parallel_groups=1") from None
        try:
            while todo or running:
                while todo and len(running) < window:
                    group = todo.pop(0)
                    fr = run_deployment(GROUP_DEPLOYMENT, parameters={**params, "shard_ids": group,
                                                                      "force": bool(force & set(group))},
                                        timeout=0, as_subflow=True, flow_run_name=f"extract-shards-{group}",
                                        tags=[f"eagle3-extract-{version.content_key}"])
                    running[fr.id] = group
                    log.info(f"extract: shards {group} -> {fr.name}: {flow_run_link(fr.id)}")
                time.sleep(POLL_S)
                for fid, group in list(running.items()):
                    fr = client.read_flow_run(fid)
                    if fr.state is None or not fr.state.is_final():
                        continue
                    del running[fid]
                    if fr.state.is_completed():
                        log.info(f"extract: shards {group} done ({fr.name})")
                    else:
                        failed.append(f"shards {group}: flow run {fr.name} ({fid}) {fr.state.name}: "
                                      f"{fr.state.message} - {flow_run_link(fid)}")
                        log.error(f"extract: {failed[-1]}")
        except BaseException:  # cancelled or crashed: the groups still running are cancelled with us
            for fid in running:
                client.set_flow_run_state(fid, Cancelling(message="the extract flow that started it ended"), force=True)
            raise
    return failed

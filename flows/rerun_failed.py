"""The rerun-failed flow: re-extract the failed or unpublished shards of a config's extract version,
then verify. Prepare is answered from the store (same content, same version); extract groups that
completed before are answered from Prefect's cache; only groups holding unpublished shards run."""

from __future__ import annotations

from prefect import flow

from eagle3_pipeline.core.config import PipelineConfig
from eagle3_pipeline.gpu.stage import GpuGateInputs
from eagle3_pipeline.verify.stage import VerifyInputs
from flows.config_param import DEFAULT_CONFIG_PATH, resolve_config
from flows.extract import extract
from flows.head import prepare_run
from flows.hub_auth import use_hub_secret
from flows.stage_runs import run_stage
from tasks import stage_tasks as t


@flow(name="rerun-failed")
def rerun_failed(config: PipelineConfig | None = None, force_shards: list[int] | None = None,
                 config_path: str = DEFAULT_CONFIG_PATH):
    config = resolve_config(config, config_path)  # flows/config_param.py: the deployment's default is a path
    use_hub_secret(config)
    version = prepare_run(config).version  # the store answers a version already done
    t.gpu_gate(config, GpuGateInputs(where="before-extract"))
    extract(config, version, force_shards=force_shards)
    t.gpu_gate(config, GpuGateInputs(where="after-extract"))
    return run_stage(config, "verify", VerifyInputs(version=version))

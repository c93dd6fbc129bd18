"""The config a deployed flow run uses: one source of truth for the deployments' default.

Flows that take a whole `PipelineConfig` (pipeline, rerun-failed) also take `config_path`: a YAML
file read when the run starts, relative to the working directory (a worker's pull step changes into
`$EAGLE3_PIPELINE_HOME`). prefect.yaml gives `config_path: configs/tiny-cpu.yaml` as the default, so
the UI's Run button runs exactly what `make run` runs, and an edit of that file needs no redeploy.
A `config` given in full (the automation passes an event's config; a custom run from the UI; the
`eagle3` command) wins over `config_path`.
"""

from __future__ import annotations

from eagle3_pipeline.config import PipelineConfig, load_config

DEFAULT_CONFIG_PATH = "configs/tiny-cpu.yaml"


def resolve_config(config: PipelineConfig | None, config_path: str | None) -> PipelineConfig:
    if config is not None:
        return config
    return load_config(config_path or DEFAULT_CONFIG_PATH)

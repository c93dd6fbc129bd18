"""The config a deployed flow run uses: one source of truth for the deployments' default.

Flows that take a whole `PipelineConfig` (pipeline, rerun-failed) also take `config_path`: a YAML
file read when the run starts, relative to the working directory (a worker's pull step changes into
`$EAGLE3_PIPELINE_HOME`). prefect.yaml gives `config_path: configs/tiny-cpu.yaml` as the default, so
the UI's Run button runs exactly what `make run` runs, and an edit of that file needs no redeploy.
A `config` given in full (the automation passes an event's config; a custom run from the UI; the
`eagle3` command) wins over `config_path`.
"""

from __future__ import annotations

from eagle3_pipeline.core.config import PipelineConfig, apply_overrides, load_config

DEFAULT_CONFIG_PATH = "configs/tiny-cpu.yaml"


def switches(*, regenerate: bool | None = None, train_mode: str | None = None, evaluate_prompts: str | None = None,
             overrides: list[str] | None = None) -> list[str]:
    """The form's switches as `key=value` overrides (None: leave the config's value)."""
    out = []
    if regenerate is not None:
        out.append(f"regenerate.enabled={'true' if regenerate else 'false'}")
    if train_mode is not None:
        out.append(f"train.mode={train_mode}")
    if evaluate_prompts is not None:
        out.append(f"evaluate.prompts={evaluate_prompts}")
    return out + list(overrides or [])


def resolve_config(config: PipelineConfig | None, config_path: str | None,
                   overrides: list[str] | None = None) -> PipelineConfig:
    """`config` (or the file at `config_path`) with `overrides` applied."""
    if config is not None:
        return apply_overrides(config, overrides or [])
    return load_config(config_path or DEFAULT_CONFIG_PATH, overrides or [])

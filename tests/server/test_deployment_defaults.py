"""What the server holds after `prefect deploy --all`: the pipeline and rerun-failed deployments'
default parameters name configs/tiny-cpu.yaml, and resolve (in a worker's working directory, through
the flow's own parameter validation) to exactly `load_config("configs/tiny-cpu.yaml")`, the config
`make run` runs. tests/unit/test_deployment_defaults.py checks prefect.yaml itself without a server."""

from __future__ import annotations

import pytest

from tests.helpers.server import ROOT


@pytest.mark.parametrize("name", ["pipeline/pipeline", "rerun-failed/rerun-failed"])
def test_deployed_default_config_is_tiny_cpu_yaml(name, client, deployed, monkeypatch):
    from prefect.flows import load_flow_from_entrypoint

    from eagle3_pipeline.core.config import load_config
    from flows.config_param import resolve_config

    dep = client.read_deployment_by_name(name)
    assert "config" not in dep.parameters, f"{name}: an inline config was deployed"
    monkeypatch.chdir(ROOT)  # the pull step: set_working_directory $EAGLE3_PIPELINE_HOME (this checkout here)
    params = load_flow_from_entrypoint(str(ROOT / dep.entrypoint)).validate_parameters(dep.parameters)
    got = resolve_config(params["config"], params["config_path"])
    assert got.model_dump(mode="json") == load_config(ROOT / "configs" / "tiny-cpu.yaml").model_dump(mode="json")

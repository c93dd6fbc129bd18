"""The deployments' default config is configs/tiny-cpu.yaml, the file `make run` runs: prefect.yaml
names it by path (`config_path`), and this test resolves what a run of each deployment with its
default parameters would use, the way a worker would (the pull step's working directory, Prefect's
validation of the parameters against the flow's signature, then the flow's own resolution), and
compares it with `load_config("configs/tiny-cpu.yaml")`. An inline copy of a config in prefect.yaml
(which drifted once: τ 2.03 from the UI, 3.34 from `make run`) fails it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENTS_WITH_A_CONFIG = ("pipeline", "rerun-failed")


def _prefect_yaml() -> dict:
    return yaml.safe_load((ROOT / "prefect.yaml").read_text())


def _deployment(name: str) -> dict:
    (dep,) = [d for d in _prefect_yaml()["deployments"] if d["name"] == name]
    return dep


def _pull_directory() -> Path:
    """Where a worker's flow run starts: prefect.yaml's set_working_directory pull step, with
    $EAGLE3_PIPELINE_HOME being this checkout (README "Workers")."""
    (step,) = [s for s in _prefect_yaml()["pull"] if "prefect.deployments.steps.set_working_directory" in s]
    directory = step["prefect.deployments.steps.set_working_directory"]["directory"]
    assert directory == "{{ $EAGLE3_PIPELINE_HOME }}", directory
    return ROOT


def resolved_default_config(name: str, monkeypatch):
    from prefect.flows import load_flow_from_entrypoint

    from flows.config_param import resolve_config

    dep = _deployment(name)
    monkeypatch.chdir(_pull_directory())
    flow = load_flow_from_entrypoint(dep["entrypoint"])
    params = flow.validate_parameters(dep.get("parameters") or {})  # + the flow's defaults, as a run gets them
    return resolve_config(params["config"], params["config_path"])


@pytest.mark.parametrize("name", DEPLOYMENTS_WITH_A_CONFIG)
def test_deployment_default_config_is_tiny_cpu_yaml(name, monkeypatch):
    from eagle3_pipeline.config import load_config

    got = resolved_default_config(name, monkeypatch)
    want = load_config(ROOT / "configs" / "tiny-cpu.yaml")
    assert got.model_dump(mode="json") == want.model_dump(mode="json")


@pytest.mark.parametrize("name", DEPLOYMENTS_WITH_A_CONFIG)
def test_no_inline_config_in_prefect_yaml(name):
    """The default is a path, not a copy: `config` must not be a deployment parameter."""
    dep = _deployment(name)
    assert "config" not in (dep.get("parameters") or {}), f"{name}: inline config in prefect.yaml"
    assert dep["parameters"]["config_path"] == "configs/tiny-cpu.yaml"


def test_a_given_config_wins_over_config_path(monkeypatch, tmp_path):
    """The automation passes `config: {{ event.payload.config }}` on top of the default parameters:
    that config, not the file, is what the run uses."""
    from eagle3_pipeline.config import load_config
    from flows.config_param import resolve_config

    monkeypatch.chdir(ROOT)
    given = load_config(ROOT / "configs" / "tiny-cpu.yaml", ["name=from-event", "train.epochs=1"])
    (trigger,) = _deployment("pipeline")["triggers"]
    assert trigger["parameters"] == {"config": "{{ event.payload.config }}"}
    params = {**_deployment("pipeline")["parameters"], "config": given.model_dump(mode="json")}
    from prefect.flows import load_flow_from_entrypoint

    params = load_flow_from_entrypoint(_deployment("pipeline")["entrypoint"]).validate_parameters(params)
    cfg = resolve_config(params["config"], params["config_path"])
    assert cfg.name == "from-event" and cfg.train.epochs == 1

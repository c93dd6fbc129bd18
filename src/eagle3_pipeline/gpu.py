"""The gpu-gate: no leftover engine of ours holds the machine, and the visible GPUs are free.

Reads the process table (psutil) and, where `nvidia-smi` exists, per-GPU used memory. Finds our
leftover engine processes by the marker that proc.run_child puts in every child's environment
(CHILD_MARKER_ENV, inherited by vLLM's engine cores and workers) and by command line: a marked
process is a leftover when the process that launched it (LAUNCHER_ENV) is gone. Engines whose
launcher is alive belong to a running pipeline (e.g. a sibling shard group) and are reported, not
touched. Leftovers are ended (SIGTERM, then SIGKILL); the gate fails loud when it cannot free them or
when GPU memory stays above the threshold. Never cached: it runs every time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

from pydantic import BaseModel

from eagle3_pipeline.errors import EnvironmentProblem
from eagle3_pipeline.proc import CHILD_MARKER_ENV, LAUNCHER_ENV

WORKER_MODULES = ("eagle3_pipeline.extract.worker", "eagle3_pipeline.train.worker", "eagle3_pipeline.evaluate.worker")


class GpuGateFailed(EnvironmentProblem):
    pass


class GpuGateResult(BaseModel):
    leftovers_found: list[str]
    killed: list[int]
    gpus: list[dict]
    passed: bool
    where: str = ""  # which gate of the pipeline (before-extract, after-extract, after-train)


def _ours(p, protected: set[int], dead_launchers: set[int]) -> str | None:
    """A description if `p` is a leftover engine process of ours, else None."""
    import psutil

    try:
        if p.pid in protected:
            return None
        env = p.environ()
        cmd = " ".join(p.cmdline())
        if CHILD_MARKER_ENV not in env and not any(m in cmd for m in WORKER_MODULES):
            return None
        launcher = env.get(LAUNCHER_ENV, "")
        if launcher.isdigit() and psutil.pid_exists(int(launcher)) and int(launcher) not in dead_launchers:
            return None  # a live pipeline's engine
        return f"pid {p.pid} ({env.get(CHILD_MARKER_ENV, 'worker')}, launcher {launcher or '?'} gone): {cmd[:120]}"
    except Exception:  # process vanished or is not ours to read
        return None
    return None


def _protected() -> set[int]:
    """This process, its ancestors and its live descendants (engines this run is using right now)."""
    import psutil

    me = psutil.Process()
    return {me.pid} | {a.pid for a in me.parents()} | {c.pid for c in me.children(recursive=True)}


def find_leftovers() -> list[tuple[object, str]]:
    """(process, description) of every leftover engine process of ours."""
    import psutil

    protected = _protected()
    zombies = {p.pid for p in psutil.process_iter(["status"]) if p.info["status"] == psutil.STATUS_ZOMBIE}
    found = ((p, _ours(p, protected, zombies)) for p in psutil.process_iter())
    return [(p, d) for p, d in found if d]


def gpu_memory() -> list[dict]:
    """[{index, used_mib, total_mib}] from nvidia-smi; [] where there is no nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    gpus = []
    for line in out.strip().splitlines():
        idx, used, total = (x.strip() for x in line.split(","))
        gpus.append({"index": int(idx), "used_mib": int(used), "total_mib": int(total)})
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        keep = {int(x) for x in visible.split(",") if x.strip().isdigit()}
        gpus = [g for g in gpus if g["index"] in keep]
    return gpus


def gpu_gate(kill: bool = True, max_used_mib: int = 2048, wait_s: float = 30.0, log=print) -> GpuGateResult:
    """End our leftover engines, then check GPU memory; raise GpuGateFailed if the machine stays busy."""
    import psutil

    pairs = find_leftovers()
    leftovers = [p for p, _ in pairs]
    found = [d for _, d in pairs]
    killed = []
    if leftovers and kill:
        for p, desc in pairs:
            log(f"gpu-gate: ending leftover {desc}")
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(leftovers, timeout=10)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(alive, timeout=10)
        killed = [p.pid for p in leftovers if p not in alive]
        if alive:
            raise GpuGateFailed(f"gpu-gate: could not end leftover engine processes: {[p.pid for p in alive]}")
    elif leftovers:
        raise GpuGateFailed(f"gpu-gate: leftover engine processes: {found}")
    gpus = gpu_memory()
    deadline = time.time() + wait_s
    while any(g["used_mib"] > max_used_mib for g in gpus) and time.time() < deadline:
        time.sleep(2)  # memory is released a moment after the process exits
        gpus = gpu_memory()
    busy = [g for g in gpus if g["used_mib"] > max_used_mib]
    if busy:
        raise GpuGateFailed("gpu-gate: GPU memory still in use: " + ", ".join(
            f"GPU {g['index']}: {g['used_mib']} of {g['total_mib']} MiB" for g in busy))
    log(f"gpu-gate: {len(found)} leftovers ended, {len(gpus)} GPUs checked" + (" (no nvidia-smi)" if not gpus else ""))
    return GpuGateResult(leftovers_found=found, killed=killed, gpus=gpus, passed=True)

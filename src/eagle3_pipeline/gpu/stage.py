"""The gpu-gate: no leftover engine of ours holds the machine, and the visible GPUs are free.

More: docs/internals.md, "gpu/stage.py".
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import psutil
from pydantic import BaseModel

from eagle3_pipeline.core.config import PipelineConfig
from eagle3_pipeline.core.errors import EnvironmentProblem
from eagle3_pipeline.core.proc import CHILD_MARKER_ENV, LAUNCHER_ENV
from eagle3_pipeline.core.stage_spec import Log, Retry, StageSpec

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


def _protected() -> set[int]:
    """This process, its ancestors and its live descendants (engines this run is using right now)."""
    me = psutil.Process()
    return {me.pid} | {a.pid for a in me.parents()} | {c.pid for c in me.children(recursive=True)}


def find_leftovers() -> list[tuple[object, str]]:
    """(process, description) of every leftover engine process of ours."""
    protected = _protected()
    zombies = {p.pid for p in psutil.process_iter(["status"]) if p.info["status"] == psutil.STATUS_ZOMBIE}
    found = ((p, _ours(p, protected, zombies)) for p in psutil.process_iter())
    return [(p, d) for p, d in found if d]


def _smi(*query: str) -> str:
    """Output of `nvidia-smi <query> --format=csv,noheader,nounits` (tests replace this function)."""
    return subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                          timeout=30, check=True).stdout


def _has_smi() -> bool:
    return shutil.which("nvidia-smi") is not None


def visible_gpus(gpus: list[dict], visible: str | None) -> list[dict]:
    """The GPUs of `gpus` ([{index, uuid, ...}]) that CUDA_VISIBLE_DEVICES=`visible` exposes, in its order.
    Entries are indices (`0,1`) or UUIDs (`GPU-8f2c...`, also a unique prefix, as CUDA accepts); like
    CUDA, the list ends at the first entry that names no GPU (`-1`, garbage). Unset: every GPU; "": none."""
    if visible is None:
        return gpus
    out: list[dict] = []
    for entry in (x.strip() for x in visible.split(",")):
        if entry.isdigit():
            match = [g for g in gpus if g["index"] == int(entry)]
        elif entry.upper().startswith(("GPU-", "MIG-")):
            match = [g for g in gpus if g.get("uuid", "").lower().startswith(entry.lower())]
        else:
            match = []
        if len(match) != 1:
            break
        if match[0] not in out:
            out.append(match[0])
    return out


def gpu_memory() -> list[dict]:
    """[{index, uuid, used_mib, total_mib}] of the GPUs visible to this process (CUDA_VISIBLE_DEVICES by
    index or UUID) from nvidia-smi; [] where there is no nvidia-smi."""
    if not _has_smi():
        return []
    gpus = []
    for line in _smi("--query-gpu=index,uuid,memory.used,memory.total").strip().splitlines():
        idx, uuid, used, total = (x.strip() for x in line.split(","))
        gpus.append({"index": int(idx), "uuid": uuid, "used_mib": int(used), "total_mib": int(total)})
    return visible_gpus(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))


def gpu_holders(gpus: list[dict]) -> dict[int, list[str]]:
    """{GPU index: ["pid 123 (python -m vllm...): 30000 MiB", ...]}: the processes nvidia-smi lists
    as holding memory on `gpus` (compute apps, matched by GPU UUID); a pid from another PID namespace
    (a container) is named by nvidia-smi's process name only."""
    by_uuid = {g["uuid"]: g["index"] for g in gpus if g.get("uuid")}
    out: dict[int, list[str]] = {}
    try:
        apps = _smi("--query-compute-apps=gpu_uuid,pid,used_memory,process_name")
    except (OSError, subprocess.SubprocessError) as e:
        return {g["index"]: [f"(nvidia-smi --query-compute-apps failed: {e})"] for g in gpus}
    for line in apps.strip().splitlines():
        parts = [x.strip() for x in line.split(",", 3)]
        if len(parts) < 4 or parts[0] not in by_uuid:
            continue
        uuid, pid, used, name = parts
        try:
            cmd = " ".join(psutil.Process(int(pid)).cmdline())[:120] or name
        except (psutil.Error, ValueError):
            cmd = name
        out.setdefault(by_uuid[uuid], []).append(f"pid {pid} ({cmd}): {used} MiB")
    return out


def describe_busy(busy: list[dict]) -> str:
    """`GPU 0 (GPU-8f2c...): 30000 of 81920 MiB, held by pid 123 (...): 29500 MiB` per busy GPU."""
    holders = gpu_holders(busy)
    return ", ".join(
        f"GPU {g['index']}" + (f" ({g['uuid']})" if g.get("uuid") else "") + f": {g['used_mib']} of {g['total_mib']} MiB, "
        + ("held by " + "; ".join(holders[g["index"]]) if holders.get(g["index"])
           else "no process listed by nvidia-smi (another container, or a driver-held context)")
        for g in busy)


def gpu_gate(kill: bool = True, max_used_mib: int = 2048, wait_s: float = 30.0, log=print) -> GpuGateResult:
    """End our leftover engines, then check GPU memory; raise GpuGateFailed if the machine stays busy."""
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
        raise GpuGateFailed(f"gpu-gate: GPU memory still in use (more than {max_used_mib} MiB): " + describe_busy(busy))
    log(f"gpu-gate: {len(found)} leftovers ended, {len(gpus)} GPUs checked" + (" (no nvidia-smi)" if not gpus else ""))
    return GpuGateResult(leftovers_found=found, killed=killed, gpus=gpus, passed=True)


class GpuGateInputs(BaseModel):
    where: str  # which point of the run the gate guards (`before-extract`, `after-train`): in its lines and record


def run(cfg: PipelineConfig, inputs: GpuGateInputs, log: Log) -> GpuGateResult:
    """The stage's entry (StageSpec.run)."""
    rec = gpu_gate(log=lambda m: log(f"[{inputs.where}] {m}"))
    return rec.model_copy(update={"where": inputs.where})


RETRY = Retry(0, 0, (), "a gate: busy GPUs are an answer for the operator, not a transient error")
STAGE = StageSpec(name="gpu", run=run, result=GpuGateResult, failure=GpuGateFailed, gate=True, reported=False,
                  task="gpu-gate", retry=RETRY)

"""The agents of a multi-node train set (train/topology.py `TrainSet`), started two ways:

More: docs/internals.md, "train/nodes.py".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from eagle3_pipeline.core.proc import next_generation
from eagle3_pipeline.core.store import atomic_write_text
from eagle3_pipeline.train.topology import LOCAL_ADDR_ENV, NODE_RANK_ENV, RDZV_ID_ENV, SET_DIR_ENV, TrainSet

WAIT_ENV = "EAGLE3_TRAIN_SET_WAIT_S"  # how long a pod of node > 0 waits for node 0's next attempt (default 1 h)
GRACE_S = 30.0


def log(msg: str) -> None:
    print(f"train nodes: {msg}", flush=True)


def _shares(n: int) -> list[list[int]]:
    """This machine's cores split among n local agents (one each at least)."""
    cores = sorted(os.sched_getaffinity(0))
    return [cores[i * len(cores) // n:(i + 1) * len(cores) // n] or [cores[i % len(cores)]] for i in range(n)]


def _end(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()  # torchrun's agent ends its workers on SIGTERM
    deadline = time.monotonic() + GRACE_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def wait_all(procs: list[subprocess.Popen], poll_s: float = 0.2) -> int:
    """0 when every agent exits 0; at the first that does not, end the others and return 1."""
    while True:
        codes = [p.poll() for p in procs]
        bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            i, c = bad[0]
            log(f"node {i}'s agent exited with code {c}: ending the set's other agents")
            _end(procs)
            return 1
        if all(c == 0 for c in codes):
            return 0
        time.sleep(poll_s)


def run_local(ts: TrainSet) -> int:
    procs = []
    try:
        for i, (argv, cores) in enumerate(zip(ts.argv, _shares(ts.nodes))):
            procs.append(subprocess.Popen(argv, preexec_fn=lambda c=cores: os.sched_setaffinity(0, c)))
            log(f"node {i} of {ts.nodes}: agent pid {procs[-1].pid} on cores {cores}, rendezvous {ts.endpoint} "
                f"({ts.id})")
        return wait_all(procs)
    finally:
        _end(procs)


# ------------------------------------------------------------------------------ a train set's pods (Kubernetes)

def set_record(set_dir: Path, set_id: str) -> Path:
    return Path(set_dir) / f"{set_id}.json"


def publish(ts: TrainSet, set_dir: Path, state: str = "running") -> None:
    """Node 0's record of the set's current attempt (a new generation each time) or its end (`done`)."""
    Path(set_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(set_record(set_dir, ts.id), json.dumps(
        {"set": ts.model_dump(mode="json"), "state": state, "generation": uuid.uuid4().hex}))


def _with_local_addr(argv: list[str], addr: str | None) -> list[str]:
    if not addr or any(a.startswith("--local-addr") for a in argv):
        return argv
    i = argv.index("-m", argv.index("torch.distributed.run") + 1)
    return [*argv[:i], f"--local-addr={addr}", *argv[i:]]


def follow(rank: int, path: Path, wait_s: float) -> int:
    """Node `rank` > 0: run this node's agent for every attempt node 0 publishes, until it says done."""
    seen, rc = None, 1
    while True:
        rec = next_generation(path, seen, wait_s)  # node 0 names its next attempt, or done
        if rec is None:
            log(f"node {rank}: no attempt from node 0 in {path} within {wait_s:.0f}s ({WAIT_ENV}); giving up")
            return rc
        if rec["state"] == "done":
            log(f"node {rank}: node 0 says the set is done")
            return 0
        seen, ts = rec["generation"], TrainSet.model_validate(rec["set"])
        argv = _with_local_addr(ts.argv[rank], os.environ.get(LOCAL_ADDR_ENV))
        log(f"node {rank} of {ts.nodes}: joining {ts.endpoint} ({ts.id}, attempt {seen[:8]})")
        rc = subprocess.call(argv)
        log(f"node {rank}: agent exited with code {rc}")


def run_pod(cmd: list[str]) -> int:
    rank = int(os.environ.get(NODE_RANK_ENV, "0") or 0)
    if rank == 0:
        os.execvp(cmd[0], cmd)  # the stage's flow run: it starts node 0's agent
    set_dir, set_id = os.environ.get(SET_DIR_ENV), os.environ.get(RDZV_ID_ENV)
    if not set_dir or not set_id:
        log(f"node {rank}: {SET_DIR_ENV} and {RDZV_ID_ENV} must be set in a train set's pod (the GPU job template)")
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return follow(rank, set_record(Path(set_dir), set_id), float(os.environ.get(WAIT_ENV, "3600")))


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "local":
        return run_local(TrainSet.model_validate_json(Path(argv[1]).read_text()))
    if len(argv) >= 3 and argv[:2] == ["pod", "--"]:
        return run_pod(argv[2:])
    print("usage: python -m eagle3_pipeline.train.nodes local SET.json | pod -- CMD...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

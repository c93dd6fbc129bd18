"""Processes and Prefect API calls shared by the server tests (conftest.py starts the fixtures)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
GPU_LIMIT = "gpu-node"
POOL = "eagle3-process"


# ------------------------------------------------------------------------------- processes

class Proc:
    """A child in its own session (process group), output to a log file."""

    def __init__(self, name: str, cmd: list[str], env: dict, log: Path, cwd: Path = ROOT):
        self.name, self.log = name, log
        self._f = open(log, "ab")
        self.p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=self._f, stderr=subprocess.STDOUT,
                                  start_new_session=True)

    def alive(self) -> bool:
        return self.p.poll() is None

    def tail(self, n: int = 40) -> str:
        lines = self.log.read_text(errors="replace").splitlines()
        return f"--- {self.name} ({self.log}) ---\n" + "\n".join(lines[-n:])

    def wait_idle(self, timeout: float = 120.0) -> None:
        """Until no process started by this one is left (a worker's flow-run processes)."""
        import psutil

        t0 = time.time()
        while psutil.Process(self.p.pid).children():
            assert time.time() - t0 < timeout, f"{self.name} still has children after {timeout:.0f}s"
            time.sleep(0.5)

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the process group and every process it started (node_processes: engine children start their own
        sessions), then SIGKILL what is left after `grace` seconds."""
        import psutil

        try:
            procs = node_processes(self.p.pid)
        except psutil.NoSuchProcess:
            procs = []
        groups = {self.p.pid}
        for pr in procs:
            try:
                groups.add(os.getpgid(pr.pid))
            except ProcessLookupError:
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for g in groups:
                try:
                    os.killpg(g, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            _, alive = psutil.wait_procs(procs, timeout=grace if sig == signal.SIGTERM else 5)
            if not alive:
                break
            procs = alive
        try:
            self.p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self._f.close()


def node_processes(pid: int) -> list:
    """What a lost node loses with process `pid`: it, its descendants, and every worker child one of them launched
    through a fork server (core/forkserver.py: under its server, not its launcher; our LAUNCHER_ENV names the
    launcher), with theirs. Raises psutil.NoSuchProcess when `pid` is gone."""
    import psutil

    from eagle3_pipeline.core.proc import LAUNCHER_ENV

    root = psutil.Process(pid)
    members = {p.pid: p for p in [root, *root.children(recursive=True)]}
    launched = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if (launcher := p.environ().get(LAUNCHER_ENV, "")).isdigit():
                launched.append((int(launcher), p))
    while grown := [p for launcher, p in launched if launcher in members and p.pid not in members]:
        for p in grown:
            members[p.pid] = p  # first: a child that ends meanwhile is not asked for again
            with contextlib.suppress(psutil.Error):
                members.update({q.pid: q for q in p.children(recursive=True)})
    return list(members.values())


def stop_all(procs: list[Proc], grace: float = 15.0) -> None:
    """Proc.stop for several at once, in one grace period rather than one each: a `prefect worker` told to
    stop outlives its SIGTERM and is killed at the end of the grace (a fixture that stopped three in turn
    waited 45 s)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(len(procs), 1)) as pool:
        list(pool.map(lambda p: p.stop(grace), procs))


def run_cmd(cmd: list[str], env: dict, timeout: float = 180) -> str:
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)} -> {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


# ------------------------------------------------------------------------------- API helpers

def ui_run(client, deployment: str, parameters: dict, job_variables: dict | None = None):
    """What the UI's Run button does: a flow run of the deployment, scheduled now."""
    from prefect.states import Scheduled

    dep = client.read_deployment_by_name(deployment)
    return client.create_flow_run_from_deployment(dep.id, parameters=parameters, job_variables=job_variables,
                                                  state=Scheduled(message="Run from the Prefect UI"))


def ui_retry(client, flow_run_id, worker: Proc | None = None) -> float:
    """What the UI's Retry button does (prefect-ui-library retryFlowRun); returns when it was pressed.
    Waits first until `worker` has no flow-run process left and has had a few seconds to handle its
    exit: a failed attempt's process exits (code 1) seconds after the run turned Failed, and Prefect
    3.7's worker reports a non-zero exit as Crashed unless the run is in a final state by then, so a
    retry pressed in between (or whose new process the runner confuses with the old one, both
    tracked by flow-run id) ends Crashed without having run."""
    from prefect.client.schemas.objects import StateType
    from prefect.states import State

    if worker is not None:
        worker.wait_idle()
        time.sleep(5)
    t = time.time()
    r = client.set_flow_run_state(flow_run_id, State(type=StateType.SCHEDULED, name="AwaitingRetry",
                                                      message="Retry from the UI"), force=False)
    assert r.status.value == "ACCEPT", r
    return t


def wait_final(client, flow_run_id, timeout: float, procs: list[Proc] = (), since: float | None = None):
    """Poll until the flow run is in a final state (entered after `since`, a time.time())."""
    t0 = time.time()
    while True:
        fr = client.read_flow_run(flow_run_id)
        if fr.state and fr.state.is_final() and (since is None or fr.state.timestamp.timestamp() > since):
            return fr
        if time.time() - t0 > timeout:
            pytest.fail(f"flow run {fr.name} still {fr.state.name if fr.state else None} after {timeout:.0f}s\n"
                        + "\n".join(p.tail() for p in procs))
        for p in procs:
            assert p.alive(), p.tail()
        time.sleep(2)


def subflow_runs(client, parent_id, name: str | None = None):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.client.schemas.sorting import FlowRunSort

    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])), sort=FlowRunSort.EXPECTED_START_TIME_ASC)
    return [r for r in runs if name is None or client.read_flow(r.flow_id).name == name]


def task_states(client, flow_run_id, run_count: int | None = None, wait_for: set[str] = frozenset(),
                timeout: float = 60) -> dict[str, str]:
    """Task-run name -> state name of a flow run (of one attempt when run_count is given). Task-run
    states reach the server as events, so this waits until `wait_for` names are in final states."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    t0 = time.time()
    while True:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        runs = [r for r in runs if run_count is None or r.flow_run_run_count == run_count]
        got = {r.name: (r.state.name if r.state else None) for r in runs}
        done = {r.name for r in runs if r.state and r.state.is_final()}
        if wait_for <= done or time.time() - t0 > timeout:
            return got
        time.sleep(1)


def read_events(client, name: str, labels: dict[str, str], since: float, want: int = 1, timeout: float = 60):
    from datetime import datetime, timezone

    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter

    f = EventFilter(event=EventNameFilter(name=[name]), resource=EventResourceFilter(labels=labels),
                    occurred=EventOccurredFilter(since=datetime.fromtimestamp(since, timezone.utc)))
    t0 = time.time()
    while True:
        events = client.read_events(filter=f, limit=50).events
        if len(events) >= want or time.time() - t0 > timeout:
            return events
        time.sleep(1)


def artifacts(client, key: str):
    """Every version of a keyed artifact, oldest first."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
                                 sort=ArtifactSort.CREATED_DESC)[::-1]

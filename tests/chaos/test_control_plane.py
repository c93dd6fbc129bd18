"""Chaos on the control plane: a real Prefect server on a real PostgreSQL, a fan-out extraction with
two process-worker "GPU nodes", and the server, a worker or the database taken away mid-group.

Set-up (one per module, as docs/operations.md and infra/docker-compose.yml run production):
  database  a PostgreSQL cluster (tests/helpers/postgres.py; `make postgres` installs Debian's package)
  server    `prefect server start` on it, PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE = the filesystem
            lease storage in the server's PREFECT_HOME (leases survive its restarts), the repossessor
            every 5 s; restarted in place by test (a)
  pool      eagle3-process, `gpu-node` limit of 2 slots, the `extract-group` deployment of prefect.yaml
  nodes     two process workers on queue `gpu`, one run each, retrying 500s like 503s
            (PREFECT_CLIENT_RETRY_EXTRA_CODES=500, docs/operations.md); group runs beat every 30 s
            (PREFECT_FLOWS_HEARTBEAT_FREQUENCY), GPU leases of 60 s (EAGLE3_GPU_LEASE_S), records
            paced (EAGLE3_TEST_RECORD_DELAY_S) so that a group takes tens of seconds
  flow      the extract flow in its own process (flows/extract.py, parallel_groups=2, 6 shards of 4 rows
            in 2 groups of 3), polling every 2 s, a group lost after 2 missed heartbeats

The last two run the extract flow as a deployment with a concurrency limit (the controller, as pipeline-k8s)
and take it away mid-fan-out: SIGTERM, and its lost deployment lease.

Each test waits until a shard is published (mid-group), disturbs, and then requires: the flow ends
Completed, every shard published, the manifest equal to an undisturbed extraction's apart from its
volatile fields (timestamps, attempts: tests/helpers/store.manifest_content) and its grouping (the reference
runs its 6 shards in one engine child), the records the same (tests/helpers/store.same_records: byte for
byte, or at rounding level where another engine process computed them), at most the affected group run
again, and 0 active slots on `gpu-node`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle3_pipeline.core.ports import free_port
from tests.helpers.postgres import PostgresCluster, pg_bin
from tests.helpers.server import BIN, GPU_LIMIT, POOL, ROOT, Proc, node_processes, run_cmd, stop_all
from tests.helpers.store import manifest_content, same_records, small_overrides

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(pg_bin() is None, reason="PostgreSQL is not installed (make postgres)")]

RECORD_DELAY_S = "2.5"
HEARTBEAT_S = "30"
LEASE_S = "60"
SERVER_DOWN_S = 20.0
GROUP_OVERRIDES = ["extract.shards_per_group=3", "extract.parallel_groups=2"]
FLOW = textwrap.dedent("""
    import json, sys
    from eagle3_pipeline.core.config import PipelineConfig
    from eagle3_pipeline.records.layout import ExtractVersion
    from flows.extract import extract
    cfg = PipelineConfig.model_validate_json(open(sys.argv[1]).read())
    version = ExtractVersion.model_validate_json(open(sys.argv[2]).read())
    extract(cfg, version)
    print("EXTRACT-FLOW-COMPLETED", flush=True)
""")


# ------------------------------------------------------------------------------- the control plane

class ControlPlane:
    def __init__(self, pg: PostgresCluster, home: Path):
        self.pg, self.home = pg, home
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        base.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                    VLLM_CPU_KVCACHE_SPACE="1")
        self.server_env = {**base, "PREFECT_HOME": str(home / "server"), "PREFECT_UI_ENABLED": "false",
                           "PREFECT_API_DATABASE_CONNECTION_URL": pg.url,
                           "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect.server.concurrency.lease_storage.filesystem",
                           "PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS": "5",
                           "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false"}
        self.client_env = {**base, "PREFECT_API_URL": self.api, "PREFECT_HOME": str(home / "client"),
                           "PREFECT_LOCAL_STORAGE_PATH": str(home / "results"), "PREFECT_WORKER_QUERY_SECONDS": "2",
                           "EAGLE3_PIPELINE_HOME": str(ROOT), "EAGLE3_FANOUT_POLL_S": "2",
                           "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": HEARTBEAT_S, "EAGLE3_FANOUT_MISSED_HEARTBEATS": "2",
                           "EAGLE3_GPU_LEASE_S": LEASE_S, "PYTHONPATH": str(ROOT),
                           # the server answers 500 (not 503) while PostgreSQL refuses connections: without
                           # this, workers exit after 3 failed polls and take their flow runs with them
                           "PREFECT_CLIENT_RETRY_EXTRA_CODES": "500"}  # BIN is first on PATH (tests/conftest.py)
        self.server: Proc | None = None
        self.nodes: dict[str, Proc] = {}
        self.starts = 0

    def start_server(self) -> float:
        import httpx

        self.starts += 1
        t0 = time.time()
        self.server = Proc("server", [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                                      str(self.port)],
                           self.server_env, self.home / f"server-{self.starts}.log")
        while True:
            assert self.server.alive(), self.server.tail()
            assert time.time() - t0 < 240, "prefect server did not come up in 240 s\n" + self.server.tail()
            try:
                if httpx.get(f"{self.api}/health", timeout=2).status_code == 200:
                    return time.time() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

    def stop_server(self) -> None:
        self.server.stop()

    def start_node(self, name: str) -> Proc:
        env = {**self.client_env, "EAGLE3_TEST_RECORD_DELAY_S": RECORD_DELAY_S}
        n = sum(1 for p in self.home.glob(f"{name}*.log"))
        self.nodes[name] = Proc(name, [str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--name", name,
                                       "--work-queue", "gpu", "--limit", "1"], env, self.home / f"{name}-{n}.log")
        return self.nodes[name]

    def procs(self) -> list[Proc]:
        return [p for p in [self.server, *self.nodes.values()] if p is not None]

    def tails(self) -> str:
        return "\n".join(p.tail(60) for p in self.procs()) + "\n" + self.pg.tail()


def _pool_and_limit(api: str) -> None:
    """The work pool and the GPU limit, made through the API from this process: what `prefect work-pool create
    eagle3-process --type process` and `prefect gcl create gpu-node --limit 2` make (those commands, as
    docs/operations.md gives them, run in tests/server/conftest.py), without a CLI process each (~3 CPU s)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, WorkPoolCreate
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.workers.process import ProcessWorker

    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as c:
        c.create_work_pool(WorkPoolCreate(name=POOL, type="process",
                                          base_job_template=ProcessWorker.get_default_base_job_template()))
        c.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=GPU_LIMIT, limit=2))


@pytest.fixture(scope="module")
def plane(tmp_path_factory, tiny_target):
    pg = PostgresCluster(pg_bin()).init()
    home = tmp_path_factory.mktemp("control-plane")
    cp = ControlPlane(pg, home)
    try:
        print(f"\nprefect server on postgres up in {cp.start_server():.1f}s")
        env, prefect = cp.client_env, str(BIN / "prefect")
        _pool_and_limit(cp.api)
        run_cmd([prefect, "--no-prompt", "deploy", "--name", "extract-group"], env, timeout=300)
        for name in ("node-a", "node-b"):
            cp.start_node(name)
        yield cp
    finally:
        stop_all(cp.procs())
        pg.destroy()


@pytest.fixture(scope="module")
def client(plane):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: plane.api}), get_client(sync_client=True) as c:
        yield c


def _config(tiny_target: Path, store: Path):
    from eagle3_pipeline.core.config import load_config

    return load_config(ROOT / "configs" / "tiny-cpu.yaml", small_overrides(tiny_target, store) + GROUP_OVERRIDES)


def _plan(cfg):
    from eagle3_pipeline.pipeline.stages import plan_extract, stage_preflight, stage_prepare

    quiet = lambda _: None  # noqa: E731
    prep = stage_prepare(cfg, log=quiet)
    return plan_extract(cfg, prep, stage_preflight(cfg, prep, log=quiet))


@pytest.fixture(scope="module")
def undisturbed(tiny_target, tmp_path_factory):
    """The same extraction, undisturbed and without Prefect (the stage function): what every run must equal.
    Its 6 shards run as one group, in one engine child (the stage runs groups one after another, an engine start
    each; the records do not depend on the grouping, tests/integration/test_concurrency.py compares them the same
    way): `groups` are the disturbed runs' two, planned from the same prepare."""
    from eagle3_pipeline.core.config import load_config
    from eagle3_pipeline.pipeline.stages import stage_extract

    store = tmp_path_factory.mktemp("cp-reference")
    groups = _plan(_config(tiny_target, store)).groups
    assert len(groups) == 2, groups
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml", small_overrides(tiny_target, store))
    version = _plan(cfg)
    assert len(version.groups) == 1, version.groups
    stage_extract(cfg, version, log=lambda _: None)
    return SimpleNamespace(dir=Path(version.path), groups=groups)


GROUPING = ("shards_per_group", "parallel_groups")  # config.extract keys the reference differs in (one group)


def published_as_undisturbed(run, undisturbed) -> dict:
    """Every shard published, the manifest the undisturbed one's (its grouping and file hashes aside) and the
    records the same (tests/helpers/store.same_records). Returns the run's manifest."""
    m = run.manifest()
    assert [s["status"] for s in m["shards"]] == ["published"] * len(m["shards"]), m["shards"]
    assert manifest_content(run.dir, GROUPING, file_hashes=False) == \
        manifest_content(undisturbed.dir, GROUPING, file_hashes=False)
    same_records(run.dir, undisturbed.dir)
    return m


# ------------------------------------------------------------------------------- one disturbed run

class Run:
    def __init__(self, plane: ControlPlane, client, tiny_target: Path, tmp: Path):
        self.plane, self.client, self.tmp = plane, client, tmp
        self.cfg = _config(tiny_target, tmp / "store")
        self.version = _plan(self.cfg)
        (tmp / "config.json").write_text(self.cfg.model_dump_json())
        (tmp / "version.json").write_text(self.version.model_dump_json())
        self.t0 = time.time()
        self.flow = Proc("extract-flow", [sys.executable, "-c", FLOW, str(tmp / "config.json"),
                                          str(tmp / "version.json")], plane.client_env, tmp / "extract-flow.log")

    @property
    def dir(self) -> Path:
        return Path(self.version.path)

    def manifest(self) -> dict:
        try:
            return json.loads((self.dir / "manifest.json").read_text())
        except (OSError, ValueError):
            return {}

    def published(self) -> list[int]:
        return [s["index"] for s in self.manifest().get("shards", []) if s["status"] == "published"]

    def wait_published(self, n: int = 1, timeout: float = 400) -> list[int]:
        while len(done := self.published()) < n:
            assert self.flow.alive(), self.flow.tail(80) + self.plane.tails()
            assert time.time() - self.t0 < timeout, f"no shard published in {timeout:.0f}s\n" + self.plane.tails()
            time.sleep(0.5)
        return done

    def finish(self, timeout: float = 600) -> float:
        try:
            self.flow.p.wait(timeout=timeout)
        except Exception:  # noqa: BLE001
            self.flow.stop()
            pytest.fail(f"the extract flow did not end in {timeout:.0f}s\n" + self.flow.tail(80) + self.plane.tails())
        log = self.flow.log.read_text(errors="replace")
        assert self.flow.p.returncode == 0 and "EXTRACT-FLOW-COMPLETED" in log, \
            self.flow.tail(120) + "\n" + self.plane.tails()
        return time.time() - self.t0

    def group_runs(self):
        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
        from prefect.client.schemas.sorting import FlowRunSort

        dep = self.client.read_deployment_by_name("extract-group/extract-group")
        runs = self.client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])),
                                          sort=FlowRunSort.EXPECTED_START_TIME_ASC)
        return [r for r in runs if r.parameters["version"]["dir"] == str(self.version.dir)]

    def running_group(self, shard: int):
        """The group run extracting `shard` (Running)."""
        for r in self.group_runs():
            if shard in r.parameters["shard_ids"] and r.state and r.state.is_running():
                return r
        return None


def active_slots(client, settle_s: float) -> tuple[int, float]:
    """Active slots of the GPU limit, waiting up to `settle_s` for them to reach 0 (a lease the
    server frees at its expiry); returns (slots, seconds waited)."""
    t0 = time.time()
    while True:
        n = client.read_global_concurrency_limit_by_name(GPU_LIMIT).active_slots
        if n == 0 or time.time() - t0 > settle_s:
            return n, time.time() - t0
        time.sleep(1)


def check_outcome(run: Run, undisturbed, what: str, max_reruns: int) -> dict:
    took = run.finish()
    m = published_as_undisturbed(run, undisturbed)
    runs = run.group_runs()
    by_group: dict[tuple, list] = {}
    for r in runs:
        by_group.setdefault(tuple(r.parameters["shard_ids"]), []).append(r)
    assert sorted(by_group) == sorted(tuple(g) for g in undisturbed.groups), sorted(by_group)
    reruns = len(runs) - len(by_group)
    assert reruns <= max_reruns, [(r.name, r.state.name) for r in runs]
    assert all(rs[-1].state.is_completed() for rs in by_group.values()), [(r.name, r.state.name) for r in runs]
    rerun_groups = [g for g, rs in by_group.items() if len(rs) > 1]
    slots, settled = active_slots(run.client, settle_s=float(LEASE_S) + 30)
    assert slots == 0, f"{slots} slot(s) of {GPU_LIMIT} still held {settled:.0f}s after the run\n" + run.plane.tails()
    out = {"test": what, "seconds": round(took), "group_runs": len(runs), "groups_rerun": rerun_groups,
           "shards_published": len(m["shards"]), "shards_lost": 0, "slots_at_end": slots,
           "slots_settled_after_s": round(settled), "attempts": [s["attempts"] for s in m["shards"]]}
    print(f"\n{what}: {json.dumps(out)}")
    return out


# ------------------------------------------------------------------------------- the three disturbances

def test_server_restart_mid_extraction(plane, client, undisturbed, tiny_target, tmp_path):
    run = Run(plane, client, tiny_target, tmp_path)
    run.wait_published(1)
    t = time.time()
    plane.stop_server()  # SIGTERM: what `docker compose restart prefect-server` does
    time.sleep(max(0.0, SERVER_DOWN_S - (time.time() - t)))  # longer than a renewal period (LEASE_S / 4)
    up = plane.start_server()
    print(f"\nserver restarted: down {time.time() - t:.1f}s (start {up:.1f}s), shards published then: "
          f"{run.published()}")
    out = check_outcome(run, undisturbed, "server restart", max_reruns=1)
    # no GPU task was cancelled by a failed lease renewal (what strict=True did on a restart)
    logs = "".join(p.log.read_text(errors="replace") for p in plane.nodes.values())
    assert "Terminating execution to prevent over-allocation" not in logs
    # the leases outlived the restart (filesystem lease storage): no renewal was answered 410
    assert "no longer has this GPU slot's lease" not in logs
    assert out["group_runs"] <= 3


API_AWAY_S = 80.0  # longer than a client's own retries (5 of them: 2 + 4 + 8 + 16 + 32 s, +-20%) and a lease (LEASE_S)


def test_api_away_longer_than_the_clients_retries(plane, client, undisturbed, tiny_target, tmp_path):
    """The API stopped for 80 s mid-extraction: every client's own retries run out (the groups' state reports,
    heartbeats and lease renewals; the fan-out's polls), and the GPU slots' 60 s leases expire meanwhile. The
    fan-out waits the API out (EAGLE3_API_OUTAGE_S), the groups' slots are taken again (their leases were
    revoked), and the run completes: every shard published once with the undisturbed bytes, at most each
    group run again, 0 slots at the end."""
    run = Run(plane, client, tiny_target, tmp_path)
    run.wait_published(1)
    t = time.time()
    plane.stop_server()
    time.sleep(max(0.0, API_AWAY_S - (time.time() - t)))
    up = plane.start_server()
    print(f"\nAPI away {time.time() - t:.1f}s (start {up:.1f}s), shards published then: {run.published()}")
    out = check_outcome(run, undisturbed, "API away 80 s", max_reruns=len(undisturbed.groups))
    assert out["shards_lost"] == 0


def test_worker_killed_mid_group(plane, client, undisturbed, tiny_target, tmp_path):
    import psutil

    run = Run(plane, client, tiny_target, tmp_path)
    first = run.wait_published(1)[0]
    victim_run = run.running_group(first)
    assert victim_run is not None, [(r.name, r.state.name) for r in run.group_runs()]
    # the worker whose flow-run process runs it: kill the worker and everything it started (the flow-run
    # process and its engine child, which starts its own session: node_processes) at once, as a lost node would
    victim = None
    for name, w in plane.nodes.items():
        for p in psutil.Process(w.p.pid).children(recursive=True):
            try:
                if p.environ().get("PREFECT__FLOW_RUN_ID") == str(victim_run.id):
                    victim = name
            except psutil.Error:
                pass
    assert victim is not None, plane.tails()
    w = plane.nodes[victim]
    procs = node_processes(w.p.pid)
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)
    print(f"\nkilled {victim} and {len(procs) - 1} process(es) it started, running {victim_run.name} "
          f"(shards {victim_run.parameters['shard_ids']}) with shards {run.published()} published")
    plane.start_node(victim)  # the worker restarts (its pod/service comes back); the lost run stays Running
    out = check_outcome(run, undisturbed, "worker killed", max_reruns=1)
    assert out["groups_rerun"] == [tuple(victim_run.parameters["shard_ids"])]
    lost = client.read_flow_run(victim_run.id)
    assert lost.state.is_crashed() and "heartbeat" in (lost.state.message or ""), lost.state
    m = run.manifest()
    assert m["shards"][first]["attempts"] == 1  # published before the kill: skipped by the re-run


def test_database_stopped_30s(plane, client, undisturbed, tiny_target, tmp_path):
    run = Run(plane, client, tiny_target, tmp_path)
    run.wait_published(1)
    plane.pg.stop()
    t = time.time()
    time.sleep(30)
    plane.pg.start()
    print(f"\ndatabase stopped for {time.time() - t:.1f}s with shards {run.published()} published; "
          f"server alive: {plane.server.alive()}")
    assert plane.server.alive(), plane.server.tail(80)
    check_outcome(run, undisturbed, "database stopped 30 s", max_reruns=1)


# ------------------------------------------------------------------------------- the controller dies

CONTROLLER = "extract/controller"


@pytest.fixture(scope="module")
def controller_deployment(plane):
    """The extract flow as a deployment with a concurrency limit of 1 (a lease per run, as pipeline-k8s), run
    the way a Kubernetes pod runs it: `prefect flow-run execute` with PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR=
    reschedule (infra/k8s/prefect.yaml), by a process worker on queue `cpu` that plays the CPU pool. Its lease
    is renewed every 5 s (tests/helpers/lease_renewal), so a lost one is found within seconds."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.extract import extract

    # made as `prefect deploy` makes infra/k8s/prefect.yaml's: the pull step sets the working directory to the
    # code (the image's /opt/eagle3-pipeline; here this checkout), which `prefect flow-run execute` runs in
    with temporary_settings({PREFECT_API_URL: plane.api}), get_client(sync_client=True) as c:
        c.create_deployment(
            c.create_flow(extract), "controller", entrypoint="flows/extract.py:extract", work_pool_name=POOL,
            work_queue_name="cpu", concurrency_limit=1,
            pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}],
            # working_dir: the pod's (the image's code dir). Without it the process worker starts each run in a
            # temporary directory it deletes when its process ends; a run rescheduled by SIGTERM was started again
            # while the old process ended, and the new one crashed in Prefect's workspace resolver on a cwd that
            # no longer existed (FileNotFoundError from Path.cwd(), in a full suite run: the test then waited out its 180 s)
            job_variables={"command": f"{BIN / 'prefect'} flow-run execute", "working_dir": str(ROOT),
                           "env": {"PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR": "reschedule",
                                   # the deployment lease renewed every 5 s, not 225 s (the helper says why)
                                   "PYTHONPATH": f"{ROOT / 'tests' / 'helpers' / 'lease_renewal'}:{ROOT}",
                                   "EAGLE3_TEST_LEASE_RENEW_S": "5"}})
    w = Proc("cpu-worker", [str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--name", "cpu-worker",
                            "--work-queue", "cpu"], plane.client_env, plane.home / "cpu-worker.log")
    plane.nodes["cpu-worker"] = w
    yield w


def start_controller(plane, client, tiny_target: Path, tmp_path: Path):
    """A run of the controller deployment extracting a fresh store, and its Run (flow: the deployment's run)."""
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    run = Run.__new__(Run)
    run.plane, run.client, run.tmp = plane, client, tmp_path
    run.cfg = _config(tiny_target, tmp_path / "store")
    run.version = _plan(run.cfg)
    run.t0 = time.time()
    with temporary_settings({PREFECT_API_URL: plane.api}):
        fr = run_deployment(CONTROLLER, parameters={"config": run.cfg.model_dump(mode="json"),
                                                    "version": run.version.model_dump(mode="json")}, timeout=0)
    run.flow = SimpleNamespace(alive=lambda: True, tail=lambda n=80: "")
    return run, fr


def rescheduled_and_done(client, fr, plane) -> list[str]:
    """Wait until the controller's run went back to AwaitingRetry, ran again and ended; its state names."""
    t0 = time.time()
    while True:  # rescheduled: AwaitingRetry, then Running again under a new process
        states = [s.name for s in client.read_flow_run_states(fr.id)]
        if "AwaitingRetry" in states and states[-1] in ("Running", "Completed"):
            break
        assert time.time() - t0 < 180, (states, plane.tails())
        time.sleep(1)
    while not (done := client.read_flow_run(fr.id)).state.is_final():
        assert time.time() - t0 < 600, plane.tails()
        time.sleep(2)
    assert done.state.is_completed(), (done.state, plane.tails())
    return [s.name for s in client.read_flow_run_states(fr.id)]


def each_group_ran_once(run, client, undisturbed) -> list:
    """Everything published with the undisturbed records, one completed run per group, all slots free."""
    published_as_undisturbed(run, undisturbed)
    runs = run.group_runs()
    assert len(runs) == len(undisturbed.groups), [(r.name, r.state.name) for r in runs]  # none submitted twice
    assert all(r.state.is_completed() for r in runs), [(r.name, r.state.name) for r in runs]
    slots, settled = active_slots(client, settle_s=float(LEASE_S) + 30)
    assert slots == 0, run.plane.tails()
    dep = client.read_deployment_by_name(CONTROLLER)
    assert client.read_global_concurrency_limit_by_name(f"deployment:{dep.id}").active_slots == 0
    return runs


def test_controller_sigterm_mid_fanout_is_rescheduled_and_reattaches(plane, client, controller_deployment,
                                                                     undisturbed, tiny_target, tmp_path):
    """SIGTERM to the controller's pod process mid-fan-out (a node drain): its run goes back to Scheduled
    (AwaitingRetry), its running groups are left alone (not cancelled), the worker starts it again, and
    the second execution re-attaches to the groups (flows/attach.py): no group submitted twice,
    nothing lost, the deployment's and the GPU limit's slots all free at the end."""
    import psutil

    run, fr = start_controller(plane, client, tiny_target, tmp_path)
    run.wait_published(1)
    groups_before = {r.id for r in run.group_runs()}
    pids = []
    for p in psutil.Process(controller_deployment.p.pid).children(recursive=True):
        try:
            if p.environ().get("PREFECT__FLOW_RUN_ID") == str(fr.id) and "flow-run" in " ".join(p.cmdline()):
                pids.append(p)
        except psutil.Error:
            pass
    assert pids, plane.tails()
    pids[0].send_signal(signal.SIGTERM)  # what the kubelet sends the pod's first process
    print(f"\nSIGTERM to the controller ({pids[0].pid}) with shards {run.published()} published and group runs "
          f"{len(groups_before)} submitted")
    states = rescheduled_and_done(client, fr, plane)
    runs = each_group_ran_once(run, client, undisturbed)
    out = {"test": "controller SIGTERM (reschedule)", "seconds": round(time.time() - run.t0),
           "group_runs": len(runs), "groups_reattached": len(groups_before), "controller_states": states}
    print(f"\ncontroller SIGTERM: {json.dumps(out)}")


def test_controller_lost_lease_is_rescheduled_and_a_rerun_reattaches(plane, client, controller_deployment,
                                                                     undisturbed, tiny_target, tmp_path):
    """The controller's deployment concurrency lease revoked mid-fan-out (what an API outage longer than the
    renewal's retries, or a server restart with the memory lease storage, does to it): its next renewal is
    refused (410), and instead of crashing the run is rescheduled (AwaitingRetry, flows/lease.py), runs again
    and re-attaches to its groups. Meanwhile a second extraction of the same content, run by hand as a flow of
    its own (another flow run id), re-attached to the same group runs instead of submitting its own: each group
    ran once. On a controller keyed by its flow-run id both fail: the run crashes, the re-run doubles the groups."""
    run, fr = start_controller(plane, client, tiny_target, tmp_path)
    t0 = time.time()
    while not run.group_runs():
        assert time.time() - t0 < 300, plane.tails()
        time.sleep(0.5)
    (tmp_path / "config.json").write_text(run.cfg.model_dump_json())
    (tmp_path / "version.json").write_text(run.version.model_dump_json())
    rerun = Proc("rerun", [sys.executable, "-c", FLOW, str(tmp_path / "config.json"), str(tmp_path / "version.json")],
                 plane.client_env, tmp_path / "rerun.log")
    try:
        run.wait_published(1)
        lease = next(s.state_details.deployment_concurrency_lease_id
                     for s in reversed(client.read_flow_run_states(fr.id)) if s.state_details.deployment_concurrency_lease_id)
        client.release_concurrency_slots_with_lease(lease)  # revoked: the next renewal gets 410
        print(f"\nrevoked the controller's lease {lease} with shards {run.published()} published")
        states = rescheduled_and_done(client, fr, plane)
        rerun.p.wait(timeout=300)
    finally:
        rerun.stop()
    log = rerun.log.read_text(errors="replace")
    assert rerun.p.returncode == 0 and "EXTRACT-FLOW-COMPLETED" in log, rerun.tail(80)
    runs = each_group_ran_once(run, client, undisturbed)
    # the re-run found groups going and submitted none of its own (fanout logs "shards [..] -> <run>" per submission)
    assert "re-attached to" in log and "] -> extract-shards" not in log, rerun.tail(80)
    worker_log = "".join(p.read_text(errors="replace") for p in plane.home.glob("cpu-worker*.log"))
    assert "lost its deployment concurrency lease" in worker_log
    out = {"test": "controller lease lost (reschedule) + a re-run", "seconds": round(time.time() - run.t0),
           "group_runs": len(runs), "controller_states": states}
    print(f"\ncontroller lease lost: {json.dumps(out)}")

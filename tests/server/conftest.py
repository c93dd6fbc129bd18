"""A real Prefect server with the project's deployments, for the tests in this directory.

Package fixtures, each started by the documented commands (docs/operations.md) and stopped when this
directory's tests end (whole process groups, descendants included), not at the end of the session: the idle
server and its workers poll, and the rest of the suite would share its 2 cores with them:
  prefect_server  `prefect server start` on 127.0.0.1, a free port, a temporary PREFECT_HOME (SQLite),
                  with its UI (at `prefect_server.ui`)
  deployed        `prefect work-pool create eagle3-process --type process`, the Kubernetes pool
                  `eagle3-gpu` from infra/k8s-gpu-job-template.json (created, never served),
                  `prefect gcl create gpu-node --limit 2` (two nodes), `prefect --no-prompt deploy --all`
  controller      a process worker on queue `default` (pipeline, refresh, rerun-failed runs)
  nodes           two process workers on queue `gpu`, one flow run each (--limit 1): the two GPU
                  nodes the extract flow fans `extract-group` runs out to. They run with
                  EAGLE3_TEST_FAIL_SHARDS=2: each node loses shard 2 of a new extract version once.
The workers are stopped with the server, all at once (tests/helpers/server.stop_all).
Workers poll every 2 s. Every run uses a tiny config (40 rows, 4 shards of 10) on a temporary store.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle3_pipeline.core.ports import free_port
from tests.helpers.prefect_events import events_to
from tests.helpers.server import BIN, GPU_LIMIT, POOL, ROOT, Proc, run_cmd, stop_all

# ------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="package")
def prefect_server(tmp_path_factory):
    import httpx
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home = tmp_path_factory.mktemp("prefect-server")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    base.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                VLLM_CPU_KVCACHE_SPACE="1")
    # the UI is on (test_report_ui.py opens artifacts in it); it asks this server's API, not :4200's
    server_env = {**base, "PREFECT_HOME": str(home / "server"), "PREFECT_UI_ENABLED": "true", "PREFECT_UI_API_URL": api,
                  "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false"}  # the cron schedule must not fire here
    client_env = {**base, "PREFECT_API_URL": api, "PREFECT_HOME": str(home / "client"),
                  "PREFECT_LOCAL_STORAGE_PATH": str(home / "results"),  # else ~/.prefect/storage, shared
                  "PREFECT_WORKER_QUERY_SECONDS": "2", "EAGLE3_PIPELINE_HOME": str(ROOT),
                  "EAGLE3_FANOUT_POLL_S": "2"}  # BIN is first on PATH (tests/conftest.py)
    t0 = time.time()
    workers: list[Proc] = []  # started by _workers, stopped with the server
    server = Proc("server", [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                  server_env, home / "server.log")
    try:
        while True:
            assert server.alive(), server.tail()
            assert time.time() - t0 < 180, "prefect server did not come up in 180 s\n" + server.tail()
            try:
                if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        print(f"\nprefect server up at {api} in {time.time() - t0:.1f}s")
        # events emitted from this process (task runs among them) must reach this server too
        with temporary_settings({PREFECT_API_URL: api}), events_to(api):
            yield SimpleNamespace(api=api, ui=api.removesuffix("/api"), env=client_env, home=home, proc=server,
                                  workers=workers)
    finally:
        stop_all([*workers, server])  # at once: a worker outlives its SIGTERM by the whole grace


@pytest.fixture(scope="package")
def client(prefect_server):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        yield c


@pytest.fixture(scope="package")
def deployed(prefect_server, tiny_target):
    """Pool, GPU limit and every deployment of prefect.yaml, by the commands README documents."""
    env, prefect = prefect_server.env, str(BIN / "prefect")
    t0 = time.time()
    run_cmd([prefect, "work-pool", "create", POOL, "--type", "process"], env)
    run_cmd([prefect, "work-pool", "create", "eagle3-gpu", "--type", "kubernetes",  # not served here: its template
             "--base-job-template", str(ROOT / "infra" / "k8s-gpu-job-template.json")], env)  # is what is checked
    run_cmd([prefect, "gcl", "create", GPU_LIMIT, "--limit", "2"], env)
    out = run_cmd([prefect, "--no-prompt", "deploy", "--all"], env, timeout=300)
    print(f"deployed in {time.time() - t0:.1f}s")
    return out


def _workers(prefect_server, specs: list[tuple[str, list[str], dict]]) -> list[Proc]:
    procs = []
    for name, args, extra in specs:
        procs.append(Proc(name, [str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--name", name, *args],
                          {**prefect_server.env, **extra}, prefect_server.home / f"{name}.log"))
    prefect_server.workers.extend(procs)  # the server's fixture stops them, all at once
    return procs


@pytest.fixture(scope="package")
def controller(prefect_server, deployed):
    (w,) = _workers(prefect_server, [("controller", ["--work-queue", "default"], {})])
    return w


@pytest.fixture(scope="package")
def nodes(prefect_server, deployed):
    ws = _workers(prefect_server, [(f"node-{n}", ["--work-queue", "gpu", "--limit", "1"],
                                    {"EAGLE3_TEST_FAIL_SHARDS": "2"}) for n in ("a", "b")])
    return ws


@pytest.fixture(scope="package")
def server_store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server-store")


@pytest.fixture(scope="package")
def server_overrides(tiny_target, server_store):
    """Overrides of configs/tiny-cpu.yaml for a 40-row dataset `dataset` from corpus file `source`:
    4 shards of 10 rows in groups of 2, one epoch, 4 held-out prompts, evaluate with one engine (the
    trained draft's, greedy); what a whole pipeline run through a worker needs to take a few minutes on 2 cores."""
    from eagle3_pipeline.core.config import VerifyConfig

    def make(dataset: str, source: str, *extra: str) -> list[str]:
        ovs = [f"name=srv-{dataset}", f"store={server_store}", f"target.model={tiny_target}",
               f"prepare.dataset={dataset}",
               f"prepare.sources=[{{path: {tiny_target / 'corpus' / source}, limit: 44}}]", "prepare.heldout_rows=4",
               "extract.rows_per_shard=10", "extract.shards_per_group=2", "extract.retries=0",
               "verify.reference_samples=2", "train.epochs=1",
               # one optimizer step of the epoch (the group asserts that training ran, steps > 0, and that its
               # records agree); whole epochs stay covered in tests/integration/test_train.py, test_pipeline.py
               "train.max_steps=1", "evaluate.num_prompts=4", "evaluate.max_tokens=16",
               "evaluate.baseline=false", "evaluate.check_lossless=false", "evaluate.min_acceptance_length=1.0",
               # evaluate's other engines and passes, which no assertion here reads (each engine a load of
               # its own in the evaluate child: 4 loads became 1). They stay covered where they are asserted:
               # the speed-up (the target alone's engine, timed rounds) and the sampled pass in
               # tests/integration/test_pipeline.py, the n-gram and suffix decoding baselines in
               # tests/integration/test_evaluate.py
               "evaluate.speedup=false", "evaluate.temperature=null", "evaluate.baseline_ngram=false",
               "evaluate.baseline_suffix=false"]
        if "invariance_samples" in VerifyConfig.model_fields:
            ovs.append("verify.invariance_samples=0")
        return ovs + list(extra)

    return make


@pytest.fixture(scope="package")
def server_config_path(tmp_path_factory) -> Path:
    """configs/tiny-cpu.yaml as it was when the session started (runs later in the session, e.g.
    the refresh deployment's, read this copy, not a file that may be edited meanwhile)."""
    path = tmp_path_factory.mktemp("configs") / "tiny-cpu.yaml"
    path.write_text((ROOT / "configs" / "tiny-cpu.yaml").read_text())
    return path


@pytest.fixture(scope="package")
def server_config(server_overrides, server_config_path):
    from eagle3_pipeline.core.config import load_config

    return lambda *a: load_config(server_config_path, server_overrides(*a))



"""Session fixtures: the tiny target (built once), a tiny pipeline config on a temporary store, and
the stage records that several integration tests share (one prepare, one extraction per session).
The records are the stages' own typed ones (pipeline/stages.py): PrepareResult, PreflightResult, the
ExtractVersion of layout.py and the ExtractResult. Helpers live in the package tests/helpers/."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle3_pipeline.core import forkserver, heap
from eagle3_pipeline.preflight import import_memo
from tests.helpers.server import BIN
from tests.helpers.store import small_overrides

ROOT = Path(__file__).resolve().parents[1]
TEST_GC_ENV = "EAGLE3_TEST_GC"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
heap.tune()  # the test workers import vLLM, torch and Prefect too (core/heap.py)
# and every process the suite starts, vLLM's and Prefect's included (tests/helpers/eagle3_test_gc.pth, which
# `make test` puts in the venv: the same thresholds from a process's first import); docs/testing.md "Suite time"
os.environ.setdefault(TEST_GC_ENV, "1")
# the venv's commands first on PATH, as in an activated venv, for every process the suite starts: the server tests'
# Prefect workers need `prefect` and `eagle3` there, and a fork server serves one PATH (core/forkserver.signature),
# so with PATH set for those workers alone, their children had fork servers of their own (rehearsal 30: 2 of 10)
if os.environ.get("PATH", "").split(os.pathsep)[0] != str(BIN):
    os.environ["PATH"] = os.pathsep.join([str(BIN), os.environ.get("PATH", "")])

# `make test` runs the suite on three pytest-xdist workers (`-n 3 --dist loadscope`; the third, see
# _WAIT_GROUPS below): the serial suite kept
# one of two cores idle half the time (engine start-ups are single-threaded imports, server tests wait on
# workers). A worker takes whole groups, never part of one: a test module each (its module fixtures
# built once), except two groups of several modules. The session fixtures (the tiny prepare + extraction,
# a Prefect harness) are built once per worker.
#   "processes": the tests that make leftover engine processes on purpose and check that the gpu-gate
#     ends exactly theirs (the chaos suite's kill and signal tests, tests/unit/test_proc_gpu.py): one
#     worker, one at a time, so no test sees another's leftovers. tests/chaos/test_control_plane.py is
#     a group of its own: it leaves no leftover (a killed worker is killed with everything under it) and
#     runs no gpu-gate (its group runs only extract), and its 9 minutes made `processes` a 22-minute group,
#     longer alone than the suite's goal of 20.
#   "server": tests/server/, which share one real Prefect server with its workers and deployments.
# Groups are handed out longest first (their seconds in the last full run, docs/testing.md), so no long
# group starts last; xdist's own reorder (most tests first) is turned off for that.
# _WAIT_GROUPS: groups that mostly wait (outages, heartbeats, paced records, Prefect's polls and hand-offs: their
# process tree's CPU seconds about half their wall seconds, docs/testing.md "Suite time"). With more than two workers (`make test`
# runs three) the workers past gw1 run only them, beside the two that run everything else on one core each
# (pytest_configure), so their waiting overlaps the others' work; on two workers they are groups like the rest.
# The chaos `processes` group, which computes about as much as it waits, is the first a computing worker takes: with
# the children forked elsewhere the computing workers ended ~300 s before a waiter that ran it after the control
# plane (docs/decisions/fork-server.md).
_GROUP_RULES = (("tests/chaos/test_control_plane.py", "tests/chaos/test_control_plane.py"),
                ("tests/chaos/", "processes"), ("tests/unit/test_proc_gpu.py", "processes"), ("tests/server/", "server"))
_GROUP_ORDER = ("tests/chaos/test_control_plane.py", "processes", "server", "tests/integration/test_real_pipeline.py",
                "tests/integration/test_online.py", "tests/integration/test_window_pipeline.py",
                "tests/integration/test_pipeline.py", "tests/integration/test_rare_corruption.py",
                "tests/integration/test_extract.py", "tests/integration/test_verify.py", "tests/integration/test_train.py",
                "tests/integration/test_speculators_interop.py", "tests/integration/test_extract_flow.py",
                "tests/integration/test_evaluate_sets.py", "tests/integration/test_poison.py")
# the control plane, then the server group (its Prefect hand-offs kept a pinned core ~0.5 busy for ~6 min; on the
# waiter after the control plane, rehearsal 35: pytest 1,057 s against 1,093 in 33 and 34, the machine 1.90 cores
# busy against 1.80; docs/testing.md "Stop 68"). No computing group: a waiter is not pinned, and a computing group
# there ran its two-thread engines against the pinned workers' (four workers, the chaos `processes` group and the
# engine modules on two waiters: 1,680 s and 3,085 CPU s against 1,597 s and 2,683; docs/decisions/one-core-per-worker.md)
_WAIT_GROUPS = ("tests/chaos/test_control_plane.py", "server")


def group_of(nodeid: str) -> str:
    """The group (see above) of a test id: the worker that runs one of its tests runs all of them."""
    module = nodeid.split("::", 1)[0]
    return next((g for prefix, g in _GROUP_RULES if module.startswith(prefix)), module)


def is_waiter(worker: str, count: int) -> bool:
    """With three workers or more, gw0 and gw1 compute and every later worker is a waiter (_WAIT_GROUPS)."""
    return count >= 3 and int(worker.removeprefix("gw")) >= 2


def _this_worker() -> tuple[str | None, int]:
    """(this xdist worker's id or None outside xdist, the number of workers)."""
    return os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))


def _waiters_group(scope: str) -> bool:
    return scope in _WAIT_GROUPS


def pytest_runtest_setup(item):
    """Every test's worker children are forked where they can be (_fork_servers), whatever a test before it left in
    the environment. A forked child shows its own command line and environment in /proc (core/forkserver.py), so the
    gpu-gate and the chaos tests find it as a spawned one; the tests find a trial's processes by its tag and a node's
    by tests/helpers/server.node_processes, not by the tree (docs/decisions/fork-server.md)."""
    root = item.config.stash.get(_FORK_ROOT, None)
    if root is not None:
        os.environ[forkserver.ENV] = root


_FORK_ROOT = pytest.StashKey[str]()
_FORK_OWNER = pytest.StashKey[bool]()


def _fork_servers(config) -> None:
    """The session's directory of fork servers (core/forkserver.py), which its tests' children use: made by the
    process that starts the suite (xdist's controller, or the one pytest process) and shared by its workers, so a
    server of one import environment forks every worker's children. A directory per worker started 12 servers in
    rehearsal 27 (~7 CPU s of imports each) for 7 environments. The servers end with the owner (pytest_unconfigure
    removes the owner file)."""
    if os.environ.get("EAGLE3_TEST_FORK_SERVER", "1") == "0":
        return
    shared = os.environ.get(forkserver.ENV)
    if os.environ.get("PYTEST_XDIST_WORKER") and shared and (Path(shared) / forkserver.OWNER_FILE).exists():
        config.stash[_FORK_ROOT] = shared  # the controller's: it owns it
        return
    root = Path(tempfile.mkdtemp(prefix="e3fork-"))
    (root / forkserver.OWNER_FILE).write_text(str(os.getpid()))
    config.stash[_FORK_ROOT] = os.environ[forkserver.ENV] = str(root)
    config.stash[_FORK_OWNER] = True


def _preflight_memo() -> None:
    """One directory of preflight's import-probe memos for the session (preflight/import_memo.py), made by the process
    that starts the suite and inherited by its workers and everything they start: the first preflight of the session
    imports vLLM and speculators, the ~16 `eagle3 run`s and flow runs after it on the same installed files do not
    (~5 CPU s each), and no memo of another session or of the user's cache is read."""
    if not os.environ.get(import_memo.ENV):
        os.environ[import_memo.ENV] = tempfile.mkdtemp(prefix="e3preflight-")


def pytest_unconfigure(config):
    root = config.stash.get(_FORK_ROOT, None)
    if root is not None and config.stash.get(_FORK_OWNER, False):  # its servers see the owner file gone and end
        (Path(root) / forkserver.OWNER_FILE).unlink(missing_ok=True)  # within a second; their logs stay


def pytest_configure(config):
    """With three workers or more, gw0 and gw1 each run on one core of their own: every process they start
    inherits the affinity, and the product sizes its threads from it (engine/build.py cpu_bind_spec,
    train/worker.py), so engines and trainers run one thread each instead of two that wait on each other across
    two busy workers (docs/decisions/one-core-per-worker.md). The waiters stay on every core."""
    _fork_servers(config)
    _preflight_memo()
    worker, count = _this_worker()
    if worker is None or count < 3 or is_waiter(worker, count):
        return
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[int(worker.removeprefix("gw")) % len(cores)]})


def pytest_collection_modifyitems(config, items):
    rank = {g: i for i, g in enumerate(_GROUP_ORDER)}
    items.sort(key=lambda it: rank.get(group_of(it.nodeid), len(rank)))  # stable: the rest keep their order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With `--dist loadscope`, xdist's scope of a test is its group, and groups go out in the collection's
    order (above): xdist would otherwise reorder them by their number of tests, which sent the 3-test,
    10-minute real-target module out late. (Its `loadgroup` cannot be used: it renames node ids through
    `item._nodeid`, which pytest 9 no longer reads.) With three workers or more, the waiters (is_waiter) run
    only the groups of _WAIT_GROUPS and the others never do: their waits overlap the others' work."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

        def _mine(self, node, scope: str) -> bool:
            if len(self.nodes) < 3:
                return True
            return is_waiter(node.gateway.id, len(self.nodes)) == _waiters_group(scope)

        def _assign_work_unit(self, node) -> None:
            scope = next((s for s in self.workqueue if self._mine(node, s)), None)
            if scope is None:  # nothing left for this worker's kind (the others take the rest): shut it down now.
                # An xdist worker runs a test only once it holds the next one or the shutdown (pytest's teardown
                # needs `nextitem`), so waiting for its pending tests first held the waiter's last control-plane
                # test back until every other group was done: 600 s idle, then 83 s at the suite's end
                if not node.shutting_down:
                    node.shutdown()
                return
            self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return ByGroup(config, log)


@pytest.fixture(scope="session")
def tiny_target() -> Path:
    """The embedded tiny target model dir; built (≈3 min) when the Makefile has not built it yet."""
    path = Path(os.environ.get("EAGLE3_TINY_TARGET", ROOT / ".cache" / "tiny-target"))
    if not (path / "tiny_target.json").exists():
        from eagle3_pipeline.tiny.target import TinyTargetConfig, build_tiny_target

        build_tiny_target(TinyTargetConfig(), path)
    return path


@pytest.fixture(scope="session")
def tiny_moe_target() -> Path:
    """The embedded tiny MoE target model dir (DeepSeek-V3 family); built (≈3 min) when the Makefile has not."""
    path = Path(os.environ.get("EAGLE3_TINY_MOE", ROOT / ".cache" / "tiny-moe"))
    if not (path / "tiny_target.json").exists():
        from eagle3_pipeline.tiny.moe_target import TinyMoeConfig, build_tiny_moe

        build_tiny_moe(TinyMoeConfig(), path)
    return path


@pytest.fixture(scope="session")
def store_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="session")
def tiny_config(tiny_target, store_root):
    """configs/tiny-cpu.yaml, the real config, made smaller only where it makes tests faster."""
    from eagle3_pipeline.core.config import load_config

    corpus = tiny_target / "corpus"
    return load_config(ROOT / "configs" / "tiny-cpu.yaml", [
        f"store={store_root}", f"target.model={tiny_target}",
        f"prepare.sources=[{{path: {corpus / 'sharegpt.jsonl'}, limit: 200}}, {{path: {corpus / 'openai.jsonl'}, limit: 200}}]",
        "prepare.heldout_rows=16", "extract.rows_per_shard=96", "evaluate.num_prompts=16", "train.epochs=2",
    ])


@pytest.fixture(scope="session")
def prepared(tiny_config):
    """The PrepareResult of the tiny config."""
    from eagle3_pipeline.pipeline.stages import stage_prepare

    return stage_prepare(tiny_config)


@pytest.fixture(scope="session")
def tokenized(prepared) -> Path:
    return Path(prepared.tokenized)


@pytest.fixture(scope="session")
def preflighted(tiny_config, prepared):
    """The PreflightResult (dims, layer ids) of the tiny config."""
    from eagle3_pipeline.pipeline.stages import stage_preflight

    return stage_preflight(tiny_config, prepared)


@pytest.fixture(scope="session")
def extract_version(tiny_config, prepared, preflighted):
    """The ExtractVersion the pipeline plans for the tiny config (layout.plan_extract)."""
    from eagle3_pipeline.pipeline.stages import plan_extract

    return plan_extract(tiny_config, prepared, preflighted)


@pytest.fixture(scope="session")
def extracted(tiny_config, extract_version) -> SimpleNamespace:
    """One real vLLM extraction of the tiny prepared data, shared by the session: its ExtractVersion
    (`version`), its ExtractResult (`record`) and the fields tests use most."""
    from eagle3_pipeline.pipeline.stages import stage_extract

    v = extract_version
    rec = stage_extract(tiny_config, v)
    return SimpleNamespace(version=v, record=rec, tokenized=Path(v.tokenized_dir), hidden_states=v.hidden_states_dir,
                           dir=v.path, layer_ids=v.layer_ids, hidden_size=v.dims.hidden_size,
                           content_key=v.content_key)


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory):
    """One temporary Prefect server (SQLite) per test session, with its own PREFECT_HOME."""
    home = tmp_path_factory.mktemp("prefect-home")
    os.environ["PREFECT_HOME"] = str(home)
    # Prefect 3.7 keeps persisted results in ~/.prefect/storage whatever PREFECT_HOME says
    os.environ["PREFECT_LOCAL_STORAGE_PATH"] = str(home / "storage")
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    from tests.helpers.prefect_events import events_to

    # the harness sets the API URL but leaves the events worker where it was: the real server's, when
    # this xdist worker ran tests/server/ first, and this harness's task runs would be sent there
    with prefect_test_harness(server_startup_timeout=120), events_to(PREFECT_API_URL.value()):
        yield


# ---------------------------------------------------------------- a smaller run for tests that start many engines

@pytest.fixture(scope="session")
def small_reference(tiny_target, tmp_path_factory) -> SimpleNamespace:
    """One clean prepare + extract of the small run (one engine start), the reference that crash and
    concurrency tests compare their stores with (tests/helpers/store.same_records): the config, the stage records (prep,
    pre, ext) and the ExtractVersion (`version`; relocate it with `version.model_copy(update={"dir": ..., "pool_dir": None})`)."""
    from eagle3_pipeline.core.config import load_config
    from eagle3_pipeline.pipeline.stages import plan_extract, stage_extract, stage_preflight, stage_prepare

    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml", small_overrides(tiny_target, tmp_path_factory.mktemp("small-ref")))
    quiet = lambda _: None  # noqa: E731
    prep = stage_prepare(cfg, log=quiet)
    pre = stage_preflight(cfg, prep, log=quiet)
    version = plan_extract(cfg, prep, pre)
    ext = stage_extract(cfg, version, log=quiet)
    return SimpleNamespace(cfg=cfg, prep=prep, pre=pre, version=version, ext=ext, dir=version.path)

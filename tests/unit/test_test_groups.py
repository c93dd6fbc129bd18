"""How `make test` splits the suite over its xdist workers (tests/conftest.py): the gpu-gate's leftover-process
tests stay together in one group, the control-plane chaos module is a group of its own, and the groups go out
in the order the conftest gives them (longest first), not in xdist's order by number of tests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.conftest import _GROUP_ORDER, _LATE_GROUPS, _WAIT_GROUPS, group_of, pytest_xdist_make_scheduler


def test_leftover_process_tests_share_a_group_and_the_control_plane_has_its_own():
    for nodeid in ("tests/chaos/test_chaos_extract.py::test_parent_killed[0]", "tests/chaos/test_signals.py::x",
                   "tests/chaos/test_gpu_slot_orphan.py::x", "tests/unit/test_proc_gpu.py::x"):
        assert group_of(nodeid) == "processes", nodeid
    assert group_of("tests/chaos/test_control_plane.py::test_worker_killed_mid_group") == \
        "tests/chaos/test_control_plane.py"
    assert group_of("tests/server/test_fanout.py::x") == "server"
    assert group_of("tests/integration/test_train.py::x") == "tests/integration/test_train.py"
    assert len(set(_GROUP_ORDER)) == len(_GROUP_ORDER)


class _Node:
    """What the scheduler reads of a worker: it is sent test indices to run."""

    def __init__(self, name: str):
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indices):
        self.sent.extend(indices)

    def shutdown(self):
        self.shutting_down = True


def test_groups_go_out_in_the_conftest_order_not_by_number_of_tests():
    """xdist reorders loadscope groups by their number of tests unless told not to: the 3-test, 10-minute
    real-target module went out late (at 1737 s of a 2620 s run)."""
    values = {"dist": "loadscope", "tx": ["2*popen"], "numprocesses": None, "maxworkerrestart": None}
    option = SimpleNamespace(loadscopereorder=True, **values)
    config = SimpleNamespace(option=option, getvalue=lambda name: getattr(option, name))
    sched = pytest_xdist_make_scheduler(config, log=None)
    assert option.loadscopereorder is False
    collection = ["tests/chaos/test_signals.py::a", "tests/integration/test_real_pipeline.py::a",
                  *(f"tests/unit/test_bad_input.py::t{i}" for i in range(20))]
    nodes = [_Node("gw0"), _Node("gw1")]
    for n in nodes:
        sched.add_node(n)
        sched.add_node_collection(n, collection)
    sched.schedule()
    assert nodes[0].sent[0] == 0 and nodes[1].sent[0] == 1  # processes first, then the real target


def _scheduled(names: list[str], collection: list[str]) -> list[_Node]:
    values = {"dist": "loadscope", "tx": [f"{len(names)}*popen"], "numprocesses": None, "maxworkerrestart": None}
    option = SimpleNamespace(loadscopereorder=True, **values)
    config = SimpleNamespace(option=option, getvalue=lambda name: getattr(option, name))
    sched = pytest_xdist_make_scheduler(config, log=None)
    nodes = [_Node(n) for n in names]
    for n in nodes:
        sched.add_node(n)
        sched.add_node_collection(n, collection)
    sched.schedule()
    for n in nodes:  # each worker finishes what it was sent, one test at a time, and asks for more
        done = 0
        while done < len(n.sent):
            sched.mark_test_complete(n, n.sent[done])
            done += 1
    assert sched.tests_finished
    return nodes


def test_a_third_worker_runs_the_waiting_groups_then_the_late_ones():
    """With three workers the highest one (gw2, whichever registered first) runs _WAIT_GROUPS, then
    _LATE_GROUPS, and nothing else, and the other two never run them; with two, a waiting group is a group like
    the rest."""
    cp = [f"tests/chaos/test_control_plane.py::t{i}" for i in range(6)]
    late = ["tests/chaos/test_signals.py::a", "tests/unit/test_proc_gpu.py::a"]
    rest = ["tests/server/test_fanout.py::a", "tests/integration/test_real_pipeline.py::a",
            *(f"tests/unit/test_bad_input.py::t{i}" for i in range(5))]
    collection = [*late[:1], *rest[:2], *cp, *rest[2:], *late[1:]]
    waiting = {collection.index(x) for x in cp}
    later = {collection.index(x) for x in late}
    assert set(_WAIT_GROUPS) == {group_of(cp[0])} and set(_LATE_GROUPS) == {group_of(x) for x in late}
    gw2, gw0, gw1 = _scheduled(["gw2", "gw0", "gw1"], collection)
    assert set(gw2.sent) == waiting | later and gw2.shutting_down
    assert gw2.sent[:len(cp)] == sorted(waiting)  # the control plane first
    assert sorted(gw0.sent + gw1.sent) == sorted(set(range(len(collection))) - waiting - later)
    two = _scheduled(["gw0", "gw1"], collection)
    assert sorted(two[0].sent + two[1].sent) == list(range(len(collection)))
    assert any(waiting <= set(n.sent) for n in two)  # whole, on one worker


def test_a_waiter_holds_itself_to_one_core_for_a_late_group_only():
    """The waiter stays on every core for the control plane and takes one core from its first late test on
    (what its engines and trainers then start with); a computing worker's pin (pytest_configure) is untouched."""
    import os
    import subprocess
    import sys

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core here: nothing to hold to")
    # the probe starts on every core (this test may run on a computing worker, held to one)
    probe = ("import os, sys; from types import SimpleNamespace as N; from tests.conftest import pytest_runtest_setup as s; "
             "os.sched_setaffinity(0, range(os.cpu_count())); "
             "[s(N(nodeid=n)) or print(len(os.sched_getaffinity(0))) for n in sys.argv[1:]]")
    ids = ["tests/chaos/test_control_plane.py::t", "tests/chaos/test_signals.py::t", "tests/integration/test_train.py::t"]
    env = {**os.environ, "PYTEST_XDIST_WORKER": "gw2", "PYTEST_XDIST_WORKER_COUNT": "3"}
    out = subprocess.run([sys.executable, "-c", probe, *ids], env=env, capture_output=True, text=True, check=True)
    n = os.cpu_count()
    assert out.stdout.split() == [str(n), "1", "1"], out.stdout + out.stderr
    env["PYTEST_XDIST_WORKER"] = "gw1"
    out = subprocess.run([sys.executable, "-c", probe, *ids], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(n)] * 3, out.stdout + out.stderr

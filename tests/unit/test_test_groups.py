"""How `make test` splits the suite over its xdist workers (tests/conftest.py): the gpu-gate's leftover-process
tests stay together in one group, the control-plane chaos module is a group of its own, and the groups go out
in the order the conftest gives them (longest first), not in xdist's order by number of tests."""

from __future__ import annotations

from types import SimpleNamespace

from tests.conftest import _GROUP_ORDER, _WAIT_GROUPS, group_of, pytest_xdist_make_scheduler


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


def test_a_third_worker_runs_only_the_waiting_groups():
    """With three workers the highest one (gw2, whichever registered first) runs _WAIT_GROUPS and nothing else, and
    the other two never run them, the chaos `processes` group first of all; with two, a waiting group is a group
    like the rest."""
    cp = [f"tests/chaos/test_control_plane.py::t{i}" for i in range(6)]
    chaos = ["tests/chaos/test_signals.py::a", "tests/unit/test_proc_gpu.py::a"]
    rest = ["tests/server/test_fanout.py::a", "tests/integration/test_real_pipeline.py::a",
            *(f"tests/unit/test_bad_input.py::t{i}" for i in range(5))]
    collection = [*cp, *chaos, *rest]  # the collection's order: _GROUP_ORDER
    waiting = {collection.index(x) for x in [*cp, rest[0]]}
    assert set(_WAIT_GROUPS) == {group_of(cp[0]), group_of(rest[0])}
    gw2, gw0, gw1 = _scheduled(["gw2", "gw0", "gw1"], collection)
    assert set(gw2.sent) == waiting and gw2.shutting_down
    assert sorted(gw0.sent + gw1.sent) == sorted(set(range(len(collection))) - waiting)
    first = gw0 if collection.index(chaos[0]) in gw0.sent else gw1
    assert first.sent[:len(chaos)] == [collection.index(x) for x in chaos]  # whole, and first on its worker
    two = _scheduled(["gw0", "gw1"], collection)
    assert sorted(two[0].sent + two[1].sent) == list(range(len(collection)))
    assert any({collection.index(x) for x in cp} <= set(n.sent) for n in two)  # whole, on one worker


def test_the_waiter_is_shut_down_once_its_groups_are_sent_so_it_runs_its_last_test_then():
    """An xdist worker runs its next-to-last test's successor only when it is sent more or told to shut down (pytest
    needs `nextitem`). The waiter, whose groups are all sent while the computing workers still have groups to run,
    is told to shut down then, not when it has nothing pending: otherwise its last control-plane test waited until
    every other group had finished (600 s of a 1,242 s run, then 83 s alone at the end)."""
    cp = [f"tests/chaos/test_control_plane.py::t{i}" for i in range(6)]
    rest = [f"tests/integration/test_m{i}.py::a" for i in range(8)]
    values = {"dist": "loadscope", "tx": ["3*popen"], "numprocesses": None, "maxworkerrestart": None}
    option = SimpleNamespace(loadscopereorder=True, **values)
    config = SimpleNamespace(option=option, getvalue=lambda name: getattr(option, name))
    sched = pytest_xdist_make_scheduler(config, log=None)
    nodes = [_Node(n) for n in ("gw0", "gw1", "gw2")]
    for n in nodes:
        sched.add_node(n)
        sched.add_node_collection(n, [*cp, *rest])
    sched.schedule()
    gw2 = nodes[2]
    assert sorted(gw2.sent) == list(range(len(cp)))
    for i in gw2.sent[:-1]:  # gw0 and gw1 still busy with their first groups
        sched.mark_test_complete(gw2, i)
    assert sched.workqueue and gw2.shutting_down  # so the worker runs its last test now
    assert not nodes[0].shutting_down and not nodes[1].shutting_down


def test_every_test_forks_its_children():
    """Every test runs with EAGLE3_FORK_SERVER naming its pytest process's fork-server directory, the chaos groups'
    too (a forked child shows its own command line and environment in /proc: core/forkserver.py), even after a test
    that took it away."""
    import os

    from eagle3_pipeline.core import forkserver
    from tests.conftest import _FORK_ROOT, pytest_runtest_setup

    config = SimpleNamespace(stash={_FORK_ROOT: "/tmp/e3fork-test"})
    saved = os.environ.get(forkserver.ENV)
    try:
        seen = []
        for nodeid in ("tests/integration/test_train.py::t", "tests/chaos/test_control_plane.py::t",
                       "tests/unit/test_proc_gpu.py::t", "tests/server/test_fanout.py::t"):
            pytest_runtest_setup(SimpleNamespace(nodeid=nodeid, config=config))
            seen.append(os.environ.get(forkserver.ENV))
            os.environ.pop(forkserver.ENV, None)
        assert seen == ["/tmp/e3fork-test"] * 4
    finally:
        os.environ.pop(forkserver.ENV, None)
        if saved is not None:
            os.environ[forkserver.ENV] = saved

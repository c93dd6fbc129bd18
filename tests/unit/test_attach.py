"""flows/attach.py's keys and choices, and flows/lease.py's test of whose CancelledError is a lost lease,
without a server (the chaos tests run both for real: tests/chaos/test_control_plane.py)."""

from types import SimpleNamespace
from uuid import uuid4

from prefect.client.schemas.objects import StateDetails
from prefect.states import Completed, Crashed, Running, Scheduled

from flows import attach
from flows.lease import lease_of


def _run(key, state):
    return SimpleNamespace(idempotency_key=key, state=state, name=key)


def test_keys_name_the_content_not_the_controller():
    base = attach.group_base("abc123", "/store/a", [3, 4, 5])
    assert base.startswith("eagle3-extract-abc123-") and base.endswith("-shards-3.4.5")
    assert attach.group_base("abc123", "/store/b", [3, 4, 5]) != base  # another store: another extraction
    p = {"config": {"train": {"lr": 1e-4}}, "version": {"dir": "/d"}}
    assert attach.stage_base("train", "abc123", p) == attach.stage_base("train", "abc123", dict(reversed(p.items())))
    changed = {**p, "config": {"train": {"lr": 2e-4}}}  # another train setting: another run, never an attach
    assert attach.stage_base("train", "abc123", changed) != attach.stage_base("train", "abc123", p)
    assert attach.stage_base("evaluate", "abc123", p) != attach.stage_base("train", "abc123", p)
    # evaluate's run directory is new in each execution of a pipeline run: a rescheduled one re-attaches
    assert attach.stage_base("evaluate", "k", {**p, "run_dir": "/runs/a"}) == attach.stage_base(
        "evaluate", "k", {**p, "run_dir": "/runs/b"})


def test_latest_attempt_per_base():
    base = attach.group_base("k", "/d", [0, 1])
    other = attach.group_base("k", "/d", [0, 1, 2])  # a prefix of the key is another group
    runs = [_run(f"{base}-1", Crashed()), _run(f"{base}-2", Running()), _run(f"{other}-7", Running()),
            _run(f"{base}-x", Running()), _run(None, Running())]
    n, fr = attach.latest(runs, base)
    assert n == 2 and fr.idempotency_key == f"{base}-2" and attach.going(fr)
    assert attach.latest(runs, attach.group_base("k", "/d", [9])) == (0, None)
    assert attach.attempt_of(runs[2], other) == 7 and attach.attempt_of(runs[2], base) is None
    assert not attach.going(_run(f"{base}-3", Crashed())) and not attach.going(_run(f"{base}-3", Completed()))
    assert attach.going(_run(f"{base}-3", Scheduled())) and not attach.going(None)


def _ctx(lease=None, parent=None, timeout=None):
    st = Running(state_details=StateDetails(deployment_concurrency_lease_id=lease))
    return SimpleNamespace(flow_run=SimpleNamespace(id=uuid4(), parent_task_run_id=parent, state=st),
                           flow=SimpleNamespace(timeout_seconds=timeout))


def test_only_the_run_that_renews_a_deployment_lease_is_rescheduled():
    lease = uuid4()
    assert lease_of(_ctx(lease)) == str(lease)
    assert lease_of(_ctx()) is None  # no deployment concurrency limit: a CancelledError is not a lost lease
    assert lease_of(_ctx(lease, parent=uuid4())) is None  # a subflow: its parent's run holds the lease
    assert lease_of(_ctx(lease, timeout=60)) is None  # a flow timeout ends the body the same way
    assert lease_of(None) is None

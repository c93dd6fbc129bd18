"""tasks.gpu_lease.gpu_slot_scope: the extract flow's groups share one GPU slot, taken by the first
group that asks for it and released when the scope ends; outside a scope every gpu_slot() takes its own.
(The real strict slot against a Prefect server: tests/integration/test_extract_flow.py.)"""

import contextlib

import pytest

import tasks.gpu_lease as t


@pytest.fixture
def acquisitions(monkeypatch) -> list[str]:
    log: list[str] = []

    @contextlib.contextmanager
    def fake_acquire():
        log.append("acquire")
        try:
            yield
        finally:
            log.append("release")

    monkeypatch.setattr(t, "acquire_gpu_slot", fake_acquire)
    return log


def test_one_slot_per_scope_taken_lazily(acquisitions):
    with t.gpu_slot_scope():
        assert acquisitions == []  # nothing asked for it yet: a scope that loads nothing takes no slot
        for _ in range(3):
            with t.gpu_slot():
                assert acquisitions == ["acquire"]
        with t.gpu_slot_scope():  # nested: the outer scope's slot
            with t.gpu_slot():
                pass
        assert acquisitions == ["acquire"]
    assert acquisitions == ["acquire", "release"]
    with t.gpu_slot_scope():
        pass
    assert acquisitions == ["acquire", "release"]


def test_without_a_scope_each_call_takes_its_own(acquisitions):
    for _ in range(2):
        with t.gpu_slot():
            pass
    assert acquisitions == ["acquire", "release"] * 2


def test_a_failing_body_releases_the_scope_slot(acquisitions):
    with pytest.raises(RuntimeError), t.gpu_slot_scope():
        with t.gpu_slot():
            raise RuntimeError("group failed")
    assert acquisitions == ["acquire", "release"]
    with t.gpu_slot():  # a later call outside the scope takes a fresh slot
        pass
    assert acquisitions == ["acquire", "release"] * 2


def test_pool_gate_takes_no_in_pod_slot(monkeypatch):
    """EAGLE3_GPU_GATE=pool (the Kubernetes Job templates set it): the work pool's limit gated the run before
    its pod existed, so the pod takes no `gpu-node` slot; without it the slot is taken."""
    taken = []

    class Lease:
        def __init__(self, name):
            taken.append(name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(t, "GpuLease", Lease)
    monkeypatch.setattr(t, "ensure_gpu_limit", lambda *a, **k: 1)
    monkeypatch.setenv("PREFECT__FLOW_RUN_ID", "started-by-a-worker")
    monkeypatch.setenv("EAGLE3_GPU_GATE", "pool")
    with t.gpu_slot():
        pass
    assert taken == []
    monkeypatch.delenv("EAGLE3_GPU_GATE")
    with t.gpu_slot():
        pass
    assert taken == [t.GPU_LIMIT]

"""Retry policies (each stage's StageSpec.retry; tasks/stage_tasks.RETRY_POLICIES by task): which errors are retried, stated once; gates
never retry on a gate answer. The one-shot fault hook of faults.py. A real retried pipeline run:
tests/integration/test_pipeline.py."""

from __future__ import annotations

import pytest

from eagle3_pipeline.core.errors import ConfigError, DiskFull, is_transient
from eagle3_pipeline.core.faults import FAIL_ONCE_DIR_ENV, FAIL_ONCE_ENV, InjectedFault, fail_once, take_fault
from eagle3_pipeline.core.proc import ChildFailed, ChildTimedOut
from eagle3_pipeline.evaluate.results import EvaluateError
from eagle3_pipeline.evaluate.stage import EvaluateGateFailed, InvalidDraftError
from eagle3_pipeline.preflight.stage import PreflightFailed
from eagle3_pipeline.records.contracts import ContractError
from eagle3_pipeline.train.export import ExportCheckError
from eagle3_pipeline.verify.stage import VerifyFailed
from tasks.stage_tasks import RETRY_POLICIES, retry_options


def _wrapped(outer: Exception, inner: Exception) -> Exception:
    try:
        try:
            raise inner
        except Exception as e:
            raise outer from e
    except Exception as e:
        return e


@pytest.mark.parametrize("stage, exc, retried", [
    ("prepare", OSError("connection reset"), True),
    ("prepare", InjectedFault("x"), True),
    ("prepare", TimeoutError("hub"), True),
    ("prepare", ContractError("row 3: bad"), False),
    ("prepare", DiskFull("no space"), False),
    ("prepare", OSError(28, "No space left on device"), False),
    ("prepare", ConfigError("bad key"), False),
    ("verify", VerifyFailed("hs_5: layer 2 expected [4, 128], found [128]"), False),
    ("verify", ChildFailed("reference child exited -9"), True),
    ("verify", _wrapped(VerifyFailed("bad"), OSError("read")), False),  # a gate answer, whatever caused it
    ("vocab", OSError("stale NFS handle"), True),
    ("vocab", ValueError("bug"), False),
    ("train", ChildFailed("train exited -9"), True),
    ("train", ChildTimedOut("train past its deadline"), True),
    ("train", ExportCheckError("d2t differs"), False),
    ("evaluate", _wrapped(EvaluateError("evaluate: engine failed"), ChildFailed("exit 1")), True),
    ("evaluate", RuntimeError("engine core failed to start"), True),
    ("evaluate", EvaluateGateFailed("τ 1.2 below 1.5"), False),
    ("evaluate", InvalidDraftError("no config.json"), False),
    ("preflight", PreflightFailed("vllm too old"), False),
    ("gpu-gate", RuntimeError("busy"), False),
])
def test_retry_condition(stage, exc, retried):
    pol = RETRY_POLICIES[stage]
    assert is_transient(exc, pol.transient) is retried
    fn = retry_options(stage)["retry_condition_fn"]
    if pol.retries:
        from prefect.states import Failed

        assert fn(None, None, Failed(data=exc)) is retried
    else:
        assert fn is None and retry_options(stage)["retries"] == 0


def _stage_tasks() -> dict:
    """{task name: the Prefect task of tasks/stage_tasks.py}."""
    from prefect.tasks import Task

    import tasks.stage_tasks as t

    return {v.name: v for v in vars(t).values() if isinstance(v, Task)}


def test_every_task_states_its_policy():
    """One task per registered stage (registry.TASKS), each with its stage's own policy (StageSpec.retry)."""
    from eagle3_pipeline.pipeline import registry

    found = _stage_tasks()
    assert list(RETRY_POLICIES) == list(registry.TASKS)
    assert all(RETRY_POLICIES[s.task_name] is s.retry for s in registry.STAGES)
    for name in registry.TASKS:
        task, pol = found[name], RETRY_POLICIES[name]
        assert task.retries == pol.retries, name
        assert (task.retry_condition_fn is not None) == (pol.retries > 0), name
    assert {"prepare", "verify", "vocab", "train", "evaluate"} <= {k for k, p in RETRY_POLICIES.items() if p.retries}
    assert retry_options("extract-group", 5)["retries"] == 5  # config.extract.retries overrides the count
    from pathlib import Path

    from eagle3_pipeline.core.config import load_config

    cfg = load_config(Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml", ["extract.retries=4", "regenerate.retries=3"])
    assert {s.name: s.retry.retries_in(cfg) for s in registry.STAGES if s.retry.count} == {"regenerate": 3, "extract": 4}


def test_gates_are_never_answered_from_a_cache():
    """Every gate's task (registry.GATES) runs every time: Prefect's cache is off for it."""
    from prefect.cache_policies import NO_CACHE

    from eagle3_pipeline.pipeline import registry

    found = _stage_tasks()
    assert set(registry.GATES) == {"preflight", "gpu-gate", "verify", "evaluate"}  # DESIGN.md §1
    assert {g: found[g].cache_policy for g in registry.GATES if found[g].cache_policy is not NO_CACHE} == {}


def test_fail_once_is_one_shot(tmp_path, monkeypatch):
    monkeypatch.setenv(FAIL_ONCE_ENV, "prepare,train")
    monkeypatch.setenv(FAIL_ONCE_DIR_ENV, str(tmp_path / "markers"))
    fail_once("vocab")  # not named: nothing
    with pytest.raises(InjectedFault, match="prepare"):
        fail_once("prepare")
    fail_once("prepare")  # the retry passes
    assert take_fault("train") and not take_fault("train")
    monkeypatch.setenv(FAIL_ONCE_ENV, "prepare,extrct")
    with pytest.raises(ValueError, match="extrct"):
        fail_once("prepare")
    monkeypatch.delenv(FAIL_ONCE_DIR_ENV)
    monkeypatch.setenv(FAIL_ONCE_ENV, "vocab")
    with pytest.raises(ValueError, match=FAIL_ONCE_DIR_ENV):
        fail_once("vocab")

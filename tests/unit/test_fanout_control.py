"""flows/fanout.py's control-plane rules without a server: which errors are the API being away, the
retry-with-backoff wrapper, and the per-group deadline from the config (the chaos tests run them for
real: tests/chaos/test_control_plane.py)."""

import httpx
import pytest

from flows import fanout


def fanout_root():
    from pathlib import Path

    return Path(__file__).resolve().parents[2]


def _status(code: int) -> httpx.HTTPStatusError:
    req = httpx.Request("GET", "http://x/api")
    return httpx.HTTPStatusError("x", request=req, response=httpx.Response(code, request=req))


def test_transient_api_errors():
    assert fanout.transient_api_error(httpx.ConnectError("refused"))
    assert fanout.transient_api_error(_status(500)) and fanout.transient_api_error(_status(503))
    assert not fanout.transient_api_error(_status(404)) and not fanout.transient_api_error(_status(410))
    try:  # wrapped, as Prefect's concurrency service wraps it
        try:
            raise httpx.ConnectError("refused")
        except httpx.ConnectError as e:
            raise RuntimeError("Unable to acquire concurrency slots") from e
    except RuntimeError as e:
        assert fanout.transient_api_error(e)
    assert not fanout.transient_api_error(ValueError("bad config"))


def test_api_retry_waits_out_an_outage_and_stops_at_its_budget():
    calls, sleeps, lines = [], [], []

    def flaky():
        calls.append(1)
        if len(calls) < 4:
            raise httpx.ConnectError("refused")
        return "ok"

    assert fanout.with_api_retry(flaky, "read", lines.append, outage_s=60, sleep=sleeps.append) == "ok"
    assert sleeps == [2.0, 4.0, 8.0] and "answers again" in lines[-1]
    assert fanout.API_RECOVERED[0] > 0  # the heartbeat clock restarts after an outage
    with pytest.raises(httpx.ConnectError):
        fanout.with_api_retry(lambda: (_ for _ in ()).throw(httpx.ConnectError("refused")), "read",
                              lines.append, outage_s=0, sleep=sleeps.append)
    with pytest.raises(ValueError):  # not the API being away: at once
        fanout.with_api_retry(lambda: (_ for _ in ()).throw(ValueError("no")), "read", lines.append,
                              outage_s=60, sleep=sleeps.append)


def test_group_deadline_from_the_config():
    """The fan-out waits for a group as long as its Job may run: every attempt of the child's own deadline
    (start_timeout_s + shard_timeout_s x shards, or timeout_s) plus the pod's start and the retry delays."""
    from eagle3_pipeline.core.config import load_config
    from eagle3_pipeline.pipeline.jobs import job_variables

    cfg = load_config(fanout_root() / "configs" / "tiny-cpu.yaml", ["extract.shard_timeout_s=600",
                                                                    "extract.start_timeout_s=1200", "extract.retries=2"])
    deadline = fanout.group_deadline_s(cfg, [0, 1, 2])
    assert deadline == job_variables(cfg, "extract", 3)["deadline_seconds"]
    assert 3 * (1200 + 600 * 3) < deadline < 3 * (1200 + 600 * 3) + 3600
    assert fanout.group_deadline_s(cfg, [0]) < deadline  # a smaller group, a shorter wait
    cfg2 = cfg.model_copy(update={"extract": cfg.extract.model_copy(update={"shard_timeout_s": None, "timeout_s": 100.0})})
    assert 3 * 100 < fanout.group_deadline_s(cfg2, [0]) == fanout.group_deadline_s(cfg2, [0, 1, 2]) < 3 * 100 + 3600

"""The real server (prefect_server) and the Prefect harness of tests/conftest.py in one test process, as
an xdist worker that ran tests/server/ before an integration module has them: a flow run and its task
runs (which reach a server only as events) must land on the same server, the one opened last."""

from __future__ import annotations


def test_a_flow_and_its_task_runs_land_on_the_server_opened_last(prefect_server, prefect_harness):
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.events.worker import EventsWorker
    from prefect.settings import PREFECT_API_URL

    @task
    def step(x: int) -> int:
        return x + 1

    @flow
    def two_steps() -> int:
        return step(step(0))

    harness_api = PREFECT_API_URL.value()
    assert harness_api != prefect_server.api  # the harness was opened after the server
    state = two_steps(return_state=True)
    assert state.is_completed()
    EventsWorker.drain_all()  # the task runs' events are sent
    runs = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
    with get_client(sync_client=True) as c:
        assert c.api_url.host in harness_api
        names = sorted(r.name.rsplit("-", 1)[0] for r in c.read_task_runs(flow_run_filter=runs))
    assert names == ["step", "step"], names

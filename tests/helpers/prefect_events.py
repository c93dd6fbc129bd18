"""Where this test process's Prefect events go.

Prefect keeps one EventsWorker per events-client type, bound to the API URL current when it first
ran, and task runs reach the server only as events. Two session fixtures talk to two servers (the
`prefect_harness` of tests/conftest.py and the real server of tests/server/conftest.py), and with
pytest-xdist a worker may open them in either order; whichever was opened last must receive both the
orchestration calls (its settings) and the events, or a flow run lands on one server and its task
runs on the other."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def events_to(api_url: str):
    """Send this process's events to `api_url` until exit, then back to where they went before."""
    from prefect.events.clients import PrefectEventsClient
    from prefect.events.worker import EventsWorker

    prior = EventsWorker._client_override
    EventsWorker.drain_all()
    EventsWorker.set_client_override(PrefectEventsClient, api_url=api_url)
    try:
        yield
    finally:
        EventsWorker.drain_all()
        if prior is None:
            EventsWorker.set_client_override(None)
        else:
            EventsWorker.set_client_override(prior[0], **dict(prior[1]))

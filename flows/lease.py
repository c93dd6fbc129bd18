"""A controller that loses its deployment's concurrency lease is rescheduled, as on SIGTERM.

More: docs/internals.md, "flows/lease.py".
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime, timedelta, timezone

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext
from prefect.exceptions import Abort
from prefect.states import AwaitingRetry

from flows.fanout import with_api_retry

# the rescheduled run is due this much later: this execution exits first (a process worker runs the run again in
# the same per-run working directory, which the ending one removes), and a lease lost to an API outage is not
# retried into the same outage at once
RESCHEDULE_AFTER_S = 30.0


def lease_of(ctx) -> str | None:
    """The deployment concurrency lease this flow run holds and renews itself, or None (a subflow, no
    deployment limit, or a flow with its own timeout, whose end is the same CancelledError)."""
    if ctx is None or ctx.flow_run is None or ctx.flow_run.parent_task_run_id is not None:
        return None
    if ctx.flow is not None and ctx.flow.timeout_seconds:
        return None
    st = ctx.flow_run.state
    lease = st.state_details.deployment_concurrency_lease_id if st is not None else None
    return str(lease) if lease else None


@contextlib.contextmanager
def rescheduled_on_lost_lease():
    try:
        yield
    except asyncio.CancelledError as e:  # prefect's CancelledError is one
        ctx = FlowRunContext.get()
        lease = lease_of(ctx)
        if lease is None:
            raise
        log = get_run_logger()
        msg = (f"this run lost its deployment concurrency lease {lease} (renewal failed); rescheduled like on "
               f"SIGTERM: its stage and group runs go on and the next execution re-attaches to them")
        with get_client(sync_client=True) as client:
            result = with_api_retry(lambda: client.set_flow_run_state(ctx.flow_run.id, AwaitingRetry(
                message=msg, scheduled_time=datetime.now(timezone.utc) + timedelta(seconds=RESCHEDULE_AFTER_S))),
                "reschedule this run", log.warning)
        if result.state is None or not result.state.is_scheduled():
            log.error(f"lost its deployment lease {lease}; the server refused to reschedule it "
                      f"({result.status}: {getattr(result.details, 'reason', '')}); it crashes")
            raise
        log.warning(msg)
        raise Abort(msg) from e

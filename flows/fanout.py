"""Multi-node extraction: shard groups as runs of the `extract-group` deployment.

How it works, what it reads and writes, its test hooks: docs/internals.md, `flows/fanout.py`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import TypeVar
from uuid import UUID

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter
from prefect.exceptions import ObjectNotFound
from prefect.runtime import flow_run as this_run
from prefect.settings import get_current_settings
from prefect.states import Cancelling, Crashed

from eagle3_pipeline.core.cluster import start_deadline_s
from eagle3_pipeline.core.config import PipelineConfig
from eagle3_pipeline.pipeline.jobs import job_variables
from eagle3_pipeline.records.layout import ExtractVersion
from eagle3_pipeline.records.shardrun import ShardRun
from flows import attach
from flows.pods import StartWatch, pod_source
from tasks.gpu_lease import transient_api_error

GROUP_DEPLOYMENT = os.environ.get("EAGLE3_EXTRACT_GROUP_DEPLOYMENT", "extract-group/extract-group")
POLL_S = float(os.environ.get("EAGLE3_FANOUT_POLL_S", "5"))
API_OUTAGE_S = float(os.environ.get("EAGLE3_API_OUTAGE_S", "900"))
MISSED_HEARTBEATS = float(os.environ.get("EAGLE3_FANOUT_MISSED_HEARTBEATS", "3"))
CANCEL_GRACE_S = 120.0  # a group cancelled at its deadline that has not stopped by then is marked Crashed
RESUBMITS = 1  # a lost group is run again once; the stage fails when that run is lost or fails too

T = TypeVar("T")


def groups_to_run(version: ExtractVersion, force: set[int]) -> list[list[int]]:
    """The planned groups holding a shard that the manifest does not list as published (all of them
    when there is no manifest yet, or it was made for another shard plan), plus forced ones."""
    m = ShardRun(version.path).read(missing_ok=True)
    same_plan = m.rows_per_shard == version.rows_per_shard and len(m.shards) == len(version.shards)
    return [g for g in version.groups if force & set(g) or not same_plan or version.unpublished(g)]


def flow_run_link(flow_run_id: UUID | str) -> str:
    ui = get_current_settings().ui_url
    return f"{ui}/runs/flow-run/{flow_run_id}" if ui else f"flow run {flow_run_id}"


def group_deadline_s(config: PipelineConfig, group: list[int]) -> float:
    """How long a group's run may take: its Job's deadline (jobs.job_variables: the pod's start, every
    attempt of the child's own deadline and the retry delays), so the child's deadline fires first."""
    return float(job_variables(config, "extract", len(group))["deadline_seconds"])


def heartbeat_grace_s() -> float | None:
    """Seconds without a heartbeat after which a running group is lost (None: heartbeats are off)."""
    freq = get_current_settings().flows.heartbeat_frequency
    return None if not freq else MISSED_HEARTBEATS * max(float(freq), 30.0) + POLL_S


SLOW_CALL_S = 10.0  # an API call that took longer went through the client's own retries
API_RECOVERED = [0.0]  # time.time() the API last answered again after failing (see check(): heartbeats)


def with_api_retry(call: Callable[[], T], what: str, log: Callable[[str], None],
                   outage_s: float | None = None, sleep: Callable[[float], None] = time.sleep) -> T:
    """`call()`, retried with backoff (2, 4, ... 30 s) while the API is away, up to `outage_s`
    (EAGLE3_API_OUTAGE_S) of continuous failure; other errors propagate at once."""
    budget = API_OUTAGE_S if outage_s is None else outage_s
    t0, n = time.monotonic(), 0
    while True:
        try:
            t_call = time.monotonic()
            out = call()
            if n or time.monotonic() - t_call > SLOW_CALL_S:  # the client itself retried a while (503s)
                API_RECOVERED[0] = time.time()
            if n:
                log(f"the Prefect API answers again ({what}) after {time.monotonic() - t0:.0f}s")
            return out
        except Exception as e:  # noqa: BLE001
            waited = time.monotonic() - t0
            if not transient_api_error(e) or waited >= budget:
                raise
            n += 1
            delay = min(2.0 ** n, 30.0, max(budget - waited, 1.0))
            log(f"Prefect API unavailable ({what}: {type(e).__name__}: {str(e)[:200]}); "
                f"retrying in {delay:.0f}s ({waited:.0f}s of {budget:.0f}s)")
            sleep(delay)


class _Group:
    def __init__(self, shards: list[int], deadline_s: float, base: str):
        self.shards, self.deadline_s, self.base = shards, deadline_s, base
        self.start: StartWatch | None = None  # this submission's start, watched (set by submit)
        self.submissions = 0  # runs this controller submitted or re-attached to (RESUBMITS counts these)
        self.attempt = 0  # n of the newest run made for this group by any controller (flows/attach.py)
        self.flow_run_id: UUID | None = None
        self.name = ""
        self.cancel_requested: float | None = None  # time.time() we asked its worker to end it
        self.seen_alive: float = time.time()  # last sign of life: submission, state change, heartbeat


def _last_heartbeat(client, flow_run_id: UUID, since: datetime) -> float | None:

    page = client.read_events(filter=EventFilter(
        event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
        resource=EventResourceFilter(id=[f"prefect.flow-run.{flow_run_id}"]),
        occurred=EventOccurredFilter(since=since)), limit=1)
    return max((e.occurred.timestamp() for e in page.events), default=None)


def run_groups_as_deployments(config: PipelineConfig, version: ExtractVersion, force: set[int]) -> list[str]:
    """Run the groups with unpublished (or forced) shards as deployment runs, `extract.parallel_groups` at a
    time, until each completed or failed; one line per group that did not complete."""
    return _FanOut(config, version, force).run()


class _FanOut:
    """One fan-out: the groups still to submit (`todo`), those in flight (`running`, by flow run id) and the
    lines of those that failed the stage (`failed`)."""

    def __init__(self, config: PipelineConfig, version: ExtractVersion, force: set[int]):
        self.config, self.version, self.force = config, version, force
        self.log = get_run_logger()
        self.todo = [_Group(g, group_deadline_s(config, g), attach.group_base(version.content_key, version.dir, g))
                     for g in groups_to_run(version, force)]
        self.window = config.extract.parallel_groups
        self.pods = pod_source()
        self.start_s = start_deadline_s(config, True, self.window)  # an extract group's pod: a GPU node's
        self.grace = heartbeat_grace_s()
        self.params = {"config": config.model_dump(mode="json"), "version": version.model_dump(mode="json")}
        self.tag = f"eagle3-extract-{version.content_key}"
        self.running: dict[UUID, _Group] = {}
        self.failed: list[str] = []

    def api(self, call: Callable[[], T], what: str) -> T:
        return with_api_retry(call, what, self.log.warning)

    def run(self) -> list[str]:
        grace, todo = self.grace, self.todo
        self.log.info(f"extract: {len(todo)} of {len(self.version.groups)} shard groups to run as {GROUP_DEPLOYMENT} "
                      f"flow runs, {self.window} at a time; the others are published. Each may run "
                      f"{max((g.deadline_s for g in todo), default=0) / 3600:.1f} h; a group lost (Crashed, "
                      + (f"no heartbeat for {grace:.0f}s" if grace else "heartbeats off") + ", past its deadline) "
                      f"is resubmitted {RESUBMITS}x; a pod not started within {self.start_s:.0f}s fails it")
        with get_client(sync_client=True) as client:
            try:
                if todo:
                    dep = self.api(lambda: client.read_deployment_by_name(GROUP_DEPLOYMENT), "read the deployment")
                    self.reattach(self.api(lambda: attach.runs_tagged(client, dep.id, self.tag), "read group runs"))
            except ObjectNotFound:
                raise RuntimeError(f"extract.parallel_groups={self.window} fans shard groups out to the deployment "
                                   f"{GROUP_DEPLOYMENT!r}, which {get_current_settings().api.url or 'this server'} "
                                   f"does not have: `prefect deploy --all` (prefect.yaml), or parallel_groups=1") from None
            try:
                while todo or self.running:
                    while todo and len(self.running) < self.window:
                        self.submit(todo.pop(0))
                    time.sleep(POLL_S)
                    for g in list(self.running.values()):
                        self.check(client, g)
            except BaseException as e:
                leave_or_cancel(client, self.running, e, self.log)
                raise
        return self.failed

    def reattach(self, runs: list) -> None:
        """Find each group's newest run made by any controller of this content (flows/attach.py): one still
        going is watched instead of submitted again; after a finished one the next submission is a new attempt."""
        for g in list(self.todo):
            g.attempt, fr = attach.latest(runs, g.base)
            if attach.going(fr):
                self.todo.remove(g)
                g.submissions += 1
                self.watch(g, fr)
                self.log.info(f"extract: shards {g.shards}: re-attached to {fr.name} ({fr.state.name}), which an "
                              f"earlier run of this content submitted: {flow_run_link(fr.id)}")

    def watch(self, g: _Group, fr) -> None:
        g.flow_run_id, g.name, g.cancel_requested, g.seen_alive = fr.id, fr.name, None, time.time()
        g.start = StartWatch(f"extract: shards {g.shards} ({fr.name})", self.start_s, self.pods, self.log.warning)
        self.running[fr.id] = g

    def submit(self, g: _Group) -> None:
        g.submissions += 1
        g.attempt += 1
        suffix = "" if g.attempt == 1 else f"-resubmit-{g.attempt - 1}"
        # the idempotency key names the group's content and attempt (flows/attach.py): a submission retried after
        # an API error, or made again by any controller of this content, is the same flow run
        fr = self.api(lambda: run_deployment(
            GROUP_DEPLOYMENT, parameters={**self.params, "shard_ids": g.shards,
                                          "force": bool(self.force & set(g.shards))},
            job_variables=job_variables(self.config, "extract", len(g.shards)),
            timeout=0, as_subflow=True, flow_run_name=f"extract-shards-{g.shards}{suffix}",
            idempotency_key=f"{g.base}-{g.attempt}", tags=[self.tag]), f"submit shards {g.shards}")
        self.watch(g, fr)
        self.log.info(f"extract: shards {g.shards} -> {fr.name}: {flow_run_link(fr.id)}")

    def fail(self, g: _Group, line: str) -> None:
        self.running.pop(g.flow_run_id, None)
        self.failed.append(f"shards {g.shards}: flow run {g.name} ({g.flow_run_id}) {line} - "
                           f"{flow_run_link(g.flow_run_id)}")
        self.log.error(f"extract: {self.failed[-1]}")

    def lost(self, g: _Group, why: str) -> None:
        """The group's run will not finish by itself: resubmit it once, else it fails the stage."""
        if g.submissions > RESUBMITS:
            return self.fail(g, f"lost again after {g.submissions - 1} resubmission(s): {why}")
        del self.running[g.flow_run_id]
        self.log.warning(f"extract: shards {g.shards}: flow run {g.name} lost ({why}); resubmitting it "
                         f"(its published shards are skipped) - {flow_run_link(g.flow_run_id)}")
        self.todo.insert(0, g)

    def crash(self, client, g: _Group, why: str) -> None:
        self.api(lambda: client.set_flow_run_state(g.flow_run_id, Crashed(message=f"eagle3 fan-out: {why}"),
                                                   force=True), f"mark {g.name} Crashed")
        if g.start.stop(g.flow_run_id):  # its pod cannot run on beside the resubmission
            self.log.warning(f"extract: shards {g.shards}: deleted the Job of {g.name}")
        self.lost(g, why)

    def cancel(self, client, g: _Group, why: str) -> None:
        self.api(lambda: client.set_flow_run_state(g.flow_run_id, Cancelling(message=f"eagle3 fan-out: {why}"),
                                                   force=True), f"cancel {g.name}")

    def check(self, client, g: _Group) -> None:
        """One look at a group's run: ended, waiting to start, past its deadline, or silent."""
        fr = self.api(lambda: client.read_flow_run(g.flow_run_id), f"read {g.name}")
        st, now = fr.state, time.time()
        if st is not None and st.is_final():
            return self.ended(g, st)
        if st is None or st.is_scheduled():  # waiting for a worker or the pool's slots: capacity, not lost
            g.seen_alive = now
            return None
        if st.is_pending():  # its Job is submitted and its pod starting: waiting, up to the start deadline
            g.seen_alive = now
            why = g.start.give_up(g.flow_run_id, st, now)
            if why is not None:  # the same pod spec would wait again: the group fails the stage
                self.cancel(client, g, why)
                g.start.stop(g.flow_run_id)
                self.fail(g, f"never started: {why}")
            return None
        g.seen_alive = max(g.seen_alive, st.timestamp.timestamp())
        if g.cancel_requested is not None:
            if now - g.cancel_requested > CANCEL_GRACE_S:
                self.crash(client, g, f"still {st.name} {CANCEL_GRACE_S:.0f}s after its cancellation at its deadline")
            return None
        started = fr.start_time.timestamp() if fr.start_time else None
        if started is not None and now - started > g.deadline_s:
            self.log.warning(f"extract: shards {g.shards}: {g.name} still {st.name} after {g.deadline_s:.0f}s "
                             f"(its deadline): cancelling it")
            self.cancel(client, g, f"past the group's deadline of {g.deadline_s:.0f}s")
            g.cancel_requested = now
            return None
        return self.silent(client, g, st.name, now)

    def ended(self, g: _Group, st) -> None:
        if st.is_crashed() or (st.is_cancelled() and g.cancel_requested is not None):
            self.lost(g, f"{st.name}: {st.message}")
        elif st.is_completed():
            del self.running[g.flow_run_id]
            self.log.info(f"extract: shards {g.shards} done ({g.name})")
        else:
            self.fail(g, f"{st.name}: {st.message}")

    def silent(self, client, g: _Group, state: str, now: float) -> None:
        """A started run without a heartbeat for the grace period has nobody behind it: Crashed, resubmitted.
        Heartbeats sent while the API or its database was away are lost, not late: a group gets a whole grace
        period again from the moment the API answered again."""
        g.seen_alive = max(g.seen_alive, API_RECOVERED[0])
        if self.grace is None or now - g.seen_alive <= self.grace:
            return
        since = datetime.fromtimestamp(g.seen_alive, timezone.utc) - timedelta(seconds=1)
        beat = self.api(lambda: _last_heartbeat(client, g.flow_run_id, since), f"heartbeats of {g.name}")
        if beat is not None:
            g.seen_alive = max(g.seen_alive, beat)
        if now - g.seen_alive > self.grace:
            self.crash(client, g, f"{state} without a heartbeat for {now - g.seen_alive:.0f}s (its worker or node "
                                  f"is gone)")


def being_cancelled(client, flow_run_id) -> bool | None:
    """Whether a person (or an automation) is cancelling this flow run: its state is Cancelling or
    Cancelled; None when the API cannot say."""
    if flow_run_id is None:
        return None
    try:
        st = client.read_flow_run(flow_run_id).state
    except Exception:  # noqa: BLE001 - the API is away: do not guess
        return None
    return st is not None and (st.is_cancelling() or st.is_cancelled())


def leave_or_cancel(client, running: dict, exc: BaseException, log) -> None:
    """The controller is ending with its groups still running. Cancelled by a person: they are cancelled
    with it. Anything else (SIGTERM for a reschedule, an eviction, a lost concurrency lease, an API outage,
    an error of its own) leaves them alone: each has its own deadline, and the controller run again
    re-attaches to them (idempotency keys) instead of resubmitting them."""

    if not running:
        return
    names = ", ".join(g.name for g in running.values())
    if being_cancelled(client, this_run.get_id()):
        for fid in running:
            try:
                client.set_flow_run_state(fid, Cancelling(message="the extract flow that started it was cancelled"),
                                          force=True)
            except Exception as e:  # noqa: BLE001
                log.warning(f"extract: could not cancel {running[fid].name}: {type(e).__name__}: {e}")
        log.warning(f"extract: cancelled with this flow: {names}")
        return
    log.warning(f"extract: this flow is ending ({type(exc).__name__}: {str(exc)[:200]}) and leaves its running "
                f"groups alone: {names}. Run it again (or let it be rescheduled) and it re-attaches to them.")

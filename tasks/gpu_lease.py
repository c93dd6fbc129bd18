"""The GPU slot: one slot of the global concurrency limit `gpu-node` (EAGLE3_GPU_LIMIT) per GPU node, held by
every task that loads the target or the draft, with a lease this process keeps itself (`GpuLease`: a failed
renewal never cancels the task; a lease the server lost is taken again; a dead holder's slot is freed at its
lease's expiry). docs/operations.md, "A control plane that survives", says why Prefect's own strict
`concurrency()` is not used."""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
from prefect.client.schemas.objects import ConcurrencyLeaseHolder
from prefect.concurrency._asyncio import ConcurrencySlotAcquisitionError
from prefect.concurrency._events import emit_concurrency_acquisition_events, emit_concurrency_release_events
from prefect.concurrency._sync import acquire_concurrency_slots_with_lease
from prefect.context import FlowRunContext, TaskRunContext
from prefect.exceptions import MissingContextError, ObjectAlreadyExists, ObjectNotFound
from prefect.logging import get_logger
from prefect.settings import get_current_settings

from eagle3_pipeline.core.store import file_lock

GPU_LIMIT = os.environ.get("EAGLE3_GPU_LIMIT", "gpu-node")


def ensure_gpu_limit(slots: int = 1, name: str | None = None) -> int:
    """Create the GPU global concurrency limit if it is missing; returns its slot count."""

    name = name or GPU_LIMIT
    with get_client(sync_client=True) as client:
        try:
            return client.read_global_concurrency_limit_by_name(name).limit
        except ObjectNotFound:
            pass
        with contextlib.suppress(ObjectAlreadyExists):  # another process won the race
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=slots))
        run_logger().warning(f"created the global concurrency limit {name!r} with {slots} slot(s) for this "
                                 f"local run; for several GPU nodes: prefect gcl update {name} --limit <nodes>")
        return client.read_global_concurrency_limit_by_name(name).limit


def run_logger():

    try:
        return get_run_logger()
    except MissingContextError:
        return get_logger("eagle3")


_ENSURED: set[tuple[str, str]] = set()  # (api url, limit) this process already made sure of


class _SlotScope:
    def __init__(self, stack: contextlib.ExitStack):
        self.stack, self.held = stack, False


_SCOPE: contextvars.ContextVar[_SlotScope | None] = contextvars.ContextVar("eagle3_gpu_slot_scope", default=None)


@contextlib.contextmanager
def gpu_slot() -> Iterator[None]:
    """Hold one slot of the GPU limit while the body runs (strict: a missing limit is an error).
    Inside `gpu_slot_scope()` the slot is taken by the first call and kept until the scope ends."""
    scope = _SCOPE.get()
    if scope is None:
        with acquire_gpu_slot():
            yield
        return
    if not scope.held:
        scope.stack.enter_context(acquire_gpu_slot())
        scope.held = True
    yield


@contextlib.contextmanager
def gpu_slot_scope() -> Iterator[None]:
    """One GPU slot for everything in this block that asks for it (the extract flow's in-process
    groups: one engine child after the other in this process, so this process is one node the whole
    time). Taken lazily by the first `gpu_slot()` (a block that loads nothing takes none), released
    when the block ends. The slot is always taken before a group's shard locks, as without a scope.
    Acquiring and releasing a strict slot costs ~0.3-2 s on SQLite (the lease is renewed at once by
    a thread that is joined on release): once per flow instead of once per group."""
    if _SCOPE.get() is not None:  # nested: the outer scope holds it
        yield
        return
    with contextlib.ExitStack() as stack:
        token = _SCOPE.set(_SlotScope(stack))
        try:
            yield
        finally:
            _SCOPE.reset(token)


NODE_LOCK = "gpu-node.lock"  # in PREFECT_HOME: runs on a temporary server hold it with their GPU slot


@contextlib.contextmanager
def acquire_gpu_slot() -> Iterator[None]:

    if os.environ.get("EAGLE3_GPU_GATE") == "pool":  # a Kubernetes pod: the work pool's limit gated it before it existed
        yield
        return
    settings = get_current_settings()
    with contextlib.ExitStack() as stack:
        if not os.environ.get("PREFECT__FLOW_RUN_ID"):  # not started by a worker: this process is the node
            key = (str(settings.api.url), GPU_LIMIT)
            if key not in _ENSURED:
                ensure_gpu_limit(1)
                _ENSURED.add(key)
            if not settings.api.url:  # a temporary server: see node_lock
                stack.enter_context(node_lock(Path(settings.home)))
        with GpuLease(GPU_LIMIT):
            yield


# The GPU slot's lease (docs/operations.md "A control plane that survives"). Prefect's `concurrency(...,
# strict=True)` cancels the holder when a renewal fails (its `raise_on_lease_renewal_failure` follows
# `strict`), and its renewal thread gives up after 3 attempts (~3 s): a server restart cancelled every
# running GPU task, and with the server's in-memory lease storage the restarted server answered 410 and
# the counted slot was never freed. So the slot is taken here with a lease this process keeps itself:
# strict acquisition (a missing limit is still an error), renewals retried with backoff for as long as
# the API is away (never fatal), a lease the server no longer has (410: it expired during an outage
# longer than the lease, and the server freed its slot) taken again, and release retried for a while.
# A holder that dies stops renewing: the server frees its slot when the lease expires (its repossessor
# service), which needs a lease storage that survives the server's restarts (the filesystem storage on
# the server's persistent PREFECT_HOME, or prefect-redis): see infra/docker-compose.yml.
GPU_LEASE_S = float(os.environ.get("EAGLE3_GPU_LEASE_S", "300"))  # the server accepts 60 s to 1 day
API_OUTAGE_S = float(os.environ.get("EAGLE3_API_OUTAGE_S", "900"))  # acquisition/release retried this long


def transient_api_error(exc: BaseException) -> bool:
    """An error of the API being away (connection refused/reset, a timeout, a 5xx, 408/429), in `exc`
    or its causes; a 4xx answer (not found, conflict, gone) is not. (Also flows/fanout.py's.)"""

    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, httpx.HTTPStatusError):
            code = e.response.status_code
            return code >= 500 or code in (408, 429)
        if isinstance(e, (httpx.TransportError, ConnectionError, TimeoutError)):
            return True
        e = e.__cause__ or e.__context__
    return False


def http_status(exc: BaseException) -> int | None:

    e: BaseException | None = exc
    while e is not None:
        if isinstance(e, httpx.HTTPStatusError):
            return e.response.status_code
        e = e.__cause__
    return None


class GpuLease:
    """One slot of `name` held under a lease this process renews until it exits (see above)."""

    RENEW_FRACTION = 0.25  # renew 4 times per lease: an outage up to 3/4 of the lease loses nothing

    def __init__(self, name: str, lease_s: float | None = None, outage_s: float | None = None):
        self.name = name
        self.lease_s = max(60.0, lease_s or GPU_LEASE_S)
        self.outage_s = API_OUTAGE_S if outage_s is None else outage_s
        self.lease_id = None
        self.limits: list = []
        self.renewal_failures = self.reacquired = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._holder = self._current_holder()

    @staticmethod
    def _current_holder():

        if (t := TaskRunContext.get()) is not None:
            return ConcurrencyLeaseHolder(type="task_run", id=t.task_run.id)
        if (f := FlowRunContext.get()) is not None and f.flow_run is not None:
            return ConcurrencyLeaseHolder(type="flow_run", id=f.flow_run.id)
        return None

    def _acquire(self):
        """A new lease on one slot (waits while the limit is full, retries while the API is away)."""

        t0, n = time.monotonic(), 0
        while True:
            try:
                r = acquire_concurrency_slots_with_lease([self.name], 1, lease_duration=self.lease_s, strict=True,
                                                         holder=self._holder)
                self.limits = r.limits
                return r.lease_id
            except ConcurrencySlotAcquisitionError as e:
                waited = time.monotonic() - t0
                if not transient_api_error(e) or waited >= self.outage_s or self._stop.is_set():
                    raise RuntimeError(f"no slot of the global concurrency limit {self.name!r}: {e}"
                                       + (f" ({e.__cause__})" if e.__cause__ else "") + ". Create it once per "
                                       f"server, one slot per GPU node: prefect gcl create {self.name} --limit <nodes>"
                                       ) from e
                n += 1
                delay = min(2.0 ** n, 30.0)
                run_logger().warning(f"{self.name}: Prefect API unavailable while taking the GPU slot ({e.__cause__}); "
                                  f"retrying in {delay:.0f}s")
                time.sleep(delay)

    def _keep(self) -> None:
        """Renew the lease every RENEW_FRACTION of it; while renewals fail, retry with backoff (never
        cancels the holder); a lease the server lost is taken again."""

        every = self.lease_s * self.RENEW_FRACTION
        wait, failing_since, warned, n = every, None, 0.0, 0
        with get_client(sync_client=True) as client:
            while not self._stop.wait(wait):
                try:
                    client.renew_concurrency_lease(lease_id=self.lease_id, lease_duration=self.lease_s)
                    if failing_since is not None:
                        run_logger().info(f"{self.name}: GPU slot lease renewed again after "
                                       f"{time.monotonic() - failing_since:.0f}s of failures")
                    wait, failing_since = every, None
                except Exception as e:  # noqa: BLE001
                    if http_status(e) in (404, 410):  # expired and revoked: its slot was freed
                        if self._stop.is_set():  # released meanwhile by the holder (a renewal that
                            return  # was retried while the API was away answered after the release)
                        run_logger().warning(f"{self.name}: the server no longer has this GPU slot's lease "
                                          f"(it expired while the API was away): taking the slot again")
                        lease_id = self._acquire()
                        if self._stop.is_set():  # the holder ended meanwhile and released the old one
                            self.lease_id = lease_id
                            self._release()
                            return
                        self.lease_id, self.reacquired = lease_id, self.reacquired + 1
                        wait, failing_since = every, None
                        continue
                    self.renewal_failures += 1
                    now = time.monotonic()
                    if failing_since is None:
                        failing_since, n = now, 0
                    n += 1
                    if now - warned > 60:
                        warned = now
                        run_logger().warning(f"{self.name}: renewing the GPU slot's lease failed for "
                                          f"{now - failing_since:.0f}s ({type(e).__name__}: {str(e)[:200]}); the "
                                          f"task goes on and the renewal is retried")
                    wait = min(2.0 ** min(n, 4), every)  # 2, 4, 8, 16 s

    def _release(self) -> None:

        t0, n = time.monotonic(), 0
        budget = min(self.outage_s, self.lease_s)  # after that the lease expires and the server frees it
        with get_client(sync_client=True) as client:
            while True:
                try:
                    client.release_concurrency_slots_with_lease(self.lease_id)
                    return
                except Exception as e:  # noqa: BLE001
                    if not transient_api_error(e) or time.monotonic() - t0 >= budget:
                        run_logger().warning(f"{self.name}: the GPU slot was not released ({type(e).__name__}: "
                                          f"{str(e)[:200]}); the server frees it when its lease expires "
                                          f"(within {self.lease_s:.0f}s)")
                        return
                    n += 1
                    time.sleep(min(2.0 ** n, 15.0))

    def __enter__(self) -> GpuLease:
        self.lease_id = self._acquire()
        events = None
        with contextlib.suppress(Exception):

            events = emit_concurrency_acquisition_events(self.limits, 1)
        self._events = events
        self._thread = threading.Thread(target=contextvars.copy_context().run, args=(self._keep,), daemon=True,
                                        name=f"eagle3-gpu-lease-{self.lease_id}")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()  # a re-acquisition still in progress releases its own new lease
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._release()
        with contextlib.suppress(Exception):

            if self._events is not None:
                emit_concurrency_release_events(self.limits, 1, self._events)


@contextlib.contextmanager
def node_lock(prefect_home: Path) -> Iterator[None]:
    """The GPU slot of runs on Prefect's temporary server (no PREFECT_API_URL): every such run on this
    machine shares PREFECT_HOME's database and so the slot count, but a temporary server keeps the
    slot's lease in its own memory and runs no service that revokes expired leases. A run killed while
    holding the slot (kill -9, OOM, a reboot) left the count at 1 for good, and every later run waited
    forever at its first GPU stage, saying nothing. So such runs also hold an flock in PREFECT_HOME
    (released by the kernel however the holder dies; a waiter logs who holds it): whoever has the lock
    is the only live holder, and slots the database still counts are nobody's and are released."""
    with file_lock(prefect_home / NODE_LOCK, "the GPU node (local runs' slot)", log=run_logger().info):
        release_orphaned_slots()
        yield


def release_orphaned_slots(name: str = GPU_LIMIT) -> int:
    """Set the limit's active slots to 0 (caller: the node lock's holder); returns how many were held."""

    with get_client(sync_client=True) as client:
        held = client.read_global_concurrency_limit_by_name(name).active_slots
        if held:
            client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(active_slots=0))
            run_logger().warning(f"{name}: {held} slot(s) counted but held by no live run (one ended without releasing "
                              f"its slot: killed, out of memory, a reboot): released")
    return held

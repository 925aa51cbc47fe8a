"""The prober and the route refresher: the gateway's background view of its fleet.

Each prober round (one at start-up, before the gateway serves, then every
``health_interval_seconds``, or sooner when woken):

1. *Discovery*: re-resolves the ``endpoints`` entries and reconciles the pool (``Discovery``,
   ``WorkerPool``);
2. *Probes*: probes every worker's ServerReady concurrently (a timed-out probe resets that worker's
   connection, so a silent worker holds one connection at a time). Workers that all time out
   are never a reason to stop: the gateway serves on and takes them back when they answer
   (the one wedge is the gateway's own event loop stalling, ``watchdog``);
3. *Admission*: admits each worker that became ready: ``on_ready`` runs first (the gateway replays
   its shared-memory registrations there), and only a worker whose ``on_ready`` succeeded is
   *routable*; a worker that stops being ready stops being routable at once;
4. *Routing table*: rebuilds the routing table from the routable workers'
   RepositoryIndex(ready=true) and swaps it in;
5. *Routing metadata*: when the routing policy asks for it and some worker is routable, polls
   ModelControlStatus on the routable workers and hands the folded routing metadata to the policy.

``RouteRefresher`` runs the *routing table* step, single-flight: a request for a model the table
does not know calls ``refresh_now`` (it waits for a scan in flight, or scans unless the last scan
finished less than ``min_interval`` ago); a worker's NOT_FOUND calls ``request_refresh`` (a scan in
the background, under the same rules). Everything runs in the gateway's task tree: the background
scans in the refresher's own ``run`` task, started by the gateway.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import anyio
import anyio.abc

from kserve_trio.client.errors import RpcError
from kserve_trio.client.transport import method_path
from kserve_trio.core.logging import get_logger
from kserve_trio.gateway.fleet.discovery import Discovery, WorkerDiff
from kserve_trio.gateway.fleet.pool import (
    PROBE_TIMEOUT_SECONDS,
    ProbeOutcome,
    WorkerClient,
    WorkerPool,
)
from kserve_trio.gateway.fleet.routing import (
    RoutingPolicy,
    RoutingState,
    RoutingTable,
    build_routing_table,
    ready_model_names,
)
from kserve_trio.gateway.fleet.routing_metadata import (
    EMPTY_METADATA,
    RoutingMetadata,
    aggregate_poll,
    fold_poll,
)
from kserve_trio.gateway.metrics import GatewayMetrics
from kserve_trio.proto import inference as pb
from kserve_trio.proto import reactant_control as rc

WATCHDOG_SECONDS = 8.0
"""The longest one worker's RepositoryIndex or ModelControlStatus may take within a round."""
MIN_REFRESH_INTERVAL_SECONDS = 1.0
REPOSITORY_INDEX = method_path("RepositoryIndex")
MODEL_CONTROL_STATUS = "/reactant_control.ControlService/ModelControlStatus"

_log = get_logger(__name__)


async def _bounded(fn: Callable[[], Awaitable[object]], timeout: float) -> object | None:
    """``fn()``, or ``None`` when it fails or takes longer than ``timeout``."""
    with anyio.move_on_after(timeout):
        try:
            return await fn()
        except RpcError:
            return None
    return None


class RouteRefresher:
    """Builds and swaps the routing table, single-flight (see the module docstring).

    Rules:
    1. *Scan*: a scan asks every routable worker for RepositoryIndex(ready=true) concurrently, each
       bounded by the watchdog; a worker that fails or is too slow contributes nothing this
       scan. The table is built from the answers and swapped in.
    2. *Single flight*: ``scan`` waits for a scan in flight instead of starting a second one;
       otherwise scans.
    3. *Not too often*: ``refresh_now`` is ``scan``, except that it does nothing when the last scan
       finished less than ``min_interval`` ago (a burst of unknown-model requests costs one scan).
    4. *In the background*: ``request_refresh`` asks the ``run`` task to do what ``refresh_now``
       does, without waiting for it.
    """

    def __init__(
        self,
        state: RoutingState,
        routable: Callable[[], Iterable[WorkerClient]],
        *,
        metrics: GatewayMetrics | None = None,
        min_interval: float = MIN_REFRESH_INTERVAL_SECONDS,
        watchdog: float = WATCHDOG_SECONDS,
    ) -> None:
        self.state = state
        self._routable = routable
        self._metrics = metrics
        self._min_interval = min_interval
        self._watchdog = watchdog
        self._in_flight: anyio.Event | None = None
        self._finished_at = -float("inf")
        self._wanted = anyio.Event()
        self.scans = 0

    async def scan(self) -> None:
        """*Single flight*."""
        if self._in_flight is not None:
            await self._in_flight.wait()
            return
        done = self._in_flight = anyio.Event()
        try:
            clients = list(self._routable())
            ready: dict[str, list[str]] = {}

            async def index(client: WorkerClient) -> None:
                reply = await _bounded(
                    lambda: client.call(
                        REPOSITORY_INDEX,
                        pb.RepositoryIndexRequest(ready=True),
                        pb.RepositoryIndexResponse,
                        timeout=PROBE_TIMEOUT_SECONDS,
                    ),
                    self._watchdog,
                )
                if isinstance(reply, pb.RepositoryIndexResponse):
                    ready[client.label] = ready_model_names(reply)

            async with anyio.create_task_group() as tg:
                for client in clients:
                    tg.start_soon(index, client)
            table = build_routing_table(ready)
            diff = self.state.swap(table, ready)
            self.scans += 1
            if self._metrics is not None:
                self._metrics.routing_table_size.set(table.size)
            if not diff.empty:
                _log.info(
                    "routing_table_changed",
                    added=list(diff.added),
                    removed=list(diff.removed),
                    changed=list(diff.changed),
                    models=table.size,
                )
        finally:
            self._finished_at = anyio.current_time()
            self._in_flight = None
            done.set()

    async def refresh_now(self) -> None:
        """*Not too often*."""
        if (
            self._in_flight is None
            and anyio.current_time() - self._finished_at < self._min_interval
        ):
            return
        await self.scan()

    def request_refresh(self) -> None:
        """*In the background*."""
        self._wanted.set()

    async def run(self) -> None:
        """Serve ``request_refresh`` until cancelled (a task of the gateway's tree)."""
        while True:
            await self._wanted.wait()
            self._wanted = anyio.Event()
            await self.refresh_now()


@dataclass(frozen=True)
class RoundReport:
    """What one prober round saw and did."""

    outcomes: dict[str, ProbeOutcome] = field(default_factory=dict)
    discovery: WorkerDiff = field(default_factory=WorkerDiff)
    admitted: tuple[str, ...] = ()
    """Workers that became routable this round."""
    table: RoutingTable = field(default_factory=RoutingTable)
    metadata_polled: tuple[str, ...] = ()


class Prober:
    """Runs the rounds of the module docstring; ``routable_labels`` and ``ready`` are what the
    request path and ``/readyz`` read."""

    def __init__(
        self,
        *,
        discovery: Discovery,
        pool: WorkerPool,
        state: RoutingState,
        policy: RoutingPolicy,
        interval: float,
        metrics: GatewayMetrics | None = None,
        on_ready: Callable[[WorkerClient], Awaitable[None]] | None = None,
        watchdog: float = WATCHDOG_SECONDS,
        probe_timeout: float = PROBE_TIMEOUT_SECONDS,
    ) -> None:
        self.discovery = discovery
        self._probe_timeout = probe_timeout
        self.pool = pool
        self.policy = policy
        self.interval = interval
        self.metrics = metrics
        self.metadata: RoutingMetadata = EMPTY_METADATA
        self._on_ready = on_ready
        self._watchdog = watchdog
        self._routable: set[str] = set()
        self._wake = anyio.Event()
        self.refresher = RouteRefresher(
            state, self.routable_clients, metrics=metrics, watchdog=watchdog
        )
        self.rounds = 0

    @property
    def ready(self) -> bool:
        """Whether any worker is ready (``/readyz``)."""
        return any(c.health.ready for c in self.pool.clients.values())

    @property
    def routable_labels(self) -> frozenset[str]:
        return frozenset(self._routable)

    def routable_clients(self) -> list[WorkerClient]:
        clients = self.pool.clients
        return [clients[label] for label in sorted(self._routable) if label in clients]

    def wake(self) -> None:
        """Run the next round now rather than at the end of the interval."""
        self._wake.set()

    async def round(self) -> RoundReport:
        """One round (the steps of the module docstring, *discovery* to *routing metadata*)."""
        found = await self.discovery.refresh()
        await self.pool.apply(found.diff)
        state = self.refresher.state
        for spec in found.diff.removed:
            self._routable.discard(spec.label)
            state.forget(spec.label)
            if self.metrics is not None:
                self.metrics.forget_worker(spec.label)
        for old, new in found.diff.changed:  # the same worker under a new label stays admitted
            state.rename(old.label, new.label)
            if old.label in self._routable:
                self._routable.discard(old.label)
                self._routable.add(new.label)
            if self.metrics is not None and old.label != new.label:
                self.metrics.forget_worker(old.label)
        probes = await self.pool.probe_all(self._probe_timeout)
        outcomes = {label: outcome for label, (outcome, _) in probes.items()}
        admitted: list[str] = []
        for label, (_outcome, step) in probes.items():
            if self.metrics is not None:
                self.metrics.set_worker_ready(label, step.health.ready)
            if not step.health.ready:
                if label in self._routable:
                    _log.warning("worker_unready", worker=label, reason=step.health.last_error)
                self._routable.discard(label)
            elif label not in self._routable and await self._admit(label):
                admitted.append(label)
        self.rounds += 1
        await self.refresher.scan()
        polled: tuple[str, ...] = ()
        if self.policy.needs_metadata and self._routable:
            polled = await self._poll_metadata()
        return RoundReport(
            outcomes, found.diff, tuple(admitted), self.refresher.state.table, polled
        )

    async def _admit(self, label: str) -> bool:
        client = self.pool.get(label)
        if client is None:
            return False
        if self._on_ready is not None:
            try:
                await self._on_ready(client)
            except Exception as exc:  # a failed replay: not routable yet, retried next round
                _log.warning("worker_admission_failed", worker=label, error=str(exc))
                return False
        self._routable.add(label)
        _log.info("worker_ready", worker=label, address=client.spec.target)
        return True

    async def _poll_metadata(self) -> tuple[str, ...]:
        replies: dict[str, rc.ModelControlStatusResponse] = {}

        async def poll(client: WorkerClient) -> None:
            reply = await _bounded(
                lambda: client.call(
                    MODEL_CONTROL_STATUS,
                    rc.ModelControlStatusRequest(),
                    rc.ModelControlStatusResponse,
                    timeout=PROBE_TIMEOUT_SECONDS,
                ),
                self._watchdog,
            )
            if isinstance(reply, rc.ModelControlStatusResponse):
                replies[client.label] = reply

        async with anyio.create_task_group() as tg:
            for client in self.routable_clients():
                tg.start_soon(poll, client)
        if replies:
            self.metadata = fold_poll(self.metadata, aggregate_poll(replies))
            self.policy.update_metadata(self.metadata)
        return tuple(sorted(replies))

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """The first round, then ``started``, then a round every ``interval`` (or when woken)
        until cancelled."""
        await self._round_logged()
        task_status.started()
        while True:
            with anyio.move_on_after(self.interval):
                await self._wake.wait()
            self._wake = anyio.Event()
            await self._round_logged()

    async def _round_logged(self) -> None:
        try:
            await self.round()
        except Exception as exc:  # a bug in one round must not stop the prober
            _log.exception("prober_round_failed", error=str(exc))


__all__ = [
    "MIN_REFRESH_INTERVAL_SECONDS",
    "WATCHDOG_SECONDS",
    "Prober",
    "RoundReport",
    "RouteRefresher",
]

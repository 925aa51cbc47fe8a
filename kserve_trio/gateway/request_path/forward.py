"""Forwarding one ModelInfer: route, forward the raw bytes, fail over, account.

This is the request path the gateway's gRPC service calls for ModelInfer and for each
ModelStreamInfer message. It needs only the pool, the routing table and the policy; the gRPC
service around it turns a returned reply into the response bytes and a raised
``ServingError`` (``RpcError`` included) into its status, unchanged.

Rules (``Forwarder.infer``):
1. *Peek*: peek ``model_name``, ``id`` and, when the policy counts items, the policy's batch input's
   shape, in one walk over the top-level fields (``peek.peek_routing``); a malformed request,
   one whose model name is over ``limits.max_name_bytes`` or one with more inputs, outputs or
   raw contents than ``limits.max_tensors`` is INVALID_ARGUMENT (the worker judges every
   other bound). The payload is never decoded. A compressed request is peeked in its
   uncompressed form (``plain``) and forwarded as it arrived, under its ``grpc-encoding``.
2. *Select*: the policy turns the shape into request units and selects replicas from the current
   table snapshot. None known: refresh the table now (single-flight) and select again; still none:
   ``RoutingState.missing``: UNAVAILABLE ``model 'm' has no ready replica now`` when some worker
   last listed the model (its replicas are all unready, frozen or unreachable), else NOT_FOUND
   ``model 'm' not found on any worker``.
3. *Attempt*: try the replicas in order, skipping any that is no longer routable. Before each
   attempt wait for that worker's register gate (a shared-memory registration in flight to it must
   land first), then compute the attempt's deadline: the client's own, exactly (already passed:
   DEADLINE_EXCEEDED, nothing sent), else the worker-client request timeout.
4. *Failover*: a worker's reply is returned as its bytes. A failure follows
   ``routing.failover_action``: NOT_FOUND asks for a background table refresh and tries the next
   replica; UNAVAILABLE (transport failure, or a worker that cannot serve now) tries the next; any
   other status is raised unchanged. With every replica tried, the last failure is raised.
5. *Shared-memory replay*, the one exception to *failover*: a worker's FAILED_PRECONDITION
   ``unregistered shared memory region: r`` for a region the gateway registered means the worker
   lost its registrations (it restarted between two prober rounds, so the prober never saw it
   unready). The ``replay`` hook re-registers the gateway's regions on that worker and the request
   is retried there once.
6. *Release and record*: the selection's reservation is released exactly once, on every path; the
   request's and each worker call's latency and the final status are recorded.

``call_replica`` runs *attempt*, *failover* and *shared-memory replay* for the model RPCs answered
by a ready replica (ModelReady, ModelMetadata, ModelConfig): the replicas of the routing table in
turn, no policy, no reservation.

The rules do not depend on the transport to the worker: ``routed`` (every rule, *peek* to *release
and record*) and ``on_replica`` (*attempt*, *failover* and *shared-memory replay*) take the peek and
the one-worker attempt as functions, so the gateway's REST forwarding (``rest_forward``) selects,
reserves, fails over and refreshes by the same code as gRPC.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from kserve_trio.client.errors import RpcError, is_stale_registration
from kserve_trio.client.transport import method_path
from kserve_trio.core.errors import ServingError
from kserve_trio.core.process import EdgeLimits
from kserve_trio.core.protocol import RequestBounds, check_name
from kserve_trio.gateway.fleet import (
    Failover,
    RouteRefresher,
    RoutingPolicy,
    RoutingState,
    WorkerClient,
    WorkerPool,
    failover_action,
    forward_deadline,
    no_ready_replica,
)
from kserve_trio.gateway.metrics import GatewayMetrics, ObservedRequest
from kserve_trio.gateway.request_path.peek import PeekedRequest, peek_routing

if TYPE_CHECKING:
    from kserve_trio.serving.tracing import RequestSpan

MODEL_INFER = method_path("ModelInfer")


class RegisterGates:
    """Per-worker gates: while a shared-memory Register or Unregister is in flight to a worker
    (``hold``), ModelInfer calls to that worker wait (``wait``), so a request naming a region
    never overtakes the region's registration. Holds on one worker are serialized."""

    def __init__(self) -> None:
        self._locks: dict[str, anyio.Lock] = {}
        self._held: dict[str, anyio.Event] = {}

    @contextlib.asynccontextmanager
    async def hold(self, worker: str) -> AsyncIterator[None]:
        lock = self._locks.setdefault(worker, anyio.Lock())
        async with lock:
            released = self._held[worker] = anyio.Event()
            try:
                yield
            finally:
                del self._held[worker]
                released.set()

    async def wait(self, worker: str) -> None:
        while (released := self._held.get(worker)) is not None:
            await released.wait()

    def held(self, worker: str) -> bool:
        return worker in self._held


T = TypeVar("T")

Attempt = Callable[[WorkerClient, float], Awaitable[T]]
"""``attempt(client, deadline)``: send one request to one worker within ``deadline`` (absolute,
``anyio.current_time()`` clock) and return its reply; a failure is an ``RpcError`` whose status
``routing.failover_action`` reads."""

StaleReplay = Callable[[WorkerClient, RpcError], Awaitable[bool]]
"""``replay(client, error)``: re-register the gateway's regions on ``client`` if ``error`` names
one of them; True when it did (the request is then retried once on that worker)."""


class Forwarder:
    """The ModelInfer request path (the rules are in the module docstring)."""

    def __init__(
        self,
        *,
        pool: WorkerPool,
        state: RoutingState,
        policy: RoutingPolicy,
        refresher: RouteRefresher,
        routable: Callable[[], frozenset[str]],
        metrics: GatewayMetrics | None = None,
        gates: RegisterGates | None = None,
        replay: StaleReplay | None = None,
        bounds: RequestBounds = EdgeLimits(),
    ) -> None:
        self.pool = pool
        self.max_name_bytes = bounds.max_name_bytes
        self.max_tensors = bounds.max_tensors
        self.state = state
        self.policy = policy
        self.refresher = refresher
        self.routable = routable
        self.metrics = metrics
        self.gates = gates or RegisterGates()
        self.replay = replay
        self._cursor = 0

    def peek(self, plain: bytes | bytearray) -> PeekedRequest:
        """The peek (*peek*) of an uncompressed request (``InvalidArgument`` if malformed)."""
        return peek_routing(plain, self.policy.batch_input, self.max_tensors)

    async def infer(
        self,
        data: bytes,
        *,
        plain: bytes | bytearray | None = None,
        compressed_with: str | None = None,
        head: PeekedRequest | None = None,
        deadline: float | None = None,
        metadata: Mapping[str, Any] | None = None,
        rpc: str = "ModelInfer",
        span: RequestSpan | None = None,
    ) -> bytes:
        """Forward one ModelInfer request and return the worker's reply bytes.

        ``data`` is the request as received (compressed with ``compressed_with`` if set, then
        ``plain`` is its uncompressed form); ``head`` its peek when the caller already has it;
        ``deadline`` the client's, absolute on the ``anyio.current_time()`` clock (``None``: it
        set none). ``span``: the traced request's server span; each attempt is then a client
        span whose ``traceparent`` the worker continues."""

        def peeked() -> PeekedRequest:
            return head if head is not None else self.peek(data if plain is None else plain)

        def attempt(client: WorkerClient, attempt_deadline: float) -> Awaitable[bytes]:
            if span is not None:
                return _traced_attempt(span, client, attempt_deadline)
            return client.call_raw(
                MODEL_INFER,
                data,
                deadline=attempt_deadline,
                metadata=metadata,
                compressed_with=compressed_with,
            )

        async def _traced_attempt(
            span: RequestSpan, client: WorkerClient, attempt_deadline: float
        ) -> bytes:
            # The call to the worker is a unary ModelInfer, also for a stream's message.
            forward = span.start_child("forward", client_rpc="ModelInfer", worker=client.label)
            carried = {**(metadata or {}), **forward.headers()}
            status, text = "OK", ""
            try:
                return await client.call_raw(
                    MODEL_INFER,
                    data,
                    deadline=attempt_deadline,
                    metadata=carried,
                    compressed_with=compressed_with,
                )
            except RpcError as exc:
                status, text = exc.status.name, exc.message
                raise
            finally:
                forward.end(status, text)

        return await self.routed(peeked, attempt, deadline=deadline, rpc=rpc)

    async def routed(
        self,
        peeked: Callable[[], PeekedRequest],
        attempt: Attempt[T],
        *,
        deadline: float | None = None,
        rpc: str = "ModelInfer",
    ) -> T:
        """Every rule (*peek* to *release and record*) for one request of any transport:
        ``peeked()`` gives its routing fields (*peek*; raising ``InvalidArgument`` if malformed) and
        ``attempt(client, deadline)`` sends it to one worker (raising ``RpcError`` as
        ``WorkerClient.call_raw`` does). The gRPC ModelInfer above and the gateway's REST forwarding
        both run through here."""
        with ObservedRequest(self.metrics, rpc) as seen:
            head = peeked()
            check_name("model_name", head.model_name, self.max_name_bytes)
            model = seen.name = head.model_name
            units = self.policy.request_units(model, head.shape)
            selection = self.policy.select(model, units, self.state.table)
            if not selection.order:
                selection.reservation.release()
                await self.refresher.refresh_now()
                selection = self.policy.select(model, units, self.state.table)
            with selection.reservation:
                if not selection.order:
                    raise self.state.missing(model)
                return await self._attempts(rpc, model, selection.order, deadline, attempt)

    async def call_replica(
        self,
        method: str,
        model: str,
        data: bytes,
        *,
        deadline: float | None = None,
    ) -> bytes | None:
        """``method`` on a ready replica of ``model`` (*attempt*, *failover* and *shared-memory
        replay*, replicas in turn); ``None`` when no worker has ``model`` ready, even after a
        refresh (``state.missing`` says which error that is)."""

        def attempt(client: WorkerClient, attempt_deadline: float) -> Awaitable[bytes]:
            return client.call_raw(method, data, deadline=attempt_deadline)

        rpc = method[method.rfind("/") + 1 :]
        return await self.on_replica(model, attempt, rpc=rpc, deadline=deadline)

    async def on_replica(
        self,
        model: str,
        attempt: Attempt[T],
        *,
        rpc: str,
        deadline: float | None = None,
    ) -> T | None:
        """``attempt`` on a ready replica of ``model`` (``call_replica`` for any transport)."""
        replicas = self.state.table.replicas(model)
        if not replicas:
            await self.refresher.refresh_now()
            replicas = self.state.table.replicas(model)
            if not replicas:
                return None
        i = self._cursor % len(replicas)
        self._cursor += 1
        order = replicas[i:] + replicas[:i]
        return await self._attempts(rpc, model, order, deadline, attempt)

    async def _attempts(
        self,
        rpc: str,
        model: str,
        order: tuple[str, ...],
        deadline: float | None,
        attempt: Attempt[T],
    ) -> T:
        routable = self.routable()
        last: ServingError | None = None
        for label in order:
            client = self.pool.get(label)
            if client is None or label not in routable:
                continue
            replayed = False
            while True:
                await self.gates.wait(label)
                attempt_deadline = forward_deadline(
                    deadline, anyio.current_time(), client.request_timeout, model
                )
                sent = anyio.current_time()
                try:
                    return await attempt(client, attempt_deadline)
                except RpcError as exc:
                    if (
                        not replayed
                        and self.replay is not None
                        and is_stale_registration(exc)
                        and await self.replay(client, exc)
                    ):
                        replayed = True
                        continue  # *shared-memory replay*: once more on the same worker
                    action = failover_action(exc.status)
                    if action is Failover.RETURN:
                        raise
                    if action is Failover.NEXT_AND_REFRESH:
                        self.refresher.request_refresh()
                    last = exc
                    break
                finally:
                    if self.metrics is not None:
                        self.metrics.observe_worker_call(rpc, label, anyio.current_time() - sent)
        if last is not None:
            raise last
        raise no_ready_replica(model)


__all__ = ["MODEL_INFER", "Attempt", "Forwarder", "RegisterGates", "StaleReplay"]

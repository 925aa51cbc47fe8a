"""Forwarding one ModelInfer: route, forward the raw bytes, fail over, account.

This is the request path the gateway's gRPC service calls for ModelInfer and for each
ModelStreamInfer message. It needs only the pool, the routing table and the policy; the grpclib
service around it turns a returned reply into the response bytes and a raised
``ServingError`` (``RpcError`` included) into its status, unchanged.

Rules (``Forwarder.infer``):
1. Peek ``model_name``, ``id`` and, when the policy counts items, the policy's batch input's
   shape (``peek``); a malformed request is INVALID_ARGUMENT. The payload is never decoded.
2. The policy turns the shape into request units and selects replicas from the current table
   snapshot. None known: refresh the table now (single-flight) and select again; still none:
   NOT_FOUND ``model 'm' not found on any worker``.
3. Try the replicas in order, skipping any that is no longer routable. Before each attempt wait
   for that worker's register gate (a shared-memory registration in flight to it must land
   first), then compute the attempt's deadline: the client's own, exactly (already passed:
   DEADLINE_EXCEEDED, nothing sent), else the worker-client request timeout.
4. A worker's reply is returned as its bytes. A failure follows ``routing.failover_action``:
   NOT_FOUND asks for a background table refresh and tries the next replica; UNAVAILABLE
   (transport failure, or a worker that cannot serve now) tries the next; any other status is
   raised unchanged. With every replica tried, the last failure is raised.
5. The selection's reservation is released exactly once, on every path; the request's and each
   worker call's latency and the final status are recorded.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping

import anyio

from kserve_trio.client.errors import RpcError
from kserve_trio.client.transport import method_path
from kserve_trio.core.errors import NotFound, ServingError, StatusCode, Unavailable
from kserve_trio.gateway.metrics import GatewayMetrics
from kserve_trio.gateway.peek import peek_infer_request
from kserve_trio.gateway.pool import WorkerPool, forward_deadline
from kserve_trio.gateway.prober import RouteRefresher
from kserve_trio.gateway.routing import (
    Failover,
    RoutingPolicy,
    RoutingState,
    Selection,
    failover_action,
)

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
    ) -> None:
        self.pool = pool
        self.state = state
        self.policy = policy
        self.refresher = refresher
        self.routable = routable
        self.metrics = metrics
        self.gates = gates or RegisterGates()

    async def infer(
        self,
        data: bytes,
        *,
        deadline: float | None = None,
        metadata: Mapping[str, str] | None = None,
        rpc: str = "ModelInfer",
    ) -> bytes:
        """Forward one ModelInfer request (``data``, the received bytes) and return the
        worker's reply bytes; ``deadline`` is the client's, absolute on the
        ``anyio.current_time()`` clock (``None``: it set none)."""
        started = anyio.current_time()
        model = ""
        status = StatusCode.INTERNAL
        try:
            head = peek_infer_request(data)
            model = head.model_name
            batch = self.policy.batch_input(model)
            shape = peek_infer_request(data, batch[0]).shape if batch is not None else None
            units = self.policy.request_units(model, shape)
            selection = self.policy.select(model, units, self.state.table)
            if not selection.order:
                selection.reservation.release()
                await self.refresher.refresh_now()
                selection = self.policy.select(model, units, self.state.table)
            with selection.reservation:
                reply = await self._attempts(model, data, selection, deadline, metadata)
            status = StatusCode.OK
            return reply
        except ServingError as exc:
            status = exc.status
            raise
        finally:
            if self.metrics is not None:
                self.metrics.observe_request(rpc, model, status, anyio.current_time() - started)

    async def _attempts(
        self,
        model: str,
        data: bytes,
        selection: Selection,
        deadline: float | None,
        metadata: Mapping[str, str] | None,
    ) -> bytes:
        if not selection.order:
            raise NotFound(f"model '{model}' not found on any worker")
        routable = self.routable()
        last: ServingError | None = None
        for label in selection.order:
            client = self.pool.get(label)
            if client is None or label not in routable:
                continue
            await self.gates.wait(label)
            attempt_deadline = forward_deadline(
                deadline, anyio.current_time(), client.request_timeout, model
            )
            sent = anyio.current_time()
            try:
                return await client.call_raw(
                    MODEL_INFER, data, deadline=attempt_deadline, metadata=metadata
                )
            except RpcError as exc:
                action = failover_action(exc.status)
                if action is Failover.RETURN:
                    raise
                if action is Failover.NEXT_AND_REFRESH:
                    self.refresher.request_refresh()
                last = exc
            finally:
                if self.metrics is not None:
                    self.metrics.observe_worker_call(
                        "ModelInfer", label, anyio.current_time() - sent
                    )
        if last is not None:
            raise last
        raise Unavailable(f"no ready worker can take model '{model}' now")


__all__ = ["MODEL_INFER", "Forwarder", "RegisterGates"]

"""The RPCs the gateway answers by asking every ready worker: repository index, statistics,
IPC namespace, model load/unload and compaction.

``Fleet`` calls the routable workers concurrently (each call bounded by its timeout) and
merges the answers with ``aggregate``'s pure functions. Rules per RPC:

1. RepositoryIndex: the union of the workers that answered (a worker that fails contributes
   nothing; with no ready worker the index is empty).
2. ModelStatistics: the sum over the workers that answered. For a named model a worker's
   NOT_FOUND only means it does not have the model; if no worker answered, the first failure
   (label order) is raised, so an unknown model is NOT_FOUND.
3. IsSameIPCNamespace: ``aggregate.same_ipc_namespace`` over every routable worker's answer
   (an error counts false; no worker: false).
4. RepositoryModelLoad / Unload go to every routable worker that has the model, i.e. lists it
   in its RepositoryIndex whatever its state (in explicit mode an unloaded model is listed,
   not ready). No worker has it: NOT_FOUND. OK when all succeed (the first reply is
   returned); otherwise the first failure, unchanged (a worker outside explicit mode answers
   FAILED_PRECONDITION), with every worker's outcome logged. Either way the routing table is
   rebuilt at once, so a loaded model is routable and an unloaded one is not.
5. CompactMemory goes to every routable worker (timeout at least five minutes): the summed
   totals when all succeed, else the first failure, with every outcome logged.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

import anyio

from kserve_trio.client.errors import RpcError
from kserve_trio.client.transport import method_path
from kserve_trio.core.errors import NotFound, ServingError, StatusCode
from kserve_trio.core.logging import get_logger
from kserve_trio.gateway.fleet import (
    PROBE_TIMEOUT_SECONDS,
    RawReply,
    RouteRefresher,
    WorkerClient,
    compact_timeout,
)
from kserve_trio.gateway.metrics import GatewayMetrics
from kserve_trio.gateway.request_path import aggregate
from kserve_trio.proto import inference as pb
from kserve_trio.proto import reactant_control as rc

R = TypeVar("R")

REPOSITORY_INDEX = method_path("RepositoryIndex")
MODEL_STATISTICS = method_path("ModelStatistics")
IS_SAME_IPC = method_path("IsSameIPCNamespace")
MODEL_LOAD = method_path("RepositoryModelLoad")
TRACE_SETTING = method_path("TraceSetting")
MODEL_UNLOAD = method_path("RepositoryModelUnload")
COMPACT_MEMORY = "/reactant_control.ControlService/CompactMemory"

_log = get_logger(__name__)


async def each(
    clients: Sequence[WorkerClient],
    call: Callable[[WorkerClient], Awaitable[R]],
    timeout: float,
) -> dict[str, R | RpcError]:
    """``call(client)`` on every client concurrently; label -> its result or its
    ``RpcError`` (a call over ``timeout`` is DEADLINE_EXCEEDED), in the clients' order."""
    results: dict[str, R | RpcError] = {}

    async def one(client: WorkerClient) -> None:
        with anyio.move_on_after(timeout):
            try:
                results[client.label] = await call(client)
            except RpcError as exc:
                results[client.label] = exc
            return
        results[client.label] = RpcError(
            StatusCode.DEADLINE_EXCEEDED,
            f"worker {client.label} did not answer within {timeout:g}s",
        )

    async with anyio.create_task_group() as tg:
        for client in clients:
            tg.start_soon(one, client)
    return {c.label: results[c.label] for c in clients}


def _parse(reply_type: type[R], raw: bytes, label: str) -> R:
    try:
        return reply_type.parse(raw)  # type: ignore[attr-defined]
    except Exception as exc:
        raise RpcError(
            StatusCode.INTERNAL, f"worker {label} sent a reply that does not parse: {exc}"
        ) from None


def _outcomes(results: Mapping[str, object]) -> dict[str, str]:
    return {
        label: "ok" if not isinstance(r, RpcError) else f"{r.status.name}: {r.message}"
        for label, r in results.items()
    }


class Fleet:
    """The fan-out RPCs (see the module docstring) over the routable workers."""

    def __init__(
        self,
        *,
        routable: Callable[[], Sequence[WorkerClient]],
        refresher: RouteRefresher,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self._routable = routable
        self.refresher = refresher
        self.metrics = metrics

    def _timeout(self, client_deadline: float | None, default: float) -> float:
        if client_deadline is None:
            return default
        return max(client_deadline - anyio.current_time(), 0.0)

    async def _ask(
        self, method: str, data: bytes, reply_type: type[R], deadline: float | None
    ) -> dict[str, R | RpcError]:
        """The client's request ``data`` to every routable worker, within the client's deadline
        (else the worker-client request timeout); replies parsed as ``reply_type``."""
        clients = self._routable()
        timeout = self._timeout(deadline, clients[0].request_timeout if clients else 60.0)
        end = anyio.current_time() + timeout

        async def ask(c: WorkerClient) -> R:
            return _parse(reply_type, await c.call_raw(method, data, deadline=end), c.label)

        return await each(clients, ask, timeout + 1.0)

    async def repository_index(self, data: bytes, deadline: float | None) -> bytes:
        """*RepositoryIndex* (``data``: the client's RepositoryIndexRequest, forwarded as it is)."""
        results = await self._ask(REPOSITORY_INDEX, data, pb.RepositoryIndexResponse, deadline)
        replies = [r for r in results.values() if isinstance(r, pb.RepositoryIndexResponse)]
        return bytes(aggregate.union_repository_index(replies))

    async def model_statistics(self, data: bytes, name: str, deadline: float | None) -> bytes:
        """*ModelStatistics*."""
        results = await self._ask(MODEL_STATISTICS, data, pb.ModelStatisticsResponse, deadline)
        replies = [r for r in results.values() if isinstance(r, pb.ModelStatisticsResponse)]
        if not replies:
            failure = aggregate.first_failure(results)
            if failure is not None:
                raise failure[1]
            if name:
                raise NotFound(f"model '{name}' not found on any worker")
        return bytes(aggregate.sum_model_statistics(replies))

    async def same_ipc_namespace(self, data: bytes) -> bytes:
        """*IsSameIPCNamespace*."""
        started = anyio.current_time()
        status = StatusCode.INTERNAL
        try:
            results = await each(
                self._routable(),
                lambda c: c.call(
                    IS_SAME_IPC, data, pb.IsSameIpcNamespaceResponse, timeout=PROBE_TIMEOUT_SECONDS
                ),
                PROBE_TIMEOUT_SECONDS + 1.0,
            )
            answers = [
                r.same if isinstance(r, pb.IsSameIpcNamespaceResponse) else None
                for r in results.values()
            ]
            status = StatusCode.OK
            return bytes(pb.IsSameIpcNamespaceResponse(same=aggregate.same_ipc_namespace(answers)))
        finally:
            self._observe("IsSameIPCNamespace", status, started)

    async def load_or_unload(
        self, rpc: str, data: bytes, model: str, deadline: float | None
    ) -> bytes:
        """*RepositoryModelLoad / Unload* (``rpc``: ``RepositoryModelLoad`` or
        ``RepositoryModelUnload``)."""
        started = anyio.current_time()
        status = StatusCode.INTERNAL
        method = MODEL_LOAD if rpc == "RepositoryModelLoad" else MODEL_UNLOAD
        try:
            holders = await self._holders(model)
            if not holders:
                raise NotFound(f"model '{model}' not found on any worker")
            timeout = self._timeout(deadline, holders[0].request_timeout)
            results = await each(
                holders,
                lambda c: c.call_raw(method, data, deadline=anyio.current_time() + timeout),
                timeout + 1.0,
            )
            try:
                await self.refresher.scan()
            finally:
                outcome = _outcomes(results)
                failure = aggregate.first_failure(results)
                log = _log.info if failure is None else _log.warning
                log("model_control_fanned_out", rpc=rpc, model=model, workers=outcome)
            if failure is not None:
                raise failure[1]
            status = StatusCode.OK
            return next(r for r in results.values() if isinstance(r, bytes))
        except ServingError as exc:
            status = exc.status
            raise
        finally:
            self._observe(rpc, status, started, model)

    async def _holders(self, model: str) -> list[WorkerClient]:
        clients = self._routable()
        results = await each(
            clients,
            lambda c: c.call(
                REPOSITORY_INDEX,
                pb.RepositoryIndexRequest(ready=False),
                pb.RepositoryIndexResponse,
                timeout=PROBE_TIMEOUT_SECONDS,
            ),
            PROBE_TIMEOUT_SECONDS + 1.0,
        )
        return [
            c
            for c in clients
            if isinstance(r := results[c.label], pb.RepositoryIndexResponse)
            and any(m.name == model for m in r.models)
        ]

    async def trace_setting(self, data: bytes, model: str, deadline: float | None) -> None:
        """A TraceSetting change to every routable worker. For a named model, a worker's
        NOT_FOUND means it does not have the model; any other failure is raised (the first,
        in label order), with every worker's outcome logged."""
        results = await self._ask(TRACE_SETTING, data, pb.TraceSettingResponse, deadline)
        if model:
            results = {
                label: r
                for label, r in results.items()
                if not (isinstance(r, RpcError) and r.status is StatusCode.NOT_FOUND)
            }
        failure = aggregate.first_failure(results)
        (_log.info if failure is None else _log.warning)(
            "trace_settings_fanned_out", model=model or None, workers=_outcomes(results)
        )
        if failure is not None:
            raise failure[1]

    async def compact_memory(self, data: bytes) -> bytes:
        """*CompactMemory*."""
        started = anyio.current_time()
        status = StatusCode.INTERNAL
        try:
            clients = self._routable()
            timeout = compact_timeout(clients[0].request_timeout if clients else 60.0)

            async def compact(c: WorkerClient) -> rc.CompactMemoryResponse:
                t0 = anyio.current_time()
                try:
                    raw = await c.call(COMPACT_MEMORY, data, RawReply, timeout=timeout)
                finally:
                    if self.metrics is not None:
                        self.metrics.observe_worker_call(
                            "CompactMemory", c.label, anyio.current_time() - t0
                        )
                return _parse(rc.CompactMemoryResponse, raw, c.label)

            results = await each(clients, compact, timeout + 1.0)
            failure = aggregate.first_failure(results)
            log = _log.info if failure is None else _log.warning
            log("compact_memory_fanned_out", workers=_outcomes(results))
            if failure is not None:
                raise failure[1]
            replies = [r for r in results.values() if isinstance(r, rc.CompactMemoryResponse)]
            status = StatusCode.OK
            return bytes(aggregate.sum_compact_memory(replies))
        except ServingError as exc:
            status = exc.status
            raise
        finally:
            self._observe("CompactMemory", status, started)

    def _observe(self, rpc: str, status: StatusCode, started: float, model: str = "") -> None:
        if self.metrics is not None:
            self.metrics.observe_request(rpc, model, status, anyio.current_time() - started)


__all__ = ["COMPACT_MEMORY", "Fleet", "each"]

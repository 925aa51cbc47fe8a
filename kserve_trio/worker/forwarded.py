"""The device process's side of a forwarded request: the ``RpcServer`` its front ends' links
(``serving.ipc.FrontendLink``) call, one handler per call class, on the same RPC layer a
single-process worker's servers call.

- ``UnaryCall``: the RPC's ``TypedRpc`` (``InferenceService.typed_rpcs``,
  ``ControlService.typed_rpcs``): its message parsed here by its own ``parse``, under the same
  bounds gRPC parses with, its reply as its own ``encode`` writes it;
- ``InferCall``: the message parsed in place in the request arena and served by the
  ``InferenceCore`` (admission, lookup, decode, validation, the scheduler, where requests of
  every front end coalesce, the observer) under the caller's trace context; the reply's pieces
  back, written once into the reply arena;
- ``StreamCall``: one stream message as ``StreamInfer.serve_message`` serves it; its admission
  slot is waited for (a stream waits at the concurrency cap, it does not fail); its
  ``StreamOrigin`` goes back with the answer;
- ``RestCall``: the worker's REST adapter (``WorkerRest``) on the request rebuilt here; the
  reply's ``RestHead`` goes back with its body.

So no RPC has a second implementation, the shared-memory registry, the hooks, statistics and
``endpoints.max_concurrent_requests`` stay one per worker, and a region registered through one
front end is used through any other.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from kserve_trio.core.errors import NotFound
from kserve_trio.core.logging import LogSettings, current_log_settings
from kserve_trio.core.protocol import Buffer
from kserve_trio.proto import inference as pb
from kserve_trio.serving.http import HttpRequest, error_response
from kserve_trio.serving.ipc import (
    Call,
    ForwardedRpc,
    InferCall,
    Reply,
    RestCall,
    RestHead,
    RpcShape,
    StreamCall,
    StreamOrigin,
    UnaryCall,
)
from kserve_trio.serving.rpc_codec import TypedRpc, parse_message, reply_pieces
from kserve_trio.serving.surface import UNIMPLEMENTED_RPCS
from kserve_trio.worker import control_service, service
from kserve_trio.worker.admission import SHUTTING_DOWN
from kserve_trio.worker.control_service import ControlService
from kserve_trio.worker.rest import WorkerRest
from kserve_trio.worker.service import InferenceService

Handler = Callable[[Any, Buffer, int], Awaitable[Reply]]
"""One call class's handler: the call (of the class it is listed under), its message, its
deadline."""


class ForwardedRpcs:
    """What the device process serves for its front ends (module docstring)."""

    def __init__(
        self,
        inference: InferenceService,
        control: ControlService,
        rest: WorkerRest | None,
        on_log_settings: Callable[[LogSettings], None],
    ) -> None:
        self._inference = inference
        self._control = control
        self._core = inference.core
        self._stream = inference.stream_infer
        self._admission = inference.state.admission
        self._bounds = inference.state.limits.edge
        self._unary: dict[str, TypedRpc] = {**inference.typed_rpcs(), **control.typed_rpcs()}
        self._rest = rest
        self._on_log_settings = on_log_settings
        self._log_settings = current_log_settings()
        self._handlers: dict[type, Handler] = {
            InferCall: self._serve_infer,
            StreamCall: self._serve_stream,
            UnaryCall: self._serve_unary,
            RestCall: self._serve_rest,
        }

    def listing(self) -> tuple[ForwardedRpc, ...]:
        """The RPCs the front ends serve, as ``Hello`` lists them (``frontend.forwarding``)."""
        rows = [
            ForwardedRpc(service.PREFIX + rpc, rpc, RpcShape.UNARY)
            for rpc in self._inference.typed_rpcs()
        ]
        rows += [
            ForwardedRpc(control_service.PREFIX + rpc, rpc, RpcShape.UNARY)
            for rpc in self._control.typed_rpcs()
        ]
        rows.append(ForwardedRpc(service.PREFIX + "ModelInfer", "ModelInfer", RpcShape.INFER))
        rows.append(
            ForwardedRpc(service.PREFIX + "ModelStreamInfer", "ModelStreamInfer", RpcShape.STREAM)
        )
        rows += [
            ForwardedRpc(service.PREFIX + rpc, rpc, RpcShape.UNIMPLEMENTED, reason)
            for rpc, reason in UNIMPLEMENTED_RPCS.items()
        ]
        return tuple(rows)

    shutting_down = SHUTTING_DOWN

    async def serve(self, call: Call, data: Buffer, deadline_ns: int) -> Reply:
        """One forwarded call (``serving.ipc.RpcServer``); raises what a server would answer
        as a status."""
        handler = self._handlers.get(call.__class__)
        if handler is None:
            raise NotFound(f"the worker serves no call of kind {type(call).__name__}")
        return await handler(call, data, deadline_ns)

    async def _serve_infer(self, call: InferCall, data: Buffer, deadline_ns: int) -> Reply:
        request = parse_message(data, pb.ModelInferRequest, self._bounds)
        reply = await self._core.infer(
            request, transport_deadline_ns=deadline_ns, trace_context=call.trace_context
        )
        return Reply(reply.pieces)

    async def _serve_stream(self, call: StreamCall, data: Buffer, deadline_ns: int) -> Reply:
        admission = self._admission
        assert admission is not None  # every worker has one (server.serve_async)
        await admission.wait_inference()
        try:
            answer, model, request_id = await self._stream.serve_message(
                data, deadline_ns, self._bounds, admitted=True, trace_context=call.trace_context
            )
        finally:
            admission.release_inference()
        return Reply(reply_pieces(answer)[0], StreamOrigin(model, request_id))

    async def _serve_unary(self, call: UnaryCall, data: Buffer, deadline_ns: int) -> Reply:
        rpc = self._unary.get(call.rpc)
        if rpc is None:
            raise NotFound(f"the worker has no RPC {call.rpc!r}")
        try:
            reply = await rpc.handler(rpc.parse(data, self._bounds))
        finally:
            self._log_settings_pushed()
        return Reply(rpc.encode(reply))

    async def _serve_rest(self, call: RestCall, data: Buffer, deadline_ns: int) -> Reply:
        request = HttpRequest(call.method, call.path, call.query, call.headers, bytes(data))
        if self._rest is None:
            response = error_response(NotFound("the worker serves no REST endpoint"))
        else:
            try:
                response = await self._rest(request)
            except Exception as exc:  # what the HTTP server answers a handler's fault with
                response = error_response(exc)
            finally:
                self._log_settings_pushed()
        body = response.body
        pieces: list[Any] = (
            [body] if isinstance(body, bytes | bytearray | memoryview) else list(body)
        )
        return Reply(
            pieces, RestHead(response.status, response.content_type, tuple(response.headers))
        )

    def _log_settings_pushed(self) -> None:
        """A request changed the log settings: every front end gets them."""
        settings = current_log_settings()
        if settings != self._log_settings:
            self._log_settings = settings
            self._on_log_settings(settings)


__all__ = ["ForwardedRpcs"]

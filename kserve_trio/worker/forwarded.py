"""The device process's side of a forwarded request: what it runs for each kind a front end
sends (``serving.ipc``), on the same RPC layer a single-process worker's servers call.

- ``KIND_UNARY``: the RPC's typed handler (``InferenceService.typed_rpcs``,
  ``ControlService.typed_rpcs``) on the message parsed here, under the same bounds gRPC parses
  with; the reply's bytes back;
- ``KIND_INFER``: the message parsed in place in the request arena and served by the
  ``InferenceCore`` (admission, lookup, decode, validation, the scheduler, where requests of
  every front end coalesce, the observer); the reply's pieces back, written once into the reply
  arena;
- ``KIND_STREAM``: one stream message as ``StreamInfer.serve_message`` serves it; its admission
  slot is waited for (a stream waits at the concurrency cap, it does not fail);
- ``KIND_REST``: the worker's REST adapter (``WorkerRest``) on the request rebuilt here.

So no RPC has a second implementation, the shared-memory registry, the hooks, statistics and
``endpoints.max_concurrent_requests`` stay one per worker, and a region registered through one
front end is used through any other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kserve_trio.core.errors import NotFound
from kserve_trio.core.logging import LogSettings, current_log_settings
from kserve_trio.proto import inference as pb
from kserve_trio.serving.grpc import TypedUnaryFn, parse_message, reply_pieces
from kserve_trio.serving.http import HttpRequest, error_response
from kserve_trio.serving.ipc import KIND_INFER, KIND_REST, KIND_STREAM, KIND_UNARY
from kserve_trio.serving.surface import UNIMPLEMENTED_RPCS
from kserve_trio.worker import control_service, service
from kserve_trio.worker.admission import SHUTTING_DOWN
from kserve_trio.worker.control_service import ControlService
from kserve_trio.worker.rest import WorkerRest
from kserve_trio.worker.service import InferenceService

Reply = tuple[Sequence[Any], Any]
"""A forwarded request's answer: the reply's buffers and the kind's extra (``DONE``)."""


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
        self._unary: dict[str, tuple[TypedUnaryFn, type]] = {
            **inference.typed_rpcs(),
            **control.typed_rpcs(),
        }
        self._rest = rest
        self._on_log_settings = on_log_settings
        self._log_settings = current_log_settings()

    def listing(self) -> list[tuple[str, str, str, str]]:
        """The RPCs the front ends serve, as ``HELLO`` lists them (``frontend.forwarding``)."""
        rows = [(service.PREFIX + rpc, rpc, "unary", "") for rpc in self._inference.typed_rpcs()]
        rows += [
            (control_service.PREFIX + rpc, rpc, "unary", "") for rpc in self._control.typed_rpcs()
        ]
        rows.append((service.PREFIX + "ModelInfer", "ModelInfer", "infer", ""))
        rows.append((service.PREFIX + "ModelStreamInfer", "ModelStreamInfer", "stream", ""))
        rows += [
            (service.PREFIX + rpc, rpc, "unimplemented", reason)
            for rpc, reason in UNIMPLEMENTED_RPCS.items()
        ]
        return rows

    shutting_down = SHUTTING_DOWN

    async def serve(self, kind: int, rpc: Any, data: Any, deadline_ns: int) -> Reply:
        """One forwarded request; raises what a server would answer as a status."""
        if kind == KIND_INFER:
            request = parse_message(data, pb.ModelInferRequest, self._bounds)
            reply = await self._core.infer(
                request, transport_deadline_ns=deadline_ns, trace_context=rpc
            )
            return reply.pieces, None
        if kind == KIND_STREAM:
            admission = self._admission
            assert admission is not None  # every worker has one (server.serve_async)
            await admission.wait_inference()
            try:
                answer, model, request_id = await self._stream.serve_message(
                    data, deadline_ns, self._bounds, admitted=True, trace_context=rpc
                )
            finally:
                admission.release_inference()
            pieces, _ = reply_pieces(answer)
            return pieces, (model, request_id)
        if kind == KIND_UNARY:
            entry = self._unary.get(rpc)
            if entry is None:
                raise NotFound(f"the worker has no RPC {rpc!r}")
            fn, request_type = entry
            try:
                reply = await fn(parse_message(data, request_type, self._bounds))
            finally:
                self._log_settings_pushed()
            pieces, _ = reply_pieces(reply)
            return pieces, None
        if kind == KIND_REST:
            return await self._serve_rest(rpc, data)
        raise NotFound(f"unknown request kind {kind}")

    async def _serve_rest(self, head: tuple, data: Any) -> Reply:
        method, path, query, headers = head
        request = HttpRequest(method, path, query, headers, bytes(data))
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
        pieces = [body] if isinstance(body, bytes | bytearray | memoryview) else list(body)
        return pieces, (response.status, response.content_type, list(response.headers))

    def _log_settings_pushed(self) -> None:
        """A request changed the log settings: every front end gets them."""
        settings = current_log_settings()
        if settings != self._log_settings:
            self._log_settings = settings
            self._on_log_settings(settings)


__all__ = ["ForwardedRpcs", "Reply"]

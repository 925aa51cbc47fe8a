"""ModelStreamInfer through the gateway: the shared stream engine over the forwarder.

``serving.grpc.StreamSession`` owns the stream's rules (ordering, the bound on outstanding
requests with backpressure, one writer, the ends, cancellation, drain), the same as on a
worker. What the gateway adds is how one message is served (``StreamInfer._one``):

1. *Admitted like a unary request*: a message counts against the inbound cap like a unary request
   while it is served: the session takes its slot (at the cap the stream waits, it is never failed
   for it), then it is peeked, and forwarded with a unary ModelInfer to a worker, exactly as
   ``Forwarder.infer`` forwards a unary call (same routing, failover, deadlines: the stream's own
   deadline bounds each message).
2. *Answers*: a worker's reply goes back as a ``ModelStreamInferResponse`` whose ``infer_response``
   is the worker's ``ModelInferResponse`` bytes, unchanged (so it carries its request's id). A
   failing request (malformed, shed, unknown model, a worker's error) goes back as a response whose
   ``error_message`` is the error's message, with the request's model and id in ``infer_response``,
   and the stream stays open.
3. *Tracing*: with tracing on, each message is a ``ModelStreamInfer`` server span continuing the
   stream's W3C context (the headers that opened it), its forward attempts client spans, exactly as
   a unary call's (``GatewayService``).
4. *Drain*: when the gateway drains (``Admission.drain_started``), the session stops reading, writes
   the answers in flight and ends the stream UNAVAILABLE (``gateway is shutting down``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio

from kserve_trio.core.errors import ServingError
from kserve_trio.core.protocol import stream_error, stream_response
from kserve_trio.gateway.caller_headers import grpc_headers
from kserve_trio.gateway.request_path.admission import SHUTTING_DOWN, Admission
from kserve_trio.gateway.request_path.forward import Forwarder
from kserve_trio.gateway.request_path.peek import PeekedRequest
from kserve_trio.serving.grpc import Call, RawMessage, StreamSession
from kserve_trio.serving.trace_settings import caller_context

if TYPE_CHECKING:
    from kserve_trio.serving.trace_control import TraceControl
    from kserve_trio.serving.tracing import Tracing


class StreamInfer:
    """The ModelStreamInfer handler (a ``serving.grpc.stream`` function); see the module
    docstring."""

    rpc = "ModelStreamInfer"

    def __init__(
        self, forwarder: Forwarder, admission: Admission, tracing: TraceControl | None = None
    ) -> None:
        self.forwarder = forwarder
        self.admission = admission
        self.tracing: Tracing | None = None
        """The gateway's tracer once built (at start-up, or turned on live)."""
        if tracing is not None:
            tracing.when_started(self._trace_with)

    def _trace_with(self, tracing: Tracing) -> None:
        self.tracing = tracing

    async def __call__(self, call: Call) -> None:
        session = StreamSession(
            call,
            self._one,
            closing=self.admission.drain_started.wait,
            shutting_down=SHUTTING_DOWN,
            admission=self.admission,
        )
        await session.run()

    async def _one(self, call: Call, message: RawMessage) -> tuple[bytes, Callable[[str], bytes]]:
        forwarder = self.forwarder
        model = request_id = ""

        def failed(why: str) -> bytes:
            return stream_error(why, model, request_id)

        try:
            started = anyio.current_time()
            try:
                plain = call.plain(message)
                head = forwarder.peek(plain)
            except ServingError as exc:
                if forwarder.metrics is not None:
                    elapsed = anyio.current_time() - started
                    forwarder.metrics.observe_request(self.rpc, "", exc.status, elapsed)
                raise
            model, request_id = head.model_name, head.id
            if self.tracing is not None:
                reply = await self._traced(self.tracing, call, message, plain, head)
            else:
                reply = await forwarder.infer(
                    message.data,
                    plain=plain,
                    compressed_with=call.encoding if message.compressed else None,
                    head=head,
                    deadline=call.deadline,
                    rpc=self.rpc,
                )
            return stream_response(reply), failed
        except ServingError as exc:
            return failed(exc.message or exc.status.name), failed

    async def _traced(
        self,
        tracing: Tracing,
        call: Call,
        message: RawMessage,
        plain: bytes | bytearray,
        head: PeekedRequest,
    ) -> bytes:
        """One message with tracing on (*tracing*)."""
        context = caller_context(call.header)
        span = tracing.begin(
            self.rpc, head.model_name, context, attributes={"kserve_trio.request_id": head.id}
        )
        metadata = grpc_headers(call.metadata) if call.metadata else None
        if span is None and context is None:
            metadata = {**(metadata or {}), **tracing.sampled_out()}
        status, text = "OK", ""
        try:
            return await self.forwarder.infer(
                message.data,
                plain=plain,
                compressed_with=call.encoding if message.compressed else None,
                head=head,
                deadline=call.deadline,
                metadata=metadata,
                rpc=self.rpc,
                span=span,
            )
        except ServingError as exc:
            status, text = exc.status.name, exc.message
            raise
        finally:
            if span is not None:
                span.end(status, text)


__all__ = ["StreamInfer", "stream_error", "stream_response"]

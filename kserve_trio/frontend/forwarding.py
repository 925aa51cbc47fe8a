"""What a front end serves: every RPC of the worker, each handed to the device process.

The front end owns the client's connection and everything the edge checks there (HTTP/2, the
gRPC framing, message caps and decompression, restricted protocols, REST's HTTP/1.1 and body
caps); the device process owns what the request means. So every RPC has one implementation,
the device process's, and a front end knows the RPCs only by the list the device process sent
it (``HELLO``):

- a unary RPC (``bytes_unary``): its plain message to the device, the reply bytes back, the
  reply compressed as the request was; a failure is the device's status and message;
- ModelInfer the same way, with the caller's W3C context (``traceparent`` and ``tracestate``,
  ``caller_context``) carried along when the worker traces or can be made to (``tracing.level``,
  or the ``tracing`` extra installed: a TraceSetting change turns tracing on in the device
  process, which no front end hears of, so a front end carries a context the caller sent
  whether or not it is used; without the extra the headers are never read), so the device
  process's span continues the caller's trace;
- ModelStreamInfer: the stream engine (``StreamSession``) runs here, each message is served by
  the device process as one request and answered with the stream's answer message; an answer
  over the send cap is replaced by an error answer naming the request's model and id, which the
  device sent along;
- REST: the parsed HTTP request (method, path, query, headers, body) to the device process's
  REST adapter, its HTTP reply back.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import anyio

from kserve_trio.core.errors import ServingError
from kserve_trio.core.stream_answers import stream_error
from kserve_trio.frontend.link import DeviceLink
from kserve_trio.serving.grpc import (
    Call,
    GrpcError,
    Limits,
    Method,
    RawMessage,
    StreamSession,
    bytes_unary,
    bytes_unary_with_header,
    stream,
    unimplemented,
)
from kserve_trio.serving.http import HttpRequest, HttpResponse
from kserve_trio.serving.ipc import KIND_INFER, KIND_REST, KIND_STREAM, KIND_UNARY
from kserve_trio.serving.trace_settings import caller_context

RpcEntry = tuple[str, str, str, str]
"""``(path, rpc, shape, reason)`` as the device process lists its RPCs: ``shape`` is
``unary``, ``infer``, ``stream`` or ``unimplemented`` (then ``reason`` says why)."""

_KINDS = {"unary": KIND_UNARY, "infer": KIND_INFER}


def _forward(
    link: DeviceLink, kind: int, rpc: str | None
) -> Callable[[bytes | bytearray, int], Awaitable[bytes]]:
    async def serve(data: bytes | bytearray, deadline_ns: int) -> bytes:
        status, message, reply, _ = await link.request(kind, rpc, data, deadline_ns)
        if status:
            raise GrpcError(status, message)
        return reply

    return serve


def _forward_infer(
    link: DeviceLink,
) -> Callable[[bytes | bytearray, int, str | None], Awaitable[bytes]]:
    async def serve(data: bytes | bytearray, deadline_ns: int, context: str | None) -> bytes:
        status, message, reply, _ = await link.request(KIND_INFER, context, data, deadline_ns)
        if status:
            raise GrpcError(status, message)
        return reply

    return serve


class ForwardedStream:
    """ModelStreamInfer: the stream here, its messages served by the device process."""

    def __init__(
        self,
        link: DeviceLink,
        rpc: str,
        closing: anyio.Event,
        shutting_down: str,
        traced: bool = False,
    ) -> None:
        self.link = link
        self.rpc = rpc
        self.closing = closing
        self.shutting_down = shutting_down
        self.traced = traced
        """The worker traces or can: each message carries the stream's trace context."""

    async def __call__(self, call: Call) -> None:
        session = StreamSession(
            call, self._one, closing=self.closing.wait, shutting_down=self.shutting_down
        )
        await session.run()

    async def _one(self, call: Call, message: RawMessage) -> tuple[bytes, Callable[[str], bytes]]:
        try:
            data = call.plain(message)
        except ServingError as exc:
            return stream_error(exc.message), stream_error
        context = caller_context(call.header) if self.traced else None
        _, _, answer, (model, request_id) = await self.link.request(
            KIND_STREAM, context, data, call.deadline_ns
        )
        return answer, lambda why: stream_error(why, model, request_id)


def forwarded_methods(
    link: DeviceLink,
    rpcs: Sequence[RpcEntry],
    limits: Limits,
    closing: anyio.Event,
    shutting_down: str,
    *,
    traced: bool = False,
) -> dict[str, Method]:
    """The front end's method table: every RPC the device process listed (``traced``: the
    worker traces or can be turned on, so ModelInfer carries the caller's trace context)."""
    methods: dict[str, Method] = {}
    for path, rpc, shape, reason in rpcs:
        if shape == "infer" and traced:
            methods[path] = bytes_unary_with_header(
                _forward_infer(link), limits, rpc, caller_context
            )
        elif shape == "stream":
            methods[path] = stream(
                ForwardedStream(link, rpc, closing, shutting_down, traced), limits, rpc
            )
        elif shape == "unimplemented":
            methods[path] = unimplemented(rpc, reason, limits)
        else:
            # ModelInfer's slot for the RPC name carries the trace context: none here.
            name = None if shape == "infer" else rpc
            methods[path] = bytes_unary(_forward(link, _KINDS[shape], name), limits, rpc)
    return methods


class ForwardedRest:
    """The REST ``App`` of a front end: each request served by the device process."""

    def __init__(self, link: DeviceLink) -> None:
        self.link = link

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        head = (request.method, request.path, request.query, request.headers)
        _, _, body, (status, content_type, headers) = await self.link.request(
            KIND_REST, head, request.body, 0
        )
        return HttpResponse(status, body, content_type, headers)


__all__ = ["ForwardedRest", "ForwardedStream", "RpcEntry", "forwarded_methods"]

"""What a front end serves: every RPC of the worker, each handed to the device process.

The front end owns the client's connection and everything the edge checks there (HTTP/2, the
gRPC framing, message caps and decompression, restricted protocols, REST's HTTP/1.1 and body
caps); the device process owns what the request means. So every RPC has one implementation,
the device process's, and a front end knows the RPCs only by the list the device process sent
it (``Hello``):

- a unary RPC (``bytes_unary``, a ``UnaryCall``): its plain message to the device, the reply
  bytes back, the reply compressed as the request was; a failure is the device's status and
  message;
- ModelInfer the same way (an ``InferCall``), with the caller's W3C context (``traceparent``
  and ``tracestate``, ``caller_context``) carried along as the call's ``trace_context`` when the
  worker traces or can be made to (``tracing.level``, or the ``tracing`` extra installed: a
  TraceSetting change turns tracing on in the device process, which no front end hears of, so a
  front end carries a context the caller sent whether or not it is used; without the extra the
  headers are never read), so the device process's span continues the caller's trace;
- ModelStreamInfer: the stream engine (``StreamSession``) runs here, each message is served by
  the device process as one request (a ``StreamCall``) and answered with the stream's answer
  message; an answer over the send cap is replaced by an error answer naming the request's
  model and id, which the device sent along (``StreamOrigin``);
- REST: the parsed HTTP request (a ``RestCall``: method, path, query, headers; the body as its
  message) to the device process's REST adapter, its HTTP reply back (the body, and its
  ``RestHead``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import anyio

from kserve_trio.core.errors import ServingError
from kserve_trio.core.protocol import stream_error
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
from kserve_trio.serving.ipc import (
    Answer,
    DeviceLink,
    ForwardedRpc,
    InferCall,
    RestCall,
    RestHead,
    RpcShape,
    StreamCall,
    StreamOrigin,
    UnaryCall,
)
from kserve_trio.serving.trace_settings import caller_context

_UNTRACED_INFER = InferCall()


def _reply(answer: Answer) -> bytes:
    """The reply of an answer, or its status raised."""
    if answer.status:
        raise GrpcError(answer.status, answer.message)
    return answer.reply


def _forward(
    link: DeviceLink, call: UnaryCall | InferCall
) -> Callable[[bytes | bytearray, int], Awaitable[bytes]]:
    async def serve(data: bytes | bytearray, deadline_ns: int) -> bytes:
        return _reply(await link.request(call, data, deadline_ns))

    return serve


def _forward_infer(
    link: DeviceLink,
) -> Callable[[bytes | bytearray, int, str | None], Awaitable[bytes]]:
    async def serve(data: bytes | bytearray, deadline_ns: int, context: str | None) -> bytes:
        call = InferCall(context) if context is not None else _UNTRACED_INFER
        return _reply(await link.request(call, data, deadline_ns))

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
        answer = await self.link.request(StreamCall(context), data, call.deadline_ns)
        origin = answer.detail
        if not isinstance(origin, StreamOrigin):  # the device process could not serve it
            why = answer.message or "the stream message was not answered"
            return stream_error(why), stream_error
        return answer.reply, lambda why: stream_error(why, origin.model, origin.request_id)


def forwarded_methods(
    link: DeviceLink,
    rpcs: Sequence[ForwardedRpc],
    limits: Limits,
    closing: anyio.Event,
    shutting_down: str,
    *,
    traced: bool = False,
) -> dict[str, Method]:
    """The front end's method table: every RPC the device process listed (``traced``: the
    worker traces or can be turned on, so ModelInfer carries the caller's trace context)."""
    methods: dict[str, Method] = {}
    for entry in rpcs:
        path, rpc = entry.path, entry.rpc
        match entry.shape:
            case RpcShape.INFER if traced:
                methods[path] = bytes_unary_with_header(
                    _forward_infer(link), limits, rpc, caller_context
                )
            case RpcShape.INFER:
                methods[path] = bytes_unary(_forward(link, _UNTRACED_INFER), limits, rpc)
            case RpcShape.STREAM:
                methods[path] = stream(
                    ForwardedStream(link, rpc, closing, shutting_down, traced), limits, rpc
                )
            case RpcShape.UNIMPLEMENTED:
                methods[path] = unimplemented(rpc, entry.reason, limits)
            case RpcShape.UNARY:
                methods[path] = bytes_unary(_forward(link, UnaryCall(rpc)), limits, rpc)
    return methods


class ForwardedRest:
    """The REST ``App`` of a front end: each request served by the device process."""

    def __init__(self, link: DeviceLink) -> None:
        self.link = link

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        call = RestCall(request.method, request.path, request.query, request.headers)
        answer = await self.link.request(call, request.body, 0)
        head = answer.detail
        if not isinstance(head, RestHead):  # the device process could not serve it
            raise GrpcError(answer.status, answer.message)
        return HttpResponse(head.status, answer.reply, head.content_type, head.headers)


__all__ = ["ForwardedRest", "ForwardedStream", "forwarded_methods"]

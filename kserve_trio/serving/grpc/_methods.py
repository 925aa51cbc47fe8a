"""The RPC shapes a server maps paths to, each a ``Method`` whose ``run(call)`` serves one call.

- ``unary(fn, request_type, limits, rpc)``: ``fn(request) -> reply`` with typed messages
  (``parse_message``); the reply is compressed like the request when the client accepts it.
  With ``with_deadline=True`` it is ``fn(request, deadline_ns)``: the call's ``grpc-timeout``
  as an absolute ``time.monotonic_ns()`` (0: none). That is all a typed handler learns of its
  call, so the same handler serves another transport (REST calls it with no deadline). With
  ``context=read`` as well it is ``fn(request, deadline_ns, read(call.header))``: what ``read``
  takes from the request headers (the worker's ModelInfer with tracing on: the caller's W3C
  trace context); the choice is made once, when the method is built.
- ``raw_unary(fn, limits, rpc)``: ``fn(call, message) -> bytes`` with the message as it
  arrived: for a proxy that never decodes a payload.
- ``bytes_unary(fn, limits, rpc)``: ``fn(data, deadline_ns) -> reply`` with the message
  decompressed and the reply compressed as ``unary`` does: for a worker's front end, which
  hands the message to the device process and sends back what it answers.
- ``stream(fn, limits, rpc)``: ``fn(call)`` reads and writes the ``Call`` itself (raw
  messages; ``StreamSession`` is the request/answer engine such a handler runs).
- ``unimplemented(rpc, reason)``: UNIMPLEMENTED naming the RPC.

When ``fn`` returns the call ends OK unless it ended the call itself; when it raises, the
connection ends it with ``status_of``'s status.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

from kserve_trio.core.errors import InvalidArgument, Unimplemented
from kserve_trio.core.protocol import IDENTITY
from kserve_trio.serving.grpc._call import Call
from kserve_trio.serving.grpc._messages import Limits, RawMessage
from kserve_trio.serving.rpc_codec import TypedUnaryFn, parse_message


@dataclass(frozen=True, slots=True)
class Method:
    """One RPC of a server: its name (for logs and errors), caps and how a call is served.
    ``unary``: a call must end with a reply message or an error, never OK with nothing (a
    handler that returns without replying is a bug, answered INTERNAL)."""

    rpc: str
    limits: Limits
    run: Callable[[Call], Awaitable[None]]
    unary: bool = True


async def _one_message(call: Call) -> RawMessage:
    message = await call.receive()
    if message is None:
        raise InvalidArgument("empty request: no message was sent")
    return message


DeadlineUnaryFn = Callable[[Any, int], Awaitable[Any]]
HeaderUnaryFn = Callable[[Any, int, str | None], Awaitable[Any]]
HeaderReader = Callable[[Callable[[str], str | None]], str | None]
"""What a method takes from its call's headers, given the call's header lookup."""


def unary(
    fn: TypedUnaryFn | DeadlineUnaryFn | HeaderUnaryFn,
    request_type: Any,
    limits: Limits,
    rpc: str,
    *,
    with_deadline: bool = False,
    context: HeaderReader | None = None,
) -> Method:
    """A typed unary-unary RPC (module docstring)."""
    if context is not None:
        return _unary_with_header(cast(HeaderUnaryFn, fn), request_type, limits, rpc, context)

    async def run(call: Call) -> None:
        message = await _one_message(call)
        request = parse_message(call.plain(message), request_type, limits.edge)
        if with_deadline:
            reply = await cast(DeadlineUnaryFn, fn)(request, call.deadline_ns)
        else:
            reply = await cast(TypedUnaryFn, fn)(request)
        encoding = call.encoding if message.compressed else IDENTITY
        await call.send_last(reply, encoding=call.reply_encoding(encoding))

    return Method(rpc, limits, run)


def _unary_with_header(
    fn: HeaderUnaryFn, request_type: Any, limits: Limits, rpc: str, context: HeaderReader
) -> Method:
    async def run(call: Call) -> None:
        message = await _one_message(call)
        request = parse_message(call.plain(message), request_type, limits.edge)
        reply = await fn(request, call.deadline_ns, context(call.header))
        encoding = call.encoding if message.compressed else IDENTITY
        await call.send_last(reply, encoding=call.reply_encoding(encoding))

    return Method(rpc, limits, run)


BytesUnaryFn = Callable[[bytes | bytearray, int], Awaitable[Any]]


HeaderBytesUnaryFn = Callable[[bytes | bytearray, int, str | None], Awaitable[Any]]


def bytes_unary_with_header(
    fn: HeaderBytesUnaryFn, limits: Limits, rpc: str, context: HeaderReader
) -> Method:
    """``bytes_unary`` whose ``fn`` also gets what ``context`` reads from the request headers
    (a front end's ModelInfer with tracing on: the caller's W3C trace context)."""

    async def run(call: Call) -> None:
        message = await _one_message(call)
        reply = await fn(call.plain(message), call.deadline_ns, context(call.header))
        encoding = call.encoding if message.compressed else IDENTITY
        await call.send_last(reply, encoding=call.reply_encoding(encoding))

    return Method(rpc, limits, run)


def bytes_unary(fn: BytesUnaryFn, limits: Limits, rpc: str) -> Method:
    """A unary RPC on its plain message bytes and deadline (module docstring)."""

    async def run(call: Call) -> None:
        message = await _one_message(call)
        reply = await fn(call.plain(message), call.deadline_ns)
        encoding = call.encoding if message.compressed else IDENTITY
        await call.send_last(reply, encoding=call.reply_encoding(encoding))

    return Method(rpc, limits, run)


RawUnaryFn = Callable[[Call, RawMessage], Awaitable[bytes]]
RawStreamFn = Callable[[Call], Awaitable[None]]


def raw_unary(fn: RawUnaryFn, limits: Limits, rpc: str) -> Method:
    """A raw-bytes unary-unary RPC: ``fn(call, message) -> reply bytes``."""

    async def run(call: Call) -> None:
        await call.send_last(await fn(call, await _one_message(call)))

    return Method(rpc, limits, run)


def stream(fn: RawStreamFn, limits: Limits, rpc: str) -> Method:
    """A streaming RPC served on the ``Call`` itself."""
    return Method(rpc, limits, fn, unary=False)


def unimplemented(rpc: str, reason: str, limits: Limits) -> Method:
    """An RPC answered UNIMPLEMENTED with a message naming it."""

    async def run(call: Call) -> None:
        raise Unimplemented(f"{rpc} is not implemented: {reason}")

    return Method(rpc, limits, run)


__all__ = [
    "BytesUnaryFn",
    "DeadlineUnaryFn",
    "HeaderBytesUnaryFn",
    "HeaderReader",
    "HeaderUnaryFn",
    "Method",
    "RawStreamFn",
    "RawUnaryFn",
    "bytes_unary",
    "bytes_unary_with_header",
    "raw_unary",
    "stream",
    "unary",
    "unimplemented",
]

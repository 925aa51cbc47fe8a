"""The RPC shapes a server maps paths to, each a ``Method`` whose ``run(call)`` serves one call.

- ``unary(fn, request_type, limits, rpc)``: ``fn(request, ctx) -> reply`` with typed messages
  (``parse_message``); the reply is compressed like the request when the client accepts it.
- ``raw_unary(fn, limits, rpc)``: ``fn(call, message) -> bytes`` with the message as it
  arrived: for a proxy that never decodes a payload.
- ``stream(fn, limits, rpc)``: ``fn(call)`` reads and writes the ``Call`` itself (raw
  messages); ``typed_stream(fn, request_type, limits, rpc)`` hands ``fn`` a ``StreamCall``
  that parses each message on its own (a bad one raises ``MessageError`` and the stream
  reads on).
- ``unimplemented(rpc, reason)``: UNIMPLEMENTED naming the RPC.

When ``fn`` returns the call ends OK unless it ended the call itself; when it raises, the
connection ends it with ``status_of``'s status.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kserve_trio.core import compression
from kserve_trio.core.errors import InvalidArgument, ServingError, StatusCode, Unimplemented
from kserve_trio.serving.grpc._call import Call
from kserve_trio.serving.grpc._messages import (
    Limits,
    MessageError,
    RawMessage,
    parse_message,
)
from kserve_trio.serving.grpc._status import status_of


@dataclass(frozen=True, slots=True)
class Method:
    """One RPC of a server: its name (for logs and errors), caps and how a call is served."""

    rpc: str
    limits: Limits
    run: Callable[[Call], Awaitable[None]]


@dataclass(slots=True)
class CallContext:
    """What a typed unary handler may know about its call besides the request message."""

    call: Call | None
    deadline_ns: int = 0  # absolute time.monotonic_ns() from grpc-timeout; 0 = none
    request_encoding: str = compression.IDENTITY

    @property
    def metadata(self) -> dict[str, str | bytes]:
        return {} if self.call is None else self.call.metadata


async def _one_message(call: Call) -> RawMessage:
    message = await call.receive()
    if message is None:
        raise InvalidArgument("empty request: no message was sent")
    return message


def unary(
    fn: Callable[[Any, CallContext], Awaitable[Any]], request_type: Any, limits: Limits, rpc: str
) -> Method:
    """A typed unary-unary RPC (module docstring)."""

    async def run(call: Call) -> None:
        message = await _one_message(call)
        request = parse_message(call.plain(message), request_type)
        encoding = call.encoding if message.compressed else compression.IDENTITY
        reply = await fn(request, CallContext(call, call.deadline_ns, encoding))
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
    return Method(rpc, limits, fn)


class StreamCall:
    """A stream of typed messages on one call (``typed_stream``).

    1. ``receive`` gives the next message parsed, ``None`` at the end of the client's side; a
       message that does not decompress or parse raises ``MessageError`` (the stream is
       intact); a framing error raises its ``ServingError`` and ends the reading.
    2. ``send`` writes one reply, compressed when the request's ``grpc-encoding`` asks and the
       client accepts it.
    3. ``end`` ends the call now, OK or with an error's status; a second call does nothing.
    """

    __slots__ = ("_request_type", "call", "reply_encoding")

    def __init__(self, call: Call, request_type: Any) -> None:
        self.call = call
        self._request_type = request_type
        self.reply_encoding = call.reply_encoding()

    @property
    def deadline_ns(self) -> int:
        return self.call.deadline_ns

    @property
    def metadata(self) -> dict[str, str | bytes]:
        return self.call.metadata

    async def receive(self) -> Any | None:
        """The next message (rule 1)."""
        message = await self.call.receive()
        if message is None:
            return None
        try:
            return parse_message(self.call.plain(message), self._request_type)
        except ServingError as exc:
            raise MessageError(exc) from None

    async def send(self, reply: Any) -> None:
        """Send one reply message (rule 2)."""
        await self.call.send(reply, encoding=self.reply_encoding)

    async def end(self, error: BaseException | None = None) -> None:
        """End the call now (rule 3)."""
        if error is None:
            self.call.finish(StatusCode.OK)
            return
        status, message = status_of(error, rpc=self.call.rpc)
        self.call.finish(status, message)


def typed_stream(
    fn: Callable[[StreamCall], Awaitable[None]], request_type: Any, limits: Limits, rpc: str
) -> Method:
    """A streaming RPC whose handler reads typed messages (``StreamCall``)."""

    async def run(call: Call) -> None:
        await fn(StreamCall(call, request_type))

    return Method(rpc, limits, run)


def unimplemented(rpc: str, reason: str, limits: Limits) -> Method:
    """An RPC answered UNIMPLEMENTED with a message naming it."""

    async def run(call: Call) -> None:
        raise Unimplemented(f"{rpc} is not implemented: {reason}")

    return Method(rpc, limits, run)


__all__ = [
    "CallContext",
    "Method",
    "RawStreamFn",
    "RawUnaryFn",
    "StreamCall",
    "raw_unary",
    "stream",
    "typed_stream",
    "unary",
    "unimplemented",
]

"""The thin grpclib adapter: the one place that touches grpclib's stream and status types.

Handlers are mapped by hand so they see the raw stream: its deadline
(``grpc-timeout``), its metadata, and the message length before the payload is buffered.
``recv_request`` enforces ``grpc.max_recv_msg_bytes`` from the length prefix (grpclib has no cap
of its own) and refuses compressed messages; ``send_reply`` sends pre-encoded bytes so the reply
is serialized exactly once and checked against ``grpc.max_send_msg_bytes``. ``status_error``
maps our exception family to ``GRPCError`` in one place.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpclib.const
from grpclib.exceptions import GRPCError

from kserve_trio.core import wire
from kserve_trio.core.errors import (
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    ServingError,
    Unimplemented,
)
from kserve_trio.core.logging import get_logger
from kserve_trio.proto import inference as pb

log = get_logger("kserve_trio.serving.grpc")


class EncodedMessage(bytes):
    """Already-serialized protobuf bytes; grpclib's codec passes them through unchanged."""

    def SerializeToString(self) -> bytes:
        return self

    @classmethod
    def FromString(cls, data: bytes) -> EncodedMessage:
        return cls(data)


@dataclass(frozen=True)
class Limits:
    """Message caps for one server (``grpc.max_*_msg_bytes``)."""

    max_recv_bytes: int
    max_send_bytes: int


@dataclass
class CallContext:
    """What a handler may know about its call besides the request message."""

    stream: Any
    deadline_ns: int  # absolute time.monotonic_ns() from grpc-timeout; 0 = none

    @property
    def metadata(self):
        return self.stream.metadata


async def _recv_exactly(h2_stream, size: int, what: str, *, may_end: bool = False) -> bytes:
    """``size`` bytes of the request stream; a stream that ends first is malformed input
    (``may_end``: ending before the first byte gives ``b""``).

    grpclib's buffer asserts when the stream ends inside a read (and returns short under
    ``python -O``); both become ``InvalidArgument`` here, never an internal error.
    """
    try:
        data = await h2_stream.recv_data(size)
    except AssertionError:
        data = None
    if data is None or (len(data) < size and not (may_end and not data)):
        raise InvalidArgument(f"truncated request: the stream ended inside the {what}")
    return data


async def recv_request(stream, message_type, max_bytes: int):
    """Read one length-prefixed message, enforcing the cap before buffering the payload.

    Every way the framing can be wrong is the client's fault and answers ``INVALID_ARGUMENT``:
    no message, a stream ending inside the 5-byte prefix or before the announced length, a
    compressed-flag byte other than 0 or 1, and a payload that does not parse.
    """
    h2_stream = stream._stream
    meta = await _recv_exactly(h2_stream, 5, "5-byte gRPC message prefix", may_end=True)
    if not meta:
        raise InvalidArgument("empty request: no message was sent")
    flag, length = struct.unpack(">BI", meta)
    if flag > 1:
        raise InvalidArgument(f"malformed gRPC message prefix: compressed flag {flag}")
    if flag:
        raise Unimplemented("compression is not supported")
    if length > max_bytes:
        raise ResourceExhausted(f"received message larger than max ({length} vs. {max_bytes})")
    data = b""
    if length:
        data = await _recv_exactly(h2_stream, length, f"{length}-byte message its prefix announced")
    try:
        if message_type is pb.ModelInferRequest:
            return wire.parse_infer_request(data)
        return message_type.parse(data)
    except Exception as exc:
        raise InvalidArgument(f"malformed request message: {exc}") from exc


async def send_reply(stream, message, max_bytes: int) -> None:
    """Serialize once, check the send cap, and send.

    A ``ModelInferResponse`` is assembled from ``core.wire`` pieces with the gRPC length prefix
    in one join (its payload buffers are never serialized through betterproto2) and written to
    the HTTP/2 stream directly.
    """
    if isinstance(message, pb.ModelInferResponse):
        pieces = wire.infer_response_pieces(message)
        length = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in pieces)
        if length > max_bytes:
            raise ResourceExhausted(f"response larger than max ({length} vs. {max_bytes})")
        data = b"".join([struct.pack(">?I", False, length), *pieces])
        if not stream._send_initial_metadata_done:
            await stream.send_initial_metadata()
        await stream._stream.send_data(data)
        stream._send_message_done = True
        stream._messages_sent += 1
        return
    data = EncodedMessage(bytes(message))
    if len(data) > max_bytes:
        raise ResourceExhausted(f"response larger than max ({len(data)} vs. {max_bytes})")
    await stream.send_message(data)


def deadline_from_stream(stream) -> int:
    """grpc-timeout as an absolute ``time.monotonic_ns()`` deadline (0 = none)."""
    deadline = stream.deadline
    if deadline is None:
        return 0
    remaining = deadline.time_remaining()
    return time.monotonic_ns() + max(0, int(remaining * 1e9)) or 1


def status_error(exc: BaseException, *, request_id: str = "", rpc: str = "") -> GRPCError:
    """Map an exception to the GRPCError grpclib sends; unexpected ones become INTERNAL."""
    if isinstance(exc, GRPCError):
        return exc
    if isinstance(exc, ServingError):
        return GRPCError(grpclib.const.Status(int(exc.status)), exc.message)
    if isinstance(exc, TimeoutError):
        return GRPCError(grpclib.const.Status.DEADLINE_EXCEEDED, str(exc) or "deadline exceeded")
    log.error(
        "request_failed_unexpectedly", rpc=rpc, request_id=request_id, error=repr(exc), exc_info=exc
    )
    return GRPCError(grpclib.const.Status.INTERNAL, f"internal error: {exc!r}")


Handler = Callable[[Any, CallContext], Awaitable[Any]]


def unary(fn: Handler, request_type, limits: Limits, rpc: str) -> grpclib.const.Handler:
    """Wrap ``fn(request, ctx) -> reply`` as a grpclib unary-unary handler."""

    async def handle(stream) -> None:
        try:
            request = await recv_request(stream, request_type, limits.max_recv_bytes)
            reply = await fn(request, CallContext(stream, deadline_from_stream(stream)))
            await send_reply(stream, reply, limits.max_send_bytes)
        except DeadlineExceeded as exc:
            raise status_error(exc, rpc=rpc) from None
        except (ServingError, TimeoutError) as exc:
            raise status_error(exc, rpc=rpc) from None
        except GRPCError:
            raise
        except Exception as exc:
            raise status_error(exc, rpc=rpc) from exc

    return grpclib.const.Handler(
        handle, grpclib.const.Cardinality.UNARY_UNARY, request_type, EncodedMessage
    )


def unimplemented(rpc: str, reason: str) -> grpclib.const.Handler:
    """A handler answering UNIMPLEMENTED with a message naming the RPC."""

    async def handle(stream) -> None:
        raise GRPCError(grpclib.const.Status.UNIMPLEMENTED, f"{rpc} is not implemented: {reason}")

    return grpclib.const.Handler(
        handle, grpclib.const.Cardinality.UNARY_UNARY, EncodedMessage, EncodedMessage
    )


__all__ = [
    "CallContext",
    "EncodedMessage",
    "Limits",
    "deadline_from_stream",
    "recv_request",
    "send_reply",
    "status_error",
    "unary",
    "unimplemented",
]

"""Raw-bytes gRPC handlers for grpclib: messages in as the bytes that arrived, replies out as
bytes, and the call's own headers at hand. For a proxy that never decodes a payload.

``raw_unary`` and ``raw_stream`` wrap a handler function as a grpclib handler. The function is
given a ``RawCall``: ``receive()`` returns the next request message as a ``RawMessage`` (its
bytes exactly as they arrived on the wire, compressed ones still compressed) and ``send()``
writes one reply message. ``RawCall.plain(message)`` gives the uncompressed bytes, for a caller
that must read a few fields of a compressed message; ``RawCall.encoding`` is the request's
``grpc-encoding``, so a compressed message can be passed on as it is, under the same header.

Framing rules (every violation is the client's fault, INVALID_ARGUMENT, unless said otherwise):
1. A message is a 5-byte prefix (flag, big-endian length) and the payload. A stream that ends
   inside either is malformed; a unary call that sends no message is malformed.
2. Flag 0 is a plain message; flag 1 a compressed one, which needs a ``grpc-encoding`` naming
   an algorithm (``core.compression``; the server's header check has already refused
   unknown ones with UNIMPLEMENTED); any other flag is malformed.
3. The announced length is checked against ``grpc.max_recv_msg_bytes`` before the payload is
   buffered (RESOURCE_EXHAUSTED); a compressed payload's decompressed size is bounded by the
   same cap when ``plain`` inflates it.
4. A reply over ``grpc.max_send_msg_bytes`` is RESOURCE_EXHAUSTED and is not sent; replies are
   sent uncompressed, which every gRPC client accepts.
5. A unary reply that fits the peer's window and frame size goes out with its headers and the
   OK trailers in one socket write (``send_last``).

Errors raised by the handler function map to statuses through ``grpc_adapter.status_error``.
"""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import grpclib.const
from grpclib.exceptions import GRPCError

from kserve_trio.core import compression
from kserve_trio.core.errors import InvalidArgument, ResourceExhausted, ServingError
from kserve_trio.serving.call_headers import header_value
from kserve_trio.serving.grpc_adapter import EncodedMessage, Limits, status_error

_SPLIT_SEND_BYTES = 64 << 10
"""Replies from this size up are framed from the payload itself (no joined copy)."""
_SEND_BATCH_BYTES = 1 << 20
"""How much DATA a large reply queues in h2 before one socket write."""


@dataclass(frozen=True, slots=True)
class RawMessage:
    """One request message: ``data`` exactly as received (still compressed when
    ``compressed``)."""

    data: bytes
    compressed: bool = False


class RawCall:
    """One call as a raw handler sees it (see the module docstring)."""

    __slots__ = ("_send_lock", "encoding", "limits", "rpc", "stream")

    def __init__(self, stream: Any, rpc: str, limits: Limits) -> None:
        self.stream = stream
        self.rpc = rpc
        self.limits = limits
        self.encoding = compression.parse_encoding(header_value(stream, "grpc-encoding"))
        self._send_lock: anyio.Lock | None = None

    @property
    def metadata(self) -> Mapping[str, Any]:
        """The caller's custom metadata (grpclib drops ``grpc-*`` and reserved headers)."""
        return self.stream.metadata or {}

    @property
    def deadline(self) -> float | None:
        """The client's deadline on the ``anyio.current_time()`` clock (``None``: none)."""
        deadline = self.stream.deadline
        if deadline is None:
            return None
        return anyio.current_time() + deadline.time_remaining()

    async def receive(self) -> RawMessage | None:
        """The next request message, or ``None`` when the client has ended its side."""
        h2_stream = self.stream._stream
        prefix = await _recv_exactly(h2_stream, 5, "5-byte gRPC message prefix", may_end=True)
        if not prefix:
            return None
        flag, length = struct.unpack(">BI", prefix)
        if flag > 1:
            raise InvalidArgument(f"malformed gRPC message prefix: compressed flag {flag}")
        if flag and self.encoding == compression.IDENTITY:
            raise InvalidArgument(
                "a compressed message arrived without a grpc-encoding naming its algorithm"
            )
        cap = self.limits.max_recv_bytes
        if length > cap:
            raise ResourceExhausted(f"received message larger than max ({length} vs. {cap})")
        data = b""
        if length:
            data = await _recv_exactly(
                h2_stream, length, f"{length}-byte message its prefix announced"
            )
        self.stream._messages_received += 1
        return RawMessage(data, bool(flag))

    def plain(self, message: RawMessage) -> bytes | bytearray:
        """``message`` uncompressed (rule 3's cap applies to what it inflates to)."""
        if not message.compressed:
            return message.data
        return compression.decompress(message.data, self.encoding, self.limits.max_recv_bytes)

    async def send(self, data: bytes) -> None:
        """Send one reply message (rule 4). On a stream, concurrent senders take turns (a
        message's frames must not interleave with another's)."""
        cap = self.limits.max_send_bytes
        if len(data) > cap:
            raise ResourceExhausted(f"response larger than max ({len(data)} vs. {cap})")
        if self.stream._cardinality.server_streaming:
            if self._send_lock is None:
                self._send_lock = anyio.Lock()
            async with self._send_lock:
                await self._send(data)
        else:
            await self._send(data)

    async def send_last(self, data: bytes) -> None:
        """A unary call's one reply and the call's end: response headers, the message and the
        OK trailers queued together and written to the socket at once (one write and one
        wake-up of the client instead of three), when the message fits the peer's window and
        frame size; otherwise ``send`` (grpclib then sends the trailers)."""
        cap = self.limits.max_send_bytes
        if len(data) > cap:
            raise ResourceExhausted(f"response larger than max ({len(data)} vs. {cap})")
        stream = self.stream
        h2_stream = stream._stream
        h2_conn = h2_stream._h2_connection
        sid = h2_stream.id
        size = len(data) + 5
        if (
            stream._send_initial_metadata_done
            or sid not in h2_conn.streams
            or size > h2_conn.max_outbound_frame_size
            or size > h2_conn.local_flow_control_window(sid)
            or not h2_stream.connection.write_ready.is_set()
        ):
            await self.send(data)
            return
        h2_conn.send_headers(sid, [(":status", "200"), ("content-type", stream._content_type)])
        h2_conn.send_data(sid, struct.pack(">BI", 0, len(data)) + data)
        h2_conn.send_headers(sid, [("grpc-status", "0")], end_stream=True)
        h2_stream._transport.write(h2_conn.data_to_send())
        stream._send_initial_metadata_done = True
        stream._send_message_done = True
        stream._send_trailing_metadata_done = True  # grpclib sends nothing more
        stream._messages_sent += 1
        h2_stream.connection.headers_send_process()
        h2_stream.connection.data_send_process()

    async def _send(self, data: bytes) -> None:
        stream = self.stream
        if not stream._send_initial_metadata_done:
            await stream.send_initial_metadata()
        prefix = struct.pack(">BI", 0, len(data))
        if len(data) < _SPLIT_SEND_BYTES:
            await stream._stream.send_data(prefix + data)
        else:
            await _send_large(stream._stream, prefix, data)
        stream._send_message_done = True
        stream._messages_sent += 1


async def _send_large(h2_stream: Any, prefix: bytes, data: bytes) -> None:
    """A large message's DATA frames, sliced from ``data`` without copying it first and
    written in batches of up to ``_SEND_BATCH_BYTES``, within the peer's flow-control window
    and frame size. (grpclib's own ``send_data`` copies every frame's bytes out of a
    ``BytesIO`` and makes one socket write per frame: for a 10 MB reply to a client that takes
    16 KiB frames that is 640 writes.) It uses grpclib's protocol stream the way its
    ``send_data`` does: the connection's write-ready event, the h2 connection, the transport."""
    conn = h2_stream.connection
    h2_conn = h2_stream._h2_connection
    sid = h2_stream.id
    pieces = [memoryview(prefix), memoryview(data)]
    while pieces:
        await conn.write_ready.wait()
        window = h2_conn.local_flow_control_window(sid)
        if not window > 0:
            h2_stream.window_updated.clear()
            await h2_stream.window_updated.wait()
            continue
        frame = h2_conn.max_outbound_frame_size
        queued = 0
        while pieces and window > 0 and queued < _SEND_BATCH_BYTES:
            piece = pieces[0]
            n = min(window, frame, len(piece))
            h2_conn.send_data(sid, piece[:n])
            window -= n
            queued += n
            if n == len(piece):
                pieces.pop(0)
            else:
                pieces[0] = piece[n:]
        h2_stream._transport.write(h2_conn.data_to_send())
        h2_stream.data_sent += queued
        conn.data_sent += queued
        conn.data_send_process()


async def _recv_exactly(h2_stream: Any, size: int, what: str, *, may_end: bool = False) -> bytes:
    """``size`` bytes of the request stream (rule 1); ``may_end``: a stream that ends before
    the first byte gives ``b""``. grpclib's buffer asserts when the stream ends inside a read;
    that is malformed input too, never an internal error."""
    try:
        data = await h2_stream.recv_data(size)
    except AssertionError:
        data = None
    if data is None or (len(data) < size and not (may_end and not data)):
        raise InvalidArgument(f"truncated request: the stream ended inside the {what}")
    return data


RawUnaryFn = Callable[[RawCall, RawMessage], Awaitable[bytes]]
RawStreamFn = Callable[[RawCall], Awaitable[None]]


def _guarded(run: Callable[[RawCall], Awaitable[None]], limits: Limits, rpc: str):
    async def handle(stream: Any) -> None:
        try:
            await run(RawCall(stream, rpc, limits))
        except GRPCError:
            raise
        except (ServingError, TimeoutError) as exc:
            raise status_error(exc, rpc=rpc) from None
        except Exception as exc:
            raise status_error(exc, rpc=rpc) from exc

    return handle


def raw_unary(fn: RawUnaryFn, limits: Limits, rpc: str) -> grpclib.const.Handler:
    """A unary-unary grpclib handler: ``fn(call, message) -> reply bytes``."""

    async def run(call: RawCall) -> None:
        message = await call.receive()
        if message is None:
            raise InvalidArgument("empty request: no message was sent")
        await call.send_last(await fn(call, message))

    return grpclib.const.Handler(
        _guarded(run, limits, rpc),
        grpclib.const.Cardinality.UNARY_UNARY,
        EncodedMessage,
        EncodedMessage,
    )


def raw_stream(fn: RawStreamFn, limits: Limits, rpc: str) -> grpclib.const.Handler:
    """A stream-stream grpclib handler: ``fn(call)`` receives and sends until it returns (the
    call then ends OK) or raises (the call ends with that status)."""
    return grpclib.const.Handler(
        _guarded(fn, limits, rpc),
        grpclib.const.Cardinality.STREAM_STREAM,
        EncodedMessage,
        EncodedMessage,
    )


__all__ = ["RawCall", "RawMessage", "RawStreamFn", "RawUnaryFn", "raw_stream", "raw_unary"]

"""The thin grpclib adapter: the one place that touches grpclib's stream and status types.

Handlers are mapped by hand so they see the raw stream: its deadline
(``grpc-timeout``), its metadata, and the message length before the payload is buffered.
``recv_message`` enforces ``grpc.max_recv_msg_bytes`` from the length prefix (grpclib has no cap
of its own) and again on the decompressed size of a gzip or deflate message (``compression``);
``send_reply`` sends pre-encoded bytes so the reply is serialized exactly once, checked against
``grpc.max_send_msg_bytes`` and compressed only when the request was (or ``compress_responses``
says so). ModelInfer messages are coded by ``core.infer_wire`` both ways: a request is parsed
with its payloads as views of the received bytes, and a response's ``WirePieces`` are written
with each large payload sent from its own buffer, never joined into a copy first.
``unary`` wraps a one-message handler; ``stream_stream`` wraps a stream handler, which reads the
client's messages through a ``StreamCall`` (each decompressed on its own, a bad one not ending
the stream) and writes its replies with the same ``send_reply``. ``status_error`` maps our
exception family to ``GRPCError`` in one place.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpclib.const
from grpclib.exceptions import GRPCError

from kserve_trio.core import compression
from kserve_trio.core.errors import (
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    ServingError,
)
from kserve_trio.core.infer_wire import (
    InferRequestMessage,
    InferResponseMessage,
    WirePieces,
    parse_infer_request,
)
from kserve_trio.core.logging import get_logger
from kserve_trio.proto import inference as pb
from kserve_trio.serving.call_headers import header_value
from kserve_trio.serving.message_check import wrong_field

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
    """Message caps for one server (``grpc.max_*_msg_bytes``, on decompressed sizes) and
    whether every reply is compressed (``grpc.compress_responses``)."""

    max_recv_bytes: int
    max_send_bytes: int
    compress_responses: bool = False


@dataclass
class CallContext:
    """What a handler may know about its call besides the request message."""

    stream: Any
    deadline_ns: int  # absolute time.monotonic_ns() from grpc-timeout; 0 = none
    request_encoding: str = compression.IDENTITY  # what the request message was compressed with

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


async def _recv_frame(stream, max_bytes: int, *, may_end: bool) -> tuple[int, bytes] | None:
    """One message's compressed flag and payload, as sent (the framing rules of
    ``recv_message``); ``None`` when ``may_end`` and the stream ended before a new message."""
    h2_stream = stream._stream
    meta = await _recv_exactly(h2_stream, 5, "5-byte gRPC message prefix", may_end=True)
    if not meta:
        if may_end:
            return None
        raise InvalidArgument("empty request: no message was sent")
    flag, length = struct.unpack(">BI", meta)
    if flag > 1:
        raise InvalidArgument(f"malformed gRPC message prefix: compressed flag {flag}")
    if length > max_bytes:
        raise ResourceExhausted(f"received message larger than max ({length} vs. {max_bytes})")
    data = b""
    if length:
        data = await _recv_exactly(h2_stream, length, f"{length}-byte message its prefix announced")
    return flag, data


def _decode(stream, flag: int, data: bytes, message_type, max_bytes: int) -> tuple[Any, str]:
    """A received payload decompressed (when flagged) and parsed, and its algorithm."""
    encoding = compression.IDENTITY
    payload: bytes | bytearray = data
    if flag:
        encoding = compression.parse_encoding(header_value(stream, "grpc-encoding"))
        payload = compression.decompress(data, encoding, max_bytes)
    return _parse(payload, message_type), encoding


async def recv_message(
    stream, message_type, max_bytes: int, *, may_end: bool = False
) -> tuple[Any, str]:
    """Read one length-prefixed message and the algorithm it was compressed with.

    Every way the framing can be wrong is the client's fault and answers ``INVALID_ARGUMENT``:
    no message, a stream ending inside the 5-byte prefix or before the announced length, a
    compressed-flag byte other than 0 or 1, a compressed message without ``grpc-encoding``, a
    payload that does not decompress or parse. The cap applies to the announced length before
    anything is buffered and to the decompressed size (a decompression bomb is
    RESOURCE_EXHAUSTED). ``may_end``: a stream that ends before a new message gives
    ``(None, "identity")`` (the end of a client stream).
    """
    frame = await _recv_frame(stream, max_bytes, may_end=may_end)
    if frame is None:
        return None, compression.IDENTITY
    return _decode(stream, frame[0], frame[1], message_type, max_bytes)


async def recv_request(stream, message_type, max_bytes: int):
    """Read the one message of a unary call (see ``recv_message``)."""
    message, _ = await recv_message(stream, message_type, max_bytes)
    return message


def _parse(data: bytes | bytearray, message_type):
    try:
        if message_type is pb.ModelInferRequest or message_type is InferRequestMessage:
            return parse_infer_request(data)
        message = message_type.parse(data)
    except Exception as exc:
        raise InvalidArgument(f"malformed request message: {exc}") from exc
    bad = wrong_field(message)
    if bad is not None:
        raise InvalidArgument(f"malformed request message: field '{bad}' has the wrong wire type")
    return message


def reply_encoding(stream, ctx_encoding: str, limits: Limits) -> str:
    """The algorithm a reply is sent with: the request's when it was compressed and the client
    accepts it back, or any accepted one under ``compress_responses``; else identity."""
    if ctx_encoding == compression.IDENTITY and not limits.compress_responses:
        return compression.IDENTITY  # the common case: no header lookup
    accepted = compression.parse_accept_encoding(header_value(stream, "grpc-accept-encoding"))
    return compression.reply_encoding(ctx_encoding, accepted, limits.compress_responses)


async def _send_initial(stream, encoding: str) -> None:
    if stream._send_initial_metadata_done:
        return
    if encoding == compression.IDENTITY:
        await stream.send_initial_metadata()
        return
    # grpclib's send_initial_metadata refuses grpc-* keys: send the headers ourselves.
    await stream._stream.send_headers(
        [
            (":status", "200"),
            ("content-type", stream._content_type),
            ("grpc-encoding", encoding),
            ("grpc-accept-encoding", compression.ACCEPT_ENCODING),
        ]
    )
    stream._send_initial_metadata_done = True


_JOIN_BYTES = 256 << 10
"""Up to this size a reply is joined into one ``bytes`` and sent in one call; from this size up
a payload is sent from its own buffer. Measured here: one h2 ``send_data`` + ``data_to_send``
costs about 9 us (before the socket write), joining 64 KiB 2.6 us, 256 KiB 11 us, 1 MiB 59 us,
so below about 256 KiB a copy is cheaper than another call."""


async def send_reply(
    stream, message, max_bytes: int, *, encoding: str = compression.IDENTITY
) -> None:
    """Serialize once, check the send cap (on the uncompressed size), compress with
    ``encoding`` when it is not identity, and send.

    A ``ModelInferResponse`` comes as ``WirePieces`` (or an ``InferResponseMessage``): with the
    gRPC length prefix it is joined into one write when it is small (``_JOIN_BYTES``); a larger
    one is written piece by piece, runs of small pieces joined, each large payload sent in DATA
    frames sliced from its own buffer.
    """
    if isinstance(message, InferResponseMessage):
        message = message.pieces()
    if isinstance(message, WirePieces):
        pieces: list[Any] = message.pieces
        length = message.nbytes
    else:
        data = bytes(message)
        pieces, length = [data], len(data)
    if length > max_bytes:
        raise ResourceExhausted(f"response larger than max ({length} vs. {max_bytes})")
    if encoding != compression.IDENTITY:
        packed = compression.compress(b"".join(pieces), encoding)
        segments: list[Any] = [struct.pack(">?I", True, len(packed)) + packed]
    elif not isinstance(message, WirePieces):
        await stream.send_message(EncodedMessage(pieces[0]))
        return
    elif length <= _JOIN_BYTES:
        segments = [b"".join([struct.pack(">?I", False, length), *pieces])]
    else:
        segments = _segments([struct.pack(">?I", False, length), *pieces])
    await _send_initial(stream, encoding)
    if len(segments) == 1 and segments[0].__class__ is bytes:
        await stream._stream.send_data(segments[0])  # one bytes object: grpclib's own loop
    else:
        await _send_segments(stream._stream, segments)
    stream._send_message_done = True
    stream._messages_sent += 1


def _segments(pieces: list[Any]) -> list[Any]:
    """Pieces regrouped for sending: each run of pieces under ``_JOIN_BYTES`` joined into one
    ``bytes``, each larger piece kept as it is."""
    out: list[Any] = []
    run: list[Any] = []
    for piece in pieces:
        size = len(piece) if piece.__class__ is bytes else memoryview(piece).nbytes
        if size < _JOIN_BYTES:
            run.append(piece)
            continue
        if run:
            out.append(b"".join(run))
            run = []
        out.append(piece)
    if run:
        out.append(b"".join(run))
    return out


async def _send_segments(h2_stream, segments: list[Any]) -> None:
    """Write ``segments`` to grpclib's HTTP/2 stream as DATA frames, each frame a slice of its
    segment's buffer (grpclib's own ``send_data`` would first copy a ``memoryview`` whole).

    The rules of grpclib's loop, per frame: wait until the transport accepts writes; a stream
    window at or below zero waits for a WINDOW_UPDATE, then everything is checked again; a
    frame is at most the window, the peer's frame size and what is left.
    """
    conn = h2_stream._h2_connection
    connection = h2_stream.connection
    transport = h2_stream._transport
    sid = h2_stream.id
    for segment in segments:
        view = memoryview(segment)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        pos, end = 0, view.nbytes
        while pos < end:
            await connection.write_ready.wait()
            window = conn.local_flow_control_window(sid)
            if not window > 0:
                h2_stream.window_updated.clear()
                await h2_stream.window_updated.wait()
                continue
            n = min(window, conn.max_outbound_frame_size, end - pos)
            conn.send_data(sid, view[pos : pos + n])
            transport.write(conn.data_to_send())
            pos += n
            h2_stream.data_sent += n
            connection.data_sent += n
            connection.data_send_process()


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


def unary(
    fn: Handler, request_type, limits: Limits, rpc: str, *, fast: bool = False
) -> grpclib.const.Handler:
    """Wrap ``fn(request, ctx) -> reply`` as a grpclib unary-unary handler. ``fast``: the
    handler also carries what a ``serving.fast_unary.FastUnary`` is built from
    (``handle.fast_spec``), which ``grpc_server`` serves plain calls with when the fast path
    is on."""

    async def handle(stream) -> None:
        try:
            request, encoding = await recv_message(stream, request_type, limits.max_recv_bytes)
            ctx = CallContext(stream, deadline_from_stream(stream), encoding)
            reply = await fn(request, ctx)
            await send_reply(
                stream,
                reply,
                limits.max_send_bytes,
                encoding=reply_encoding(stream, encoding, limits),
            )
        except DeadlineExceeded as exc:
            raise status_error(exc, rpc=rpc) from None
        except (ServingError, TimeoutError) as exc:
            raise status_error(exc, rpc=rpc) from None
        except GRPCError:
            raise
        except Exception as exc:
            raise status_error(exc, rpc=rpc) from exc

    if fast:  # grpc_server builds the FastUnary from it (serving.fast_unary)
        handle.fast_spec = (fn, request_type, limits, rpc)  # type: ignore[attr-defined]
    return grpclib.const.Handler(
        handle, grpclib.const.Cardinality.UNARY_UNARY, request_type, EncodedMessage
    )


class MessageError(Exception):
    """One message of a client stream that could not be used (it does not decompress or
    parse); the stream itself is intact and can be read on. ``error`` is why."""

    def __init__(self, error: ServingError) -> None:
        super().__init__(error.message)
        self.error = error


class StreamCall:
    """A stream-stream call as its handler sees it: ``receive`` the client's messages one at a
    time, ``send`` replies (from one task at a time: frames of two replies must not
    interleave), ``end`` the call with a status.

    Rules:
    1. ``receive`` returns the next parsed message, ``None`` once the client has ended its
       side. A framing error (a prefix or payload cut short, a bad flag, an announced length
       over ``grpc.max_recv_msg_bytes``) raises its ``ServingError``: the stream cannot be
       read past it. A message that does not decompress (a bomb included) or parse raises
       ``MessageError``: the next message can still be read.
    2. Replies are compressed with the algorithm of the call's ``grpc-encoding`` when the
       client accepts it back, or under ``grpc.compress_responses`` (``reply_encoding``);
       each reply is checked against ``grpc.max_send_msg_bytes`` before anything is sent.
    3. ``deadline_ns`` is the call's ``grpc-timeout`` as an absolute ``time.monotonic_ns()``
       (0 = none): the deadline of every request on the stream.
    4. ``end`` sends the trailers now (OK, or the status ``status_error`` maps ``error`` to),
       so the call is over on the wire when it returns; a handler that returns without it
       ends OK (grpclib sends the trailers).
    """

    def __init__(self, stream, request_type, limits: Limits, rpc: str) -> None:
        self.stream = stream
        self.rpc = rpc
        self.limits = limits
        self._request_type = request_type
        self.deadline_ns = deadline_from_stream(stream)
        self.reply_encoding = reply_encoding(
            stream, compression.parse_encoding(header_value(stream, "grpc-encoding")), limits
        )

    @property
    def metadata(self):
        return self.stream.metadata

    async def receive(self) -> Any | None:
        """The next message (rule 1)."""
        max_bytes = self.limits.max_recv_bytes
        frame = await _recv_frame(self.stream, max_bytes, may_end=True)
        if frame is None:
            return None
        try:
            message, _ = _decode(self.stream, frame[0], frame[1], self._request_type, max_bytes)
        except ServingError as exc:
            raise MessageError(exc) from None
        return message

    async def send(self, reply) -> None:
        """Send one reply message (rule 2)."""
        await send_reply(
            self.stream, reply, self.limits.max_send_bytes, encoding=self.reply_encoding
        )

    async def end(self, error: BaseException | None = None) -> None:
        """End the call now (rule 4); a second call does nothing."""
        stream = self.stream
        if stream._send_trailing_metadata_done:
            return
        if error is None:
            await stream.send_trailing_metadata()
            return
        grpc_error = status_error(error, rpc=self.rpc)
        await stream.send_trailing_metadata(
            status=grpc_error.status, status_message=grpc_error.message
        )


StreamHandler = Callable[[StreamCall], Awaitable[None]]


def stream_stream(
    fn: StreamHandler, request_type, limits: Limits, rpc: str
) -> grpclib.const.Handler:
    """Wrap ``fn(call)`` as a grpclib stream-stream handler: the call ends when ``fn`` returns
    (OK, unless it ended the call itself) or raises (the status ``status_error`` maps the
    exception to)."""

    async def handle(stream) -> None:
        try:
            await fn(StreamCall(stream, request_type, limits, rpc))
        except GRPCError:
            raise
        except (ServingError, TimeoutError) as exc:
            raise status_error(exc, rpc=rpc) from None
        except Exception as exc:
            raise status_error(exc, rpc=rpc) from exc

    return grpclib.const.Handler(
        handle, grpclib.const.Cardinality.STREAM_STREAM, request_type, EncodedMessage
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
    "MessageError",
    "StreamCall",
    "StreamHandler",
    "deadline_from_stream",
    "recv_message",
    "recv_request",
    "reply_encoding",
    "send_reply",
    "status_error",
    "stream_stream",
    "unary",
    "unimplemented",
]

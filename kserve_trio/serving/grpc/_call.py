"""One gRPC call: the object every handler of every RPC shape talks to.

A ``Call`` is made by its connection when a stream's request headers arrive; it owns that
stream's inbound buffer and writes the stream's side of the reply through the connection's h2
state. The same object serves unary calls (typed or raw-bytes messages), server streaming and
bidirectional streaming, so there is one receive path and one send path:

Receiving (``receive``), per message:
1. A message is a 5-byte prefix (flag, big-endian length) and the payload. A stream that ends
   inside either is malformed (INVALID_ARGUMENT); one that ends before a new prefix ends the
   client's side (``None``).
2. Flag 0 is a plain message; flag 1 a compressed one, which needs a ``grpc-encoding``; any
   other flag is malformed.
3. The announced length is checked against ``Limits.max_recv_bytes`` before the payload is
   buffered (RESOURCE_EXHAUSTED); ``plain`` bounds what a compressed payload inflates to by the
   same cap.
4. Received bytes are handed back to the client's flow-control window as they arrive while the
   call holds at most one window (or the message it waits for) unread; beyond that only as the
   handler reads them, so a client cannot make a slow handler buffer without bound.

Sending (``send`` for one message, ``send_last`` for a unary reply and the call's end):
5. The send cap (``Limits.max_send_bytes``, on the uncompressed size) is checked before
   anything is sent (RESOURCE_EXHAUSTED).
6. A reply that fits the peer's window and frame size is one DATA frame, queued with the
   response headers (and, for ``send_last``, the OK trailers) so the connection writes them in
   one socket write. A larger one is framed from its own buffers within the peer's flow-control
   window and frame size, written in batches, waiting for WINDOW_UPDATE when the window is
   spent. Concurrent senders on one stream take turns for framed messages.
7. ``finish`` ends the call with a status: trailers-only when nothing was sent yet, trailers
   otherwise, ``grpc-message`` percent-encoded.

Cancellation: the call's handler runs inside ``scope``; RST_STREAM from the client, a lost
connection and the call's deadline cancel it (``expired`` tells the deadline apart).
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import h2.exceptions

from kserve_trio.core import compression
from kserve_trio.core.errors import InvalidArgument, ResourceExhausted, StatusCode
from kserve_trio.serving.grpc._headers import Headers, custom_metadata, header_value
from kserve_trio.serving.grpc._messages import (
    Limits,
    RawMessage,
    reply_encoding,
    reply_pieces,
)
from kserve_trio.serving.grpc._status import encode_message

if TYPE_CHECKING:
    from kserve_trio.serving.grpc._connection import Connection

JOIN_BYTES = 256 << 10
"""Up to this size a reply is joined into one ``bytes`` and queued as one frame when it fits;
from this size up each payload is framed from its own buffer (joining 256 KiB costs about one
more h2 ``send_data`` call)."""
SEND_BATCH_BYTES = 1 << 20
"""How much DATA a framed reply queues before it waits for the socket write."""

_PREFIX = struct.Struct(">BI")
_CONTENT_TYPE = ("content-type", "application/grpc+proto")
_OK_TRAILERS = [("grpc-status", "0")]


class CallClosed(Exception):
    """The stream can take no more: the client reset it, the connection is gone, or the call
    already ended."""


class Call:
    """One call as its handler sees it (module docstring)."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_data_event",
        "_metadata",
        "_need",
        "_send_lock",
        "_unacked",
        "_window_event",
        "closed",
        "deadline",
        "deadline_ns",
        "encoding",
        "expired",
        "headers",
        "headers_sent",
        "inbound_done",
        "limits",
        "method",
        "path",
        "reset",
        "rpc",
        "scope",
        "stream_id",
    )

    def __init__(
        self,
        conn: Connection,
        stream_id: int,
        path: str,
        headers: Headers,
        encoding: str,
        limits: Limits,
        rpc: str,
        method: Any = None,
    ) -> None:
        self._conn = conn
        self.stream_id = stream_id
        self.path = path
        self.headers = headers
        self.encoding = encoding
        self.limits = limits
        self.rpc = rpc
        self.method = method
        self.deadline: float | None = None
        self.deadline_ns = 0
        self.scope: anyio.CancelScope | None = None
        self._metadata: dict[str, str | bytes] | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._unacked = 0
        self._need = 0
        self._data_event: anyio.Event | None = None
        self._window_event: anyio.Event | None = None
        self._send_lock: anyio.Lock | None = None
        self.inbound_done = False
        self.reset = False
        self.expired = False
        self.headers_sent = False
        self.closed = False

    # ---------------------------------------------------------------- what the handler reads

    @property
    def metadata(self) -> dict[str, str | bytes]:
        """The caller's custom metadata (``-bin`` values as bytes; ``grpc-*`` left out)."""
        if self._metadata is None:
            self._metadata = custom_metadata(self.headers)
        return self._metadata

    @property
    def peer(self) -> str:
        """The client's address as ``host:port`` (empty when the stream does not say)."""
        return self._conn.peer()

    def header(self, name: str) -> str | None:
        """The first value of request header ``name``."""
        return header_value(self.headers, name)

    def reply_encoding(self, request_encoding: str | None = None) -> str:
        """The algorithm replies are compressed with (``request_encoding``: what the request
        message was compressed with; default: the call's ``grpc-encoding``)."""
        encoding = self.encoding if request_encoding is None else request_encoding
        return reply_encoding(encoding, self.header("grpc-accept-encoding"), self.limits)

    # ---------------------------------------------------------------- receiving (rules 1-4)

    def _feed(self, data: bytes, flow_length: int) -> None:
        """A DATA frame's payload for this call (from the connection's read loop)."""
        if data:
            self._chunks.append(data)
            self._buffered += len(data)
        if self._buffered <= max(self._conn.settings.limits.stream_window_bytes, self._need):
            self._conn.acknowledge(flow_length + self._unacked, self.stream_id)
            self._unacked = 0
        else:
            self._unacked += flow_length
        self._wake_reader()

    def _end_inbound(self) -> None:
        self.inbound_done = True
        self._wake_reader()

    def _wake_reader(self) -> None:
        event = self._data_event
        if event is not None:
            self._data_event = None
            event.set()

    def _wake_sender(self) -> None:
        event = self._window_event
        if event is not None:
            self._window_event = None
            event.set()

    def _on_reset(self) -> None:
        """The client reset the stream, or the connection is gone."""
        self.reset = True
        self.closed = True
        if self.scope is not None:  # first: a waiter woken before it would miss the cancel
            self.scope.cancel()
        self._wake_reader()
        self._wake_sender()

    def _expire(self) -> None:
        """The call's deadline has passed (from the connection's timer)."""
        if self.closed:
            return
        self.expired = True
        if self.scope is not None:
            self.scope.cancel()

    def _release(self) -> int:
        """Drop what was buffered and not read; the flow-control bytes still owed to the
        connection window (the connection acknowledges them)."""
        owed = self._unacked
        self._chunks = []
        self._buffered = 0
        self._unacked = 0
        return owed

    async def _read(self, n: int) -> bytes | None:
        """Exactly ``n`` buffered bytes, or None when the stream ended (or was reset) first."""
        while self._buffered < n:
            if self.inbound_done or self.reset:
                return None
            self._need = n
            if self._unacked:  # the reader now needs more than the window: let it in
                self._conn.acknowledge(self._unacked, self.stream_id)
                self._unacked = 0
            event = self._data_event = anyio.Event()
            await event.wait()
        self._need = 0
        chunks = self._chunks
        first = chunks[0]
        if len(first) == n:
            del chunks[0]
            data = first
        elif len(first) > n:
            chunks[0] = first[n:]
            data = first[:n]
        else:
            got: list[bytes] = []
            size = 0
            while size < n:
                chunk = chunks[0]
                take = n - size
                if len(chunk) <= take:
                    got.append(chunk)
                    size += len(chunk)
                    del chunks[0]
                else:
                    got.append(chunk[:take])
                    chunks[0] = chunk[take:]
                    size = n
            data = b"".join(got)
        self._buffered -= n
        if self._unacked and self._buffered <= self._conn.settings.limits.stream_window_bytes:
            self._conn.acknowledge(self._unacked, self.stream_id)
            self._unacked = 0
        return data

    async def receive(self) -> RawMessage | None:
        """The next request message, or None when the client has ended its side (rules 1-3)."""
        prefix = await self._read(5)
        if prefix is None:
            if self._buffered:
                raise InvalidArgument(
                    "truncated request: the stream ended inside the 5-byte gRPC message prefix"
                )
            return None
        flag, length = _PREFIX.unpack(prefix)
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
            got = await self._read(length)
            if got is None:
                raise InvalidArgument(
                    f"truncated request: the stream ended inside the {length}-byte message "
                    "its prefix announced"
                )
            data = got
        return RawMessage(data, bool(flag))

    def plain(self, message: RawMessage) -> bytes | bytearray:
        """``message`` uncompressed (rule 3's cap applies to what it inflates to)."""
        if not message.compressed:
            return message.data
        return compression.decompress(message.data, self.encoding, self.limits.max_recv_bytes)

    # ---------------------------------------------------------------- sending (rules 5-7)

    def _response_headers(self, encoding: str) -> list[tuple[str, str]]:
        headers = [(":status", "200"), _CONTENT_TYPE]
        if encoding != compression.IDENTITY:
            headers.append(("grpc-encoding", encoding))
            headers.append(("grpc-accept-encoding", compression.ACCEPT_ENCODING))
        return headers

    async def send(self, reply: Any, *, encoding: str = compression.IDENTITY) -> None:
        """Send one reply message (rules 5-6); the call stays open."""
        await self._send(reply, encoding, last=False)

    async def send_last(self, reply: Any, *, encoding: str = compression.IDENTITY) -> None:
        """Send a unary call's reply and end the call OK (rules 5-6)."""
        await self._send(reply, encoding, last=True)

    async def _send(self, reply: Any, encoding: str, *, last: bool) -> None:
        pieces, length = reply_pieces(reply)
        cap = self.limits.max_send_bytes
        if length > cap:
            raise ResourceExhausted(f"response larger than max ({length} vs. {cap})")
        if self.closed:
            raise CallClosed(f"{self.rpc}: the call has ended")
        if encoding != compression.IDENTITY:
            packed = compression.compress(b"".join(pieces), encoding)
            pieces, length, flag = [packed], len(packed), 1
        else:
            flag = 0
        conn = self._conn
        h2conn = conn.h2
        sid = self.stream_id
        try:
            if length <= JOIN_BYTES:
                payload = b"".join([_PREFIX.pack(flag, length), *pieces])
                if len(payload) <= min(
                    h2conn.local_flow_control_window(sid), h2conn.max_outbound_frame_size
                ) and (self._send_lock is None or not self._send_lock.locked()):
                    if conn.backlogged and not last:
                        await conn.drained()
                        if self.closed:
                            raise CallClosed(f"{self.rpc}: the call has ended")
                    if not self.headers_sent:
                        h2conn.send_headers(sid, self._response_headers(encoding))
                        self.headers_sent = True
                    if last:
                        h2conn.send_data(sid, payload)
                        h2conn.send_headers(sid, _OK_TRAILERS, end_stream=True)
                        self.closed = True
                    else:
                        h2conn.send_data(sid, payload)
                    conn.want_write()
                    return
                buffers: list[Any] = [payload]
            else:
                buffers = [_PREFIX.pack(flag, length), *pieces]
            if self._send_lock is None:
                self._send_lock = anyio.Lock()
            async with self._send_lock:
                if self.closed:
                    raise CallClosed(f"{self.rpc}: the call has ended")
                if not self.headers_sent:
                    h2conn.send_headers(sid, self._response_headers(encoding))
                    self.headers_sent = True
                await self._send_framed(buffers)
                if last:
                    h2conn.send_headers(sid, _OK_TRAILERS, end_stream=True)
                    self.closed = True
                conn.want_write()
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError) as exc:
            self.closed = True
            raise CallClosed(f"{self.rpc}: the stream is closed ({exc})") from None

    async def _send_framed(self, buffers: list[Any]) -> None:
        """DATA frames sliced from ``buffers`` within flow control (rule 6)."""
        conn = self._conn
        h2conn = conn.h2
        sid = self.stream_id
        queued = 0
        for buffer in buffers:
            view = memoryview(buffer)
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
            pos, end = 0, view.nbytes
            while pos < end:
                if self.reset:
                    raise CallClosed(f"{self.rpc}: the client reset the stream")
                window = h2conn.local_flow_control_window(sid)
                if window <= 0:
                    if queued:
                        conn.want_write()
                        queued = 0
                    event = self._window_event = anyio.Event()
                    await event.wait()
                    continue
                n = min(window, h2conn.max_outbound_frame_size, end - pos)
                h2conn.send_data(sid, view[pos : pos + n])
                pos += n
                queued += n
                if queued >= SEND_BATCH_BYTES:
                    conn.want_write()
                    await conn.drained()
                    queued = 0

    def finish(
        self,
        status: StatusCode,
        message: str = "",
        extra: Headers = (),
    ) -> None:
        """End the call with ``status`` (rule 7); nothing happens when it has ended already."""
        if self.closed:
            return
        self.closed = True
        trailers: list[tuple[str, str]] = (
            [] if self.headers_sent else [(":status", "200"), _CONTENT_TYPE]
        )
        trailers.append(("grpc-status", str(int(status))))
        if message:
            trailers.append(("grpc-message", encode_message(message)))
        trailers.extend(extra)
        try:
            self._conn.h2.send_headers(self.stream_id, trailers, end_stream=True)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            return
        self.headers_sent = True
        self._conn.want_write()


__all__ = ["JOIN_BYTES", "SEND_BATCH_BYTES", "Call", "CallClosed"]

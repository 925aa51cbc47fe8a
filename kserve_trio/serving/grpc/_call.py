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
   handler reads them, so a client cannot make a slow handler buffer without bound. What a call
   holds beyond the message it is reading counts in its connection's inbound buffer, which
   stops reading the socket at ``limits.max_connection_buffer_bytes``.
5. Once its length is known a message is charged to the process's bytes in flight
   (``Limits.inflight``) until its request is done (``done_with``, or the call's end): past the
   cap a unary call is refused RESOURCE_EXHAUSTED and a stream's message waits
   (``receive(wait=True)``). A message whose first bytes have come must be whole within
   ``limits.message_receive_seconds`` (DEADLINE_EXCEEDED, then the stream is reset).
6. A compressed message is inflated on arrival a bounded step at a time
   (``compression.Inflater``), its output charged as it grows (refused past the bytes in
   flight, never waiting for them) and the task yielding between steps, so a bomb neither takes
   more than its cap nor holds the event loop; ``plain`` returns the result (or raises what
   stopped it).

Sending (``send`` for one message, ``send_last`` for a unary reply and the call's end):
7. The send cap (``Limits.max_send_bytes``, on the uncompressed size) is checked before
   anything is sent (RESOURCE_EXHAUSTED).
8. A reply that fits the peer's window and frame size is one DATA frame, queued with the
   response headers (and, for ``send_last``, the OK trailers) so the connection writes them in
   one socket write. A larger one is framed from its own buffers within the peer's flow-control
   window and frame size, written in batches, waiting for WINDOW_UPDATE when the window is
   spent. Concurrent senders on one stream take turns for framed messages. A sender waits while
   its connection has ``limits.max_send_queue_bytes`` queued for the socket; a reply that cannot
   make progress (flow control, the queue) for ``limits.send_stall_seconds`` is reset
   (RST_STREAM CANCEL) and its call cancelled, which releases everything it held.
9. ``finish`` ends the call with a status: trailers-only when nothing was sent yet, trailers
   otherwise, ``grpc-message`` percent-encoded.

Cancellation: the call's handler runs inside ``scope``; RST_STREAM from the client, a lost
connection and the call's deadline cancel it (``expired`` tells the deadline apart).
"""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.lowlevel
import h2.exceptions

from kserve_trio.core import compression
from kserve_trio.core.errors import (
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    ServingError,
    StatusCode,
)
from kserve_trio.core.logging import get_logger
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

log = get_logger("kserve_trio.serving.grpc")

_PREFIX = struct.Struct(">BI")
_CONTENT_TYPE = ("content-type", "application/grpc+proto")
_OK_TRAILERS = [("grpc-status", "0")]


class CallClosed(Exception):
    """The stream can take no more: the client reset it, the connection is gone, or the call
    already ended."""


@dataclass(frozen=True, slots=True)
class InflatedMessage(RawMessage):
    """A compressed message inflated on arrival (rule 6): ``plain_data``, or the ``problem``
    that stopped it (raised by ``Call.plain``)."""

    plain_data: bytes = b""
    problem: ServingError | None = None


class Call:
    """One call as its handler sees it (module docstring)."""

    __slots__ = (
        "_buffered",
        "_charged",
        "_chunks",
        "_conn",
        "_data_event",
        "_excess",
        "_message_by",
        "_metadata",
        "_need",
        "_reserved",
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
        self._reserved = 0  # the length of the charged message being read (rules 4-5)
        self._excess = 0  # what this call counts in its connection's inbound buffer
        self._charged = 0  # bytes charged to the process's bytes in flight
        self._message_by: float | None = None  # the receive deadline of the message arriving
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
            self._recount()
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
        """The client reset the stream, or the connection is gone (or a reply stalled)."""
        self.reset = True
        self.closed = True
        if self.scope is not None:  # first: a waiter woken before it would miss the cancel
            self.scope.cancel()
        self._wake_reader()
        self._wake_sender()
        self._drop_inbound()

    def _recount(self) -> None:
        """Rule 4: tell the connection what this call holds beyond the message it reads."""
        excess = self._buffered - self._reserved
        if excess < 0:
            excess = 0
        if excess != self._excess:
            self._conn.inbound_changed(excess - self._excess)
            self._excess = excess

    def _drop_inbound(self) -> None:
        """Forget what was buffered and give back every byte charged (the call is over)."""
        self._chunks = []
        self._buffered = 0
        self._reserved = 0
        self._recount()
        self._uncharge(self._charged)

    def done_with(self, message: RawMessage) -> None:
        """Rule 5: the request ``message`` carried is done (a stream's; a unary call's message
        is given back at the call's end): its bytes leave the process's bytes in flight."""
        n = len(message.data)
        if isinstance(message, InflatedMessage):
            n += len(message.plain_data)
        self._uncharge(n)

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
        self._unacked = 0
        self._drop_inbound()
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
            if self._buffered or self._reserved:  # a message has begun to arrive (rule 5)
                await self._wait_for_message(event)
            else:
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
        self._recount()
        if self._unacked and self._buffered <= self._conn.settings.limits.stream_window_bytes:
            self._conn.acknowledge(self._unacked, self.stream_id)
            self._unacked = 0
        return data

    async def _wait_for_message(self, event: anyio.Event) -> None:
        """Wait for more of a message that has begun to arrive, within its receive deadline."""
        by = self._message_by
        if by is None:
            seconds = self._conn.settings.limits.message_receive_seconds
            if not seconds:
                await event.wait()
                return
            by = self._message_by = anyio.current_time() + seconds
        with anyio.CancelScope(deadline=by) as scope:
            await event.wait()
        if scope.cancelled_caught:
            seconds = self._conn.settings.limits.message_receive_seconds
            raise DeadlineExceeded(
                "",
                f"the request message was not received within {seconds:g} s "
                "(limits.message_receive_seconds)",
            )

    async def receive(self, *, wait: bool = False) -> RawMessage | None:
        """The next request message, or None when the client has ended its side (rules 1-6).

        ``wait``: past the process's bytes in flight the message waits for room (a stream's
        backpressure) instead of being refused RESOURCE_EXHAUSTED (a unary call).
        """
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
            budget = self.limits.inflight
            if budget is not None:  # rule 5, inline: no coroutine per message on this path
                if wait:
                    await budget.charge_waiting(length)
                else:
                    budget.charge(length)
                self._charged += length
            self._reserved = length
            self._recount()
            got = await self._read(length)
            if got is None:
                raise InvalidArgument(
                    f"truncated request: the stream ended inside the {length}-byte message "
                    "its prefix announced"
                )
            data = got
            self._reserved = 0
            self._recount()
        self._message_by = None  # (an error above ends the call, and with it all of this)
        if flag:
            return await self._inflate(data)
        return RawMessage(data, False)

    def _charge(self, n: int, own: int) -> None:
        """Rule 5: ``n`` more bytes of a message that has charged ``own`` already."""
        budget = self.limits.inflight
        if budget is not None:
            budget.charge(n, own)
            self._charged += n

    async def _inflate(self, data: bytes) -> InflatedMessage:
        """Rule 6: ``data`` inflated step by step, charged as it grows, yielding between steps.

        The steps never wait for room in the bytes in flight (two messages inflating at once
        could wait for each other for good): past it the message is refused, RESOURCE_EXHAUSTED
        when ``plain`` is asked for it, a stream's one included.
        """
        inflater = compression.Inflater(data, self.encoding, self.limits.max_recv_bytes)
        grown = 0
        try:
            while not inflater.done:
                n = inflater.step()
                if n:
                    self._charge(n, own=len(data) + grown)
                    grown += n
                if not inflater.done:
                    await anyio.lowlevel.checkpoint()  # the other connections meanwhile
            return InflatedMessage(data, True, inflater.result())
        except ServingError as exc:
            del inflater  # the pieces go before the error answer is made
            self._uncharge(grown)
            return InflatedMessage(data, True, b"", exc)

    def _uncharge(self, n: int) -> None:
        n = min(n, self._charged)
        if n:
            self._charged -= n
            budget = self.limits.inflight
            if budget is not None:
                budget.release(n)

    def plain(self, message: RawMessage) -> bytes | bytearray:
        """``message`` uncompressed (rule 3's cap applies to what it inflates to)."""
        if not message.compressed:
            return message.data
        if isinstance(message, InflatedMessage):
            if message.problem is not None:
                raise message.problem
            return message.plain_data
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
                if self._send_lock is None or not self._send_lock.locked():
                    if conn.send_queue_full():
                        await self._progress(conn.send_room)
                    elif conn.backlogged and not last:
                        await self._progress(conn.drained)
                    if self.closed:
                        raise CallClosed(f"{self.rpc}: the call has ended")
                if len(payload) <= min(
                    h2conn.local_flow_control_window(sid), h2conn.max_outbound_frame_size
                ) and (self._send_lock is None or not self._send_lock.locked()):
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
                if window <= 0 or conn.send_queue_full():
                    if queued:
                        conn.want_write()
                        queued = 0
                    if window <= 0:
                        event = self._window_event = anyio.Event()
                        await self._progress(event.wait)
                    else:
                        await self._progress(conn.send_room)
                    continue
                n = min(window, h2conn.max_outbound_frame_size, end - pos)
                h2conn.send_data(sid, view[pos : pos + n])
                pos += n
                queued += n
                if queued >= SEND_BATCH_BYTES:
                    conn.want_write()
                    await self._progress(conn.drained)
                    queued = 0

    async def _progress(self, wait: Callable[[], Awaitable[Any]]) -> None:
        """``wait()`` for the reply to be able to go on (rule 8): within
        ``limits.send_stall_seconds``, or the stream is reset and the call cancelled."""
        stall = self._conn.settings.limits.send_stall_seconds
        if not stall:
            await wait()
            return
        with anyio.move_on_after(stall) as scope:
            await wait()
        if scope.cancelled_caught and not self.closed:
            log.info("send_stalled", rpc=self.rpc, seconds=stall)
            self._conn.reset_stalled(self.stream_id)
            self._on_reset()
            raise CallClosed(f"{self.rpc}: the reply made no progress for {stall:g} s")

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

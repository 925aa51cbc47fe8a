"""One gRPC call: the object every handler of every RPC shape talks to, and its lifecycle.

A ``Call`` is made by its connection when a stream's request headers arrive. It owns that
stream's inbound buffer, and it writes only through its ``CallSink`` (the connection): queue
these headers, this DATA, these trailers, reset the stream. It never sees the HTTP/2 engine.
The same object serves unary calls (typed or raw-bytes messages), server streaming and
bidirectional streaming, so there is one receive path and one send path.

Lifecycle (``CallState``, moved only through ``_TRANSITIONS``):

- ``PENDING``: opened, waiting for a call task;
- ``RUNNING``: its handler runs (in a cancel scope of its own, ``scope``);
- ``EXPIRED``: its deadline passed while it ran: the handler is cancelled and the call will be
  answered DEADLINE_EXCEEDED;
- ``ANSWERED``: its trailers are queued (the end of every call we end ourselves);
- ``RESET``: the stream is gone (the client reset it, a reply stalled, the connection ended):
  nothing more is sent.

Receiving (``receive``), per message:

- *Framing*: a message is a 5-byte prefix (flag, big-endian length) and the payload. A stream
  that ends inside either is malformed (INVALID_ARGUMENT); one that ends before a new prefix
  ends the client's side (``None``). Flag 0 is a plain message, flag 1 a compressed one (which
  needs a ``grpc-encoding``); any other flag is malformed.
- *Receive cap*: the announced length is checked against ``Limits.max_recv_bytes`` before the
  payload is buffered (RESOURCE_EXHAUSTED); ``plain`` bounds what a compressed payload
  inflates to by the same cap.
- *Bounded buffering*: received bytes are acknowledged to the client's flow-control windows as
  they arrive while the call holds at most one window (or the message it waits for) unread;
  beyond that only as the handler reads them, so a client cannot make a slow handler buffer
  without bound. What a call holds beyond the message it is reading counts in its connection's
  inbound buffer, which stops reading the socket at ``limits.max_connection_buffer_bytes``.
- *Bytes in flight*: a message's bytes are charged to the process's bytes in flight
  (``Limits.inflight``) as they arrive, never as its prefix announces them (an announcement
  alone, 23 bytes on the wire, holds nothing), until its request is done (``done_with``, or the
  call's end): past the cap a unary call is refused RESOURCE_EXHAUSTED and a stream's message
  waits (``receive(wait=True)``). What has arrived and could not be charged yet counts in the
  connection's inbound buffer, so a waiting stream holds its client back. A message whose
  first bytes have come must be whole within ``limits.message_receive_seconds``
  (DEADLINE_EXCEEDED, then the stream is reset).
- *Connection share*: before its arrived bytes are charged, a message still arriving asks its
  connection's share of the bytes in flight (``admission.ConnectionShare``,
  ``limits.max_inflight_bytes_per_connection``); at the share it waits, unary or stream,
  within its receive deadline, its bytes uncharged (so the connection's inbound buffer stops
  the socket), until the connection's other messages are whole or it takes the lane. Once
  whole, its bytes leave the share (they stay charged until its request is done).
- *Stepwise inflation*: a compressed message is inflated on arrival a bounded step at a time
  (``Inflater``), its output charged as it grows (refused past the bytes in flight,
  never waiting for them) and the task yielding between steps, so a bomb neither takes more
  than its cap nor holds the event loop; ``plain`` returns the result (or raises what stopped
  it).

Sending (``send`` for one message, ``send_last`` for a unary reply and the call's end):

- *Send cap*: ``Limits.max_send_bytes`` (on the uncompressed size) is checked before anything
  is queued (RESOURCE_EXHAUSTED).
- *One queue*: the reply is queued in the engine whole (headers, DATA, trailers for
  ``send_last``), its buffers as they are, and the engine frames it within the client's flow
  control; the connection writes what a loop turn queued in one socket write.
- *Bounded sending*: before a reply is queued the sender waits while its connection has
  ``limits.max_send_queue_bytes`` queued for the socket; after, it waits while more than
  ``SEND_BATCH_BYTES`` of its stream are still queued, and a unary reply's end waits while
  any of it is held back by the client's windows (a reply the windows admit never waits: it
  goes out with the connection's next write). A wait that sees no progress for
  ``limits.send_stall_seconds`` resets the stream (RST_STREAM CANCEL), which releases
  everything the call held.
- *Status*: ``finish`` ends the call with a status: trailers-only when nothing was sent yet,
  trailers otherwise (``core.protocol.grpc_wire.status_trailers``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.lowlevel

from kserve_trio.core.errors import (
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    ServingError,
    StatusCode,
)
from kserve_trio.core.logging import get_logger
from kserve_trio.core.process import EdgeLimits
from kserve_trio.core.protocol import (
    ACCEPT_ENCODING,
    IDENTITY,
    OK_TRAILERS,
    PREFIX,
    PREFIX_BYTES,
    RESPONSE_HEADERS,
    Inflater,
    compress,
    custom_metadata,
    decompress,
    message_prefix,
    status_trailers,
)
from kserve_trio.serving.grpc._headers import Headers, header_value
from kserve_trio.serving.grpc._messages import Limits, RawMessage, reply_encoding
from kserve_trio.serving.rpc_codec import reply_pieces

if TYPE_CHECKING:
    from kserve_trio.serving.admission import ConnectionShare, InflightBytes

JOIN_BYTES = 256 << 10
"""Up to this size a reply's pieces are joined into one ``bytes`` with its prefix (one DATA
frame when it fits); from this size up each piece is queued as its own buffer, uncopied."""
SEND_BATCH_BYTES = 256 << 10
"""How much of a stream's DATA may wait in the engine (for the client's window, or the next
write) before its sender waits for it to go."""

log = get_logger("kserve_trio.serving.grpc")

_ACCEPT_ENCODING = ACCEPT_ENCODING.encode("ascii")


class CallClosed(Exception):
    """The stream can take no more: the client reset it, the connection is gone, or the call
    already ended."""


class CallState(enum.IntEnum):
    """Where a call is in its life (module docstring). (Integers: the transition table is
    looked up on every move, and an ``IntEnum`` hashes as fast as an ``int``.)"""

    PENDING = 0
    RUNNING = 1
    EXPIRED = 2
    ANSWERED = 3
    RESET = 4


class CallEvent(enum.IntEnum):
    """What moves a call from one state to the next."""

    START = 0
    EXPIRE = 1
    ANSWER = 2
    RESET = 3


_P, _R, _X = CallState.PENDING, CallState.RUNNING, CallState.EXPIRED
_TRANSITIONS: dict[tuple[CallState, CallEvent], CallState] = {
    (_P, CallEvent.START): _R,
    (_P, CallEvent.EXPIRE): _X,
    (_P, CallEvent.ANSWER): CallState.ANSWERED,
    (_P, CallEvent.RESET): CallState.RESET,
    (_R, CallEvent.EXPIRE): _X,
    (_R, CallEvent.ANSWER): CallState.ANSWERED,
    (_R, CallEvent.RESET): CallState.RESET,
    (_X, CallEvent.ANSWER): CallState.ANSWERED,
    (_X, CallEvent.RESET): CallState.RESET,
    (CallState.ANSWERED, CallEvent.RESET): CallState.RESET,
}
"""Every move a call can make; any other is ignored (an expiry after the answer, a second
answer, a reset of a reset stream)."""


class CallSink(Protocol):
    """What a call asks of its connection: the narrow way out (module docstring)."""

    limits: EdgeLimits

    def queue_headers(self, stream_id: int, block: list[tuple[bytes, bytes]], end: bool) -> None:
        """Queue a header block (response headers, or trailers-only with ``end``)."""
        ...

    def queue_data(self, stream_id: int, data: bytes | memoryview) -> None: ...

    def queue_trailers(self, stream_id: int, block: list[tuple[bytes, bytes]]) -> None: ...

    def reset(self, stream_id: int, stalled: bool = False) -> None:
        """RST_STREAM (CANCEL); ``stalled``: a reply made no progress (counted and logged)."""
        ...

    def pending(self, stream_id: int) -> int:
        """DATA of ``stream_id`` queued in the engine and not yet framed."""
        ...

    def blocked(self, stream_id: int) -> bool:
        """Whether DATA of ``stream_id`` waits for the client's flow-control windows (rather
        than for the connection's next write)."""
        ...

    def send_queue_full(self) -> bool:
        """Whether ``limits.max_send_queue_bytes`` are queued for the socket."""
        ...

    def queued_bytes(self) -> int:
        """Bytes queued for the socket and not yet written (the engine's and the transport's)."""
        ...

    async def progress(self) -> None:
        """Return once something queued has moved to the socket (or the windows grew)."""
        ...

    def acknowledge(self, stream_id: int, n: int) -> None: ...

    def share(self, budget: InflightBytes) -> ConnectionShare:
        """The connection's share of ``budget`` (*connection share*)."""
        ...

    def inbound_changed(self, delta: int) -> None: ...

    def peer(self) -> str: ...


@dataclass(frozen=True, slots=True)
class InflatedMessage(RawMessage):
    """A compressed message inflated on arrival (*stepwise inflation*): ``plain_data``, or the
    ``problem`` that stopped it (raised by ``Call.plain``)."""

    plain_data: bytes = b""
    problem: ServingError | None = None


class Call:
    """One call as its handler sees it (module docstring)."""

    __slots__ = (
        "_buffered",
        "_charged",
        "_chunks",
        "_data_event",
        "_excess",
        "_message_by",
        "_metadata",
        "_need",
        "_reserved",
        "_send_lock",
        "_share",
        "_sink",
        "_unacked",
        "deadline",
        "deadline_ns",
        "encoding",
        "headers",
        "headers_sent",
        "inbound_done",
        "limits",
        "path",
        "rpc",
        "scope",
        "state",
        "stream_id",
    )

    def __init__(
        self,
        sink: CallSink,
        stream_id: int,
        path: str,
        headers: Headers,
        encoding: str,
        limits: Limits,
        rpc: str,
    ) -> None:
        self._sink = sink
        self.stream_id = stream_id
        self.path = path
        self.headers = headers
        self.encoding = encoding
        self.limits = limits
        self.rpc = rpc
        self.state = CallState.PENDING
        self.deadline: float | None = None
        """When the call expires, on the connection's clock (None: no deadline)."""
        self.deadline_ns = 0
        """The same moment as ``time.monotonic_ns()`` (0: none): what handlers are given."""
        self.scope: anyio.CancelScope | None = None
        self._metadata: dict[str, str | bytes] | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._unacked = 0
        self._need = 0
        self._reserved = 0  # the bytes of the message being read charged so far
        self._excess = 0  # what this call counts in its connection's inbound buffer
        self._charged = 0  # bytes charged to the process's bytes in flight
        self._share: ConnectionShare | None = None  # where ``_reserved`` counts, once charged
        self._message_by: float | None = None  # the receive deadline of the message arriving
        self._data_event: anyio.Event | None = None
        self._send_lock: anyio.Lock | None = None
        self.inbound_done = False
        self.headers_sent = False

    # ---------------------------------------------------------------- lifecycle

    def move(self, event: CallEvent) -> bool:
        """Apply ``event`` (``_TRANSITIONS``); whether the state changed."""
        after = _TRANSITIONS.get((self.state, event))
        if after is None:
            return False
        self.state = after
        return True

    @property
    def closed(self) -> bool:
        """Nothing more can be sent: the call was answered or its stream is gone."""
        state = self.state
        return state is CallState.ANSWERED or state is CallState.RESET

    @property
    def reset(self) -> bool:
        """The stream is gone (the client reset it, a reply stalled, the connection ended)."""
        return self.state is CallState.RESET

    @property
    def expired(self) -> bool:
        return self.state is CallState.EXPIRED

    def expire(self) -> None:
        """The deadline has passed (from the connection's timer): the handler is cancelled."""
        if self.move(CallEvent.EXPIRE) and self.scope is not None:
            self.scope.cancel()

    def on_reset(self) -> None:
        """The stream is gone: the handler is cancelled and what it held is released."""
        if not self.move(CallEvent.RESET):
            return
        if self.scope is not None:  # first: a waiter woken before it would miss the cancel
            self.scope.cancel()
        self._wake_reader()
        self._drop_inbound()

    # ---------------------------------------------------------------- what the handler reads

    @property
    def metadata(self) -> dict[str, str | bytes]:
        """The caller's custom metadata (``-bin`` values as bytes; ``grpc-*`` left out)."""
        if self._metadata is None:
            self._metadata = custom_metadata(self.headers)
        return self._metadata

    @property
    def peer(self) -> str:
        """The client's address as ``host:port`` (empty when the transport does not say)."""
        return self._sink.peer()

    def header(self, name: str) -> str | None:
        """The first value of request header ``name``."""
        return header_value(self.headers, name)

    def reply_encoding(self, request_encoding: str | None = None) -> str:
        """The algorithm replies are compressed with (``request_encoding``: what the request
        message was compressed with; default: the call's ``grpc-encoding``)."""
        encoding = self.encoding if request_encoding is None else request_encoding
        return reply_encoding(encoding, self.header("grpc-accept-encoding"), self.limits)

    # ---------------------------------------------------------------- receiving

    def feed(self, data: bytes, flow_length: int) -> None:
        """A DATA payload for this call (from the connection)."""
        if data:
            self._chunks.append(data)
            self._buffered += len(data)
            self._recount()
        if self._buffered <= max(self._sink.limits.stream_window_bytes, self._need):
            if flow_length + self._unacked:
                self._sink.acknowledge(self.stream_id, flow_length + self._unacked)
            self._unacked = 0
        else:
            self._unacked += flow_length
        self._wake_reader()

    def end_inbound(self) -> None:
        """The client has ended its side."""
        self.inbound_done = True
        self._wake_reader()

    def _wake_reader(self) -> None:
        event = self._data_event
        if event is not None:
            self._data_event = None
            event.set()

    def _recount(self) -> None:
        """*Bounded buffering*: tell the connection what this call holds beyond the message
        it reads."""
        excess = self._buffered - self._reserved
        if excess < 0:
            excess = 0
        if excess != self._excess:
            self._sink.inbound_changed(excess - self._excess)
            self._excess = excess

    def _drop_inbound(self) -> None:
        """Forget what was buffered and give back every byte charged (the call is over)."""
        self._chunks = []
        self._buffered = 0
        self._message_whole()
        self._uncharge(self._charged)

    def done_with(self, message: RawMessage) -> None:
        """*Bytes in flight*: the request ``message`` carried is done (a stream's; a unary
        call's message is given back at the call's end)."""
        n = len(message.data)
        if isinstance(message, InflatedMessage):
            n += len(message.plain_data)
        self._uncharge(n)

    def release(self) -> int:
        """Drop what was buffered and not read; the flow-control bytes still owed to the
        connection window (the connection acknowledges them)."""
        owed = self._unacked
        self._unacked = 0
        self._drop_inbound()
        return owed

    async def _read(self, n: int, *, charged: bool = False, wait: bool = False) -> bytes | None:
        """Exactly ``n`` buffered bytes, or None when the stream ended (or was reset) first.
        ``charged``: they are a message's, charged to the bytes in flight as they arrive
        (``wait``: waiting for room rather than refused)."""
        while self._buffered < n:
            if charged:
                await self._charge_arrived(n, wait)
                if self._buffered >= n:
                    break  # the rest (and maybe the stream's end) came while the charge waited
            if self.inbound_done or self.state is CallState.RESET:
                return None
            self._need = n
            if self._unacked:  # the reader now needs more than the window: let it in
                self._sink.acknowledge(self.stream_id, self._unacked)
                self._unacked = 0
            event = self._data_event = anyio.Event()
            if charged or self._buffered:  # a message has begun to arrive (its prefix came)
                await self._wait_for_message(event)
            else:
                await event.wait()
        if charged:
            await self._charge_arrived(n, wait)
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
        if self._unacked and self._buffered <= self._sink.limits.stream_window_bytes:
            self._sink.acknowledge(self.stream_id, self._unacked)
            self._unacked = 0
        return data

    async def _charge_arrived(self, n: int, wait: bool) -> None:
        """*Bytes in flight*: charge what has arrived of the ``n``-byte message being read and
        is not charged yet; the charged part leaves the connection's inbound count."""
        arrived = min(self._buffered, n)
        delta = arrived - self._reserved
        if delta <= 0:
            return
        budget = self.limits.inflight
        if budget is not None:
            share = self._share
            if share is None:
                share = self._share = self._sink.share(budget)
            if not share.fits(delta):
                await self._wait_share(share, delta)  # (what comes meanwhile: charged next)
            share.add(delta)
            try:
                if wait:
                    await budget.charge_waiting(delta, own=self._reserved)
                else:
                    budget.charge(delta, own=self._reserved)
            except BaseException:
                share.give(delta)
                raise
            self._charged += delta
            arrived = self._reserved + delta
        self._reserved = arrived
        self._recount()

    async def _wait_share(self, share: ConnectionShare, n: int) -> None:
        """*Connection share*: wait until ``n`` more bytes of this message fit the connection's
        share, within the message's receive deadline."""
        by = self._message_deadline()
        if by is None:
            await share.wait(n)
            return
        with anyio.CancelScope(deadline=by) as scope:
            await share.wait(n)
        if scope.cancelled_caught:
            raise self._late()

    def _message_whole(self) -> None:
        """The message being read is whole (or gone): its bytes leave the connection's share
        and its inbound count."""
        if self._share is not None and self._reserved:
            self._share.give(self._reserved)
        self._reserved = 0
        self._recount()

    def _message_deadline(self) -> float | None:
        """When the message that has begun to arrive must be whole (None: no limit)."""
        by = self._message_by
        if by is None:
            seconds = self._sink.limits.message_receive_seconds
            if not seconds:
                return None
            by = self._message_by = anyio.current_time() + seconds
        return by

    def _late(self) -> DeadlineExceeded:
        seconds = self._sink.limits.message_receive_seconds
        return DeadlineExceeded(
            "",
            f"the request message was not received within {seconds:g} s "
            "(limits.message_receive_seconds)",
        )

    async def _wait_for_message(self, event: anyio.Event) -> None:
        """Wait for more of a message that has begun to arrive, within its receive deadline."""
        by = self._message_deadline()
        if by is None:
            await event.wait()
            return
        with anyio.CancelScope(deadline=by) as scope:
            await event.wait()
        if scope.cancelled_caught:
            raise self._late()

    async def receive(self, *, wait: bool = False) -> RawMessage | None:
        """The next request message, or None when the client has ended its side (module
        docstring: *framing* to *stepwise inflation*).

        ``wait``: past the process's bytes in flight the message waits for room (a stream's
        backpressure) instead of being refused RESOURCE_EXHAUSTED (a unary call).
        """
        prefix = await self._read(PREFIX_BYTES)
        if prefix is None:
            if self._buffered:
                raise InvalidArgument(
                    "truncated request: the stream ended inside the 5-byte gRPC message prefix"
                )
            return None
        flag, length = PREFIX.unpack(prefix)
        if flag > 1:
            raise InvalidArgument(f"malformed gRPC message prefix: compressed flag {flag}")
        if flag and self.encoding == IDENTITY:
            raise InvalidArgument(
                "a compressed message arrived without a grpc-encoding naming its algorithm"
            )
        cap = self.limits.max_recv_bytes
        if length > cap:
            raise ResourceExhausted(f"received message larger than max ({length} vs. {cap})")
        data = b""
        if length:
            got = await self._read(length, charged=True, wait=wait)
            if got is None:
                raise InvalidArgument(
                    f"truncated request: the stream ended inside the {length}-byte message "
                    "its prefix announced"
                )
            data = got
            self._message_whole()
        self._message_by = None  # (an error above ends the call, and with it all of this)
        if flag:
            return await self._inflate(data)
        return RawMessage(data, False)

    def _charge(self, n: int, own: int) -> None:
        """*Bytes in flight*: ``n`` more bytes of a message that has charged ``own``."""
        budget = self.limits.inflight
        if budget is not None:
            budget.charge(n, own)
            self._charged += n

    async def _inflate(self, data: bytes) -> InflatedMessage:
        """*Stepwise inflation*: ``data`` inflated step by step, charged as it grows, yielding
        between steps.

        The steps never wait for room in the bytes in flight (two messages inflating at once
        could wait for each other for good): past it the message is refused, RESOURCE_EXHAUSTED
        when ``plain`` is asked for it, a stream's one included.
        """
        inflater = Inflater(data, self.encoding, self.limits.max_recv_bytes)
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
        """``message`` uncompressed (the *receive cap* applies to what it inflates to)."""
        if not message.compressed:
            return message.data
        if isinstance(message, InflatedMessage):
            if message.problem is not None:
                raise message.problem
            return message.plain_data
        return decompress(message.data, self.encoding, self.limits.max_recv_bytes)

    # ---------------------------------------------------------------- sending

    def _response_headers(self, encoding: str) -> list[tuple[bytes, bytes]]:
        headers = list(RESPONSE_HEADERS)
        if encoding != IDENTITY:
            headers.append((b"grpc-encoding", encoding.encode("ascii")))
            headers.append((b"grpc-accept-encoding", _ACCEPT_ENCODING))
        return headers

    async def send(self, reply: Any, *, encoding: str = IDENTITY) -> None:
        """Send one reply message; the call stays open."""
        await self._send(reply, encoding, last=False)

    async def send_last(self, reply: Any, *, encoding: str = IDENTITY) -> None:
        """Send a unary call's reply and end the call OK."""
        await self._send(reply, encoding, last=True)

    async def _send(self, reply: Any, encoding: str, *, last: bool) -> None:
        pieces, length = reply_pieces(reply)
        cap = self.limits.max_send_bytes
        if length > cap:
            raise ResourceExhausted(f"response larger than max ({length} vs. {cap})")
        if encoding != IDENTITY:
            packed = compress(b"".join(pieces), encoding)
            pieces, length, compressed = [packed], len(packed), True
        else:
            compressed = False
        prefix = message_prefix(compressed, length)
        buffers: list[Any] = (
            [b"".join([prefix, *pieces])] if length <= JOIN_BYTES else [prefix, *pieces]
        )
        lock = self._send_lock
        if lock is None and not last:
            lock = self._send_lock = anyio.Lock()  # a stream's concurrent senders take turns
        if lock is not None:
            async with lock:
                await self._queue(buffers, encoding, last)
        else:
            await self._queue(buffers, encoding, last)

    async def _queue(self, buffers: list[Any], encoding: str, last: bool) -> None:
        """*One queue* and *bounded sending* for one reply."""
        sink = self._sink
        sid = self.stream_id
        if sink.send_queue_full():
            await self._progress(lambda: not sink.send_queue_full(), sink.queued_bytes)
        if self.closed or self.state is CallState.EXPIRED:
            raise CallClosed(f"{self.rpc}: the call has ended")
        if not self.headers_sent:
            self.headers_sent = True
            sink.queue_headers(sid, self._response_headers(encoding), False)
        for buffer in buffers:
            sink.queue_data(sid, buffer)
        if last:
            self.move(CallEvent.ANSWER)
            sink.queue_trailers(sid, OK_TRAILERS)
            if sink.blocked(sid):  # the reply's end waits for the client's windows
                await self._progress(lambda: not sink.pending(sid), lambda: sink.pending(sid))
        elif sink.pending(sid) > SEND_BATCH_BYTES:
            await self._progress(
                lambda: sink.pending(sid) <= SEND_BATCH_BYTES, lambda: sink.pending(sid)
            )

    async def _progress(self, done: Callable[[], bool], level: Callable[[], int]) -> None:
        """Wait until ``done()`` (*bounded sending*): ``level()`` going down is progress; none
        for ``limits.send_stall_seconds`` resets the stream and cancels the call."""
        sink = self._sink
        stall = sink.limits.send_stall_seconds or float("inf")
        deadline = anyio.current_time() + stall
        lowest = level()
        while True:
            if self.state is CallState.RESET:  # (a reset also empties the queue waited on)
                # the reset cancelled the handler's scope: that is what the handler sees
                await anyio.lowlevel.checkpoint()
                raise CallClosed(f"{self.rpc}: the stream was reset")
            if done():
                return
            with anyio.CancelScope(deadline=deadline):
                await sink.progress()
            now = level()
            if now < lowest:
                lowest = now
                deadline = anyio.current_time() + stall
            elif anyio.current_time() >= deadline and not done():
                log.info("send_stalled", rpc=self.rpc, seconds=stall)
                sink.reset(self.stream_id, stalled=True)
                self.on_reset()
                raise CallClosed(f"{self.rpc}: the reply made no progress for {stall:g} s")

    def finish(
        self,
        status: StatusCode,
        message: str = "",
        extra: Headers = (),
    ) -> None:
        """End the call with ``status`` (*status*); nothing happens when it has ended already."""
        if not self.move(CallEvent.ANSWER):
            return
        block = status_trailers(status, message, extra, trailers_only=not self.headers_sent)
        if self.headers_sent:
            self._sink.queue_trailers(self.stream_id, block)
        else:
            self.headers_sent = True
            self._sink.queue_headers(self.stream_id, block, True)


__all__ = [
    "JOIN_BYTES",
    "SEND_BATCH_BYTES",
    "Call",
    "CallClosed",
    "CallEvent",
    "CallSink",
    "CallState",
    "InflatedMessage",
]

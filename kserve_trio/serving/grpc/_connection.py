"""One client connection's gRPC protocol, with no I/O: bytes in, calls run, bytes out.

``ServerConnection`` is the core both transports drive. A transport gives it the bytes it reads
(``feed``), takes what is to be written (``data_to_send``) when the connection wakes it, and
awaits ``run`` (the call tasks and the timers, in the connection's own task group). What the
connection asks of its transport is the narrow ``Transport`` protocol: wake the writer, pause
or resume reading, what it still holds unwritten, and stop. HTTP/2 itself is the engine's
(``kserve_trio.http2``): the connection sees only its events and never a frame.

Rules of a call's opening (the engine has refused what HTTP/2 refuses):

- *Refused at once*: a request whose headers are wrong (method, content type, ``te``,
  ``header_problem``, an unknown path) is answered at once, trailers-only, and runs no task.
- *Expired at once*: a request whose ``grpc-timeout`` has already passed is answered
  DEADLINE_EXCEEDED at once.
- *Half-open end*: when a call ends before the client has ended its side, the stream is reset
  (NO_ERROR), and what the call had buffered unread is given back to the connection window.

Timers (one task, one clock: ``anyio.current_time``, so a test's ``MockClock`` drives them
all): every call's deadline (one heap per connection, not a timer per call), the keepalive
PING, the maximum connection age, the drain's phases, and the handshake and idle deadlines.

Defences (``limits``, counted in the server's ``EdgeStats``):

- *Engine rules*: what the engine refuses (``PeerError``) ends the connection with its GOAWAY.
- *Premature resets* (Envoy's rule, ``ResetJudge``): of the recent calls, more than half reset
  by the client right after opening is GOAWAY(ENHANCE_YOUR_CALM).
- *Ping strikes* (grpc-core's rule): a client PING less than ``limits.min_ping_interval_seconds``
  after the previous one with no DATA or HEADERS moved in between is a strike; more than
  ``limits.max_ping_strikes`` is GOAWAY(ENHANCE_YOUR_CALM, ``too_many_pings``).
- *Handshake*: without the client's preface and first SETTINGS ``limits.handshake_seconds``
  after the start, the connection is closed (no GOAWAY: the client has not spoken HTTP/2).
- *Idle*: no call for ``limits.idle_seconds`` is GOAWAY(NO_ERROR), then the close.
- *Eviction* (``evict``, the port's cap full, ``serving.accept``): a connection with no call
  is the port's to close for a new one: GOAWAY(NO_ERROR) when the client has spoken HTTP/2,
  then the close, with no linger, so that its descriptor comes back at once. The connection
  tells its ``Slot`` when it has a call (busy) and when it has none (idle).
- *Memory*: reading pauses while the calls hold ``limits.max_connection_buffer_bytes`` beyond
  the messages they are reading (and a message waiting for the connection's share of the
  bytes in flight, ``limits.max_inflight_bytes_per_connection``, is not charged, so it counts
  there), and senders wait while ``limits.max_send_queue_bytes`` are
  queued for the socket (the engine's queues and the transport's buffer).

Drain (``start_drain``, at shutdown or at the maximum connection age): GOAWAY with the largest
stream id and a PING; once the PING is answered (or after a timeout) the final GOAWAY. The
calls in flight finish, then the connection ends; ``close_calls`` cancels what is left.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import anyio
import anyio.abc

from kserve_trio.core.errors import StatusCode
from kserve_trio.core.logging import get_logger
from kserve_trio.core.protocol import IDENTITY, parse_encoding, parse_timeout, status_trailers
from kserve_trio.http2 import (
    DataReceived,
    ErrorCode,
    GoAwayReceived,
    PeerError,
    PingAcknowledged,
    PingReceived,
    RequestReceived,
    SettingsReceived,
    StreamGone,
    StreamReset,
    TrailersReceived,
    WindowOpened,
    code_name,
    new_engine,
)
from kserve_trio.serving.accept import Slot
from kserve_trio.serving.admission import ConnectionShare, InflightBytes
from kserve_trio.serving.edge_stats import EdgeStats
from kserve_trio.serving.grpc._call import Call, CallState
from kserve_trio.serving.grpc._headers import header_problem, read_request
from kserve_trio.serving.grpc._methods import Method
from kserve_trio.serving.grpc._reset_judge import ResetJudge
from kserve_trio.serving.grpc._runners import CallRunners
from kserve_trio.serving.grpc._settings import ServerSettings, engine_settings

log = get_logger("kserve_trio.serving.grpc")

_DRAIN_PING = b"drain\x00\x00\x00"
_KEEPALIVE_PING = b"alive\x00\x00\x00"
_FLUSH_SECONDS = 1.0
"""How long a connection's end waits for what is queued (a GOAWAY, the last trailers) to go."""
_LINGER_SECONDS = 1.0
"""How long a connection we end with a GOAWAY keeps draining the client's bytes."""
_GRPC_CONTENT_TYPES = ("application/grpc", "application/grpc+proto")
_TOO_MANY_PINGS = b"too_many_pings"
_PREMATURE_RESETS = b"too_many_premature_resets"


class Transport(Protocol):
    """What a connection asks of the I/O under it."""

    def wake_writer(self) -> None:
        """Something is queued: take ``data_to_send`` soon (coalescing a loop turn's replies)."""
        ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def buffered(self) -> int:
        """Bytes taken from ``data_to_send`` and not yet written to the socket."""
        ...

    def stop(self) -> None:
        """Stop reading: the connection is ending."""
        ...

    async def flush(self) -> None:
        """Write everything ``data_to_send`` has (and will have) until it is empty and the
        socket took it. Bounded by the caller."""
        ...

    async def linger(self) -> None:
        """After a GOAWAY that ends the connection: half-close our side and read (and drop)
        what the client still sends until it closes, so its kernel does not drop the GOAWAY
        with a TCP RST. Bounded by the caller."""
        ...

    def peer(self) -> str: ...


OnClosed = Callable[["ServerConnection"], None]
"""What a connection calls once it has closed (its server forgets it)."""


class ServerConnection:
    """One HTTP/2 connection of a ``GrpcServer`` (module docstring)."""

    def __init__(
        self,
        methods: Mapping[str, Method],
        settings: ServerSettings,
        transport: Transport,
        on_closed: OnClosed,
        stats: EdgeStats | None = None,
        slot: Slot | None = None,
    ) -> None:
        """``slot``: the connection's place under its port's cap (None: a port with none)."""
        self.methods = methods
        self.settings = settings
        self.limits = settings.limits
        self.transport = transport
        self._on_closed = on_closed
        self.stats = stats or EdgeStats()
        self._slot = slot
        self.engine = new_engine(settings.http2_engine, engine_settings(settings.limits))
        self._judge = ResetJudge(settings.limits, slot.strictness if slot is not None else 1)
        self.calls: dict[int, Call] = {}
        self._methods_of: dict[int, Method] = {}
        self._opened_at: dict[int, float] = {}
        self._runners: CallRunners | None = None
        self._ended = anyio.Event()
        self._linger_at_close = False
        self.closed = False
        # writing
        self._progress: anyio.Event | None = None
        self.inbound_bytes = 0
        """What the calls hold beyond the messages they are reading (*memory*)."""
        self._read_paused = False
        self._shares: dict[InflightBytes, ConnectionShare] = {}
        """This connection's share of each budget its calls charge (one, in a server)."""
        self._idle_event: anyio.Event | None = None
        # timers
        self._deadlines: list[tuple[float, int, Call]] = []
        self._seq = itertools.count()
        self._timer_wake: anyio.Event | None = None
        self._timer_at = math.inf
        self._handshake_at = math.inf
        self._handshaken = False
        self._idle_since = 0.0
        self._idle_check_at = math.inf
        self._reads = 0
        self._keepalive_reads = -1
        self._keepalive_sent_at: float | None = None
        self._aged_at = math.inf
        self._close_at = math.inf
        self._keepalive_at = math.inf
        # ping strikes
        self._moved = False  # DATA or HEADERS went either way since the last client PING
        self._strikes = 0
        self._last_ping = -math.inf
        # drain
        self.draining = False
        self._drain_phase_at = math.inf
        self._final_goaway = False
        self._client_gone_away = False

    # ------------------------------------------------------------------ the transport's side

    def start(self) -> None:
        """Queue our SETTINGS and start the connection's clocks (before any ``feed``)."""
        self.engine.initiate()
        now = anyio.current_time()
        lim = self.limits
        if lim.handshake_seconds > 0:
            self._handshake_at = now + lim.handshake_seconds
        if lim.idle_seconds > 0:
            self._idle_since = now
            self._idle_check_at = now + lim.idle_seconds
        if self.settings.max_connection_age_seconds > 0:
            jitter = 1 + 0.1 * random.random()
            self._aged_at = now + self.settings.max_connection_age_seconds * jitter
        if self.settings.keepalive_seconds > 0:
            self._keepalive_at = now + self.settings.keepalive_seconds
        if self._slot is not None:
            self._slot.bind(self.evict)
        self.transport.wake_writer()

    def feed(self, data: bytes) -> bool:
        """Bytes from the client; False once the connection is to stop reading."""
        self._reads += 1
        try:
            events = self.engine.receive(data)
        except PeerError as exc:
            self._peer_error(exc)
            return False
        calls = self.calls
        for event in events:
            kind = event.__class__
            if kind is DataReceived:
                self._moved = True
                call = calls.get(event.stream_id)  # type: ignore[union-attr]
                if call is not None:
                    call.feed(event.data, event.flow_length)  # type: ignore[union-attr]
                    if event.end_stream:  # type: ignore[union-attr]
                        call.end_inbound()
                elif event.flow_length:  # type: ignore[union-attr]
                    self.engine.acknowledge(event.stream_id, event.flow_length)  # type: ignore[union-attr]
            elif kind is RequestReceived:
                self._moved = True
                self._open(event)  # type: ignore[arg-type]
            elif kind is WindowOpened or kind is SettingsReceived:
                if kind is SettingsReceived:
                    self._handshaken = True
                self._wake_progress()
            elif kind is StreamReset:
                if self._stream_reset(event):  # type: ignore[arg-type]
                    return False
            elif kind is TrailersReceived:
                call = calls.get(event.stream_id)  # type: ignore[union-attr]
                if call is not None:
                    call.end_inbound()
            elif kind is PingReceived:
                if self._ping_struck():
                    self._abuse(ErrorCode.ENHANCE_YOUR_CALM, _TOO_MANY_PINGS)
                    return False
            elif kind is PingAcknowledged:
                self._on_ping_ack(event.data)  # type: ignore[union-attr]
            elif kind is GoAwayReceived:
                self._client_goaway(event)  # type: ignore[arg-type]
        self.transport.wake_writer()
        return not self._ended.is_set()

    def data_to_send(self) -> bytes:
        """Everything queued for the client now; senders waiting for room are woken."""
        data = self.engine.data_to_send()
        if data:
            self._wake_progress()
        return data

    def writable(self) -> None:
        """The transport wrote what it held (its buffer is below its high-water mark)."""
        self._wake_progress()

    def lost(self) -> None:
        """The client is gone (the transport's read ended)."""
        self._end()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve the connection until it ends (the client leaves, a protocol error, the drain's
        end): the call tasks and the timers run here, then what is queued is flushed. Started
        (``task_status``) once calls can run: the transport feeds it from then on."""
        try:
            async with anyio.create_task_group() as tg:
                self._runners = CallRunners(tg, self._end_call)
                tg.start_soon(self._timers)
                task_status.started()
                await self._ended.wait()
                with anyio.move_on_after(_FLUSH_SECONDS):
                    await self.transport.flush()
                if self._linger_at_close:
                    self._reset_calls()
                    with anyio.move_on_after(_LINGER_SECONDS):
                        await self.transport.linger()
                tg.cancel_scope.cancel()
        finally:
            self.closed = True
            self._reset_calls()
            self._on_closed(self)

    def _end(self) -> None:
        """The connection is to stop reading and end (callable from anywhere, once)."""
        if not self._ended.is_set():
            self._ended.set()
            self.transport.stop()
            if self._slot is not None:  # closing: never evicted
                self._slot.busy()

    def peer(self) -> str:
        """The client's ``host:port`` (empty when the transport does not say)."""
        return self.transport.peer()

    # ------------------------------------------------------------------ events

    def _peer_error(self, exc: PeerError) -> None:
        """*Engine rules*: the engine has queued its GOAWAY; send it and end."""
        self.stats.goaway(code_name(exc.code))
        log.info(
            "h2_protocol_error", error=exc.reason[:200], code=code_name(exc.code), peer=self.peer()
        )
        if exc.code == ErrorCode.ENHANCE_YOUR_CALM:
            self._linger_at_close = True
            self._peer_abused()
        self.transport.wake_writer()
        self._end()

    def _abuse(self, code: ErrorCode, debug: bytes) -> None:
        """A rule of ours broken: GOAWAY with its code and debug data; the connection ends."""
        log.info("h2_abuse", rule=debug.decode(), peer=self.peer())
        self.stats.goaway(code.name)
        self.engine.goaway(code, debug)
        self._linger_at_close = True
        self._peer_abused()
        self.transport.wake_writer()
        self._end()

    def _peer_abused(self) -> None:
        """Ended for abuse: the peer's address goes on probation (``serving.peer_ledger``)."""
        if self._slot is not None:
            self._slot.abused()

    def _stream_reset(self, event: StreamReset) -> bool:
        """A stream gone; True when it ended the connection (*premature resets*)."""
        sid = event.stream_id
        if not event.remote and event.code == ErrorCode.REFUSED_STREAM:
            self.stats.refused_streams += 1
        call = self.calls.pop(sid, None)
        self._methods_of.pop(sid, None)
        if call is None:
            return False
        self._give_back(call)
        call.on_reset()
        if not event.remote:
            self._opened_at.pop(sid, None)
            return False
        opened = self._opened_at.pop(sid, None)
        premature = opened is not None and time.monotonic() - opened < self._judge.max_age
        if premature:
            self.stats.premature_resets += 1
        if self._judge.record(premature):
            self._abuse(ErrorCode.ENHANCE_YOUR_CALM, _PREMATURE_RESETS)
            return True
        return False

    def _ping_struck(self) -> bool:
        """*Ping strikes*: a client PING; True when it is one strike too many."""
        interval = self.limits.min_ping_interval_seconds
        if not interval:
            return False
        now = time.monotonic()
        if self._moved:
            self._moved = False
            self._strikes = 0
        elif now - self._last_ping < interval:
            self._strikes += 1
        self._last_ping = now
        return self._strikes > self.limits.max_ping_strikes

    def _client_goaway(self, event: GoAwayReceived) -> None:
        """The client's GOAWAY: it opens no more streams; an error ends the connection now, a
        graceful one once the calls in flight are done."""
        self._client_gone_away = True
        if event.code != ErrorCode.NO_ERROR or not self.calls:
            self._end()

    # ------------------------------------------------------------------ opening calls

    def _open(self, event: RequestReceived) -> None:
        """*Refused at once* and *expired at once*, then the call's task."""
        sid = event.stream_id
        head = read_request(event.headers)
        ended = event.end_stream
        if head.method != "POST":
            self._refuse(sid, ended, StatusCode.UNIMPLEMENTED, "only POST is supported", "405")
            return
        if head.content_type.split(";", 1)[0] not in _GRPC_CONTENT_TYPES:
            message = f"unacceptable content type {head.content_type[:64]!r}"
            self._refuse(sid, ended, StatusCode.UNKNOWN, message, "415")
            return
        if head.te != "trailers":
            message = 'required "te: trailers" header is missing'
            self._refuse(sid, ended, StatusCode.UNKNOWN, message, "400")
            return
        problem = header_problem(head.headers) if head.checked else None
        if problem is not None:
            status, message, extra = problem
            log.info("call_refused", status=status.name, message=message)
            self._refuse(sid, ended, status, message, extra=extra)
            return
        method = self.methods.get(head.path)
        if method is None:
            message = f"method not found: {head.path[:200]}"
            self._refuse(sid, ended, StatusCode.UNIMPLEMENTED, message)
            return
        encoding = head.encoding
        if encoding != IDENTITY:
            encoding = parse_encoding(encoding)
        call = Call(self, sid, head.path, head.headers, encoding, method.limits, method.rpc)
        if ended:
            call.inbound_done = True
        if head.timeouts:
            remaining = min(map(parse_timeout, head.timeouts))
            if remaining <= 0:
                call.finish(StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
                self._after_answer(call)
                return
            call.deadline = anyio.current_time() + remaining
            call.deadline_ns = time.monotonic_ns() + int(remaining * 1e9)
            self._add_deadline(call)
        if not self.calls and self._slot is not None:
            self._slot.busy()
        self.calls[sid] = call
        self._methods_of[sid] = method
        self._opened_at[sid] = time.monotonic()
        assert self._runners is not None
        self._runners.run(call, method)

    def _refuse(
        self,
        sid: int,
        ended: bool,
        status: StatusCode,
        message: str,
        http_status: str = "200",
        extra: Sequence[tuple[str, str]] = (),
    ) -> None:
        """Answer a stream without a call task (*refused at once*)."""
        if http_status != "200":
            block = status_trailers(status, message, trailers_only=True)
            block[0] = (b":status", http_status.encode("ascii"))
            self.queue_headers(sid, block, True)
        else:
            block = status_trailers(status, message, tuple(extra), trailers_only=True)
            self.queue_headers(sid, block, True)
        if not ended:
            self.engine.reset_stream(sid, ErrorCode.NO_ERROR)

    def _after_answer(self, call: Call) -> None:
        """*Half-open end* for a call answered without a task."""
        if not call.inbound_done:
            self.engine.reset_stream(call.stream_id, ErrorCode.NO_ERROR)

    def _end_call(self, call: Call) -> None:
        """A call is over (from its task): *half-open end*, and the connection's bookkeeping."""
        sid = call.stream_id
        if self.calls.get(sid) is call:
            del self.calls[sid]
            self._methods_of.pop(sid, None)
            self._opened_at.pop(sid, None)
            if not call.inbound_done and call.state is not CallState.RESET and not self.closed:
                self.engine.reset_stream(sid, ErrorCode.NO_ERROR)
            self._give_back(call)
            self._judge.record(False)
            self.transport.wake_writer()
        if not self.calls:
            if self._idle_check_at != math.inf:
                self._idle_since = anyio.current_time()
            if self._slot is not None and not self._ended.is_set():
                self._slot.idle()
            idle = self._idle_event
            if idle is not None:
                self._idle_event = None
                idle.set()
            if self._final_goaway or self._client_gone_away:
                self._end()

    def _give_back(self, call: Call) -> None:
        owed = call.release()
        if owed and not self.closed:
            self.engine.acknowledge(call.stream_id, owed)
            self.transport.wake_writer()

    def _reset_calls(self) -> None:
        for call in list(self.calls.values()):
            call.on_reset()

    # ------------------------------------------------------------------ the calls' sink

    def queue_headers(self, stream_id: int, block: list[tuple[bytes, bytes]], end: bool) -> None:
        self._moved = True
        try:
            self.engine.send_headers(stream_id, block, end_stream=end)
        except StreamGone:
            return
        self.transport.wake_writer()

    def queue_data(self, stream_id: int, data: bytes | memoryview) -> None:
        self._moved = True
        try:
            self.engine.send_data(stream_id, data)
        except StreamGone:
            return
        self.transport.wake_writer()

    def queue_trailers(self, stream_id: int, block: list[tuple[bytes, bytes]]) -> None:
        try:
            self.engine.send_trailers(stream_id, block)
        except StreamGone:
            return
        self.transport.wake_writer()

    def reset(self, stream_id: int, stalled: bool = False) -> None:
        self.engine.reset_stream(stream_id, ErrorCode.CANCEL)
        self.transport.wake_writer()

    def pending(self, stream_id: int) -> int:
        return self.engine.pending(stream_id)

    def blocked(self, stream_id: int) -> bool:
        engine = self.engine
        pending = engine.pending(stream_id)
        return bool(pending) and engine.send_window(stream_id) < pending

    def queued_bytes(self) -> int:
        """Bytes queued for the socket and not yet written (*memory*)."""
        return self.engine.pending(0) + self.transport.buffered()

    def send_queue_full(self) -> bool:
        cap = self.limits.max_send_queue_bytes
        return bool(cap) and self.queued_bytes() >= cap

    async def progress(self) -> None:
        self.transport.wake_writer()
        event = self._progress
        if event is None:
            event = self._progress = anyio.Event()
        await event.wait()

    def _wake_progress(self) -> None:
        event = self._progress
        if event is not None:
            self._progress = None
            event.set()

    def acknowledge(self, stream_id: int, n: int) -> None:
        self.engine.acknowledge(stream_id, n)
        self.transport.wake_writer()

    def share(self, budget: InflightBytes) -> ConnectionShare:
        """*Memory*: this connection's share of ``budget`` (``admission.ConnectionShare``)."""
        share = self._shares.get(budget)
        if share is None:
            share = self._shares[budget] = budget.connection()
        return share

    def inbound_changed(self, delta: int) -> None:
        """*Memory*: a call holds ``delta`` more (or fewer) bytes beyond the message it reads."""
        total = self.inbound_bytes = self.inbound_bytes + delta
        cap = self.limits.max_connection_buffer_bytes
        if not cap:
            return
        if total >= cap:
            if not self._read_paused:
                self._read_paused = True
                self.transport.pause_reading()
        elif self._read_paused:
            self._read_paused = False
            self.transport.resume_reading()

    # ------------------------------------------------------------------ timers

    def _add_deadline(self, call: Call) -> None:
        assert call.deadline is not None
        heap = self._deadlines
        if len(heap) > 2 * len(self.calls) + 64:  # drop the entries of finished calls
            heap[:] = [entry for entry in heap if not entry[2].closed]
            heapq.heapify(heap)
        heapq.heappush(heap, (call.deadline, next(self._seq), call))
        if call.deadline < self._timer_at:
            self._wake_timer()

    def _wake_timer(self) -> None:
        wake = self._timer_wake
        if wake is not None:
            self._timer_wake = None
            wake.set()

    def next_timer(self) -> float:
        """When the timers next have something to do (``math.inf``: nothing is due)."""
        heap = self._deadlines
        at = min(heap[0][0] if heap else math.inf, self._keepalive_at, self._aged_at)
        at = min(at, self._drain_phase_at, self._close_at, self._handshake_at)
        return min(at, self._idle_check_at)

    def on_timer(self, now: float) -> None:
        """Everything due by ``now``: expired calls, keepalive, age, drain, handshake, idle."""
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            call = heapq.heappop(heap)[2]
            if not call.closed:
                call.expire()
        if now >= self._keepalive_at:
            self._keepalive_at = self._keepalive(now)
        if now >= self._aged_at:
            self._aged_at = math.inf
            log.debug("connection_aged")
            self.start_drain()
            self._close_at = now + self.settings.max_connection_age_grace_seconds
        if now >= self._drain_phase_at:
            self._drain_second_phase()
        if now >= self._close_at:
            self._close_at = math.inf
            self.close_calls()
        if now >= self._handshake_at:
            self._handshake_at = math.inf
            self._handshake_due()
        if now >= self._idle_check_at:
            self._idle_check_at = self._idle_check(now)

    async def _timers(self) -> None:
        while True:
            self.on_timer(anyio.current_time())
            at = self._timer_at = self.next_timer()
            wake = self._timer_wake = anyio.Event()
            with anyio.CancelScope(deadline=at):
                await wake.wait()

    def _keepalive(self, now: float) -> float:
        """The keepalive rule; returns when it runs next."""
        s = self.settings
        if self._keepalive_sent_at is not None:
            # A PING is out and unanswered past its timeout: the client is gone.
            log.info("keepalive_timeout")
            self.stats.goaway(ErrorCode.NO_ERROR.name)
            self.engine.goaway(ErrorCode.NO_ERROR, b"keepalive timeout")
            self.transport.wake_writer()
            self._end()
            return math.inf
        if self._reads != self._keepalive_reads:  # heard from the client since: wait again
            self._keepalive_reads = self._reads
            return now + s.keepalive_seconds
        self._keepalive_sent_at = now
        self.engine.ping(_KEEPALIVE_PING)
        self.transport.wake_writer()
        return now + s.keepalive_timeout_seconds

    def _handshake_due(self) -> None:
        """*Handshake*: without the client's first SETTINGS by now, the connection closes."""
        if not self._handshaken:
            log.info("h2_handshake_timeout", peer=self.peer())
            self.stats.refuse_connection("handshake_timeout")
            self._end()

    def _idle_check(self, now: float) -> float:
        """*Idle*; returns when it is checked next. The time the last call ended is noted as
        calls end; a check that comes early (a call ran meanwhile) moves to the real deadline."""
        idle = self.limits.idle_seconds
        if self.calls or self.draining:
            return now + idle
        if now - self._idle_since < idle:
            return self._idle_since + idle
        log.info("connection_idle", peer=self.peer())
        self.stats.refuse_connection("idle")
        self.stats.goaway(ErrorCode.NO_ERROR.name)
        self._linger_at_close = True
        self.engine.goaway(ErrorCode.NO_ERROR)
        self.transport.wake_writer()
        self._end()
        return math.inf

    def evict(self) -> None:
        """*Eviction* (module docstring): the port needs this idle connection's place."""
        if self._ended.is_set():
            return
        log.debug("connection_evicted", peer=self.peer())
        if self._handshaken:
            self.stats.goaway(ErrorCode.NO_ERROR.name)
            self.engine.goaway(ErrorCode.NO_ERROR)
            self.transport.wake_writer()
        self._end()

    def _on_ping_ack(self, data: bytes) -> None:
        if data == _KEEPALIVE_PING:
            self._keepalive_sent_at = None
            self._keepalive_reads = self._reads
        elif data == _DRAIN_PING and self.draining:
            self._drain_second_phase()

    # ------------------------------------------------------------------ drain

    def start_drain(self) -> None:
        """The first phase of a graceful GOAWAY (module docstring)."""
        if self.draining or self.closed:
            return
        self.draining = True
        self.engine.goaway_notice()
        self.stats.goaway(ErrorCode.NO_ERROR.name)
        self.engine.ping(_DRAIN_PING)
        self.transport.wake_writer()
        self._drain_phase_at = anyio.current_time() + self.settings.drain_ping_timeout_seconds
        self._wake_timer()

    def _drain_second_phase(self) -> None:
        if self._final_goaway:
            return
        self._final_goaway = True
        self._drain_phase_at = math.inf
        self.engine.goaway(ErrorCode.NO_ERROR)
        self.stats.goaway(ErrorCode.NO_ERROR.name)
        self.transport.wake_writer()
        if not self.calls:
            self._end()

    def close_calls(self) -> None:
        """Cancel every call still running and end the connection (the drain's end)."""
        for call in list(self.calls.values()):
            self.engine.reset_stream(call.stream_id, ErrorCode.CANCEL)
            call.on_reset()
        self.transport.wake_writer()
        self._end()

    async def wait_idle(self) -> None:
        """Return once no call is running."""
        while self.calls:
            event = self._idle_event
            if event is None:
                event = self._idle_event = anyio.Event()
            await event.wait()


__all__ = ["OnClosed", "ServerConnection", "Transport"]

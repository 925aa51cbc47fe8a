"""One client connection: h2's sans-IO state driven by an anyio byte stream.

A connection is three tasks in its own task group (inside the server's, inside the process's
one tree) plus the call tasks, which are reused from call to call:

- the read loop: bytes from the socket, their frame headers read by the frame guard
  (``_frame_guard``), then into ``h2.H2Connection.receive_data``, each event dispatched at
  once (a request opens a ``Call`` and starts its task; DATA feeds the call's buffer;
  RST_STREAM cancels the call; WINDOW_UPDATE and SETTINGS wake blocked senders);
- the writer: the only task that writes to the socket. Calls and the read loop queue frames in
  h2 and ask for a write (``want_write``); the writer takes everything h2 has queued in one
  ``data_to_send`` and writes it, so replies finished in one loop iteration share a write and
  no frame is ever lost to a cancelled writer;
- the timer: the calls' deadlines (one heap per connection instead of a timer per call), the
  keepalive PING, the maximum connection age, the drain's phases, and the handshake and idle
  deadlines.

Rules of a call's life:
1. A request whose headers are refused (method, content type, ``te``, ``header_problem``, an
   unknown path) is answered at once, trailers-only, and no task is started.
2. A request whose ``grpc-timeout`` has already passed is answered DEADLINE_EXCEEDED at once.
3. A call's handler runs in the call's cancel scope. Its deadline, RST_STREAM from the client
   and the end of the connection cancel the scope; an expired call is answered
   DEADLINE_EXCEEDED, a reset one nothing.
4. An exception from the handler ends the call with ``status_of``'s status.
5. When a call ends before the client has ended its side, the stream is reset (NO_ERROR), and
   what the call had buffered unread is given back to the connection window.
6. Call tasks are reused: a task that has served a call waits for the next one of its
   connection instead of ending (an anyio task spawn costs several times a hand-over; the
   figures are in docs/benchmarks.md).

Defences (``limits``, counted in the server's ``EdgeStats``):
- The frame guard's rules (header blocks past the header-list cap, control-frame and ping
  floods) are judged on each read before h2 sees it; a broken rule is GOAWAY with its code and
  debug data, and the read goes no further.
- A stream beyond the advertised SETTINGS_MAX_CONCURRENT_STREAMS is refused alone
  (RST_STREAM REFUSED_STREAM, ``_h2_hooks.AdvertisedSettings``); the connection serves on.
- Premature resets (``ResetJudge``): each call's end is recorded, reset by the client within
  ``premature_reset_seconds`` of opening or not; too many of the recent ones is
  GOAWAY(ENHANCE_YOUR_CALM).
- Handshake: without the client preface and its first SETTINGS ``handshake_seconds`` after the
  connection started, it is closed (no GOAWAY: the client has not spoken HTTP/2).
- Idle: no call for ``idle_seconds`` is GOAWAY(NO_ERROR, the last stream id), then the close.

Memory (``limits.*``): the connection stops reading its socket while the bytes its calls hold
beyond the messages they are reading reach ``max_connection_buffer_bytes`` (``inbound_changed``;
resumed below it), and its senders wait while ``max_send_queue_bytes`` are queued for the
socket (``send_queue_full``: h2's outbound buffer, frames of ours not yet taken, the write in
progress and the transport's buffer).

Drain (``start_drain``, at shutdown or at the maximum connection age): GOAWAY with the last
stream id 2^31-1 and a PING; once the PING is answered (or after a timeout) GOAWAY with the
real last stream id. Streams opened after it are refused (REFUSED_STREAM); the calls in flight
finish, then the connection closes. ``close_calls`` cancels what is left.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.lowlevel
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
from h2.errors import ErrorCodes
from hyperframe.frame import GoAwayFrame, PingFrame

from kserve_trio.core import compression
from kserve_trio.core.errors import StatusCode
from kserve_trio.core.event_loops import stream_attribute
from kserve_trio.core.logging import get_logger
from kserve_trio.serving.edge_stats import EdgeStats
from kserve_trio.serving.grpc._call import Call
from kserve_trio.serving.grpc._fast_io import FastIO, attach
from kserve_trio.serving.grpc._frame_guard import (
    PREMATURE_RESETS,
    FrameGuard,
    ResetJudge,
    Violation,
)
from kserve_trio.serving.grpc._h2_hooks import (
    H2_CONFIG,
    UNBOUNDED_STREAMS,
    AdvertisedSettings,
    ServerH2,
)
from kserve_trio.serving.grpc._headers import header_problem, timeout_seconds
from kserve_trio.serving.grpc._settings import ServerSettings
from kserve_trio.serving.grpc._status import encode_message, status_of

if TYPE_CHECKING:
    from kserve_trio.serving.grpc._methods import Method

log = get_logger("kserve_trio.serving.grpc")

_RECEIVE_BYTES = 1 << 20
_LINGER_SECONDS = 1.0
"""How long a connection we end with a GOAWAY keeps draining the client's bytes (``_linger``)."""
_MAX_IDLE_RUNNERS = 64
"""Idle call tasks a connection keeps for its next calls (more exit when they go idle)."""
_MAX_STREAM_ID = 2**31 - 1
_DRAIN_PING = b"drain\x00\x00\x00"
_KEEPALIVE_PING = b"alive\x00\x00\x00"

_GRPC_CONTENT_TYPES = ("application/grpc", "application/grpc+proto")

OnClosed = Callable[["Connection"], None]
"""What a connection calls once it has closed (its server forgets it)."""


class Connection:
    """One HTTP/2 connection of a ``GrpcServer`` (module docstring)."""

    def __init__(
        self,
        stream: anyio.abc.ByteStream | None,
        methods: Mapping[str, Method],
        settings: ServerSettings,
        on_closed: OnClosed,
        fast: FastIO | None = None,
        stats: EdgeStats | None = None,
    ) -> None:
        self.stream = stream
        self._native = fast
        self.methods = methods
        self.settings = settings
        self._on_closed = on_closed
        self.stats = stats or EdgeStats()
        lim = settings.limits
        self.h2 = ServerH2(H2_CONFIG)
        self._guard = FrameGuard(lim, self.h2)
        self._judge = ResetJudge(lim)
        self._opened_at: dict[int, float] = {}  # a call's stream id -> when it opened
        self._max_streams = lim.max_concurrent_streams or UNBOUNDED_STREAMS
        self._abused = False
        self._linger_at_close = False
        self._handshake_at = math.inf
        self._idle_since = 0.0
        self._idle_check_at = math.inf
        self.calls: dict[int, Call] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._read_scope = anyio.CancelScope()
        self._stash: list[bytes] = []
        self._fast: FastIO | None = None
        self._write_pending = False
        self._writer_wake: anyio.Event | None = None
        self._writing = False
        self._sending = 0  # bytes of the socket write in progress (the anyio stream's)
        self.inbound_bytes = 0
        """What the calls hold beyond the messages they are reading (``inbound_changed``)."""
        self._read_paused = False
        self._read_resumed: anyio.Event | None = None
        self._drained_event: anyio.Event | None = None
        self._deadlines: list[tuple[float, int, Call]] = []
        self._seq = itertools.count()
        self._timer_wake: anyio.Event | None = None
        self._timer_at = math.inf
        self._reads = 0
        self._keepalive_reads = -1
        self._keepalive_sent_at: float | None = None
        self._aged_at = math.inf
        self.draining = False
        self._drain_phase_at = math.inf
        self._last_stream_id = _MAX_STREAM_ID
        self._close_at = math.inf
        self._idle: anyio.Event | None = None
        self._idle_runners: list[_Runner] = []
        self.closed = False

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Serve the connection until the client leaves, a protocol error, or the drain ends."""
        conn = self.h2
        s = self.settings
        lim = s.limits
        codes = h2.settings.SettingCodes
        advertised = {
            codes.INITIAL_WINDOW_SIZE: lim.stream_window_bytes,
            codes.MAX_FRAME_SIZE: lim.max_frame_bytes,
        }
        if lim.max_concurrent_streams:
            advertised[codes.MAX_CONCURRENT_STREAMS] = lim.max_concurrent_streams
        if lim.max_header_list_bytes:
            advertised[codes.MAX_HEADER_LIST_SIZE] = lim.max_header_list_bytes
            conn.decoder.max_header_list_size = lim.max_header_list_bytes
        # One SETTINGS frame, in force at once, not only after the client acknowledges it:
        # grpc-core may send a large DATA frame ahead of that (accepting more than advertised
        # is always safe for the receiver).
        conn.local_settings = AdvertisedSettings(client=False, initial_values=advertised)
        conn.initiate_connection()
        conn.max_inbound_frame_size = lim.max_frame_bytes
        if lim.connection_window_bytes > 65535:
            conn.increment_flow_control_window(lim.connection_window_bytes - 65535)
        now = anyio.current_time()
        if lim.handshake_seconds > 0:
            self._handshake_at = now + lim.handshake_seconds
        if lim.idle_seconds > 0:
            self._idle_since = now
            self._idle_check_at = now + lim.idle_seconds
        if s.max_connection_age_seconds > 0:
            self._aged_at = now + s.max_connection_age_seconds * (1 + 0.1 * random.random())
        self._write_pending = True
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                if self._native is not None:
                    self._fast = self._native
                    self._native.bind(self)
                else:
                    self._fast = attach(self.stream, self)
                tg.start_soon(self._writer)
                tg.start_soon(self._timer)
                with self._read_scope:
                    if self._fast is not None:
                        await self._fast.lost.wait()  # the transport feeds us meanwhile
                    else:
                        await self._read_loop()
                await self._flush_final()
                if self._linger_at_close:
                    for call in list(self.calls.values()):
                        call._on_reset()
                    await self._linger()
                tg.cancel_scope.cancel()
        finally:
            self.closed = True
            for call in list(self.calls.values()):
                call._on_reset()
            if self.stream is not None:
                with anyio.CancelScope(shield=True):
                    await self.stream.aclose()
            elif self._fast is not None:
                self._fast.close()
            self._on_closed(self)

    async def _flush_final(self) -> None:
        """Let the writer send what is queued (a GOAWAY, the last trailers), briefly."""
        with anyio.move_on_after(1.0):
            await self.drained()

    async def _linger(self) -> None:
        """After a GOAWAY of ours that ends the connection (a broken rule, idle): our side
        half-closed, what the client still sends read and dropped until it closes its side,
        briefly. Closing a socket with unread bytes in its buffer sends a TCP RST, with which
        the client's kernel may drop the GOAWAY before the client has read it."""
        with anyio.move_on_after(_LINGER_SECONDS):
            fast = self._fast
            if fast is not None:  # the transport reads and drops meanwhile (``FastIO.lost``)
                transport = fast.transport
                if transport.can_write_eof():
                    transport.write_eof()
                while not transport.is_closing():
                    await anyio.sleep(0.05)
                return
            stream = self.stream
            assert stream is not None
            try:
                await stream.send_eof()
            except (NotImplementedError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
            except OSError:
                pass
            try:
                while await stream.receive(_RECEIVE_BYTES):
                    pass
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                return
            except OSError:
                return

    # ------------------------------------------------------------------ reading

    async def _read_loop(self) -> None:
        """The reading of every stream but asyncio TCP's (``_fast_io``): bytes into ``feed``."""
        stream = self.stream
        assert stream is not None
        while True:
            while self._read_paused:
                resumed = self._read_resumed = anyio.Event()
                await resumed.wait()
            try:
                data = await stream.receive(_RECEIVE_BYTES)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                return
            except OSError:
                return
            if not self.feed(data):
                return

    def peer(self) -> str:
        """The client's ``host:port`` (empty when the stream does not say)."""
        if self._fast is not None:
            return self._fast.peer()
        if self.stream is None:
            return ""
        address = stream_attribute(self.stream, anyio.abc.SocketAttribute.remote_address, "")
        if isinstance(address, tuple):
            return f"{address[0]}:{address[1]}"
        return str(address)

    def _stop_reading(self) -> None:
        """End the connection's reading (callable from a task or a transport callback)."""
        if self._fast is not None:
            self._fast.lost.set()
        else:
            self._read_scope.cancel()

    def feed(self, data: bytes) -> bool:
        """Received bytes into h2 and each event dispatched; False once the connection is to
        stop reading (a protocol error, the end of a drain)."""
        conn = self.h2
        self._reads += 1
        broken = self._guard.scan(data)
        if broken is not None:  # refused before h2 buffers or answers any of it
            self._abuse(broken)
            return False
        try:
            events = conn.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            # h2 has queued its GOAWAY; send it and leave.
            log.info("h2_protocol_error", error=str(exc)[:200])
            self.stats.goaway(_code_name(exc.error_code))
            self.want_write()
            return False
        except Exception as exc:  # a parsing bug must never take the process down
            log.warning("h2_receive_failed", error=repr(exc)[:200])
            self._goaway_now(ErrorCodes.PROTOCOL_ERROR)
            return False
        if events:
            self._dispatch(events)
        out = conn.data_to_send()
        if out:
            self._stash.append(out)
            self.want_write()
        if self._abused:
            return False
        return not (self.draining and not self.calls and self._last_stream_id != _MAX_STREAM_ID)

    def _abuse(self, broken: Violation) -> None:
        """A frame-level rule broken: GOAWAY with its code and debug data; reading ends."""
        log.info("h2_abuse", rule=broken.debug.decode(), peer=self.peer())
        self._abused = True
        self._linger_at_close = True
        self._goaway_now(broken.code, broken.debug)

    def _dispatch(self, events: list[Any]) -> None:
        calls = self.calls
        for event in events:
            kind = event.__class__
            if kind is h2.events.DataReceived:
                call = calls.get(event.stream_id)
                if call is not None:
                    call._feed(event.data, event.flow_controlled_length)
                elif event.flow_controlled_length:
                    self.acknowledge(event.flow_controlled_length, event.stream_id)
            elif kind is h2.events.RequestReceived:
                self._open(event)
            elif kind is h2.events.StreamEnded:
                call = calls.get(event.stream_id)
                if call is not None:
                    call._end_inbound()
            elif kind is h2.events.StreamReset:
                call = calls.pop(event.stream_id, None)
                if call is not None:
                    self._give_back(call)
                    call._on_reset()
                    if self._judge_reset(event.stream_id):
                        return
            elif kind is h2.events.WindowUpdated:
                if event.stream_id == 0:
                    for call in calls.values():
                        call._wake_sender()
                else:
                    call = calls.get(event.stream_id)
                    if call is not None:
                        call._wake_sender()
            elif kind is h2.events.RemoteSettingsChanged:
                for call in calls.values():
                    call._wake_sender()
            elif kind is h2.events.PingAckReceived:
                self._on_ping_ack(event.ping_data)
            elif kind is h2.events.ConnectionTerminated:
                # The client's GOAWAY: h2 sends nothing more on this connection.
                self._stop_reading()
            elif kind is h2.events.TrailersReceived:
                call = calls.get(event.stream_id)
                if call is not None:
                    call._end_inbound()

    def _judge_reset(self, sid: int) -> bool:
        """The premature-reset rule for a call the client reset; True when it ended the
        connection (the events left in the read are not acted on)."""
        opened = self._opened_at.pop(sid, None)
        premature = opened is not None and time.monotonic() - opened < self._judge.max_age
        if premature:
            self.stats.premature_resets += 1
        if self._judge.record(premature):
            self._abuse(PREMATURE_RESETS)
            return True
        return False

    def _refuse_stream(self, sid: int) -> None:
        """RST_STREAM(REFUSED_STREAM): the stream was not processed, the client may retry it."""
        self.stats.refused_streams += 1
        self._reset_stream(sid, ErrorCodes.REFUSED_STREAM)

    def _open(self, event: h2.events.RequestReceived) -> None:
        """Rules 1-2 for a new request, then the call's task; a stream beyond the advertised
        concurrency (``AdvertisedSettings``) or after the drain's last stream is refused."""
        sid = event.stream_id
        if (self.draining and sid > self._last_stream_id) or len(self.calls) >= self._max_streams:
            self._refuse_stream(sid)
            return
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in event.headers]
        method_name = path = content_type = te = ""
        timeouts: list[str] = []
        encoding = compression.IDENTITY
        for key, value in headers:
            if key[0] == ":":
                if key == ":method":
                    method_name = value
                elif key == ":path":
                    path = value
            elif key == "content-type":
                content_type = value
            elif key == "te":
                te = value
            elif key == "grpc-timeout":
                timeouts.append(value)
            elif key == "grpc-encoding":
                encoding = value
        ended = event.stream_ended is not None
        if method_name != "POST":
            self._refuse(sid, ended, StatusCode.UNIMPLEMENTED, "only POST is supported", "405")
            return
        if content_type.split(";", 1)[0] not in _GRPC_CONTENT_TYPES:
            self._refuse(
                sid,
                ended,
                StatusCode.UNKNOWN,
                f"unacceptable content type {content_type[:64]!r}",
                "415",
            )
            return
        if te != "trailers":
            self._refuse(
                sid, ended, StatusCode.UNKNOWN, 'required "te: trailers" header is missing', "400"
            )
            return
        problem = header_problem(headers)
        if problem is not None:
            status, message, extra = problem
            log.info("call_refused", status=status.name, message=message)
            self._refuse(sid, ended, status, message, extra=extra)
            return
        method = self.methods.get(path)
        if method is None:
            self._refuse(sid, ended, StatusCode.UNIMPLEMENTED, f"method not found: {path[:200]}")
            return
        if encoding != compression.IDENTITY:
            encoding = compression.parse_encoding(encoding)
        call = Call(self, sid, path, headers, encoding, method.limits, method.rpc, method)
        if ended:
            call.inbound_done = True
        if timeouts:
            remaining = min(timeout_seconds(value) for value in timeouts)
            if remaining <= 0:
                call.finish(StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
                self._after_answer(call)
                return
            now = anyio.current_time()
            call.deadline = now + remaining
            call.deadline_ns = time.monotonic_ns() + int(remaining * 1e9)
            self._add_deadline(call)
        self.calls[sid] = call
        self._opened_at[sid] = time.monotonic()
        self._dispatch_call(call)

    def _refuse(
        self,
        sid: int,
        ended: bool,
        status: StatusCode,
        message: str,
        http_status: str = "200",
        extra: Any = (),
    ) -> None:
        """Answer a stream without a call task (rule 1)."""
        call = Call(self, sid, "", (), compression.IDENTITY, _NO_LIMITS, "")
        call.inbound_done = ended
        if http_status != "200":
            headers = [
                (":status", http_status),
                ("content-type", "application/grpc+proto"),
                ("grpc-status", str(int(status))),
                ("grpc-message", encode_message(message)),
            ]
            try:
                self.h2.send_headers(sid, headers, end_stream=True)
            except h2.exceptions.ProtocolError:
                return
            call.closed = True
        else:
            call.finish(status, message, extra)
        self._after_answer(call)

    def _after_answer(self, call: Call) -> None:
        """Rule 5 for a call answered without a task. (When the client's END_STREAM came in
        the same read, h2 has closed the stream already and the reset is a no-op.)"""
        if not call.inbound_done:
            self._reset_stream(call.stream_id, ErrorCodes.NO_ERROR)

    # ------------------------------------------------------------------ calls

    def _dispatch_call(self, call: Call) -> None:
        """Hand ``call`` to an idle runner, or start a new one (rule 6)."""
        idle = self._idle_runners
        if idle:
            runner = idle.pop()
            runner.call = call
            wake = runner.wake
            if wake is not None:
                runner.wake = None
                wake.set()
            return
        assert self._tg is not None
        self._tg.start_soon(self._runner, _Runner(call))

    async def _runner(self, runner: _Runner) -> None:
        """A call task that serves one call after another (rule 6).

        Its cancel scope lasts across calls: a call's deadline or reset cancels it, and only
        then is a new one opened, so a call that is not cancelled costs no scope of its own.
        """
        idle = self._idle_runners
        while True:
            call: Call | None = None
            with anyio.CancelScope() as scope:
                while True:
                    call = runner.call
                    if call is None:
                        if len(idle) >= _MAX_IDLE_RUNNERS:
                            return
                        idle.append(runner)
                        wake = runner.wake = anyio.Event()
                        try:
                            await wake.wait()
                        except BaseException:
                            # A cancellation meant for the call just finished (it was asked
                            # for before that call reached its end) lands here: leave the idle
                            # list, or the runner could be handed two calls and drop one. A
                            # call handed over meanwhile is kept in ``runner.call``.
                            if runner in idle:
                                idle.remove(runner)
                            runner.wake = None
                            raise
                        continue
                    runner.call = None
                    if self._starts(call):
                        call.scope = scope
                        await self._serve_call(call)
                    self._finish_call(call)
                    call = None
            if call is not None:  # cancelled in the middle of it
                self._finish_call(call)

    def _starts(self, call: Call) -> bool:
        """Rule 2 once more at the start (a deadline may pass while the call waits for its
        task: the handler might never reach a checkpoint), and a call reset meanwhile."""
        if call.deadline is not None and anyio.current_time() >= call.deadline:
            call.expired = True
        return not (call.expired or call.reset)

    async def _serve_call(self, call: Call) -> None:
        """Rule 4: the handler, and its exception as the call's status."""
        try:
            await call.method.run(call)
        except Exception as exc:
            if not call.reset:
                status, message = status_of(exc, rpc=call.rpc)
                call.finish(status, message)

    def _finish_call(self, call: Call) -> None:
        """Rules 3 and 5 once the handler is done (or was never run, or was cancelled)."""
        call.scope = None
        if call.expired and not call.closed:
            call.finish(StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        elif not call.closed and not call.reset:
            call.finish(StatusCode.OK)
        self._end_call(call)

    def _end_call(self, call: Call) -> None:
        if self.calls.get(call.stream_id) is call:
            del self.calls[call.stream_id]
            del self._opened_at[call.stream_id]
            if not call.inbound_done and not call.reset and not self.closed:
                self._reset_stream(call.stream_id, ErrorCodes.NO_ERROR)
            self._give_back(call)
            self._judge.record(False)
        call.scope = None
        if not self.calls:
            if self._idle_check_at != math.inf:
                self._idle_since = anyio.current_time()
            idle = self._idle
            if idle is not None:
                self._idle = None
                idle.set()
            if self.draining and self._last_stream_id != _MAX_STREAM_ID:
                self._stop_reading()

    def _give_back(self, call: Call) -> None:
        owed = call._release()
        if owed and not self.closed:
            try:
                self.h2.acknowledge_received_data(owed, call.stream_id)
            except h2.exceptions.ProtocolError:
                return
            self.want_write()

    def _reset_stream(self, sid: int, code: ErrorCodes) -> None:
        try:
            self.h2.reset_stream(sid, code)
        except h2.exceptions.ProtocolError:  # closed already: nothing to reset
            return
        self.want_write()

    def inbound_changed(self, delta: int) -> None:
        """A call holds ``delta`` more (or fewer) bytes beyond the message it reads: reading
        stops at ``limits.max_connection_buffer_bytes`` and resumes below it."""
        total = self.inbound_bytes = self.inbound_bytes + delta
        cap = self.settings.limits.max_connection_buffer_bytes
        if not cap:
            return
        if total >= cap:
            if not self._read_paused:
                self._read_paused = True
                fast = self._fast
                if fast is not None and fast.transport is not None:
                    try:
                        fast.transport.pause_reading()
                    except (RuntimeError, AttributeError):  # closing already
                        pass
        elif self._read_paused:
            self._read_paused = False
            fast = self._fast
            if fast is not None and fast.transport is not None:
                if not fast.transport.is_closing():
                    try:
                        fast.transport.resume_reading()
                    except (RuntimeError, AttributeError):
                        pass
            resumed = self._read_resumed
            if resumed is not None:
                self._read_resumed = None
                resumed.set()

    def reset_stalled(self, sid: int) -> None:
        """A reply of stream ``sid`` made no progress for ``limits.send_stall_seconds``."""
        self._reset_stream(sid, ErrorCodes.CANCEL)

    def acknowledge(self, flow_length: int, sid: int) -> None:
        """Give ``flow_length`` received bytes of stream ``sid`` back to the client's windows."""
        if flow_length:
            try:
                self.h2.acknowledge_received_data(flow_length, sid)
            except h2.exceptions.ProtocolError:
                return
            self.want_write()

    # ------------------------------------------------------------------ writing

    def queued_bytes(self) -> int:
        """Bytes queued for the socket and not yet sent (module docstring, memory)."""
        # h2 keeps what it has framed in one bytearray until ``data_to_send`` takes it.
        queued = len(getattr(self.h2, "_data_to_send", b"")) + self._sending
        for piece in self._stash:
            queued += len(piece)
        fast = self._fast
        if fast is not None and fast.transport is not None:
            queued += fast.transport.get_write_buffer_size()
        return queued

    def send_queue_full(self) -> bool:
        """Whether senders wait: ``limits.max_send_queue_bytes`` are queued for the socket."""
        cap = self.settings.limits.max_send_queue_bytes
        return bool(cap) and self.queued_bytes() >= cap

    async def send_room(self) -> None:
        """Return once what is queued for the socket has been written (a sender that found
        the send queue full waits here)."""
        self.want_write()
        await self.drained()
        await anyio.lowlevel.checkpoint()  # never a busy loop, whatever is queued

    @property
    def backlogged(self) -> bool:
        """The socket is slower than the replies: a write is in progress and more is queued."""
        return self._writing and self._write_pending

    def want_write(self) -> None:
        """Something is queued in h2 (or the stash): the writer takes it on its next turn, or,
        on asyncio TCP with at most one call in flight (nothing to coalesce with), it goes to
        the transport at once (no task switch on the latency path)."""
        fast = self._fast
        if (
            fast is not None
            and len(self.calls) <= 1
            and not self._write_pending
            and not self._writing
            and not fast.paused
        ):
            self._write_now(fast)
            return
        if not self._write_pending:
            self._write_pending = True
            wake = self._writer_wake
            if wake is not None:
                self._writer_wake = None
                wake.set()

    def _take(self) -> bytes:
        """Everything queued for the socket, in order: the stash, then what h2 holds."""
        data = self.h2.data_to_send()
        if self._stash:
            stash = self._stash
            self._stash = []
            if data:
                stash.append(data)
            data = b"".join(stash)
        return data

    def _write_now(self, fast: FastIO) -> None:
        data = self._take()
        if data and not fast.write(data):  # the transport is closing: the peer is gone
            fast.lost.set()

    async def drained(self) -> None:
        """Return once everything queued so far has been written to the socket (and, written
        straight to an asyncio transport, its buffer is below its high-water mark again)."""
        while self._write_pending or self._writing:
            event = self._drained_event
            if event is None:
                event = self._drained_event = anyio.Event()
            await event.wait()
        if self._fast is not None:
            await self._fast.writable()

    async def _writer(self) -> None:
        stream = self.stream
        try:
            while True:
                if not self._write_pending:
                    drained = self._drained_event
                    if drained is not None:
                        self._drained_event = None
                        drained.set()
                    wake = self._writer_wake = anyio.Event()
                    await wake.wait()
                self._write_pending = False
                data = self._take()
                if data:
                    self._writing = True
                    try:
                        fast = self._fast
                        if fast is None:
                            assert stream is not None
                            self._sending = len(data)
                            await stream.send(data)
                        elif fast.write(data):
                            await fast.writable()
                        else:
                            raise anyio.BrokenResourceError
                    finally:
                        self._writing = False
                        self._sending = 0
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            self._stop_reading()  # the peer is gone
        finally:
            self._write_pending = False
            drained = self._drained_event
            if drained is not None:
                self._drained_event = None
                drained.set()

    def _goaway_now(self, code: ErrorCodes, debug: bytes = b"") -> None:
        try:
            self.h2.close_connection(code, additional_data=debug)
        except h2.exceptions.ProtocolError:
            return
        self.stats.goaway(code.name)
        self.want_write()

    def _inject(self, frame: GoAwayFrame | PingFrame) -> None:
        """Queue a frame h2 must not know about (a GOAWAY that keeps its streams open)."""
        pending = self.h2.data_to_send()
        if pending:
            self._stash.append(pending)
        self._stash.append(frame.serialize())
        self.want_write()

    # ------------------------------------------------------------------ timer

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

    async def _timer(self) -> None:
        s = self.settings
        heap = self._deadlines
        keepalive_at = (
            anyio.current_time() + s.keepalive_seconds if s.keepalive_seconds > 0 else math.inf
        )
        while True:
            now = anyio.current_time()
            while heap and heap[0][0] <= now:
                call = heapq.heappop(heap)[2]
                if not call.closed:
                    call._expire()
            if now >= keepalive_at:
                keepalive_at = self._keepalive(now)
            if now >= self._aged_at:
                self._aged_at = math.inf
                log.debug("connection_aged")
                self.start_drain()
                self._close_at = now + s.max_connection_age_grace_seconds
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
            at = min(heap[0][0] if heap else math.inf, keepalive_at, self._aged_at)
            at = min(at, self._drain_phase_at, self._close_at, self._handshake_at)
            at = min(at, self._idle_check_at)
            self._timer_at = at
            wake = self._timer_wake = anyio.Event()
            with anyio.CancelScope(deadline=at):
                await wake.wait()

    def _keepalive(self, now: float) -> float:
        """The keepalive rule; returns when it runs next."""
        s = self.settings
        if self._keepalive_sent_at is not None:
            # A PING is out and unanswered past its timeout: the client is gone.
            log.info("keepalive_timeout")
            self._goaway_now(ErrorCodes.NO_ERROR, b"keepalive timeout")
            self._stop_reading()
            return math.inf
        if self._reads != self._keepalive_reads:  # heard from the client since: wait again
            self._keepalive_reads = self._reads
            return now + s.keepalive_seconds
        self._keepalive_sent_at = now
        self._inject(_ping(_KEEPALIVE_PING))
        return now + s.keepalive_timeout_seconds

    def _handshake_due(self) -> None:
        """``limits.handshake_seconds`` after the start: without the client's preface and
        first SETTINGS by now (``FrameGuard.handshaken``), the connection is closed."""
        if not self._guard.handshaken:
            log.info("h2_handshake_timeout", peer=self.peer())
            self.stats.refuse_connection("handshake_timeout")
            self._stop_reading()

    def _idle_check(self, now: float) -> float:
        """The idle rule; returns when it is checked next. The time the last call ended
        (``_idle_since``) is noted as calls end; the timer is never woken for it: a check
        that comes early (a call ran meanwhile) is moved to the real deadline."""
        idle = self.settings.limits.idle_seconds
        if self.calls or self.draining:
            return now + idle
        if now - self._idle_since < idle:
            return self._idle_since + idle
        log.info("connection_idle", peer=self.peer())
        self.stats.refuse_connection("idle")
        self._linger_at_close = True
        self._goaway_now(ErrorCodes.NO_ERROR)
        self._stop_reading()
        return math.inf

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
        self._inject(GoAwayFrame(0, last_stream_id=_MAX_STREAM_ID, error_code=0))
        self.stats.goaway(ErrorCodes.NO_ERROR.name)
        self._inject(_ping(_DRAIN_PING))
        self._drain_phase_at = anyio.current_time() + self.settings.drain_ping_timeout_seconds
        self._wake_timer()

    def _drain_second_phase(self) -> None:
        if self._last_stream_id != _MAX_STREAM_ID:
            return
        self._drain_phase_at = math.inf
        self._last_stream_id = self.h2.highest_inbound_stream_id
        self._inject(GoAwayFrame(0, last_stream_id=self._last_stream_id, error_code=0))
        self.stats.goaway(ErrorCodes.NO_ERROR.name)
        if not self.calls:
            self._stop_reading()

    def close_calls(self) -> None:
        """Cancel every call still running and close the connection (the drain's end)."""
        for call in list(self.calls.values()):
            self._reset_stream(call.stream_id, ErrorCodes.CANCEL)
            call._on_reset()
        self._stop_reading()

    async def wait_idle(self) -> None:
        """Return once no call is running."""
        while self.calls:
            event = self._idle
            if event is None:
                event = self._idle = anyio.Event()
            await event.wait()


class _Runner:
    """One reusable call task's mailbox: the call handed to it, and its wake-up."""

    __slots__ = ("call", "wake")

    def __init__(self, call: Call) -> None:
        self.call: Call | None = call
        self.wake: anyio.Event | None = None


def _code_name(code: Any) -> str:
    """An HTTP/2 error code's name (its number when HTTP/2 does not name it)."""
    try:
        return ErrorCodes(code).name
    except ValueError:
        return str(code)


def _ping(opaque: bytes) -> PingFrame:
    frame = PingFrame(0)
    frame.opaque_data = opaque
    return frame


class _NoLimits:
    max_recv_bytes = 0
    max_send_bytes = 0
    compress_responses = False
    inflight = None


_NO_LIMITS: Any = _NoLimits()

__all__ = ["Connection"]

"""One HTTP/2 connection of the h2 transport: the h2 state machine, the anyio byte stream under
it, and the calls in flight on it (``kserve_trio.client.h2_transport`` opens and replaces these;
``_h2_call`` holds the pure per-call half).

Who reads the socket. There is no background reader task: the tasks waiting for replies take
turns. Rules (``Connection.progress``):
1. A call that needs something from the peer (its reply, send window, a stream slot) first
   checks whether it already has it.
2. If not, and nobody is reading, it becomes the reader: one ``receive``, then every event is
   dispatched to the call it belongs to (replies, windows, resets, GOAWAY), and the waiters
   whose state changed are woken.
3. If someone else is reading, it waits on its own event.
4. A reader that leaves (its call is complete, or it was cancelled) wakes one waiter, who takes
   over the reading.
So every task belongs to a caller and nothing outlives a call; cancellation needs no
supervision, and at concurrency 1 a reply costs one task wake-up, not two. A connection with
no call in flight is not read; before reusing it the next call peeks at the socket (one
zero-timeout ``poll``, ``Connection.peek_idle``) and handles what the server sent meanwhile
(GOAWAY, EOF).

Sends go out through one flusher at a time (``Connection.flush``): whoever queues frames in the
h2 state machine calls it; if a flush is already running, that flusher picks the new bytes up
before it returns. Socket writes are shielded from cancellation (a half-written frame would corrupt the
connection for every call on it) and bounded by their own stall timeout instead.
"""

from __future__ import annotations

import os
import select
import socket
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from kserve_trio.client._h2_call import _Call, _error_name
from kserve_trio.client.errors import RpcError
from kserve_trio.core.errors import StatusCode

WINDOW_BYTES = 64 << 20
"""Our receive windows (connection and each stream): a large reply never waits for a
WINDOW_UPDATE round trip."""
MAX_FRAME_BYTES = 1 << 20
"""The largest DATA frame we accept (h2's default is 16 KiB)."""
RECEIVE_BYTES = 1 << 20
FLUSH_BYTES = 1 << 20
"""How much DATA a large send queues in h2 before writing it to the socket."""
SEND_STALL_SECONDS = 30.0
"""A socket write that makes no progress for this long declares the connection dead."""

_CANCEL = h2.errors.ErrorCodes.CANCEL
_REFUSED = h2.errors.ErrorCodes.REFUSED_STREAM
CONNECTION_ERRORS = (
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    anyio.EndOfStream,
    OSError,  # ssl.SSLError included
)


def _h2_config() -> h2.config.H2Configuration:
    # Our headers are built valid and lowercase; skipping h2's per-header checks saves CPU.
    return h2.config.H2Configuration(
        client_side=True,
        header_encoding=None,
        validate_outbound_headers=False,
        normalize_outbound_headers=False,
        validate_inbound_headers=False,
        normalize_inbound_headers=False,
    )


class Connection:
    """One HTTP/2 connection and the calls on it (see the module docstring for who reads)."""

    def __init__(self, stream: anyio.abc.ByteStream, address: str) -> None:
        self.stream = stream
        self.address = address
        self.h2 = h2.connection.H2Connection(_h2_config())
        self.calls: dict[int, _Call] = {}
        self.parked: set[_Call] = set()  # waiting for a window or a stream slot
        self.reading = False
        self.sending = False
        self.dead: str | None = None  # why the connection can no longer carry calls
        self.draining = False  # GOAWAY received: no new streams
        self.sock: Any = stream.extra(anyio.abc.SocketAttribute.raw_socket, None)
        self.poller: Any = None
        if self.sock is not None and hasattr(select, "poll"):
            self.poller = select.poll()
            self.poller.register(self.sock.fileno(), select.POLLIN)

    @property
    def usable(self) -> bool:
        return self.dead is None and not self.draining

    async def start(self) -> None:
        """Send the connection preface: our settings and the enlarged connection window."""
        conn = self.h2
        conn.local_settings = h2.settings.Settings(
            client=True,
            initial_values={
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: WINDOW_BYTES,
                h2.settings.SettingCodes.MAX_FRAME_SIZE: MAX_FRAME_BYTES,
            },
        )
        conn.initiate_connection()
        conn.increment_flow_control_window(WINDOW_BYTES - 65535)
        conn.max_inbound_frame_size = MAX_FRAME_BYTES
        await self.flush()
        if self.dead is not None:
            raise RpcError(StatusCode.UNAVAILABLE, self.dead)

    # -- failure -----------------------------------------------------------------------------

    def fail(self, reason: str) -> None:
        """The connection is dead: every unfinished call fails UNAVAILABLE with ``reason``."""
        if self.dead is None:
            self.dead = reason
        for call in list(self.calls.values()):
            if not call.done:
                call.fail(RpcError(StatusCode.UNAVAILABLE, reason, method=call.rpc))
            _wake(call)
        for call in list(self.parked):
            _wake(call)

    def abort(self) -> None:
        """Best-effort close from any thread: shut the socket down; the owning loop sees EOF."""
        if self.dead is None:
            self.dead = f"connection to {self.address} was closed by the client"
        sock = self.sock
        if sock is None:
            return
        try:
            # Through a duplicate descriptor: the event loop's own socket object may not
            # offer shutdown() (uvloop's does not); shutdown acts on the connection itself.
            dup = socket.socket(fileno=os.dup(sock.fileno()))
        except (OSError, ValueError):
            return
        try:
            dup.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            dup.close()

    def peek_idle(self) -> bool:
        """On an idle connection: whether the server sent something meanwhile (GOAWAY, EOF,
        PING), by one zero-timeout ``poll`` of the socket. (Nobody reads an idle connection,
        so what the server sent, end of stream included, waits in the kernel.)"""
        poller = self.poller
        if poller is None:
            return False
        try:
            return bool(poller.poll(0))
        except OSError:
            return True  # let the read find out what is wrong

    async def aclose(self) -> None:
        """Fail what is still in flight, say GOAWAY (bounded), close the socket."""
        if self.dead is None:
            self.fail(f"connection to {self.address} was closed by the client")
            try:
                self.h2.close_connection()
            except h2.exceptions.ProtocolError:
                pass
            await self.flush()
        with anyio.CancelScope(shield=True):
            await anyio.aclose_forcefully(self.stream)

    # -- sending -----------------------------------------------------------------------------

    async def flush(self) -> None:
        """Write what h2 has queued (see the module docstring: one flusher at a time,
        shielded, bounded by ``SEND_STALL_SECONDS``)."""
        if self.sending or self.dead is not None:
            return
        data = self.h2.data_to_send()
        if not data:
            return
        self.sending = True
        try:
            with anyio.CancelScope(
                deadline=anyio.current_time() + SEND_STALL_SECONDS, shield=True
            ) as scope:
                while data:
                    await self.stream.send(data)
                    data = self.h2.data_to_send()
            if scope.cancelled_caught:
                self.fail(
                    f"connection to {self.address} stalled: a write made no progress for "
                    f"{SEND_STALL_SECONDS:.0f}s"
                )
        except CONNECTION_ERRORS as exc:
            self.fail(f"connection to {self.address} lost: {describe(exc)}")
        finally:
            self.sending = False

    # -- receiving ---------------------------------------------------------------------------

    async def read_once(self) -> None:
        """One receive, dispatched (rule 2 of the module docstring)."""
        self.reading = True
        try:
            data = await self.stream.receive(RECEIVE_BYTES)
        except anyio.EndOfStream:
            self.fail(f"connection to {self.address} was closed by the server")
            return
        except CONNECTION_ERRORS as exc:
            self.fail(f"connection to {self.address} lost: {describe(exc)}")
            return
        finally:
            self.reading = False
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            self.fail(f"HTTP/2 protocol error on the connection to {self.address}: {exc}")
            return
        self.dispatch(events)
        await self.flush()

    def dispatch(self, events: list[h2.events.Event]) -> None:
        """Route each event to its call; wake the calls whose state changed."""
        calls = self.calls
        wake_parked = False
        for event in events:
            # ``type(event)`` tested each time, not saved once, so that ``event`` is narrowed.
            if type(event) is h2.events.DataReceived:
                sid = event.stream_id
                if event.flow_controlled_length:
                    self.h2.acknowledge_received_data(event.flow_controlled_length, sid)
                call = calls.get(sid)
                if call is not None and not call.done and not call.data(event.data):
                    call.done = True
                    self.reset(call)
                    _wake(call)
            elif (
                type(event) is h2.events.ResponseReceived
                or type(event) is h2.events.TrailersReceived
            ):
                call = calls.get(event.stream_id)
                if call is not None:
                    call.headers(event.headers)
            elif type(event) is h2.events.StreamEnded:
                call = calls.get(event.stream_id)
                if call is not None:
                    call.done = True
                    _wake(call)
            elif type(event) is h2.events.StreamReset:
                call = calls.get(event.stream_id)
                if call is not None and not call.done:
                    call.reset_code = event.error_code
                    call.refused = event.error_code == _REFUSED
                    call.done = True
                    _wake(call)
            elif (
                type(event) is h2.events.WindowUpdated
                or type(event) is h2.events.RemoteSettingsChanged
            ):
                wake_parked = True
            elif type(event) is h2.events.ConnectionTerminated:
                self.goaway(event.last_stream_id, event.error_code)
                wake_parked = True
        if wake_parked:
            for call in self.parked:
                _wake(call)

    def goaway(self, last_stream_id: int | None, error_code: int | None) -> None:
        """GOAWAY: no new streams here; streams above ``last_stream_id`` were not processed
        (retry-safe); the others may still complete."""
        self.draining = True
        last = last_stream_id if last_stream_id is not None else 0
        reason = _error_name(error_code) if error_code is not None else "no error code"
        for sid, call in self.calls.items():
            if sid > last and not call.done:
                call.fail(
                    RpcError(
                        StatusCode.UNAVAILABLE,
                        f"{self.address} is going away ({reason}); the call was not processed",
                        method=call.rpc,
                    ),
                    refused=True,
                )
                _wake(call)

    def reset(self, call: _Call) -> None:
        """Queue RST_STREAM CANCEL for ``call``'s stream (if it is still open)."""
        try:
            self.h2.reset_stream(call.stream_id, _CANCEL)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError, KeyError):
            pass

    # -- waiting -----------------------------------------------------------------------------

    async def progress(
        self, call: _Call, ready: Callable[[], bool], parked: bool, may_read: bool = True
    ) -> None:
        """Return once ``ready()`` holds or the connection died (rules 1-4 of the module docstring).

        A call waiting for a stream slot passes ``may_read=False``: what it waits for is
        another call finishing (in that call's task), not something the peer sends, so it
        must not sit in ``receive`` when that happens; the calls holding the slots read."""
        try:
            while not ready() and self.dead is None:
                if may_read and not self.reading:
                    await self.read_once()
                    continue
                event = call.event = anyio.Event()
                if parked:
                    self.parked.add(call)
                try:
                    await event.wait()
                finally:
                    call.event = None
                    if parked:
                        self.parked.discard(call)
        finally:
            if not self.reading:
                self.wake_reader()

    def wake_reader(self) -> None:
        """Hand the reading over to one waiting call (rule 4)."""
        for call in self.calls.values():
            if call.event is not None and not call.done:
                call.event.set()
                return

    # -- one call ----------------------------------------------------------------------------

    async def request(
        self, call: _Call, headers: list[tuple[bytes, bytes]], payload: bytes, flag: int = 0
    ) -> None:
        """Run ``call`` on this connection to completion (``call.done``); ``call.message``
        gives the outcome. Cancellation resets the stream."""
        conn = self.h2
        max_streams = conn.remote_settings.max_concurrent_streams
        if len(self.calls) >= max_streams:
            await self.progress(
                call,
                lambda: (
                    not self.usable or len(self.calls) < conn.remote_settings.max_concurrent_streams
                ),
                parked=True,
                may_read=False,
            )
        if not self.usable:
            call.fail(
                RpcError(
                    StatusCode.UNAVAILABLE, self.dead or "connection draining", method=call.rpc
                ),
                refused=True,
            )
            return
        try:
            sid = conn.get_next_available_stream_id()
        except h2.exceptions.NoAvailableStreamIDError:
            self.draining = True
            call.fail(
                RpcError(StatusCode.UNAVAILABLE, "stream ids exhausted", method=call.rpc),
                refused=True,
            )
            return
        call.stream_id = sid
        self.calls[sid] = call
        sent = False
        try:
            conn.send_headers(sid, headers)
            size = len(payload) + 5
            if size <= conn.local_flow_control_window(sid) and size <= conn.max_outbound_frame_size:
                prefix = bytes((flag,)) + len(payload).to_bytes(4, "big")
                conn.send_data(sid, prefix + payload, end_stream=True)
                sent = True
                await self.flush()
            else:
                sent = await self._send_large(call, payload, flag)
            if not call.done:
                await self.progress(call, lambda: call.done, parked=False)
        finally:
            if (not call.done or call.error is not None or not sent) and self.dead is None:
                self.reset(call)
                await self.flush()
            self.calls.pop(sid, None)
            for waiting in self.parked:
                _wake(waiting)
            if self.draining and not self.calls and self.dead is None:
                await self.aclose()  # GOAWAY'd and now idle: the transport has moved on

    async def _send_large(self, call: _Call, payload: bytes, flag: int = 0) -> bool:
        """The message in DATA frames within the peer's windows and frame size; False when
        the call ended (or the connection died) before all of it was sent."""
        conn = self.h2
        sid = call.stream_id
        view = memoryview(payload)
        total = len(view)
        pending = bytes((flag,)) + total.to_bytes(4, "big")
        pos = 0
        while not call.done and self.dead is None:
            try:
                window = conn.local_flow_control_window(sid)
            except (h2.exceptions.StreamClosedError, KeyError):
                return False
            if window <= 0:
                await self.flush()
                await self.progress(
                    call,
                    lambda: call.done or conn.local_flow_control_window(sid) > 0,
                    parked=True,
                )
                continue
            frame = conn.max_outbound_frame_size
            queued = 0
            while window > 0 and queued < FLUSH_BYTES:
                if pending:
                    n = min(window, len(pending))
                    chunk, pending = pending[:n], pending[n:]
                else:
                    n = min(window, frame, total - pos)
                    chunk = view[pos : pos + n]
                    pos += n
                last = not pending and pos == total
                conn.send_data(sid, chunk, end_stream=last)
                window -= n
                queued += n
                if last:
                    await self.flush()
                    return True
            await self.flush()
        return False


def _wake(call: _Call) -> None:
    event = call.event
    if event is not None:
        event.set()


def describe(exc: BaseException) -> str:
    """An exception as the end of an error message (its text, its cause's, or its type)."""
    text = str(exc)
    if not text and exc.__cause__ is not None:
        text = str(exc.__cause__)
    return text or type(exc).__name__


__all__ = [
    "CONNECTION_ERRORS",
    "FLUSH_BYTES",
    "MAX_FRAME_BYTES",
    "RECEIVE_BYTES",
    "SEND_STALL_SECONDS",
    "WINDOW_BYTES",
    "Connection",
    "describe",
]

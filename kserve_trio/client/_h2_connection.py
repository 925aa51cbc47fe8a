"""One HTTP/2 connection of the client transport: the HTTP/2 engine holding its protocol state
(``kserve_trio.http2``: ngh2 by default, h2 as the fallback; framing, HPACK, flow control,
SETTINGS, PING and GOAWAY are the engine's), the anyio byte stream under it, and the calls in
flight on it (``kserve_trio.client.h2_transport`` opens and replaces these; ``_h2_call`` holds
the pure per-call half).

Who reads the socket. There is no background reader task: the tasks waiting for replies take
turns. Rules (``Connection.progress``):
1. *Look first*: a call that needs something from the peer (its reply, send window, a stream slot)
   first checks whether it already has it.
2. *Become the reader*: if not, and nobody is reading, it becomes the reader: one ``receive``, then
   every frame is dispatched to the call it belongs to (replies, windows, resets, GOAWAY), and the
   waiters whose state changed are woken.
3. *Wait for the reader*: if someone else is reading, it waits on its own event.
4. *Hand the reading on*: a reader that leaves (its call is complete, or it was cancelled) wakes one
   waiter, who takes over the reading.
So every task belongs to a caller and nothing outlives a call; cancellation needs no
supervision, and at concurrency 1 a reply costs one task wake-up, not two. A connection with
no call in flight is not read; before reusing it the next call peeks at the socket (one
zero-timeout ``poll``, ``Connection.peek_idle``) and handles what the server sent meanwhile
(GOAWAY, EOF) in ``Connection.catch_up``, which hands the reading on like any reader (*hand the
reading on*).

Sends go out through one flusher at a time (``Connection.flush``): whoever queues frames calls
it; if a flush is already running, that flusher picks the new bytes up before it returns. A
socket write must never be cut in half by a cancellation (a half-written frame would corrupt
the connection for every call on it): on asyncio's plain TCP streams the bytes go to the
transport's buffer synchronously, which no cancellation can interrupt; any other stream (TLS,
trio) is written inside a shielded scope, bounded by its own stall timeout instead.

What the engine's events do (``Connection.dispatch``, no I/O): a reply's headers, DATA and
trailers go to its call (its DATA acknowledged as it is taken), resets and GOAWAY to the calls
they end, window updates and SETTINGS wake the calls waiting to send; a peer that breaks the
protocol fails every call (``PeerError``). The engine queues its answers (acknowledgements,
WINDOW_UPDATEs, RST_STREAMs) for the connection's next flush.
"""

from __future__ import annotations

import os
import select
import socket
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.abc

from kserve_trio.client._h2_call import _Call
from kserve_trio.client.errors import RpcError
from kserve_trio.core.errors import StatusCode
from kserve_trio.core.process import (
    MAX_FRAME_BYTES,
    WINDOW_BYTES,
    asyncio_transport,
    stream_attribute,
)
from kserve_trio.core.protocol import message_prefix
from kserve_trio.http2 import (
    MAX_STREAM_ID,
    DataReceived,
    EngineSettings,
    ErrorCode,
    GoAwayReceived,
    Header,
    PeerError,
    ResponseReceived,
    SettingsReceived,
    StreamGone,
    StreamReset,
    TrailersReceived,
    WindowOpened,
    code_name,
    new_engine,
)

# The client advertises the same receive windows (connection and each stream) and largest DATA
# frame as our servers do by default (WINDOW_BYTES, MAX_FRAME_BYTES): a large reply never waits
# for a WINDOW_UPDATE round trip and arrives in few frames.
CLIENT_SETTINGS = EngineSettings(
    client=True,
    stream_window=WINDOW_BYTES,
    connection_window=WINDOW_BYTES,
    max_frame=MAX_FRAME_BYTES,
)
RECEIVE_BYTES = 1 << 20
SEND_BATCH_BYTES = 1 << 20
"""How much of a large message may wait in the engine for the server's windows before its
sender writes and waits."""
JOIN_BYTES = 64 << 10
"""A message up to this size is joined with its prefix into one buffer; a larger one is queued
piece by piece (its tensors' own buffers, not copied)."""
SEND_STALL_SECONDS = 30.0
"""A socket write that makes no progress for this long declares the connection dead."""

CONNECTION_ERRORS = (
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    anyio.EndOfStream,
    OSError,  # ssl.SSLError included
)

Buffer = bytes | bytearray | memoryview
"""What a message piece is."""


class Connection:
    """One HTTP/2 connection and the calls on it (see the module docstring for who reads and
    what received frames do)."""

    def __init__(self, stream: anyio.abc.ByteStream, address: str, engine: str) -> None:
        self.stream = stream
        self.address = address
        self.calls: dict[int, _Call] = {}
        self.parked: set[_Call] = set()  # waiting for a window or a stream slot
        self.reading = False
        self.sending = False
        self.dead: str | None = None  # why the connection can no longer carry calls
        self.draining = False  # GOAWAY received: no new streams
        self.sock: Any = stream_attribute(stream, anyio.abc.SocketAttribute.raw_socket)
        self.poller: Any = None
        if self.sock is not None and hasattr(select, "poll"):
            self.poller = select.poll()
            self.poller.register(self.sock.fileno(), select.POLLIN)
        self._direct = asyncio_transport(stream)
        self.engine = new_engine(engine, CLIENT_SETTINGS)

    @property
    def usable(self) -> bool:
        return self.dead is None and not self.draining

    async def start(self) -> None:
        """Send the connection preface: our settings and the enlarged connection window."""
        self.engine.initiate()
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

    async def catch_up(self, seconds: float) -> None:
        """On an idle connection the server wrote to (``peek_idle``): read what it sent, for
        ``seconds`` at most, then follow *hand the reading on*. The reader here is no call, and
        calls that joined while it read (they saw ``reading`` and wait on their events) would
        otherwise wait for a reader that never comes, even after GOAWAY sent the caller
        elsewhere."""
        try:
            with anyio.move_on_after(seconds):
                await self.read_once()
        finally:
            if not self.reading:
                self.wake_reader()

    async def aclose(self) -> None:
        """Fail what is still in flight, say GOAWAY (bounded), close the socket."""
        if self.dead is None:
            self.engine.goaway(ErrorCode.NO_ERROR)
            await self.flush()
            self.fail(f"connection to {self.address} was closed by the client")
        with anyio.CancelScope(shield=True):
            await anyio.aclose_forcefully(self.stream)

    # -- sending -----------------------------------------------------------------------------

    def _take(self) -> list[bytes]:
        """What the engine has queued for the socket, as one write (or none)."""
        data = self.engine.data_to_send()
        return [data] if data else []

    async def flush(self) -> None:
        """Write what is queued (see the module docstring: one flusher at a time, never cut
        by a cancellation, bounded by ``SEND_STALL_SECONDS``)."""
        if self.sending or self.dead is not None:
            return
        if self._direct is not None:
            await self._flush_direct()
            return
        self.sending = True
        try:
            with anyio.CancelScope(
                deadline=anyio.current_time() + SEND_STALL_SECONDS, shield=True
            ) as scope:
                while writes := self._take():
                    for data in writes:
                        await self.stream.send(data)
            if scope.cancelled_caught:
                self.fail(
                    f"connection to {self.address} stalled: a write made no progress for "
                    f"{SEND_STALL_SECONDS:.0f}s"
                )
        except CONNECTION_ERRORS as exc:
            self.fail(f"connection to {self.address} lost: {describe(exc)}")
        finally:
            self.sending = False

    async def _flush_direct(self) -> None:
        """``flush`` on asyncio TCP: hand the bytes to the transport (synchronous, so no
        cancellation can split a frame), then wait for its buffer to drain below its high-water
        mark, as anyio's own ``send`` does; a cancelled wait leaves nothing half-written."""
        assert self._direct is not None
        transport, protocol = self._direct
        if transport.is_closing() or protocol.exception is not None:
            exc = protocol.exception
            self.fail(f"connection to {self.address} lost: {describe(exc) if exc else 'closed'}")
            return
        try:
            for data in self._take():
                transport.write(data)
        except (RuntimeError, OSError) as exc:
            self.fail(f"connection to {self.address} lost: {describe(exc)}")
            return
        if protocol.write_event.is_set():
            return
        self.sending = True
        try:
            with anyio.move_on_after(SEND_STALL_SECONDS) as scope:
                while not protocol.write_event.is_set() and self.dead is None:
                    await protocol.write_event.wait()
                    for data in self._take():
                        transport.write(data)
            if scope.cancelled_caught:
                self.fail(
                    f"connection to {self.address} stalled: a write made no progress for "
                    f"{SEND_STALL_SECONDS:.0f}s"
                )
        except (RuntimeError, OSError) as exc:
            self.fail(f"connection to {self.address} lost: {describe(exc)}")
        finally:
            self.sending = False
            if self.dead is None:  # queued while we waited: never left behind
                for data in self._take():
                    transport.write(data)

    # -- receiving ---------------------------------------------------------------------------

    async def read_once(self) -> None:
        """One receive, dispatched (*become the reader* of the module docstring)."""
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
            events = self.engine.receive(data)
        except PeerError as exc:
            await self.flush()  # the GOAWAY saying why
            self.protocol_error(exc.code, exc.reason)
            return
        self.dispatch(events)
        await self.flush()

    def protocol_error(self, code: int, message: str) -> None:
        """The peer broke the protocol: every call fails UNAVAILABLE, no more frames go out."""
        self.fail(f"HTTP/2 protocol error on the connection to {self.address}: {message}")

    def dispatch(self, events: Sequence[Any]) -> None:
        """Apply each event to the connection or its call; wake the calls whose state changed."""
        calls = self.calls
        wake_parked = False
        for event in events:
            kind = event.__class__
            if kind is DataReceived:
                self._data(calls.get(event.stream_id), event)
            elif kind is ResponseReceived:
                self._headers(calls.get(event.stream_id), event.headers, event.end_stream)
            elif kind is TrailersReceived:
                self._headers(calls.get(event.stream_id), event.headers, True)
            elif kind is WindowOpened or kind is SettingsReceived:
                wake_parked = True
            elif kind is StreamReset:
                call = calls.get(event.stream_id)
                if call is not None:
                    call.remote_closed = call.local_closed = True
                    if not call.done:
                        call.reset_code = event.code
                        call.refused = event.code == ErrorCode.REFUSED_STREAM
                        call.done = True
                        _wake(call)
            elif kind is GoAwayReceived:
                self.goaway(event.last_stream_id, event.code)
                wake_parked = True
        if wake_parked:
            for call in self.parked:
                _wake(call)

    def _data(self, call: _Call | None, event: DataReceived) -> None:
        if event.flow_length:  # taken at once: a reply's bytes are bounded by the call's cap
            self.engine.acknowledge(event.stream_id, event.flow_length)
        if call is None or call.done:
            return  # a stream already answered or reset: the bytes only count for the window
        if not call.data(event.data):
            call.done = True
            self.reset(call)
            _wake(call)
            return
        if event.end_stream:
            call.remote_closed = call.done = True
            _wake(call)

    def _headers(self, call: _Call | None, headers: Sequence[Header], ended: bool) -> None:
        if call is None:
            return
        if not call.done:
            call.headers(headers)
        if ended:
            call.remote_closed = True
            if not call.done:
                call.done = True
                _wake(call)

    def goaway(self, last_stream_id: int | None, error_code: int | None) -> None:
        """GOAWAY: no new streams here; streams above ``last_stream_id`` were not processed
        (retry-safe); the others may still complete."""
        self.draining = True
        last = last_stream_id if last_stream_id is not None else 0
        reason = code_name(error_code) if error_code is not None else "no error code"
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
        if call.stream_id and not (call.local_closed and call.remote_closed):
            call.local_closed = call.remote_closed = True
            self.engine.reset_stream(call.stream_id, ErrorCode.CANCEL)

    # -- waiting -----------------------------------------------------------------------------

    async def progress(
        self, call: _Call, ready: Callable[[], bool], parked: bool, may_read: bool = True
    ) -> None:
        """Return once ``ready()`` holds or the connection died (*look first*, *become the reader*,
        *wait for the reader* and *hand the reading on* of the module docstring).

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
        """Hand the reading over to one waiting call (*hand the reading on*)."""
        for call in self.calls.values():
            if call.event is not None and not call.done:
                call.event.set()
                return

    # -- one call ----------------------------------------------------------------------------

    async def request(
        self,
        call: _Call,
        headers: list[Header],
        pieces: Sequence[Buffer],
        nbytes: int,
        flag: int = 0,
    ) -> None:
        """Run ``call`` on this connection to completion (``call.done``): ``headers`` are its
        request headers, ``pieces`` its message (``nbytes`` in all, sent as one gRPC message
        with compressed ``flag``); ``call.message`` gives the outcome. Cancellation resets the
        stream."""
        engine = self.engine
        if len(self.calls) >= engine.peer_max_streams:
            await self.progress(
                call,
                lambda: not self.usable or len(self.calls) < engine.peer_max_streams,
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
            sid = engine.send_request(headers)
        except StreamGone as exc:  # stream ids exhausted, or the connection is closing
            self.draining = True
            call.fail(RpcError(StatusCode.UNAVAILABLE, str(exc), method=call.rpc), refused=True)
            return
        if sid > MAX_STREAM_ID - 2:
            self.draining = True  # the last stream id: the next call opens a new connection
        call.stream_id = sid
        self.calls[sid] = call
        sent = False
        try:
            sent = await self._send_message(call, pieces, nbytes, flag)
            if not call.done:
                await self.progress(call, lambda: call.done, parked=False)
        finally:
            if (not call.done or call.error is not None or not sent) and self.dead is None:
                self.reset(call)
                await self.flush()
            self.calls.pop(sid, None)
            for waiting in self.parked:
                _wake(waiting)
            if not self.calls and (self.dead is not None or self.draining):
                await self.aclose()  # dead, or GOAWAY'd and now idle: the transport moved on

    async def _send_message(
        self, call: _Call, pieces: Sequence[Buffer], nbytes: int, flag: int
    ) -> bool:
        """The message queued in the engine (its buffers as they are), written, and waited on
        while more than ``SEND_BATCH_BYTES`` of it wait for the server's windows; False when
        the call ended (or the connection died) before all of it was sent."""
        engine = self.engine
        sid = call.stream_id
        prefix = message_prefix(bool(flag), nbytes)
        try:
            if nbytes <= JOIN_BYTES:
                engine.send_data(sid, b"".join([prefix, *pieces]), end_stream=True)
            else:
                engine.send_data(sid, prefix)
                for n, piece in enumerate(pieces):
                    engine.send_data(sid, piece, end_stream=n == len(pieces) - 1)
        except StreamGone:
            return False
        call.local_closed = True
        await self.flush()
        while engine.pending(sid) > SEND_BATCH_BYTES and not call.done and self.dead is None:
            await self.progress(
                call, lambda: call.done or engine.pending(sid) <= SEND_BATCH_BYTES, parked=True
            )
            await self.flush()
        return self.dead is None


def _wake(call: _Call) -> None:
    event: anyio.Event | None = call.event
    if event is not None:
        event.set()


def describe(exc: BaseException) -> str:
    """An exception as the end of an error message (its text, its cause's, or its type)."""
    text = str(exc)
    if not text and exc.__cause__ is not None:
        text = str(exc.__cause__)
    return text or type(exc).__name__


__all__ = [
    "CLIENT_SETTINGS",
    "CONNECTION_ERRORS",
    "JOIN_BYTES",
    "MAX_FRAME_BYTES",
    "RECEIVE_BYTES",
    "SEND_BATCH_BYTES",
    "SEND_STALL_SECONDS",
    "WINDOW_BYTES",
    "Connection",
    "describe",
]

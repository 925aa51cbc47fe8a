"""One HTTP/2 connection of the h2 transport: its protocol state (settings, flow-control
windows, streams), the anyio byte stream under it, and the calls in flight on it
(``kserve_trio.client.h2_transport`` opens and replaces these; ``_h2_call`` holds the pure
per-call half, ``_h2_frames`` the frame and header-block coding).

The protocol state is kept here rather than in a general HTTP/2 state machine: a unary gRPC
call needs one HEADERS and the DATA of one message out, HEADERS, DATA and trailers back, and
the flow-control, SETTINGS, PING, RST_STREAM and GOAWAY handling around them; the generic
machinery cost more client CPU per call than all of that (docs/benchmarks.md, "Client").

Who reads the socket. There is no background reader task: the tasks waiting for replies take
turns. Rules (``Connection.progress``):
1. A call that needs something from the peer (its reply, send window, a stream slot) first
   checks whether it already has it.
2. If not, and nobody is reading, it becomes the reader: one ``receive``, then every frame is
   dispatched to the call it belongs to (replies, windows, resets, GOAWAY), and the waiters
   whose state changed are woken.
3. If someone else is reading, it waits on its own event.
4. A reader that leaves (its call is complete, or it was cancelled) wakes one waiter, who takes
   over the reading.
So every task belongs to a caller and nothing outlives a call; cancellation needs no
supervision, and at concurrency 1 a reply costs one task wake-up, not two. A connection with
no call in flight is not read; before reusing it the next call peeks at the socket (one
zero-timeout ``poll``, ``Connection.peek_idle``) and handles what the server sent meanwhile
(GOAWAY, EOF) in ``Connection.catch_up``, which hands the reading on by rule 4 like any reader.

Sends go out through one flusher at a time (``Connection.flush``): whoever queues frames calls
it; if a flush is already running, that flusher picks the new bytes up before it returns. A
socket write must never be cut in half by a cancellation (a half-written frame would corrupt
the connection for every call on it): on asyncio's plain TCP streams the bytes go to the
transport's buffer synchronously, which no cancellation can interrupt; any other stream (TLS,
trio) is written inside a shielded scope, bounded by its own stall timeout instead.

What received frames do (``Connection.dispatch``, no I/O): a reply's HEADERS, DATA and trailers
go to its call, resets and GOAWAY to the calls they end, SETTINGS, PING and WINDOW_UPDATE to the
connection's state; whatever breaks the protocol raises ``_h2_frames.FrameError`` with its HTTP/2
error code. Answers (SETTINGS and PING acknowledgements, WINDOW_UPDATEs, RST_STREAMs) are queued
on ``out`` for the connection's next flush.
"""

from __future__ import annotations

import os
import select
import socket
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.abc
import hpack
import hpack.exceptions

from kserve_trio.client import _h2_frames as fr
from kserve_trio.client._h2_call import _Call, _error_name
from kserve_trio.client.errors import RpcError
from kserve_trio.core.config import MAX_FRAME_BYTES, WINDOW_BYTES
from kserve_trio.core.errors import StatusCode
from kserve_trio.core.event_loops import asyncio_transport, stream_attribute

# The client advertises the same receive windows (connection and each stream) and largest DATA
# frame as our servers do by default (WINDOW_BYTES, MAX_FRAME_BYTES): a large reply never waits
# for a WINDOW_UPDATE round trip and arrives in few frames.
DECODED_BLOCKS = 64
"""How many indexed-only reply header blocks a connection keeps decoded."""
RECEIVE_BYTES = 1 << 20
FLUSH_BYTES = 1 << 20
"""How much DATA a large send queues before writing it to the socket."""
JOIN_BYTES = 64 << 10
"""Queued pieces below this size are joined into one write; larger ones are written as they
are (a view of the caller's buffer, not copied)."""
SEND_STALL_SECONDS = 30.0
"""A socket write that makes no progress for this long declares the connection dead."""

_REFUSED = 0x7  # RST_STREAM's REFUSED_STREAM

CONNECTION_ERRORS = (
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    anyio.EndOfStream,
    OSError,  # ssl.SSLError included
)

Buffer = bytes | bytearray | memoryview
"""What a queued frame piece or a message piece is."""


class Connection:
    """One HTTP/2 connection and the calls on it (see the module docstring for who reads and
    what received frames do)."""

    def __init__(self, stream: anyio.abc.ByteStream, address: str) -> None:
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
        # protocol state
        self.out: list[Buffer] = []  # frames queued for the socket
        self.decoder = hpack.Decoder()
        self.decoded: dict[bytes, list[tuple[bytes, bytes]]] = {}  # indexed-only blocks
        self.max_streams = 1 << 32  # the peer's SETTINGS_MAX_CONCURRENT_STREAMS
        self.max_frame = fr.DEFAULT_FRAME  # the peer's SETTINGS_MAX_FRAME_SIZE
        self.initial_window = fr.DEFAULT_WINDOW  # the peer's SETTINGS_INITIAL_WINDOW_SIZE
        self.send_window = fr.DEFAULT_WINDOW  # the connection's send window
        self.unacked = 0  # DATA received on the connection, not yet given back
        self.continued: tuple[int, int, list[bytes]] | None = None  # a header block in parts
        self.reader = fr.FrameReader(MAX_FRAME_BYTES)
        self.next_stream_id = 1
        self.first_block = True

    @property
    def usable(self) -> bool:
        return self.dead is None and not self.draining

    async def start(self) -> None:
        """Send the connection preface: our settings and the enlarged connection window."""
        self.out += [
            fr.PREFACE,
            fr.settings_frame(
                {
                    fr.ENABLE_PUSH: 0,
                    fr.INITIAL_WINDOW_SIZE: WINDOW_BYTES,
                    fr.MAX_FRAME_SIZE: MAX_FRAME_BYTES,
                }
            ),
            fr.window_update(0, WINDOW_BYTES - fr.DEFAULT_WINDOW),
        ]
        await self.flush()
        if self.dead is not None:
            raise RpcError(StatusCode.UNAVAILABLE, self.dead)

    def window(self, call: _Call) -> int:
        """How much DATA ``call`` may send now."""
        return min(self.send_window, call.window)

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
        ``seconds`` at most, then follow rule 4. The reader here is no call, and calls that
        joined while it read (they saw ``reading`` and wait on their events) would otherwise
        wait for a reader that never comes, even after GOAWAY sent the caller elsewhere."""
        try:
            with anyio.move_on_after(seconds):
                await self.read_once()
        finally:
            if not self.reading:
                self.wake_reader()

    async def aclose(self) -> None:
        """Fail what is still in flight, say GOAWAY (bounded), close the socket."""
        if self.dead is None:
            self.out.append(fr.goaway(fr.NO_ERROR))
            await self.flush()
            self.fail(f"connection to {self.address} was closed by the client")
        with anyio.CancelScope(shield=True):
            await anyio.aclose_forcefully(self.stream)

    # -- sending -----------------------------------------------------------------------------

    def _take(self) -> list[Buffer]:
        """The queued frames as writes: runs of small pieces joined, large pieces alone."""
        out, self.out = self.out, []
        if len(out) == 1:
            return out
        writes: list[Buffer] = []
        run: list[Buffer] = []
        for piece in out:
            if len(piece) < JOIN_BYTES:
                run.append(piece)
                continue
            if run:
                writes.append(b"".join(run))
                run = []
            writes.append(piece)
        if run:
            writes.append(b"".join(run) if len(run) > 1 else run[0])
        return writes

    async def flush(self) -> None:
        """Write what is queued (see the module docstring: one flusher at a time, never cut
        by a cancellation, bounded by ``SEND_STALL_SECONDS``)."""
        if self.sending or self.dead is not None or not self.out:
            return
        if self._direct is not None:
            await self._flush_direct()
            return
        self.sending = True
        try:
            with anyio.CancelScope(
                deadline=anyio.current_time() + SEND_STALL_SECONDS, shield=True
            ) as scope:
                while self.out:
                    for data in self._take():
                        await self.stream.send(data)  # type: ignore[arg-type]
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
            if self.out and self.dead is None:  # queued while we waited: never left behind
                for data in self._take():
                    transport.write(data)

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
            self.dispatch(self.reader.feed(data))
        except fr.FrameError as exc:
            self.protocol_error(exc.code, str(exc))
        except hpack.exceptions.HPACKError as exc:
            self.protocol_error(fr.COMPRESSION_ERROR, f"bad header block: {exc}")
        await self.flush()

    def protocol_error(self, code: int, message: str) -> None:
        """The peer broke the protocol: every call fails UNAVAILABLE, no more frames go out."""
        self.fail(f"HTTP/2 protocol error on the connection to {self.address}: {message}")

    def dispatch(self, frames: Sequence[tuple[int, int, int, memoryview]]) -> None:
        """Apply each frame to the connection or its call; wake the calls whose state changed."""
        calls = self.calls
        wake_parked = False
        for ftype, flags, sid, payload in frames:
            if self.continued is not None and ftype != fr.CONTINUATION:
                raise fr.FrameError(fr.PROTOCOL_ERROR, "a header block was interrupted")
            if ftype == fr.DATA:
                if sid == 0:
                    raise fr.FrameError(fr.PROTOCOL_ERROR, "DATA on stream 0")
                self._data(calls.get(sid), flags, payload)
            elif ftype == fr.HEADERS:
                if sid == 0:
                    raise fr.FrameError(fr.PROTOCOL_ERROR, "HEADERS on stream 0")
                block = fr.unpad(payload, flags)
                if flags & fr.PRIORITY_FLAG:
                    block = block[5:]
                if flags & fr.END_HEADERS:
                    self._headers(sid, flags, block)
                else:
                    self.continued = (sid, flags, [bytes(block)])
            elif ftype == fr.CONTINUATION:
                if self.continued is None or self.continued[0] != sid:
                    raise fr.FrameError(fr.PROTOCOL_ERROR, "CONTINUATION without HEADERS")
                self.continued[2].append(bytes(payload))
                if flags & fr.END_HEADERS:
                    first_flags, parts = self.continued[1], self.continued[2]
                    self.continued = None
                    self._headers(sid, first_flags, b"".join(parts))
            elif ftype == fr.RST_STREAM:
                if len(payload) != 4:
                    raise fr.FrameError(fr.FRAME_SIZE_ERROR, "an RST_STREAM frame not 4 bytes")
                call = calls.get(sid)
                if call is not None:
                    call.remote_closed = call.local_closed = True
                    if not call.done:
                        code = fr.u32(payload)
                        call.reset_code = code
                        call.refused = code == _REFUSED
                        call.done = True
                        _wake(call)
            elif ftype == fr.SETTINGS:
                if sid != 0:
                    raise fr.FrameError(fr.PROTOCOL_ERROR, "SETTINGS on a stream")
                if not flags & fr.ACK:
                    self._settings(payload)
                    wake_parked = True
            elif ftype == fr.WINDOW_UPDATE:
                if len(payload) != 4:
                    raise fr.FrameError(fr.FRAME_SIZE_ERROR, "a WINDOW_UPDATE frame not 4 bytes")
                increment = fr.u32(payload) & fr.MAX_WINDOW
                if sid == 0:
                    if increment == 0:
                        raise fr.FrameError(fr.PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
                    self.send_window += increment
                    if self.send_window > fr.MAX_WINDOW:
                        raise fr.FrameError(fr.FLOW_CONTROL_ERROR, "the send window overflowed")
                else:
                    call = calls.get(sid)
                    if call is not None:
                        call.window += increment
                wake_parked = True
            elif ftype == fr.PING:
                if len(payload) != 8:
                    raise fr.FrameError(fr.FRAME_SIZE_ERROR, "a PING frame not 8 bytes")
                if not flags & fr.ACK:
                    self.out.append(fr.frame(fr.PING, fr.ACK, 0, bytes(payload)))
            elif ftype == fr.GOAWAY:
                if len(payload) < 8:
                    raise fr.FrameError(fr.FRAME_SIZE_ERROR, "a GOAWAY frame under 8 bytes")
                self.goaway(fr.u32(payload) & fr.MAX_STREAM_ID, fr.u32(payload, 4))
                wake_parked = True
            elif ftype == fr.PUSH_PROMISE:
                raise fr.FrameError(fr.PROTOCOL_ERROR, "PUSH_PROMISE, which we disabled")
            # PRIORITY and unknown frame types are ignored
        if wake_parked:
            for call in self.parked:
                _wake(call)

    def _data(self, call: _Call | None, flags: int, payload: memoryview) -> None:
        size = len(payload)  # padding included: all of it counts against the windows
        self.unacked += size
        if self.unacked >= WINDOW_BYTES // 2:
            self.out.append(fr.window_update(0, self.unacked))
            self.unacked = 0
        if call is None or call.done:
            return  # a stream already answered or reset: the bytes only count for the window
        body = fr.unpad(payload, flags)
        if not call.data(body):
            call.done = True
            self.reset(call)
            _wake(call)
            return
        if flags & fr.END_STREAM:
            call.remote_closed = call.done = True
            _wake(call)
            return
        call.unacked += size
        if call.unacked >= WINDOW_BYTES // 2:
            self.out.append(fr.window_update(call.stream_id, call.unacked))
            call.unacked = 0

    def _headers(self, sid: int, flags: int, block: bytes | memoryview) -> None:
        # every block is decoded, a closed stream's too, to keep the HPACK table in step; a
        # server answers each call with the same few indexed-only blocks, decoded once
        key = bytes(block)
        headers = self.decoded.get(key)
        if headers is None:
            headers = self.decoder.decode(key, raw=True)  # type: ignore[assignment]
            if fr.indexed_only(key):
                if len(self.decoded) >= DECODED_BLOCKS:
                    self.decoded.clear()
                self.decoded[key] = headers  # type: ignore[assignment]
            else:  # the table may have changed: what the cached blocks meant, too
                self.decoded.clear()
        call = self.calls.get(sid)
        if call is None:
            return
        if not call.done:
            call.headers(headers)  # type: ignore[arg-type]
        if flags & fr.END_STREAM:
            call.remote_closed = True
            if not call.done:
                call.done = True
                _wake(call)

    def _settings(self, payload: memoryview) -> None:
        for key, value in fr.settings_values(payload):
            if key == fr.INITIAL_WINDOW_SIZE:
                if value > fr.MAX_WINDOW:
                    raise fr.FrameError(fr.FLOW_CONTROL_ERROR, f"an initial window of {value}")
                delta = value - self.initial_window
                self.initial_window = value
                for call in self.calls.values():
                    call.window += delta
            elif key == fr.MAX_FRAME_SIZE:
                if not fr.DEFAULT_FRAME <= value <= (1 << 24) - 1:
                    raise fr.FrameError(fr.PROTOCOL_ERROR, f"a max frame size of {value}")
                self.max_frame = value
            elif key == fr.MAX_CONCURRENT_STREAMS:
                self.max_streams = value
        self.out.append(fr.SETTINGS_ACK)

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
        if call.stream_id and not (call.local_closed and call.remote_closed):
            call.local_closed = call.remote_closed = True
            self.out.append(fr.rst_stream(call.stream_id, fr.CANCEL))

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
        self,
        call: _Call,
        block: bytes,
        pieces: Sequence[Buffer],
        nbytes: int,
        flag: int = 0,
    ) -> None:
        """Run ``call`` on this connection to completion (``call.done``): ``block`` is its
        header block (``_h2_frames.header_block``), ``pieces`` its message (``nbytes`` in all,
        sent as one gRPC message with compressed ``flag``); ``call.message`` gives the outcome.
        Cancellation resets the stream."""
        if len(self.calls) >= self.max_streams:
            await self.progress(
                call,
                lambda: not self.usable or len(self.calls) < self.max_streams,
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
        sid = self.next_stream_id
        if sid > fr.MAX_STREAM_ID:
            self.draining = True
            call.fail(
                RpcError(StatusCode.UNAVAILABLE, "stream ids exhausted", method=call.rpc),
                refused=True,
            )
            return
        self.next_stream_id = sid + 2
        call.stream_id = sid
        call.window = self.initial_window
        self.calls[sid] = call
        sent = False
        try:
            if self.first_block:
                self.first_block = False
                block = fr.TABLE_SIZE_ZERO + block
            out = self.out
            out.append(fr.headers_frames(sid, block, self.max_frame))
            size = nbytes + 5
            if size <= self.send_window and size <= call.window and size <= self.max_frame:
                out.append(
                    fr.frame_header(fr.DATA, fr.END_STREAM, sid, size)
                    + bytes((flag,))
                    + nbytes.to_bytes(4, "big")
                )
                out.extend(pieces)
                self.send_window -= size
                call.window -= size
                call.local_closed = sent = True
                await self.flush()
            else:
                sent = await self._send_large(call, pieces, nbytes, flag)
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

    async def _send_large(
        self, call: _Call, pieces: Sequence[Buffer], nbytes: int, flag: int = 0
    ) -> bool:
        """The message in DATA frames within the peer's windows and frame size; False when
        the call ended (or the connection died) before all of it was sent."""
        sid = call.stream_id
        segments: list[Buffer] = [bytes((flag,)) + nbytes.to_bytes(4, "big")]
        segments += [p if type(p) is bytes else memoryview(p).cast("B") for p in pieces]
        index, offset = 0, 0  # the next byte to send: segments[index][offset]
        remaining = nbytes + 5
        while not call.done and self.dead is None:
            window = self.window(call)
            if window <= 0:
                await self.flush()
                await self.progress(call, lambda: call.done or self.window(call) > 0, parked=True)
                continue
            queued = 0
            while window > 0 and queued < FLUSH_BYTES:
                n = min(window, self.max_frame, remaining)
                last = n == remaining
                self.out.append(fr.frame_header(fr.DATA, fr.END_STREAM if last else 0, sid, n))
                need = n
                while need:
                    seg = segments[index]
                    take = min(need, len(seg) - offset)
                    self.out.append(seg[offset : offset + take])
                    need -= take
                    offset += take
                    if offset == len(seg):
                        index, offset = index + 1, 0
                self.send_window -= n
                call.window -= n
                window -= n
                queued += n
                remaining -= n
                if last:
                    call.local_closed = True
                    await self.flush()
                    return True
            await self.flush()
        return False


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
    "CONNECTION_ERRORS",
    "DECODED_BLOCKS",
    "FLUSH_BYTES",
    "MAX_FRAME_BYTES",
    "RECEIVE_BYTES",
    "SEND_STALL_SECONDS",
    "WINDOW_BYTES",
    "Connection",
    "describe",
]

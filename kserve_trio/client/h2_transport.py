"""The h2 transport: unary gRPC calls over one HTTP/2 connection on anyio streams (asyncio or trio).

``H2Transport`` implements the client's ``Transport`` protocol with ``h2`` (the sans-I/O HTTP/2
state machine grpclib also uses) on top of ``anyio.connect_tcp`` (plus anyio's TLS stream with
ALPN ``h2`` for ``grpcs://``), so it runs wherever anyio runs. One connection per transport,
opened on the first call and reopened after a loss.

Who reads the socket. There is no background reader task: the tasks waiting for replies take
turns. Rules (``_Connection._progress``):
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
non-blocking ``recv(MSG_PEEK)``) and handles what the server sent meanwhile (GOAWAY, EOF).

Sends go out through one flusher at a time (``_flush``): whoever queues frames in the h2 state
machine calls it; if a flush is already running, that flusher picks the new bytes up before it
returns. Socket writes are shielded from cancellation (a half-written frame would corrupt the
connection for every call on it) and bounded by their own stall timeout instead.

Wire behaviour (gRPC over HTTP/2): HEADERS with ``:method POST``, ``:scheme``, ``:path``,
``:authority``, ``content-type: application/grpc``, ``te: trailers``, ``grpc-timeout`` from the
deadline and the caller's metadata; then the 5-byte-prefixed message in DATA frames within the
peer's flow-control windows. We advertise 64 MiB windows and 1 MiB frames. The reply's
``grpc-status`` / percent-decoded ``grpc-message`` become an ``RpcError`` with the same codes
and wording as the grpclib transport; message caps are checked before sending and when the
reply's length prefix arrives; a cancelled or timed-out call resets its stream (RST_STREAM
CANCEL). A stream the server provably did not process (GOAWAY with a lower last stream id,
RST_STREAM REFUSED_STREAM) is retried once on a fresh connection.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import anyio
import anyio.abc
import anyio.streams.tls
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from kserve_trio.client._h2_call import (
    _Call,
    _error_name,
    decode_grpc_message,
    grpc_timeout,
    metadata_headers,
    status_from_http,
    status_from_reset,
)
from kserve_trio.client.endpoint import Endpoint
from kserve_trio.client.errors import RpcError
from kserve_trio.client.tls import client_ssl_context, handshake_error_message
from kserve_trio.core.errors import StatusCode

R = TypeVar("R")

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
CLOSE_SECONDS = 1.0
USER_AGENT = b"kserve_trio-h2/1"

_CANCEL = h2.errors.ErrorCodes.CANCEL
_REFUSED = h2.errors.ErrorCodes.REFUSED_STREAM
_CONNECTION_ERRORS = (
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    anyio.EndOfStream,
    OSError,  # ssl.SSLError included
)


# --------------------------------------------------------------------------------------------
# One HTTP/2 connection


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


class _Connection:
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
        except _CONNECTION_ERRORS as exc:
            self.fail(f"connection to {self.address} lost: {_describe(exc)}")
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
        except _CONNECTION_ERRORS as exc:
            self.fail(f"connection to {self.address} lost: {_describe(exc)}")
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
            kind = type(event)
            if kind is h2.events.DataReceived:
                sid = event.stream_id
                if event.flow_controlled_length:
                    self.h2.acknowledge_received_data(event.flow_controlled_length, sid)
                call = calls.get(sid)
                if call is not None and not call.done and not call.data(event.data):
                    call.done = True
                    self.reset(call)
                    _wake(call)
            elif kind is h2.events.ResponseReceived or kind is h2.events.TrailersReceived:
                call = calls.get(event.stream_id)
                if call is not None:
                    call.headers(event.headers)
            elif kind is h2.events.StreamEnded:
                call = calls.get(event.stream_id)
                if call is not None:
                    call.done = True
                    _wake(call)
            elif kind is h2.events.StreamReset:
                call = calls.get(event.stream_id)
                if call is not None and not call.done:
                    call.reset_code = event.error_code
                    call.refused = event.error_code == _REFUSED
                    call.done = True
                    _wake(call)
            elif kind is h2.events.WindowUpdated or kind is h2.events.RemoteSettingsChanged:
                wake_parked = True
            elif kind is h2.events.ConnectionTerminated:
                self.goaway(event.last_stream_id, event.error_code)
                wake_parked = True
        if wake_parked:
            for call in self.parked:
                _wake(call)

    def goaway(self, last_stream_id: int | None, error_code: int) -> None:
        """GOAWAY: no new streams here; streams above ``last_stream_id`` were not processed
        (retry-safe); the others may still complete."""
        self.draining = True
        last = last_stream_id if last_stream_id is not None else 0
        for sid, call in self.calls.items():
            if sid > last and not call.done:
                call.fail(
                    RpcError(
                        StatusCode.UNAVAILABLE,
                        f"{self.address} is going away ({_error_name(error_code)}); the call "
                        "was not processed",
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
        """Return once ``ready()`` holds or the connection died (rules 1-4, module docstring).

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


def _authority(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _describe(exc: BaseException) -> str:
    text = str(exc)
    if not text and exc.__cause__ is not None:
        text = str(exc.__cause__)
    return text or type(exc).__name__


# --------------------------------------------------------------------------------------------
# The transport


_NOT_SET: Any = object()


class H2Transport:
    """A ``Transport`` over one HTTP/2 connection on anyio streams (asyncio or trio).

    Bound to the event loop of its first call. ``async with H2Transport(endpoint) as t`` closes
    it on exit; otherwise ``aclose()`` (from its loop) or ``close()`` (from any thread).
    ``server_hostname`` is the name the server's TLS certificate is checked against and the
    ``:authority`` sent, when it differs from the host connected to (the gateway connects to a
    worker's resolved address but verifies the name it was configured with).
    """

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._hostname = server_hostname or endpoint.host
        context = ssl_context or endpoint.ssl_context
        if context is None and endpoint.secure:
            context = client_ssl_context()
        self._ssl = context
        self._conn: _Connection | None = None
        self._connecting: anyio.Lock | None = None
        self._address = endpoint.address
        scheme = b"https" if context is not None else b"http"
        self._base = [
            (b":method", b"POST"),
            (b":scheme", scheme),
            (b":path", b""),
            (b":authority", _authority(self._hostname, endpoint.port).encode("idna")),
            (b"te", b"trailers"),
            (b"content-type", b"application/grpc"),
            (b"user-agent", USER_AGENT),
        ]
        self._headers: dict[str, list[tuple[bytes, bytes]]] = {}

    def __repr__(self) -> str:
        return f"H2Transport({self._address})"

    async def __aenter__(self) -> H2Transport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- connections -------------------------------------------------------------------------

    async def _connection(self, rpc: str) -> _Connection:
        conn = self._conn
        if conn is not None and conn.usable:
            if conn.calls or conn.reading:
                return conn
            if conn.peek_idle():
                with anyio.move_on_after(CLOSE_SECONDS):
                    await conn.read_once()  # what the server sent while nobody was reading
            if conn.usable:
                return conn
        if self._connecting is None:
            self._connecting = anyio.Lock()
        async with self._connecting:
            conn = self._conn
            if conn is not None and conn.usable:
                return conn
            if conn is not None and not conn.calls:
                with anyio.move_on_after(CLOSE_SECONDS):
                    await conn.aclose()
            self._conn = conn = await self._connect(rpc)
            return conn

    async def _connect(self, rpc: str) -> _Connection:
        host, port, address = self.endpoint.host, self.endpoint.port, self._address
        try:
            stream: anyio.abc.ByteStream = await anyio.connect_tcp(host, port)
        except OSError as exc:
            raise RpcError(
                StatusCode.UNAVAILABLE, f"cannot reach {address}: {_describe(exc)}", method=rpc
            ) from None
        try:
            if self._ssl is not None:
                try:
                    stream = await anyio.streams.tls.TLSStream.wrap(
                        stream,
                        hostname=self._hostname,
                        ssl_context=self._ssl,
                        standard_compatible=False,
                    )
                except _CONNECTION_ERRORS as exc:
                    raise RpcError(
                        StatusCode.UNAVAILABLE, handshake_error_message(address, exc), method=rpc
                    ) from None
                alpn = stream.extra(anyio.streams.tls.TLSAttribute.alpn_protocol, None)
                if alpn not in (None, "h2"):
                    raise RpcError(
                        StatusCode.UNAVAILABLE,
                        f"{address} negotiated {alpn!r} instead of HTTP/2 (ALPN h2)",
                        method=rpc,
                    )
            conn = _Connection(stream, address)
            await conn.start()
        except BaseException:  # cancellation included: the socket is not left to the GC
            await anyio.aclose_forcefully(stream)
            raise
        return conn

    # -- calls -------------------------------------------------------------------------------

    def _request_headers(
        self, method: str, timeout: float | None, metadata: Mapping[str, Any] | None
    ) -> list[tuple[bytes, bytes]]:
        base = self._headers.get(method)
        if base is None:
            base = list(self._base)
            base[2] = (b":path", method.encode("ascii"))
            self._headers[method] = base
        if timeout is None and not metadata:
            return base
        headers = list(base)
        if timeout is not None:
            headers.append((b"grpc-timeout", grpc_timeout(timeout)))
        if metadata:
            headers.extend(metadata_headers(metadata))
        return headers

    async def unary(
        self,
        method: str,
        request: Any,
        reply_type: type[R],
        *,
        timeout: float | None = None,
        metadata: Mapping[str, str] | None = None,
        compressed_with: str | None = None,
    ) -> R:
        """One unary call; see ``Transport.unary`` for the error contract.

        ``compressed_with`` names the ``grpc-encoding`` ``request`` is already compressed with
        (a proxy forwarding a compressed message as it received it): the message goes out
        flagged compressed, with that header."""
        rpc = method[method.rfind("/") + 1 :]
        payload = request if type(request) is bytes else bytes(request)
        cap = self.endpoint.max_send_message_length
        if len(payload) > cap:
            raise RpcError(
                StatusCode.RESOURCE_EXHAUSTED,
                f"sent message larger than max ({len(payload)} vs. {cap})",
                method=rpc,
                retryable=False,
            )
        flag = 0
        if timeout is None:
            headers = self._request_headers(method, timeout, metadata)
            if compressed_with:
                headers, flag = [*headers, (b"grpc-encoding", compressed_with.encode())], 1
            data = await self._call(rpc, headers, payload, flag)
        else:
            if not timeout > 0:
                raise RpcError(
                    StatusCode.DEADLINE_EXCEEDED,
                    f"deadline exceeded before {rpc} was sent to {self._address}",
                    method=rpc,
                )
            headers = self._request_headers(method, timeout, metadata)
            if compressed_with:
                headers, flag = [*headers, (b"grpc-encoding", compressed_with.encode())], 1
            data = _NOT_SET
            with anyio.CancelScope(deadline=anyio.current_time() + timeout):
                data = await self._call(rpc, headers, payload, flag)
            if data is _NOT_SET:
                raise RpcError(
                    StatusCode.DEADLINE_EXCEEDED,
                    f"deadline of {timeout:.3f}s exceeded calling {rpc} on {self._address}",
                    method=rpc,
                )
        try:
            return reply_type.FromString(data)  # type: ignore[attr-defined]
        except Exception as exc:
            raise RpcError(
                StatusCode.INTERNAL, f"cannot parse the {rpc} reply: {exc}", method=rpc
            ) from None

    async def _call(
        self, rpc: str, headers: list[tuple[bytes, bytes]], payload: bytes, flag: int = 0
    ) -> bytes:
        cap = self.endpoint.max_receive_message_length
        for attempt in range(2):
            conn = await self._connection(rpc)
            call = _Call(rpc, cap)
            await conn.request(call, headers, payload, flag)
            if call.refused and attempt == 0:
                continue  # the server did not process it: once more, on a fresh connection
            return call.message(self._address)
        raise AssertionError("unreachable")  # pragma: no cover

    # -- closing -----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the connection (from the loop that owns it); calls in flight fail UNAVAILABLE.
        The transport stays usable: a later call reconnects."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with anyio.move_on_after(CLOSE_SECONDS, shield=True):
                await conn.aclose()

    def close(self) -> None:
        """Close from any thread, best effort: the socket is shut down and the owning loop
        sees the end of the connection."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()


__all__ = [
    "MAX_FRAME_BYTES",
    "WINDOW_BYTES",
    "H2Transport",
    "decode_grpc_message",
    "grpc_timeout",
    "metadata_headers",
    "status_from_http",
    "status_from_reset",
]

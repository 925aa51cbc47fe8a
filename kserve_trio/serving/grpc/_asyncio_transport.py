"""The asyncio (and uvloop) transport of a gRPC connection: the event loop's own transport
under ``ServerConnection``, with no task and no stream in between.

The server accepts on its listening sockets itself (``serving.accept``) and gives each accepted
socket a transport of the event loop's own, TLS included (uvloop's native TLS, not a
Python-level ``MemoryBIO``), with this protocol: received bytes go straight into
``ServerConnection.feed`` from the transport's callback, and the writes of one loop turn go in
one ``transport.write`` from one callback (``wake_writer`` schedules it once), so replies
finished in the same turn share a write and nothing waits on a task switch.

Backpressure: while the transport's buffer is above its high-water mark (``pause_writing``)
nothing more is taken from the connection, whose senders wait on ``queued_bytes``; reading is
paused and resumed on the connection's word.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Mapping

import anyio
import sniffio

from kserve_trio.core.logging import get_logger
from kserve_trio.serving.accept import Slot
from kserve_trio.serving.edge_stats import EdgeStats
from kserve_trio.serving.grpc._connection import OnClosed, ServerConnection
from kserve_trio.serving.grpc._methods import Method
from kserve_trio.serving.grpc._settings import ServerSettings

log = get_logger("kserve_trio.serving.grpc")


class AsyncioTransport(asyncio.Protocol):
    """One connection's asyncio transport and callbacks (module docstring)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.conn: ServerConnection | None = None
        self._loop = asyncio.get_running_loop()
        self._early: list[bytes] = []  # what arrived before the connection was bound
        self._write_scheduled = False
        self._paused = False
        self._stopped = False
        self._closed = anyio.Event()
        self._drained: anyio.Event | None = None

    def bind(self, conn: ServerConnection) -> None:
        """Feed ``conn`` from now on, starting with what arrived before."""
        self.conn = conn
        early, self._early = self._early, []
        for data in early:
            self.data_received(data)

    # ---- the event loop's callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        conn = self.conn
        if self._stopped:
            return  # the connection has ended: what still comes is dropped
        if conn is None:
            self._early.append(data)
            return
        try:
            if not conn.feed(data):
                self._stopped = True
        except Exception as exc:  # a bug must end this connection only
            log.error("connection_feed_failed", error=repr(exc)[:500], exc_info=exc)
            self._stopped = True
            conn.lost()

    def eof_received(self) -> bool:
        if self.conn is not None:
            self.conn.lost()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed.set()
        self._paused = False
        if self.conn is not None:
            self.conn.lost()
            self.conn.writable()
        self._wake_drained()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self.wake_writer()
        if self.conn is not None:
            self.conn.writable()

    # ---- what the connection asks (``Transport``)

    def wake_writer(self) -> None:
        if not self._write_scheduled:
            self._write_scheduled = True
            self._loop.call_soon(self._write)

    def _write(self) -> None:
        self._write_scheduled = False
        transport, conn = self.transport, self.conn
        if transport is None or conn is None or self._paused or transport.is_closing():
            self._wake_drained()
            return
        data = conn.data_to_send()
        if data:
            try:
                transport.write(data)
            except (RuntimeError, OSError):
                conn.lost()
        self._wake_drained()

    def _wake_drained(self) -> None:
        event = self._drained
        if event is not None:
            self._drained = None
            event.set()

    async def flush(self) -> None:
        transport = self.transport
        while transport is not None and not transport.is_closing():
            conn = self.conn
            if not self._paused and conn is not None:
                data = conn.data_to_send()
                if data:
                    transport.write(data)
                    continue
                if not transport.get_write_buffer_size():
                    return
            event = self._drained = anyio.Event()
            await event.wait()

    def pause_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def buffered(self) -> int:
        transport = self.transport
        return transport.get_write_buffer_size() if transport is not None else 0

    def stop(self) -> None:
        self._stopped = True

    async def linger(self) -> None:
        transport = self.transport
        if transport is None:
            return
        if transport.can_write_eof():
            transport.write_eof()
        await self._closed.wait()

    def peer(self) -> str:
        address = self.transport.get_extra_info("peername") if self.transport else None
        if isinstance(address, tuple):
            return f"{address[0]}:{address[1]}"
        return str(address or "")


def loop_transport_available() -> bool:
    """Whether the running event loop is asyncio's (uvloop included): then accepted sockets get
    its own transports (``serve_socket``); elsewhere the anyio stream transport serves."""
    return sniffio.current_async_library() == "asyncio"


async def serve_socket(
    sock: socket.socket,
    ssl_context: ssl.SSLContext | None,
    methods: Mapping[str, Method],
    settings: ServerSettings,
    stats: EdgeStats,
    on_closed: OnClosed,
    started: OnClosed,
    slot: Slot | None = None,
) -> None:
    """Serve an accepted socket on the running asyncio loop until its connection ends.
    ``started(conn)`` is told of the connection once it exists (the server's bookkeeping);
    ``slot``: its place under the port's cap (``serving.accept``)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    loop = asyncio.get_running_loop()
    proto = AsyncioTransport()
    handshake = settings.limits.handshake_seconds or None
    try:
        with anyio.fail_after(handshake):
            if ssl_context is None:
                await loop.connect_accepted_socket(lambda: proto, sock)
            else:
                await loop.connect_accepted_socket(
                    lambda: proto, sock, ssl=ssl_context, ssl_handshake_timeout=handshake
                )
    except BaseException as exc:  # cancelled too (evicted, shut down): closed all the same
        sock.close()
        if not isinstance(exc, Exception):
            raise
        if isinstance(exc, TimeoutError):
            stats.refuse_connection("handshake_timeout")
        log.info("tls_handshake_failed" if ssl_context else "accept_failed", error=repr(exc)[:200])
        return
    conn = ServerConnection(methods, settings, proto, on_closed, stats, slot)
    started(conn)
    try:
        conn.start()
        async with anyio.create_task_group() as tg:
            await tg.start(conn.run)
            proto.bind(conn)
    finally:
        transport = proto.transport
        if transport is not None and not transport.is_closing():
            transport.close()


__all__ = ["AsyncioTransport", "loop_transport_available", "serve_socket"]

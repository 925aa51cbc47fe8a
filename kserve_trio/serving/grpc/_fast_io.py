"""The connection's bytes on asyncio without anyio's stream in between: the one place our gRPC
layer touches asyncio.

On asyncio (and uvloop) the server accepts on its listening sockets itself (``serving.accept``)
and gives each accepted socket (``open_native``) a transport of the event loop's own, TLS
included (uvloop's native TLS, not a Python-level ``MemoryBIO``), with a protocol of ours: received bytes go straight into
``Connection.feed`` from the transport's callback, with no read task, no wake-up and no
pause/resume of the transport per read, and writes go straight to ``transport.write``, which
takes them whole and synchronously. That is how the raw asyncio + h2 floor works, and it is
where the layer's cost above that floor per request went on the latency path
(docs/benchmarks.md). A connection that arrives as an anyio stream on asyncio TCP is taken over
the same way (``attach``); on trio the connection keeps anyio's read loop and writer task.

Backpressure: the transport's ``pause_writing`` / ``resume_writing`` become ``writable``, which
the writer waits for before it writes more; ``pause_reading`` is the connection's to call when
it holds enough unread bytes.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import TYPE_CHECKING, Any

import anyio

from kserve_trio.core.event_loops import asyncio_transport
from kserve_trio.core.logging import get_logger

if TYPE_CHECKING:
    from kserve_trio.serving.grpc._connection import Connection

log = get_logger("kserve_trio.serving.grpc")


class FastIO(asyncio.Protocol):
    """A connection's transport and the callbacks it calls (module docstring)."""

    def __init__(self, transport: Any = None, conn: Connection | None = None) -> None:
        self.transport = transport
        self.conn = conn
        self.paused = False
        self._resumed: anyio.Event | None = None
        self._early: list[bytes] = []  # what arrived before a connection was bound
        self.lost = anyio.Event()

    def bind(self, conn: Connection) -> None:
        """Feed ``conn`` from now on, starting with what arrived before."""
        self.conn = conn
        early, self._early = self._early, []
        for data in early:
            self.data_received(data)

    def peer(self) -> str:
        """The client's ``host:port``."""
        address = self.transport.get_extra_info("peername") if self.transport else None
        if isinstance(address, tuple):
            return f"{address[0]}:{address[1]}"
        return str(address or "")

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    # ---- the transport's callbacks

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.lost.is_set():
            return  # the connection stopped reading; it closes soon
        if self.conn is None:
            self._early.append(data)
            return
        try:
            if not self.conn.feed(data):
                self.lost.set()
        except Exception as exc:  # a bug must end this connection only
            log.error("connection_feed_failed", error=repr(exc)[:500], exc_info=exc)
            self.lost.set()

    def eof_received(self) -> bool:
        self.lost.set()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.set()
        self._resume()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self._resume()

    def _resume(self) -> None:
        self.paused = False
        resumed = self._resumed
        if resumed is not None:
            self._resumed = None
            resumed.set()

    # ---- what the connection calls

    def write(self, data: bytes) -> bool:
        """Hand ``data`` to the transport; False when it is closing (the peer is gone)."""
        if self.transport.is_closing():
            return False
        try:
            self.transport.write(data)
        except (RuntimeError, OSError):
            return False
        return True

    async def writable(self) -> None:
        """Return once the transport's buffer is below its high-water mark."""
        while self.paused and not self.lost.is_set():
            resumed = self._resumed
            if resumed is None:
                resumed = self._resumed = anyio.Event()
            await resumed.wait()


async def open_native(
    sock: socket.socket, ssl_context: ssl.SSLContext | None, handshake_timeout: float | None
) -> FastIO:
    """An accepted socket as a native transport (TLS handshake done) and its ``FastIO``;
    ``handshake_timeout`` None: asyncio's default."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    loop = asyncio.get_running_loop()
    fast = FastIO()
    try:
        if ssl_context is None:
            await loop.connect_accepted_socket(lambda: fast, sock)
        else:
            await loop.connect_accepted_socket(
                lambda: fast, sock, ssl=ssl_context, ssl_handshake_timeout=handshake_timeout
            )
    except BaseException:
        sock.close()
        raise
    return fast


def attach(stream: object, conn: Connection) -> FastIO | None:
    """Take over ``stream``'s transport for ``conn`` when it is asyncio TCP (else None)."""
    found = asyncio_transport(stream)
    if found is None:
        return None
    transport, old = found
    fast = FastIO(transport, conn)
    transport.set_protocol(fast)
    if not transport.is_reading():  # anyio keeps it paused between its own reads
        transport.resume_reading()
    # What arrived before the swap (the client's preface, often) is in anyio's queue.
    queued = list(getattr(old, "read_queue", ()))
    for chunk in queued:
        fast.data_received(chunk)
    if transport.is_closing() or getattr(old, "is_at_eof", False):
        fast.lost.set()
    return fast


__all__ = ["FastIO", "attach", "open_native"]

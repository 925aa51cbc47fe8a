"""``GrpcServer``: listeners, connections and the drain, all inside the caller's task tree.

``await tg.start(server.serve, host, port, ssl_context)`` binds (port 0: an ephemeral port;
the bound one is what ``start`` returns and ``server.port``), then runs one accept loop per
listening socket and a task per connection in the server's own task group. ``shutdown(grace)``
is the orderly end:

1. the listeners close, so no new connection is accepted;
2. every connection starts its two-phase GOAWAY (``Connection.start_drain``), so clients stop
   opening streams on it and move elsewhere without losing a request in flight;
3. the calls in flight finish for up to ``grace`` seconds; what is left is cancelled;
4. ``serve`` returns.

An accept that fails because the process is out of descriptors or memory (EMFILE, ENFILE,
ENOBUFS, ENOMEM) is logged and retried after a short back-off; the connections being served
are not affected. TLS connections finish their handshake (ALPN ``h2``) within
``limits.handshake_seconds`` or are closed.
"""

from __future__ import annotations

import errno
import socket
import ssl
from collections.abc import Mapping

import anyio
import anyio.abc
from anyio.streams.tls import TLSStream

from kserve_trio.core.logging import get_logger
from kserve_trio.serving.edge_stats import EdgeStats
from kserve_trio.serving.grpc._connection import Connection
from kserve_trio.serving.grpc._fast_io import acceptor, open_native
from kserve_trio.serving.grpc._methods import Method
from kserve_trio.serving.grpc._settings import ServerSettings, warn_removed_switches

log = get_logger("kserve_trio.serving.grpc")

_ACCEPT_RETRY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_ACCEPT_BACKOFF_SECONDS = (0.005, 0.05, 0.2)


class GrpcServer:
    """A gRPC server on ``methods`` (path -> ``Method``); see the module docstring."""

    def __init__(
        self,
        methods: Mapping[str, Method],
        settings: ServerSettings | None = None,
        stats: EdgeStats | None = None,
    ) -> None:
        warn_removed_switches()
        self.methods = dict(methods)
        self.settings = settings or ServerSettings()
        self.stats = stats or EdgeStats()
        """What the edge defences did (shared with the process's other servers)."""
        self.port = 0
        self.connections: set[Connection] = set()
        self._accepting = anyio.CancelScope()
        self._scope: anyio.CancelScope | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._ssl: ssl.SSLContext | None = None
        self._no_connections: anyio.Event | None = None
        self._shutting_down = False
        self._listener: anyio.abc.Listener[anyio.abc.SocketStream] | None = None

    async def serve(
        self,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None = None,
        *,
        reuse_port: bool = False,
        task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind and serve until ``shutdown`` (or cancellation); ``task_status`` gets the port.
        ``reuse_port``: bind with SO_REUSEPORT, so several processes share the port (the
        kernel spreads new connections over their listening sockets)."""
        self._ssl = ssl_context
        listener = await anyio.create_tcp_listener(
            local_host=host, local_port=port, reuse_port=reuse_port
        )
        self._listener = listener
        listeners = [one for one in listener.listeners if isinstance(one, anyio.abc.SocketListener)]
        self.port = int(listeners[0].extra(anyio.abc.SocketAttribute.local_port))
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                self._scope = tg.cancel_scope
                for one in listeners:
                    tg.start_soon(self._accept_loop, one)
                task_status.started(self.port)
        finally:
            with anyio.CancelScope(shield=True):
                await listener.aclose()

    async def _accept_loop(self, listener: anyio.abc.SocketListener) -> None:
        failures = 0
        native = acceptor(listener)
        with self._accepting:
            while True:
                try:
                    if native is not None:
                        sock, _ = await native()
                        assert self._tg is not None
                        self._tg.start_soon(self._serve_socket, sock)
                        failures = 0
                        continue
                    stream = await listener.accept()
                except OSError as exc:
                    if exc.errno not in _ACCEPT_RETRY_ERRNOS:
                        raise
                    pause = _ACCEPT_BACKOFF_SECONDS[min(failures, len(_ACCEPT_BACKOFF_SECONDS) - 1)]
                    failures += 1
                    log.warning("accept_failed", error=exc.strerror, retry_seconds=pause)
                    await anyio.sleep(pause)
                    continue
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    return
                failures = 0
                assert self._tg is not None
                self._tg.start_soon(self._serve_connection, stream)

    async def _serve_socket(self, sock: socket.socket) -> None:
        """An accepted socket on asyncio: a native transport (TLS on it when configured)."""
        try:
            with anyio.fail_after(self.settings.limits.handshake_seconds):
                fast = await open_native(sock, self._ssl, self.settings.limits.handshake_seconds)
        except Exception as exc:
            log.info(
                "tls_handshake_failed" if self._ssl else "accept_failed", error=repr(exc)[:200]
            )
            return
        await self._run(Connection(None, self.methods, self.settings, self._closed, fast))

    async def _serve_connection(self, stream: anyio.abc.ByteStream) -> None:
        if self._ssl is not None:
            try:
                with anyio.fail_after(self.settings.limits.handshake_seconds):
                    stream = await TLSStream.wrap(
                        stream, server_side=True, ssl_context=self._ssl, standard_compatible=False
                    )
            except Exception as exc:
                log.info("tls_handshake_failed", error=repr(exc)[:200])
                with anyio.CancelScope(shield=True):
                    await stream.aclose()
                return
        await self._run(Connection(stream, self.methods, self.settings, self._closed))

    async def _run(self, conn: Connection) -> None:
        self.connections.add(conn)
        if self._shutting_down:
            conn.start_drain()
        try:
            await conn.run()
        except Exception as exc:  # a bug in one connection must not end the server
            log.error("connection_failed", error=repr(exc)[:500], exc_info=exc)

    def _closed(self, conn: Connection) -> None:
        self.connections.discard(conn)
        if not self.connections and self._no_connections is not None:
            self._no_connections.set()

    async def shutdown(self, grace: float) -> int:
        """The orderly end of the module docstring; returns once every connection is closed,
        with the number of calls that were still running after ``grace`` and were cancelled."""
        self._shutting_down = True
        self._accepting.cancel()
        if self._listener is not None:  # refused from now on, not queued and reset later
            with anyio.CancelScope(shield=True):
                await self._listener.aclose()
        for conn in list(self.connections):
            conn.start_drain()
        with anyio.move_on_after(grace):
            while self.connections:
                self._no_connections = anyio.Event()
                await self._no_connections.wait()
        cancelled = self.running_calls()
        for conn in list(self.connections):
            conn.close_calls()
        with anyio.move_on_after(1.0):
            while self.connections:
                self._no_connections = anyio.Event()
                await self._no_connections.wait()
        if self._scope is not None:
            self._scope.cancel()
        return cancelled

    def running_calls(self) -> int:
        """Calls in flight on every connection."""
        return sum(len(conn.calls) for conn in self.connections)


__all__ = ["GrpcServer"]

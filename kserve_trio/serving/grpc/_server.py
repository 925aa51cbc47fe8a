"""``GrpcServer``: listeners, connections and the drain, all inside the caller's task tree.

``await tg.start(server.serve, host, port, ssl_context)`` binds (port 0: an ephemeral port;
the bound one is what ``start`` returns and ``server.port``), then runs one accept loop per
listening socket and a task per connection in the server's own task group. ``shutdown(grace)``
is the orderly end:

1. the listeners close, so no new connection is accepted;
2. every connection starts its two-phase GOAWAY (``ServerConnection.start_drain``), so clients stop
   opening streams on it and move elsewhere without losing a request in flight;
3. the calls in flight finish for up to ``grace`` seconds; what is left is cancelled;
4. ``serve`` returns.

Accepting is ``serving.accept``'s loop: a port that cannot be bound is a ``ListenError`` (the
only error that stops the start), the open connections are capped at ``connection_cap`` (the
listener's share of the process's descriptors, ``serving.fd_budget``; at the cap the
longest-idle connection is evicted for the new one, with a GOAWAY when it speaks HTTP/2), and
an accept that fails because the process is out of descriptors or memory backs off without
touching the connections being served. TLS connections finish their handshake (ALPN ``h2``)
within ``limits.handshake_seconds`` or are closed.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Mapping

import anyio
import anyio.abc
from anyio.streams.tls import TLSStream

from kserve_trio.core.logging import get_logger
from kserve_trio.serving.accept import ConnectionCap, Slot, accept_loop, bind, listening_sockets
from kserve_trio.serving.edge_stats import EdgeStats
from kserve_trio.serving.grpc._asyncio_transport import loop_transport_available, serve_socket
from kserve_trio.serving.grpc._connection import ServerConnection
from kserve_trio.serving.grpc._methods import Method
from kserve_trio.serving.grpc._settings import ServerSettings, warn_removed_switches
from kserve_trio.serving.grpc._stream_transport import serve_stream
from kserve_trio.serving.peer_ledger import PeerLedger

log = get_logger("kserve_trio.serving.grpc")


class GrpcServer:
    """A gRPC server on ``methods`` (path -> ``Method``); see the module docstring."""

    def __init__(
        self,
        methods: Mapping[str, Method],
        settings: ServerSettings | None = None,
        stats: EdgeStats | None = None,
        connection_cap: int | None = None,
    ) -> None:
        """``connection_cap``: this listener's cap on open connections (the composition root's
        ``FdBudget.connection_cap``); ``None``: ``limits.max_connections``."""
        warn_removed_switches()
        self.methods = dict(methods)
        self.settings = settings or ServerSettings()
        self.stats = stats or EdgeStats()
        """What the edge defences did (shared with the process's other servers)."""
        self.port = 0
        self.connections: set[ServerConnection] = set()
        self._accepting = anyio.CancelScope()
        self._scope: anyio.CancelScope | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._ssl: ssl.SSLContext | None = None
        self._no_connections: anyio.Event | None = None
        self._shutting_down = False
        self._listener: anyio.abc.Listener[anyio.abc.SocketStream] | None = None
        self._accept_loops_done = anyio.Event()
        self.cap = ConnectionCap(
            self.settings.limits.max_connections if connection_cap is None else connection_cap,
            self.stats,
            "grpc",
            PeerLedger(
                self.settings.limits.max_connections_per_peer_per_second,
                self.settings.limits.peer_probation_seconds,
            ),
        )
        """The open connections against the cap (module docstring)."""

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
        listener = await bind(host, port, reuse_port=reuse_port)
        self._listener = listener
        sockets = listening_sockets(listener)
        self.port = int(sockets[0].getsockname()[1])
        serve_one = self._serve_socket if loop_transport_available() else self._serve_stream
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                self._scope = tg.cancel_scope
                tg.start_soon(self._accept, sockets, serve_one, tg)
                task_status.started(self.port)
        finally:
            self._accept_loops_done.set()  # also when ``_accept`` never got to run
            with anyio.CancelScope(shield=True):
                await listener.aclose()

    async def _accept(self, sockets, serve_one, tg: anyio.abc.TaskGroup) -> None:
        """One accept loop per listening socket until ``shutdown`` stops them; the
        connections are tasks of the server's group ``tg``, so they outlive the loops."""
        try:
            with self._accepting:
                async with anyio.create_task_group() as loops:
                    for raw in sockets:
                        loops.start_soon(accept_loop, raw, self.cap, serve_one, tg)
        finally:
            self._accept_loops_done.set()

    async def _serve_socket(self, sock: socket.socket, slot: Slot) -> None:
        """An accepted socket on asyncio: the loop's own transport (TLS on it when set)."""
        try:
            await serve_socket(
                sock,
                self._ssl,
                self.methods,
                self.settings,
                self.stats,
                self._closed,
                self._opened,
                slot,
            )
        except Exception as exc:  # a bug in one connection must not end the server
            log.error("connection_failed", error=repr(exc)[:500], exc_info=exc)

    async def _serve_stream(self, sock: socket.socket, slot: Slot) -> None:
        """An accepted socket on trio: anyio's stream over it (TLS through ``TLSStream``)."""
        try:
            stream: anyio.abc.ByteStream = await anyio.abc.SocketStream.from_socket(sock)
        except BaseException:
            sock.close()
            raise
        if self._ssl is not None:
            try:
                with anyio.fail_after(self.settings.limits.handshake_seconds or None):
                    stream = await TLSStream.wrap(
                        stream, server_side=True, ssl_context=self._ssl, standard_compatible=False
                    )
            except BaseException as exc:  # cancelled too (evicted, shut down): closed all the same
                if isinstance(exc, TimeoutError):
                    self.stats.refuse_connection("handshake_timeout")
                with anyio.CancelScope(shield=True):
                    await stream.aclose()
                if not isinstance(exc, Exception):
                    raise
                log.info("tls_handshake_failed", error=repr(exc)[:200])
                return
        try:
            await serve_stream(
                stream, self.methods, self.settings, self.stats, self._closed, self._opened, slot
            )
        except Exception as exc:  # a bug in one connection must not end the server
            log.error("connection_failed", error=repr(exc)[:500], exc_info=exc)

    def _opened(self, conn: ServerConnection) -> None:
        self.connections.add(conn)
        if self._shutting_down:
            conn.start_drain()

    def _closed(self, conn: ServerConnection) -> None:
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
                await self._accept_loops_done.wait()  # none waits on a socket being closed
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

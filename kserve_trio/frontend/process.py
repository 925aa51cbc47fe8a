"""One front-end process of a worker: ``python -m kserve_trio frontend`` (started by the
device process, never by hand).

It inherits three descriptors from the device process: its end of the channel's socket pair
and the two arenas (``serving.ipc``). The first message on the channel is ``Hello``
(``read_hello``): the worker's resolved configuration, this front end's index and the RPCs to
forward. The front end then binds the worker's gRPC (and REST) address with SO_REUSEPORT and
listens, beside the other front ends (the device process holds the same addresses bound and
never listens, so port 0 resolved once and the port stays reserved across a restart), says
``Ready`` and serves.

Its own, per process: the edge limits (connections, streams, bytes in flight, deadlines; they
protect this process's memory), TLS, restricted protocols, the edge counters (sent to the
device process as an exposition when they changed, at most once a ``EDGE_PUSH_SECONDS``, so
the worker's ``/metrics`` shows them per front end), and the idle trim that gives its freed
heap back once it forwards nothing (``serving.process_tuning``).

It ends when the device process says ``Drain`` (the worker's shutdown: GOAWAY, the calls in
flight finish within the grace period), on SIGTERM or SIGINT (the same drain), and at once when
the channel closes: the device process is gone (the kernel closes its end however it ended,
SIGKILL included), so nothing it was asked will be answered (the parent-death signal its
launcher asked for, ``serving.supervisor``, comes then too: the same drain, cut short by the
closing channel).
"""

from __future__ import annotations

import functools
import socket
import ssl
from dataclasses import asdict

import anyio
import anyio.abc

from kserve_trio.core.logging import LogSettings, get_logger
from kserve_trio.core.process.config import ServerConfig
from kserve_trio.core.process.restricted import Restrictions
from kserve_trio.frontend.forwarding import ForwardedRest, forwarded_methods
from kserve_trio.serving.admission import InflightBytes
from kserve_trio.serving.background import shutdown_signals
from kserve_trio.serving.edge_stats import EdgeCollector, EdgeStats
from kserve_trio.serving.grpc import GrpcServer
from kserve_trio.serving.ipc import Arena, Channel, DeviceLink, Edge, Hello, Ready
from kserve_trio.serving.process_tuning import run_idle_trim
from kserve_trio.serving.trace_control import tracing_installed

log = get_logger("kserve_trio.frontend")

EDGE_PUSH_SECONDS = 1.0
"""How often a front end looks whether its edge counters changed (and sends them if so)."""

DRAIN_SECONDS = 5.0
"""The grace a drain gives the calls in flight (the worker's own drain waits this long too)."""


class Frontend:
    """One front end's servers and its link (module docstring)."""

    def __init__(self, hello: Hello, sock: socket.socket, requests: Arena, replies: Arena) -> None:
        self.config: ServerConfig = hello.config
        self.index = hello.index
        self.rpcs = hello.rpcs
        self.shutting_down = hello.shutting_down
        self.sock = sock
        self.requests = requests
        self.replies = replies
        self.stats = EdgeStats()
        self.closing = anyio.Event()
        self.drained = False

    async def run(self) -> int:
        """Serve until drained (0) or the device process is gone (1)."""
        from kserve_trio.serving.fd_budget import FdBudget, open_file_limit
        from kserve_trio.serving.grpc import Limits, ServerSettings
        from kserve_trio.serving.restricted import restrict
        from kserve_trio.serving.tls import server_ssl_context

        config = self.config
        ep = config.endpoints
        channel = Channel(await anyio.abc.SocketStream.from_socket(self.sock))
        link = DeviceLink(channel, self.requests, self.replies)
        inflight = InflightBytes(
            config.limits.max_inflight_bytes, config.limits.max_inflight_bytes_per_connection
        )
        self.stats.inflight_bytes = lambda: inflight.used
        limits = Limits(
            config.grpc.max_recv_msg_bytes,
            config.grpc.max_send_msg_bytes,
            config.grpc.compress_responses,
            config.limits,
            inflight=inflight,
        )
        restrictions = Restrictions.from_specs(ep.restricted_protocols)
        budget = FdBudget.plan(open_file_limit(), listeners=2 if ep.http_port else 1)
        cap = budget.connection_cap(config.limits.max_connections)
        server = GrpcServer(
            restrict(
                forwarded_methods(
                    link,
                    self.rpcs,
                    limits,
                    self.closing,
                    self.shutting_down,
                    traced=config.tracing.on or tracing_installed(),
                ),
                restrictions,
            ),
            ServerSettings(limits=config.limits, http2_engine=config.endpoints.http2_engine),
            self.stats,
            connection_cap=cap,
        )
        ssl_context = server_ssl_context(ep.tls)
        async with anyio.create_task_group() as tg:
            tg.start_soon(channel.run_writer)
            port = await tg.start(
                functools.partial(server.serve, ep.host, ep.port, ssl_context, reuse_port=True)
            )
            rest_scope = anyio.CancelScope()
            http_port = 0
            if ep.http_port:
                http_port = await tg.start(
                    self._serve_rest, rest_scope, link, ssl_context, cap, inflight
                )
            channel.send(Ready(port, http_port))
            log.info("frontend_up", index=self.index, port=port, http_port=http_port or None)
            tg.start_soon(self._push_edge, channel)
            tg.start_soon(run_idle_trim, lambda: link.served)
            tg.start_soon(self._drain_on_signal)
            tg.start_soon(self._drain_when_closing, server, rest_scope, tg.cancel_scope)
            await link.run_reader(on_drain=self.closing.set, on_log=_apply_log_settings)
            tg.cancel_scope.cancel()  # the channel closed
        if self.drained:
            return 0
        log.warning("frontend_device_gone", index=self.index)
        return 1

    async def _drain_when_closing(
        self, server: GrpcServer, rest_scope: anyio.CancelScope, scope: anyio.CancelScope
    ) -> None:
        """Once asked to close: GOAWAY and the calls in flight finish (within the grace),
        REST stops, then everything ends."""
        await self.closing.wait()
        cancelled = await server.shutdown(DRAIN_SECONDS)
        if cancelled:
            log.warning("frontend_drain_timeout", index=self.index, cancelled_calls=cancelled)
        rest_scope.cancel()
        self.drained = True
        scope.cancel()

    async def _serve_rest(
        self,
        scope: anyio.CancelScope,
        link: DeviceLink,
        ssl_context: ssl.SSLContext | None,
        cap: int,
        inflight: InflightBytes,
        *,
        task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """The REST port (restrictions are the device process's REST adapter's to check)."""
        from kserve_trio.serving.http import serve_app

        config = self.config
        with scope:
            await serve_app(
                config.endpoints.host,
                config.endpoints.http_port,
                ForwardedRest(link),
                max_body_bytes=config.grpc.max_recv_msg_bytes,
                ssl_context=ssl_context,
                name="rest",
                limits=config.limits,
                stats=self.stats,
                connection_cap=cap,
                reuse_port=True,
                inflight=inflight,
                task_status=task_status,
            )

    async def _drain_on_signal(self) -> None:
        """The first SIGINT/SIGTERM drains; later ones are ignored (``shutdown_signals``)."""
        with shutdown_signals() as signals:
            async for _ in signals:
                self.closing.set()

    async def _push_edge(self, channel: Channel) -> None:
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry()
        registry.register(EdgeCollector(self.stats, "worker"))
        last = b""
        while True:
            text = generate_latest(registry)
            if text != last:
                channel.send(Edge(text.decode()))
                last = text
            await anyio.sleep(EDGE_PUSH_SECONDS)


def _apply_log_settings(settings: LogSettings) -> None:
    """The device process's log settings, now in force here too."""
    from kserve_trio.core.logging import update_log_settings

    update_log_settings(asdict(settings))


__all__ = ["DRAIN_SECONDS", "EDGE_PUSH_SECONDS", "Frontend"]

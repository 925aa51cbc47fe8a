"""One front-end process of a worker: ``python -m kserve_trio frontend`` (started by the
device process, never by hand).

It inherits three descriptors from the device process: its end of the channel's socket pair
and the two arenas (``serving.ipc``). The first message on the channel is ``Hello``
(``read_hello``): the worker's resolved configuration, this front end's index and the RPCs to
forward. ``serve_frontend`` opens the channel on the process's event loop and builds the
``Frontend`` (its constructor wires every part and does no I/O); ``Frontend.run`` then binds
the worker's gRPC (and REST) address with SO_REUSEPORT and listens, beside the other front ends
(the device process holds the same addresses bound and never listens, so port 0 resolved once
and the port stays reserved across a restart), says ``Ready`` and serves.

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
from dataclasses import asdict

import anyio
import anyio.abc
from prometheus_client import CollectorRegistry, generate_latest

from kserve_trio.core.logging import LogSettings, get_logger, update_log_settings
from kserve_trio.core.process import Restrictions, ServerConfig
from kserve_trio.frontend.forwarding import ForwardedRest, forwarded_methods
from kserve_trio.serving.admission import InflightBytes
from kserve_trio.serving.background import shutdown_signals
from kserve_trio.serving.edge_stats import EdgeCollector, EdgeStats
from kserve_trio.serving.fd_budget import FdBudget, open_file_limit
from kserve_trio.serving.grpc import GrpcServer, Limits, ServerSettings
from kserve_trio.serving.http import serve_app
from kserve_trio.serving.ipc import Arena, Channel, DeviceLink, Edge, Hello, Ready
from kserve_trio.serving.process_tuning import run_idle_trim
from kserve_trio.serving.restricted import restrict
from kserve_trio.serving.tls import server_ssl_context
from kserve_trio.serving.trace_control import tracing_installed

log = get_logger("kserve_trio.frontend")

EDGE_PUSH_SECONDS = 1.0
"""How often a front end looks whether its edge counters changed (and sends them if so)."""

DRAIN_SECONDS = 5.0
"""The grace a drain gives the calls in flight (the worker's own drain waits this long too)."""


async def serve_frontend(hello: Hello, sock: socket.socket, requests: Arena, replies: Arena) -> int:
    """Open the channel on this process's event loop, build the front end and serve until
    drained (0) or the device process is gone (1)."""
    channel = Channel(await anyio.abc.SocketStream.from_socket(sock))
    return await Frontend(hello, channel, requests, replies).run()


class Frontend:
    """One front end's parts, wired together by the constructor (no I/O); ``run`` starts their
    tasks (module docstring)."""

    def __init__(self, hello: Hello, channel: Channel, requests: Arena, replies: Arena) -> None:
        config: ServerConfig = hello.config
        ep = config.endpoints
        self.config = config
        self.index = hello.index
        self.channel = channel
        self.link = DeviceLink(channel, requests, replies)
        self.stats = EdgeStats()
        self.closing = anyio.Event()
        self.drained = False
        self.inflight = InflightBytes(
            config.limits.max_inflight_bytes, config.limits.max_inflight_bytes_per_connection
        )
        self.stats.inflight_bytes = lambda: self.inflight.used
        limits = Limits(
            config.grpc.max_recv_msg_bytes,
            config.grpc.max_send_msg_bytes,
            config.grpc.compress_responses,
            config.limits,
            inflight=self.inflight,
        )
        self.ssl_context = server_ssl_context(ep.tls)
        budget = FdBudget.plan(open_file_limit(), listeners=2 if ep.http_port else 1)
        self.connection_cap = budget.connection_cap(config.limits.max_connections)
        self.server = GrpcServer(
            restrict(
                forwarded_methods(
                    self.link,
                    hello.rpcs,
                    limits,
                    self.closing,
                    hello.shutting_down,
                    traced=config.tracing.on or tracing_installed(),
                ),
                Restrictions.from_specs(ep.restricted_protocols),
            ),
            ServerSettings(limits=config.limits, http2_engine=ep.http2_engine),
            self.stats,
            connection_cap=self.connection_cap,
        )
        # REST restrictions are the device process's REST adapter's to check.
        self.rest = ForwardedRest(self.link) if ep.http_port else None

    async def run(self) -> int:
        """Serve until drained (0) or the device process is gone (1)."""
        ep = self.config.endpoints
        channel, link = self.channel, self.link
        async with anyio.create_task_group() as tg:
            tg.start_soon(channel.run_writer)
            port = await tg.start(
                functools.partial(
                    self.server.serve, ep.host, ep.port, self.ssl_context, reuse_port=True
                )
            )
            rest_scope = anyio.CancelScope()
            http_port = 0
            if self.rest is not None:
                http_port = await tg.start(self._serve_rest, self.rest, rest_scope)
            channel.send(Ready(port, http_port))
            log.info("frontend_up", index=self.index, port=port, http_port=http_port or None)
            tg.start_soon(self._push_edge)
            tg.start_soon(run_idle_trim, lambda: link.served)
            tg.start_soon(self._drain_on_signal)
            tg.start_soon(self._drain_when_closing, rest_scope, tg.cancel_scope)
            await link.run_reader(on_drain=self.closing.set, on_log=_apply_log_settings)
            tg.cancel_scope.cancel()  # the channel closed
        if self.drained:
            return 0
        log.warning("frontend_device_gone", index=self.index)
        return 1

    async def _drain_when_closing(
        self, rest_scope: anyio.CancelScope, scope: anyio.CancelScope
    ) -> None:
        """Once asked to close: GOAWAY and the calls in flight finish (within the grace),
        REST stops, then everything ends."""
        await self.closing.wait()
        cancelled = await self.server.shutdown(DRAIN_SECONDS)
        if cancelled:
            log.warning("frontend_drain_timeout", index=self.index, cancelled_calls=cancelled)
        rest_scope.cancel()
        self.drained = True
        scope.cancel()

    async def _serve_rest(
        self,
        app: ForwardedRest,
        scope: anyio.CancelScope,
        *,
        task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """The REST port."""
        config = self.config
        with scope:
            await serve_app(
                config.endpoints.host,
                config.endpoints.http_port,
                app,
                max_body_bytes=config.grpc.max_recv_msg_bytes,
                ssl_context=self.ssl_context,
                name="rest",
                limits=config.limits,
                stats=self.stats,
                connection_cap=self.connection_cap,
                reuse_port=True,
                inflight=self.inflight,
                task_status=task_status,
            )

    async def _drain_on_signal(self) -> None:
        """The first SIGINT/SIGTERM drains; later ones are ignored (``shutdown_signals``)."""
        with shutdown_signals() as signals:
            async for _ in signals:
                self.closing.set()

    async def _push_edge(self) -> None:
        registry = CollectorRegistry()
        registry.register(EdgeCollector(self.stats, "worker"))
        last = b""
        while True:
            text = generate_latest(registry)
            if text != last:
                self.channel.send(Edge(text.decode()))
                last = text
            await anyio.sleep(EDGE_PUSH_SECONDS)


def _apply_log_settings(settings: LogSettings) -> None:
    """The device process's log settings, now in force here too."""
    update_log_settings(asdict(settings))


__all__ = ["DRAIN_SECONDS", "EDGE_PUSH_SECONDS", "Frontend", "serve_frontend"]

"""``serve_gateway`` / ``RunningGateway`` / ``stop``: one gateway process as one task tree.

``Gateway`` is the composition root: its constructor builds and wires every part (discovery,
pool, routing, admission, metrics, tracing, the shared-memory fan-out, prober, forwarder,
services, placement, the watchdog and the gRPC server) and starts nothing.
``serve_gateway_async`` starts their tasks; it is the tree::

    serve_gateway_async(config)
    └─ task group (root)                 cancel = orderly shutdown
       ├─ route refresher                background table scans (a worker said NOT_FOUND)
       ├─ idle trim                      freed heap back once idle (serving.process_tuning)
       ├─ prober                         first round before anything serves, then every interval
       ├─ compactor (lpt_packing)        CompactMemory fan-outs after repacks
       ├─ admin HTTP                     /metrics /healthz /readyz /routing on listen.metrics
       ├─ REST (when listen.http is set) KServe V2 HTTP/REST (``rest``), bound before gRPC
       └─ gRPC server (serving.grpc)     listen.grpc (TLS from tls:); a task per connection
                                         and per call, drained on exit

Every call task and every task a handler starts (a stream's per-request tasks) lives under the
server's task group, so nothing outlives the tree.

Given a ``ProcessRole`` (one of several gateway processes, ``gateway.processes``) the same tree
binds the public ports with SO_REUSEPORT, keeps its shared-memory registrations in the shared
record, announces its admin port once it serves and, under lpt_packing, places (process 0) or
follows the placement (``placement.multiprocess``).

Start-up: the first prober round runs before the ports open (discovery, probes, shared-memory
replay, routing table). If no worker is routable after it, the gateway waits up to
``KSERVE_TRIO_GATEWAY_STARTUP_WAIT_SECONDS`` for one (probing every half second meanwhile), then
serves regardless: ServerReady and ``/readyz`` say not ready until a worker is. Under
lpt_packing the scheduler's preconditions run next (``LptScheduler.start``); a failed one ends
the start-up with its error.

Shutdown (``stop``, SIGTERM, SIGINT) drains: admission stops (new requests are refused
UNAVAILABLE, ``/readyz`` turns 503, ServerReady false), requests in flight finish within
``DRAIN_SECONDS`` (the gRPC server's two-phase GOAWAY), then the tree is cancelled and the worker
connections close. The loop watchdog (``watchdog.LoopWatchdog``, a task of the tree and its
thread) ends the process with status 1 if the event loop stalls, so its supervisor restarts it;
workers that stop answering never do.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel

from kserve_trio.core.logging import get_logger
from kserve_trio.core.process import Restrictions
from kserve_trio.gateway.admin import AdminEndpoints
from kserve_trio.gateway.caller_headers import pass_caller_headers
from kserve_trio.gateway.config import (
    GatewayConfig,
    SchedulingMode,
    load_gateway_config,
    log_gateway_config,
)
from kserve_trio.gateway.fleet import (
    Discovery,
    PoolSettings,
    Prober,
    Resolver,
    RoutingState,
    WorkerPool,
    hosts_file_resolver,
    make_policy,
    system_resolver,
)
from kserve_trio.gateway.metrics import GatewayMetrics
from kserve_trio.gateway.placement import (
    Compactor,
    GatewayControl,
    LptCollector,
    LptFollower,
    LptPacking,
    LptPlacer,
    LptScheduler,
    shared_lpt,
)
from kserve_trio.gateway.processes._layout import ProcessRole
from kserve_trio.gateway.request_path import (
    Admission,
    Fleet,
    Forwarder,
    GatewayService,
    RegisterGates,
    ShmFanout,
    serve_rest,
)
from kserve_trio.gateway.shm_record import SharedShmRegistrations
from kserve_trio.gateway.tls import public_ssl_context
from kserve_trio.gateway.watchdog import LoopWatchdog, exit_wedged, wedge_limit
from kserve_trio.serving.admin_http import serve_http
from kserve_trio.serving.background import (
    BackgroundLoop,
    RunningHandle,
    run_loop,
    running_event_loop,
    serve_until_signal,
    start_in_thread,
)
from kserve_trio.serving.edge_stats import EdgeStats
from kserve_trio.serving.fd_budget import FdBudget, open_file_limit
from kserve_trio.serving.grpc import GrpcServer, Limits, ServerSettings
from kserve_trio.serving.process_tuning import run_idle_trim
from kserve_trio.serving.restricted import restrict
from kserve_trio.serving.trace_control import TraceControl

DRAIN_SECONDS = 5.0
"""How long a stopping gateway lets requests in flight finish (the node supervisor allows it
10 s before SIGKILL)."""
STARTUP_POLL_SECONDS = 0.5

_log = get_logger("kserve_trio.gateway")


class Gateway:
    """The gateway's composition root: every part, wired together by the constructor (which
    does no I/O beyond reading the TLS files); ``serve_gateway_async`` starts their tasks."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        resolver: Resolver | None = None,
        process: ProcessRole | None = None,
        on_wedge: Callable[[float], None] = exit_wedged,
    ) -> None:
        self.config = config
        self.process = process
        """Set when this gateway is one of several processes (``gateway.processes``)."""
        self.watchdog = LoopWatchdog(
            wedge_limit(config.prober.wedge_exit_rounds, config.prober.health_interval_seconds),
            on_wedge=on_wedge,
        )
        self.ssl_context = public_ssl_context(config.tls)  # a bad certificate fails first
        listeners = 3 if config.listen.http_address is not None else 2
        budget = FdBudget.plan(open_file_limit(), listeners=listeners, gateway=True)
        budget.log("gateway", config.limits.max_connections)
        self.connection_cap = budget.connection_cap(config.limits.max_connections)
        self.restrictions = Restrictions.from_specs(config.restricted_protocols)
        hosts = config.prober.hosts_file
        if resolver is None:
            resolver = hosts_file_resolver(hosts) if hosts else system_resolver
        self.discovery = Discovery.from_config(config, resolver)
        self.pool = WorkerPool(PoolSettings.from_config(config))
        lpt = config.scheduling.mode is SchedulingMode.LPT_PACKING
        self.policy = LptPacking(config.scheduling.basis) if lpt else make_policy(config.scheduling)
        self.state = RoutingState()
        self.listening = False  # the gRPC port accepts (the admin port comes up before it)
        self.admission = Admission(
            config.grpc.max_concurrent_requests_per_worker,
            lambda: len(self.pool.clients),
            queued_per_worker=config.grpc.max_queued_requests_per_worker,
            on_shed=lambda: self.metrics.shed.inc(),
            max_inflight_bytes=config.limits.max_inflight_bytes,
            max_inflight_bytes_per_connection=config.limits.max_inflight_bytes_per_connection,
        )
        self.edge_stats = EdgeStats()
        self.edge_stats.inflight_bytes = lambda: self.admission.bytes.used
        self.metrics = GatewayMetrics(
            edge=self.edge_stats,
            inflight=lambda: self.admission.inflight,
            queued=lambda: self.admission.waiting,
            max_concurrent=lambda: self.admission.cap,
            policy=self.policy,
            workers=lambda: self.pool.clients.keys(),
        )
        self.tracing = TraceControl(
            config.tracing, role="gateway", metric_prefix="gateway", registry=self.metrics.registry
        )
        self.tracing.open_configured()  # OpenTelemetry is imported only here, or once turned on
        self.gates = RegisterGates()
        self.shm = ShmFanout(
            targets=lambda: self.prober.routable_clients(),
            gates=self.gates,
            metrics=self.metrics,
            registrations=SharedShmRegistrations(process.shm_record) if process else None,
            policy=config.shm_policy,
        )
        self.prober = Prober(
            discovery=self.discovery,
            pool=self.pool,
            state=self.state,
            policy=self.policy,
            interval=config.prober.health_interval_seconds,
            metrics=self.metrics,
            on_ready=self.shm.replay,
        )
        self.forwarder = Forwarder(
            pool=self.pool,
            state=self.state,
            policy=self.policy,
            refresher=self.prober.refresher,
            routable=lambda: self.prober.routable_labels,
            metrics=self.metrics,
            gates=self.gates,
            replay=self.shm.replay_stale,
            bounds=config.limits,
        )
        self.fleet = Fleet(
            routable=self.prober.routable_clients,
            refresher=self.prober.refresher,
            metrics=self.metrics,
        )
        self.service = GatewayService(
            forwarder=self.forwarder,
            shm=self.shm,
            fleet=self.fleet,
            admission=self.admission,
            limits=Limits(
                config.grpc.max_recv_msg_bytes,
                config.grpc.max_send_msg_bytes,
                edge=config.limits,
                inflight=self.admission.bytes,
            ),
            ready=self.has_routable_worker,
            tracing=self.tracing,
        )
        self.admin = AdminEndpoints(
            metrics=self.metrics, pool=self.pool, state=self.state, ready=self.ready
        )
        self.scheduler: LptScheduler | None = None
        if isinstance(self.policy, LptPacking):  # lpt_packing: the placement scheduler
            self.scheduler = LptScheduler(
                config.scheduling,
                self.policy,
                clients=lambda: self.pool.clients,
                startup_wait=config.prober.startup_wait_seconds,
                wake=self.prober.wake,
                compactor=Compactor(
                    lambda: self.pool.clients,
                    observe=lambda w, t: self.metrics.observe_worker_call("CompactMemory", w, t),
                ),
            )
            self.metrics.add_collector(LptCollector(self.scheduler))
            self.service.placement_managed = True
        self.control = GatewayControl(
            config.scheduling.mode,
            self.scheduler,
            routable_models=lambda: set(self.state.table.models),
            limits=self.service.limits,
        )
        self.shared_lpt: LptPlacer | LptFollower | None = None
        """lpt_packing among several processes: process 0 places, the others follow it."""
        if self.scheduler is not None and process is not None:
            self.shared_lpt = shared_lpt(self.scheduler, self.control, process, self.service.limits)
        self.grpc = GrpcServer(
            restrict(
                pass_caller_headers({**self.service.methods(), **self.control_methods()}),
                self.restrictions,
            ),
            ServerSettings(limits=config.limits, http2_engine=config.http2_engine),
            self.edge_stats,
            connection_cap=self.connection_cap,
        )

    def control_methods(self) -> dict[str, Any]:
        """GatewayControlService: served here, or forwarded to the placing process."""
        methods = self.control.methods()
        if isinstance(self.shared_lpt, LptFollower):
            return self.shared_lpt.control_methods(list(methods))
        return methods

    async def start_placement(self) -> None:
        """lpt_packing's start-up: the scheduler's, or a follower's wait for the placement."""
        assert self.scheduler is not None
        await (self.shared_lpt or self.scheduler).start()

    def has_routable_worker(self) -> bool:
        return bool(self.prober.routable_labels)

    def ready(self) -> bool:
        """``/readyz``: the gRPC port accepts, some worker is routable and the gateway is not
        draining. (The admin port is up first: without the first condition a client that
        waited for /readyz could find the gRPC port still refusing connections.)"""
        return self.listening and self.has_routable_worker() and not self.admission.draining


@dataclass
class RunningGateway(RunningHandle):
    """A running gateway: its configuration, bound ports and parts (``gateway``)."""

    config: GatewayConfig
    host: str
    port: int
    metrics_port: int
    gateway: Gateway
    http_port: int = 0
    _loop: BackgroundLoop[RunningGateway] | None = None

    @property
    def metrics_address(self) -> str:
        return f"{self.host}:{self.metrics_port}"


async def _wait_for_a_worker(gateway: Gateway, wait: float) -> None:
    if gateway.has_routable_worker() or not wait > 0:
        return
    _log.info("waiting_for_a_ready_worker", seconds=wait)
    with anyio.move_on_after(wait):
        while not gateway.has_routable_worker():
            await anyio.sleep(STARTUP_POLL_SECONDS)
            gateway.prober.wake()


async def _drain(gateway: Gateway) -> None:
    """Refuse new requests, let those in flight finish (bounded), close the gRPC server."""
    admission = gateway.admission
    admission.start_drain()
    busy = admission.busy
    if busy:
        _log.info("gateway_draining", inflight=busy, seconds=DRAIN_SECONDS)
    # The ports keep accepting meanwhile: a new call is answered UNAVAILABLE "gateway is
    # shutting down", which tells a client more than a refused connection.
    deadline = anyio.current_time() + DRAIN_SECONDS
    with anyio.move_on_after(DRAIN_SECONDS):
        await admission.drained(DRAIN_SECONDS)
    cancelled = await gateway.grpc.shutdown(max(0.0, deadline - anyio.current_time()))
    if cancelled:
        _log.warning("gateway_drain_timeout", inflight=admission.busy, cancelled_calls=cancelled)


@contextlib.asynccontextmanager
async def serve_gateway_async(
    config: GatewayConfig,
    *,
    resolver: Resolver | None = None,
    process: ProcessRole | None = None,
    on_wedge: Callable[[float], None] = exit_wedged,
) -> AsyncIterator[RunningGateway]:
    """Run a gateway for the duration of the ``async with`` block (the whole task tree).
    ``process``: this gateway is one of several processes; it shares the public ports
    (SO_REUSEPORT) and announces its admin port once it serves. ``on_wedge``: what the loop
    watchdog does when the loop stalls (the process exits 1)."""
    gateway = Gateway(config, resolver=resolver, process=process, on_wedge=on_wedge)
    shared_ports = process is not None
    grpc_host, grpc_port = config.listen.grpc_address
    metrics_host, metrics_port = config.listen.metrics_address
    edge = {
        "limits": config.limits,
        "stats": gateway.edge_stats,
        "connection_cap": gateway.connection_cap,
    }
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(gateway.watchdog.run)
            tg.start_soon(gateway.prober.refresher.run)
            tg.start_soon(run_idle_trim, lambda: gateway.admission.admitted)
            await tg.start(gateway.prober.run)
            await _wait_for_a_worker(gateway, config.prober.startup_wait_seconds)
            if not gateway.has_routable_worker():
                _log.warning("serving_without_a_ready_worker", workers=len(gateway.pool.clients))
            if gateway.scheduler is not None:  # lpt_packing's preconditions, startup repack
                await gateway.start_placement()
                tg.start_soon(gateway.scheduler.compactor.run)
                if gateway.shared_lpt is not None:
                    await tg.start(gateway.shared_lpt.run, config.limits)
            bound_metrics = await tg.start(
                functools.partial(
                    serve_http,
                    metrics_host,
                    metrics_port,
                    exposition=gateway.metrics.exposition,
                    ready=gateway.ready,
                    routes=gateway.admin.routes(),
                    **edge,
                )
            )
            bound_http = 0
            if config.listen.http_address is not None:  # first: a taken port fails before gRPC
                http_host, http_port = config.listen.http_address
                bound_http = await tg.start(
                    functools.partial(
                        serve_rest,
                        http_host,
                        http_port,
                        gateway.service,
                        gateway.restrictions,
                        max_body_bytes=config.grpc.max_recv_msg_bytes,
                        max_json_depth=config.limits.max_json_depth,
                        ssl_context=gateway.ssl_context,
                        reuse_port=shared_ports,
                        inflight=gateway.admission.bytes,
                        **edge,
                    )
                )
            bound_grpc = await tg.start(
                functools.partial(
                    gateway.grpc.serve,
                    grpc_host,
                    grpc_port,
                    gateway.ssl_context,
                    reuse_port=shared_ports,
                )
            )
            gateway.listening = True
            running = RunningGateway(
                config=config,
                host=grpc_host,
                port=bound_grpc,
                metrics_port=bound_metrics,
                gateway=gateway,
                http_port=bound_http,
            )
            _log.info(
                "gateway_up",
                address=running.address,
                metrics_port=bound_metrics,
                http_port=bound_http or None,
                tls=config.tls.logged,
                scheduling=gateway.policy.mode,
                workers=sorted(gateway.pool.clients),
                routable=sorted(gateway.prober.routable_labels),
                models=sorted(gateway.state.table.models),
                event_loop=running_event_loop(),
                http2_engine=config.http2_engine,
            )
            if process is not None:
                process.announce(bound_metrics)
            try:
                yield running
            finally:
                with anyio.CancelScope(shield=True):
                    if not tg.cancel_scope.cancel_called:
                        await _drain(gateway)
                    tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise _single(group) from None
    finally:
        with anyio.CancelScope(shield=True):
            await gateway.pool.aclose()
            await anyio.to_thread.run_sync(gateway.tracing.close)  # the last spans (bounded)
    _log.info("gateway_down", address=f"{grpc_host}:{grpc_port}")


def _single(group: BaseExceptionGroup) -> BaseException:
    """The one error a failed tree raises: the group's only leaf, else the group itself."""
    leaves = _leaves(group)
    return leaves[0] if len(leaves) == 1 else group


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def resolve_gateway_config(
    path_or_config: str | os.PathLike[str] | GatewayConfig | None = None,
    *,
    env: Mapping[str, str] = os.environ,
    overrides: Mapping[str, Any] | None = None,
) -> GatewayConfig:
    """A ``GatewayConfig`` as given, or loaded from a ``gateway.yml`` path (``None``: the file
    ``KSERVE_TRIO_GATEWAY_FILE`` names, else the environment alone) and logged."""
    if isinstance(path_or_config, GatewayConfig):
        return path_or_config
    loaded = load_gateway_config(path_or_config, env=env, overrides=overrides)
    log_gateway_config(loaded, _log)
    return loaded.config


def serve_gateway(
    path: str | os.PathLike[str] | GatewayConfig | None = None,
    blocking: bool = True,
    *,
    resolver: Resolver | None = None,
    overrides: Mapping[str, Any] | None = None,
    process: ProcessRole | None = None,
) -> RunningGateway | None:
    """Serve a gateway. Blocking: until SIGINT/SIGTERM (then drain and return ``None``).
    Non-blocking: on a background thread with its own event loop; returns the
    ``RunningGateway`` once its ports are open (``stop`` it).

    ``path`` is a ``gateway.yml`` path, a ``GatewayConfig``, or ``None`` (the file
    ``KSERVE_TRIO_GATEWAY_FILE`` names, else the environment alone); ``overrides`` are raw
    values in YAML shape applied last (what command-line flags set); ``resolver`` replaces the
    system resolver of discovery (see ``discovery.Resolver``); ``process`` makes it one of
    several gateway processes (``gateway.processes``).
    """
    config = resolve_gateway_config(path, overrides=overrides)
    if blocking:
        run_loop(
            serve_until_signal,
            serve_gateway_async(config, resolver=resolver, process=process),
            _log,
            event_loop=config.event_loop or None,
        )
        return None
    loop = start_in_thread(
        lambda: serve_gateway_async(config, resolver=resolver, process=process),
        thread_name="kserve_trio-gateway",
        what="the gateway",
        event_loop=config.event_loop or None,
    )
    loop.value._loop = loop
    return loop.value


def stop(gateway: RunningGateway, timeout: float = 30.0) -> None:
    """Stop a gateway started with ``serve_gateway(..., blocking=False)``: drain, close, and
    return once everything is released (re-raising what ended it, if it failed)."""
    if gateway._loop is None:
        raise ValueError("stop() needs a RunningGateway returned by serve_gateway(blocking=False)")
    gateway._loop.stop(timeout, f"gateway {gateway.address}")
    if gateway._loop.error is not None:
        raise gateway._loop.error


__all__ = [
    "DRAIN_SECONDS",
    "Gateway",
    "RunningGateway",
    "resolve_gateway_config",
    "serve_gateway",
    "serve_gateway_async",
    "stop",
]

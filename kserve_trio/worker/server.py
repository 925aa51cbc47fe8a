"""``serve`` / ``stop``: one worker process as one nursery tree.

``serve_async`` is the tree itself: it resolves the configuration, loads and compiles the model
repository, starts the dispatch loop, the idle trim (``serving.process_tuning``: the freed heap
back once no request is admitted) and the gRPC server (``serving.grpc``) inside one task group,
and tears
them down in order on cancellation. ``serve(..., blocking=False)`` runs that tree on a background
thread with its own event loop and returns a ``RunningServer``; ``stop(server)`` cancels it and
returns once everything is released.

Memory: the worker builds its ``WeightCache`` from the backend's arena. With the cache
on, bundles compile without putting their weights on the device; each model is admitted at its
residency floor (device-pinned ones first, so they sit at the base of the arena), then the
isolation probe measures the scratch and resolves the on-demand budget before the server
accepts requests. The ``ControlService`` is served on the same gRPC server.

Shutdown order: refuse new work (new ModelInfer calls answer UNAVAILABLE), answer queued requests
UNAVAILABLE "server is shutting down", let the running execution finish and the requests in
flight end, then drain the gRPC server (listeners closed, two-phase GOAWAY; whatever still runs
when ``DRAIN_SECONDS`` have passed in all is cancelled), then
release every model's device and host weights (shared host regions are unlinked by their last
holder).
"""

from __future__ import annotations

import contextlib
import functools
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel

from kserve_trio.core.logging import get_logger
from kserve_trio.core.memory.buffer_pool import BufferPool
from kserve_trio.core.memory.shm import ShmRegistry
from kserve_trio.core.process.config import (
    ModelControlMode,
    ResidencyMode,
    ResidencyState,
    ServerConfig,
    log_config,
)
from kserve_trio.core.process.node import load_server_config
from kserve_trio.serving.background import (
    BackgroundLoop,
    RunningHandle,
    run_loop,
    running_event_loop,
    serve_until_signal,
    start_in_thread,
)
from kserve_trio.serving.trace_control import TraceControl
from kserve_trio.worker import heartbeat

if TYPE_CHECKING:
    from kserve_trio.runtime.backend import WorkerBackend
    from kserve_trio.runtime.weight_cache import WeightCache
    from kserve_trio.serving.admission import InflightBytes
    from kserve_trio.serving.edge_stats import EdgeStats
    from kserve_trio.serving.grpc import GrpcServer
    from kserve_trio.worker.frontends import FrontendProcesses
    from kserve_trio.worker.inference import InferenceCore
    from kserve_trio.worker.metrics import WorkerMetrics
    from kserve_trio.worker.registry import ModelBundle
    from kserve_trio.worker.repository import ModelRepository
    from kserve_trio.worker.scheduler import Scheduler
    from kserve_trio.worker.service import InferenceService
    from kserve_trio.worker.state import WorkerState

log = get_logger("kserve_trio.worker")

DRAIN_SECONDS = 5.0


@dataclass
class RunningServer(RunningHandle):
    """Handle to a running worker: its resolved config, bound port and live components."""

    config: ServerConfig
    port: int
    host: str
    state: WorkerState
    scheduler: Scheduler
    metrics_port: int = 0
    http_port: int = 0
    _loop: BackgroundLoop[RunningServer] | None = None

    @property
    def bundles(self) -> Mapping[str, ModelBundle]:
        """The loaded bundles by name (a read-only view of the model repository)."""
        return self.state.repository.bundles


def resolve_config(
    node_path_or_config=None, worker: str | None = None, **overrides
) -> ServerConfig:
    """A ``ServerConfig`` from a node file path, an existing config, or defaults + env."""
    if isinstance(node_path_or_config, ServerConfig):
        return node_path_or_config
    cfg, applied = load_server_config(node_path_or_config, worker, overrides=overrides or None)
    log_config(cfg, applied, log)  # the effective configuration, then the env overrides
    return cfg


def _make_backend(config: ServerConfig) -> WorkerBackend:
    from kserve_trio.runtime.backend import JaxBackend

    return JaxBackend.from_config(config.runtime, config.cache_dir)


def _platform(backend: WorkerBackend) -> str:
    return str(getattr(backend, "platform", "cpu"))


@contextlib.asynccontextmanager
async def serve_async(
    config: ServerConfig, *, backend: WorkerBackend | None = None
) -> AsyncIterator[RunningServer]:
    """Run a worker for the duration of the ``async with`` block (the whole nursery tree)."""
    from kserve_trio.core.process.restricted import Restrictions
    from kserve_trio.runtime.weight_cache import WeightCache
    from kserve_trio.serving.admin_http import serve_http
    from kserve_trio.serving.edge_stats import EdgeStats
    from kserve_trio.serving.fd_budget import FdBudget, open_file_limit
    from kserve_trio.serving.grpc import GrpcServer, Limits, ServerSettings
    from kserve_trio.serving.process_tuning import run_idle_trim
    from kserve_trio.serving.restricted import restrict
    from kserve_trio.serving.tls import server_ssl_context
    from kserve_trio.worker.admission import worker_admission
    from kserve_trio.worker.control_service import ControlService
    from kserve_trio.worker.forwarded import ForwardedRpcs
    from kserve_trio.worker.frontends import FrontendProcesses
    from kserve_trio.worker.inference import InferenceCore
    from kserve_trio.worker.metrics import WorkerMetrics, gpu_label
    from kserve_trio.worker.observer import RequestObserver
    from kserve_trio.worker.registry import load_repository
    from kserve_trio.worker.repository import ModelRepository
    from kserve_trio.worker.rest import WorkerRest
    from kserve_trio.worker.scheduler import Scheduler
    from kserve_trio.worker.service import InferenceService
    from kserve_trio.worker.state import WorkerState

    heartbeat.run_guards(config)  # before anything is allocated; a refusal propagates
    ssl_context = server_ssl_context(config.endpoints.tls)  # a bad PEM fails before loading
    ports = (config.endpoints.port, config.endpoints.metrics_port, config.endpoints.http_port)
    budget = FdBudget.plan(
        open_file_limit(), listeners=1 + sum(1 for p in ports[1:] if p), worker=True
    )
    budget.log("worker", config.limits.max_connections)
    cap = budget.connection_cap(config.limits.max_connections)
    started = time.monotonic()
    backend = backend if backend is not None else _make_backend(config)
    cache = _make_cache(WeightCache, backend, config)
    scheduler = Scheduler(config.scheduler, cache=cache)
    edge_stats = EdgeStats()
    metrics = WorkerMetrics(
        lambda: state,
        worker=config.worker_name,
        gpu=gpu_label(config.runtime.backend, config.runtime.device_ordinal),
        edge=edge_stats,
    )
    repository = ModelRepository(
        scheduler,
        cache=cache,
        externally_managed=config.residency_mode is ResidencyMode.EXTERNALLY_MANAGED,
        compilations=metrics.compilations,
    )
    admission = worker_admission(
        config.endpoints.max_concurrent_requests,
        on_shed=metrics.shed.inc,
        max_inflight_bytes=config.limits.max_inflight_bytes,
        max_inflight_bytes_per_connection=config.limits.max_inflight_bytes_per_connection,
    )
    edge_stats.inflight_bytes = lambda: admission.bytes.used
    tracing = TraceControl(
        config.tracing, role="worker", metric_prefix="worker", registry=metrics.registry
    )
    tracing.open_configured()  # OpenTelemetry is imported only here, or once turned on live
    state = WorkerState(
        repository=repository,
        observer=RequestObserver(repository, metrics),
        config=config,
        platform=_platform(backend),
        limits=Limits(
            config.grpc.max_recv_msg_bytes,
            config.grpc.max_send_msg_bytes,
            config.grpc.compress_responses,
            config.limits,
            inflight=admission.bytes,
        ),
        shm_registry=ShmRegistry(
            max_regions=budget.shm_regions, policy=config.endpoints.shm_policy
        ),
        admission=admission,
        metrics=metrics,
        cache=cache,
        backend=backend,
        tracing=tracing,
    )
    tracing.when_started(scheduler.trace_executions)
    frontends: FrontendProcesses | None = None
    async with _weights_released(cache, repository), anyio.create_task_group() as tg:
        metrics_port = 0
        if config.endpoints.metrics_port:
            metrics_port = await tg.start(
                functools.partial(
                    serve_http,
                    config.endpoints.host,
                    config.endpoints.metrics_port,
                    exposition=lambda: _exposition(metrics, frontends),
                    ready=state.server_ready,
                    limits=config.limits,
                    stats=edge_stats,
                    connection_cap=cap,
                )
            )
        await tg.start(scheduler.run)
        tg.start_soon(run_idle_trim, lambda: admission.admitted)  # memory back once idle
        bundles, failures = await anyio.to_thread.run_sync(
            lambda: load_repository(
                config.model_dirs,
                backend,
                include=config.models_include,
                serve_without_hooks=config.serve_without_hooks,
            )
        )
        for name, failure in failures.items():  # RepositoryIndex lists them with the reason
            repository.record_failure(name, failure)
        for _, bundle in sorted(bundles.items(), key=lambda kv: _admission_order(config, kv[0])):
            # The same install a watcher reload goes through; with the cache on, the startup
            # probe below seeds the learned costs instead of a warmup.
            await repository.install(bundle, warm=not cache.enabled)
        if cache.enabled:
            await scheduler.probe_weights()
        state.loading = False
        watcher_scope = anyio.CancelScope()
        if config.model_control_mode is ModelControlMode.DYNAMIC:
            await tg.start(_run_watcher, config, state, backend, watcher_scope)
        meta = config.meta
        core = InferenceCore(
            repository=repository,
            observer=state.observer,
            shm_registry=state.shm_registry,
            admission=admission,
            meta_pool=(
                BufferPool(meta.fanout_bytes, meta.fanout_slots, name="meta_scratch")
                if meta.pool_enabled
                else None
            ),
            bounds=config.limits,
            tracing=tracing,
        )
        service = InferenceService(state, core)
        control = ControlService(state)
        restrictions = Restrictions.from_specs(config.endpoints.restricted_protocols)
        server: GrpcServer | FrontendProcesses
        if config.endpoints.frontend_processes > 1:
            rest = (
                WorkerRest(service, core, restrictions, max_json_depth=config.limits.max_json_depth)
                if config.endpoints.http_port
                else None
            )
            frontends = FrontendProcesses(
                config,
                ForwardedRpcs(service, control, rest, lambda s: _push_log_settings(frontends, s)),
                config.endpoints.frontend_processes,
            )
            port, http_port = await tg.start(frontends.serve)
            server = frontends
        else:
            http_port = 0
            if config.endpoints.http_port:  # first: a taken REST port fails before gRPC listens
                http_port = await tg.start(
                    functools.partial(
                        _serve_rest,
                        config,
                        service,
                        core,
                        ssl_context,
                        edge_stats,
                        cap,
                        inflight=admission.bytes,
                    )
                )
            server = GrpcServer(
                restrict({**service.methods(), **control.methods()}, restrictions),
                ServerSettings(limits=config.limits, http2_engine=config.endpoints.http2_engine),
                edge_stats,
                connection_cap=cap,
            )
            port = await tg.start(
                server.serve, config.endpoints.host, config.endpoints.port, ssl_context
            )
        running = RunningServer(
            config=config,
            port=port,
            host=config.endpoints.host,
            state=state,
            scheduler=scheduler,
            metrics_port=metrics_port,
            http_port=http_port,
        )
        log.info(
            "server_up",
            address=running.address,
            metrics_port=metrics_port or None,
            http_port=http_port or None,
            tls=config.endpoints.tls.logged,
            models=sorted(bundles),
            failed=sorted(failures),
            startup_seconds=round(time.monotonic() - started, 3),
            event_loop=running_event_loop(),
            http2_engine=config.endpoints.http2_engine,
            frontend_processes=config.endpoints.frontend_processes,
        )
        heartbeat.fire("up", config)
        try:
            yield running
        finally:
            with anyio.CancelScope(shield=True):
                watcher_scope.cancel()
                await _shutdown(state, scheduler, server)
                # the spans of the last requests go out (bounded; nothing without a tracer)
                await anyio.to_thread.run_sync(tracing.close)
                tg.cancel_scope.cancel()
    log.info("server_down", address=running.address)
    heartbeat.fire("down", config)


@contextlib.asynccontextmanager
async def _weights_released(cache: WeightCache, repository: ModelRepository) -> AsyncIterator[None]:
    """Once the tree has stopped (or failed to start): free every model's device buffers and
    release the host copies, so shared regions are unlinked by their last holder."""
    try:
        yield
    finally:
        try:
            cache.close()
        except Exception as exc:
            log.warning("weight_release_failed", error=repr(exc))
        repository.close()


def _make_cache(
    cache_cls: type[WeightCache], backend: WorkerBackend, config: ServerConfig
) -> WeightCache:
    """The worker's weight cache; warns about settings that cannot take effect."""
    cache = cache_cls.from_config(backend, config)
    rt = config.runtime
    if cache.enabled:
        backend.load_weights_at_compile = False  # the cache places every model's weights
    log.info(
        "weight_cache_configured",
        enabled=cache.enabled,
        arena_bytes=cache.arena,
        residency_mode=config.residency_mode.value,
        host_store="shared" if rt.shared_host_weights else "private",
    )
    if config.model_control_mode is ModelControlMode.EXPLICIT and not cache.enabled:
        log.warning(
            "explicit_mode_without_weight_cache",
            detail="every model stays resident and RepositoryModelLoad/Unload and "
            "SetModelResidency answer FAILED_PRECONDITION; give the device an arena "
            "(on the CPU: runtime.cpu_device_memory_bytes > 0)",
        )
    if rt.shared_host_weights:
        if not cache.enabled:
            log.warning(
                "shared_host_weights_unused",
                detail="host weight copies exist only with the on-demand weight cache",
            )
        elif rt.shared_host_weights_mode == 0o666:
            log.warning(
                "shared_host_weights_world_writable",
                mode="666",
                detail='set runtime.shared_host_weights_mode to "660" on multi-user machines',
            )
    return cache


def _admission_order(config: ServerConfig, name: str) -> tuple[int, str]:
    """Device-pinned models first (loaded before any on-demand churn), then by name."""
    sched = config.scheduler.models.get(name)
    pinned = sched is not None and sched.residency is ResidencyState.PINNED_DEVICE
    return (0 if pinned else 1, name)


async def _run_watcher(
    config: ServerConfig,
    state: WorkerState,
    backend: WorkerBackend,
    scope: anyio.CancelScope,
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """The dynamic-mode watcher, seeded with what loaded at startup (failed bundles retry)."""
    from kserve_trio.worker.lifecycle import Lifecycle
    from kserve_trio.worker.watcher import ChangeDetector, scan, watch

    snapshot = await anyio.to_thread.run_sync(
        lambda: scan(config.model_dirs, config.models_include)
    )
    detector = ChangeDetector({n: s for n, s in snapshot.items() if n in state.repository})
    lifecycle = Lifecycle(state.repository, backend, serve_without_hooks=config.serve_without_hooks)
    with scope:
        await watch(
            config.model_dirs,
            config.models_include,
            config.model_poll_seconds,
            lifecycle.apply,
            detector,
            task_status=task_status,
        )


async def _serve_rest(
    config: ServerConfig,
    service: InferenceService,
    core: InferenceCore,
    ssl_context: ssl.SSLContext | None,
    edge_stats: EdgeStats,
    connection_cap: int,
    *,
    inflight: InflightBytes | None = None,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """The KServe V2 REST endpoint (``endpoints.http_port``, TLS like the gRPC port): the
    same service and inference core behind ``worker.rest``; bodies capped like gRPC messages
    and charged to the same bytes in flight (``inflight``, the admission's), connections and
    deadlines under ``config.limits``."""
    from kserve_trio.core.process.restricted import Restrictions
    from kserve_trio.serving.accept import ListenError
    from kserve_trio.serving.http import serve_app
    from kserve_trio.worker.rest import WorkerRest

    host, port = config.endpoints.host, config.endpoints.http_port
    try:
        await serve_app(
            host,
            port,
            WorkerRest(
                service,
                core,
                Restrictions.from_specs(config.endpoints.restricted_protocols),
                max_json_depth=config.limits.max_json_depth,
            ),
            max_body_bytes=config.grpc.max_recv_msg_bytes,
            ssl_context=ssl_context,
            name="rest",
            limits=config.limits,
            stats=edge_stats,
            connection_cap=connection_cap,
            inflight=inflight,
            task_status=task_status,
        )
    except ListenError as exc:  # the bind: say which port (the CLI prints this one line)
        raise ListenError(exc.errno, f"REST port {host}:{port}: {exc.strerror or exc}") from None


def _exposition(metrics: WorkerMetrics, frontends: FrontendProcesses | None) -> bytes:
    """The worker's ``/metrics``: its own series, and with front ends theirs (each sample
    labelled ``frontend_process``)."""
    own = metrics.exposition()
    if frontends is None:
        return own
    from kserve_trio.serving.metrics_merge import merge_expositions

    return merge_expositions([own.decode(), *frontends.expositions()]).encode()


def _push_log_settings(frontends: FrontendProcesses | None, settings) -> None:
    if frontends is not None:
        frontends.push_log_settings(settings)


async def _shutdown(
    state: WorkerState, scheduler: Scheduler, server: GrpcServer | FrontendProcesses
) -> None:
    if state.admission is not None:
        state.admission.start_drain()
    state.streams.close()  # open ModelStreamInfer calls stop reading and end UNAVAILABLE
    await scheduler.stop()
    # New calls are still accepted meanwhile and answered UNAVAILABLE "server is shutting
    # down", which tells a client more than a refused connection.
    deadline = time.monotonic() + DRAIN_SECONDS
    while (state.inflight > 0 or state.streams.count > 0) and time.monotonic() < deadline:
        await anyio.sleep(0.01)
    cancelled = await server.shutdown(max(0.0, deadline - time.monotonic()))
    if cancelled:  # calls, or with front ends the front ends killed
        log.warning("shutdown_drain_timeout", cancelled=cancelled)
    if state.shm_registry is not None:
        state.shm_registry.close()


def serve(
    node_path_or_config=None,
    worker: str | None = None,
    backend: WorkerBackend | None = None,
    blocking: bool = True,
    **overrides,
) -> RunningServer | None:
    """Serve a worker. Blocking: until SIGINT/SIGTERM. Non-blocking: returns a ``RunningServer``.

    ``node_path_or_config`` is a node file path, a ``ServerConfig``, or None (defaults and the
    ``INFERENCE_SERVER_*`` environment). ``overrides`` are raw config values in YAML shape (what
    CLI flags set), applied last.
    """
    config = resolve_config(node_path_or_config, worker, **overrides)
    if blocking:
        run_loop(
            serve_until_signal,
            serve_async(config, backend=backend),
            log,
            event_loop=config.endpoints.event_loop or None,
        )
        return None
    loop = start_in_thread(
        lambda: serve_async(config, backend=backend),
        thread_name="kserve_trio-worker",
        what="worker",
        event_loop=config.endpoints.event_loop or None,
    )
    loop.value._loop = loop
    return loop.value


def serve_worker(
    node_path: str, worker: str, backend: WorkerBackend | None = None, blocking: bool = True
) -> RunningServer | None:
    """``serve`` with the worker named positionally."""
    return serve(node_path, worker, backend=backend, blocking=blocking)


def stop(server: RunningServer, timeout: float = 30.0) -> None:
    """Shut down a server started with ``serve(..., blocking=False)``; returns when released."""
    if server._loop is None:
        raise ValueError("stop() needs a RunningServer returned by serve(..., blocking=False)")
    server._loop.stop(timeout, f"worker {server.address}")


__all__ = ["RunningServer", "resolve_config", "serve", "serve_async", "serve_worker", "stop"]

"""``serve`` / ``stop``: one worker process as one nursery tree.

``serve_async`` is the tree itself: ``worker.parts.build_worker`` constructs every part from
the resolved configuration, then ``serve_async`` starts their tasks inside one task group: the
metrics port, the dispatch loop, the idle trim (``serving.process_tuning``: the freed heap back
once no request is admitted), the start-up loading of the model repository, the watcher (dynamic
mode) and the servers (``serving.grpc`` and REST, or the front-end processes); it tears them
down in order on cancellation. ``serve(..., blocking=False)`` runs that tree on a background
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
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel

from kserve_trio.core.logging import get_logger
from kserve_trio.core.process import (
    ModelControlMode,
    ResidencyState,
    ServerConfig,
    load_server_config,
    log_config,
)
from kserve_trio.runtime.backend import WorkerBackend
from kserve_trio.serving.accept import ListenError
from kserve_trio.serving.admin_http import serve_http
from kserve_trio.serving.background import (
    BackgroundLoop,
    RunningHandle,
    run_loop,
    running_event_loop,
    serve_until_signal,
    start_in_thread,
)
from kserve_trio.serving.http import serve_app
from kserve_trio.serving.process_tuning import run_idle_trim
from kserve_trio.worker import heartbeat
from kserve_trio.worker.lifecycle import Lifecycle
from kserve_trio.worker.parts import WorkerParts, build_worker
from kserve_trio.worker.registry import ModelBundle, load_repository
from kserve_trio.worker.scheduler import Scheduler
from kserve_trio.worker.state import WorkerState
from kserve_trio.worker.watcher import ChangeDetector, scan, watch

log = get_logger("kserve_trio.worker")

DRAIN_SECONDS = 5.0


@dataclass
class RunningServer(RunningHandle):
    """Handle to a running worker: its bound ports and the parts it runs (``parts``)."""

    parts: WorkerParts
    port: int
    host: str
    metrics_port: int = 0
    http_port: int = 0
    _loop: BackgroundLoop[RunningServer] | None = None

    @property
    def config(self) -> ServerConfig:
        """The resolved configuration the worker runs with."""
        return self.parts.config

    @property
    def state(self) -> WorkerState:
        """What the RPC adapters share (repository, observer, admission, metrics...)."""
        return self.parts.state

    @property
    def scheduler(self) -> Scheduler:
        """The dispatch engine."""
        return self.parts.scheduler

    @property
    def bundles(self) -> Mapping[str, ModelBundle]:
        """The loaded bundles by name (a read-only view of the model repository)."""
        return self.parts.repository.bundles


def resolve_config(
    node_path_or_config=None, worker: str | None = None, **overrides
) -> ServerConfig:
    """A ``ServerConfig`` from a node file path, an existing config, or defaults + env."""
    if isinstance(node_path_or_config, ServerConfig):
        return node_path_or_config
    cfg, applied = load_server_config(node_path_or_config, worker, overrides=overrides or None)
    log_config(cfg, applied, log)  # the effective configuration, then the env overrides
    return cfg


@contextlib.asynccontextmanager
async def serve_async(
    config: ServerConfig, *, backend: WorkerBackend | None = None
) -> AsyncIterator[RunningServer]:
    """Run a worker for the duration of the ``async with`` block (the whole nursery tree):
    ``build_worker`` constructs its parts, this starts their tasks in order, loads the model
    repository and tears everything down on exit."""
    started = time.monotonic()
    parts = build_worker(config, backend=backend)
    ep = config.endpoints
    async with _weights_released(parts), anyio.create_task_group() as tg:
        metrics_port = 0
        if ep.metrics_port:
            metrics_port = await tg.start(
                functools.partial(
                    serve_http,
                    ep.host,
                    ep.metrics_port,
                    exposition=parts.exposition,
                    ready=parts.state.server_ready,
                    limits=config.limits,
                    stats=parts.edge_stats,
                    connection_cap=parts.connection_cap,
                )
            )
        await tg.start(parts.scheduler.run)
        tg.start_soon(
            run_idle_trim, lambda: parts.state.admission.admitted
        )  # memory back once idle
        loaded, failed = await _load_repository(parts)
        watcher_scope = anyio.CancelScope()
        if config.model_control_mode is ModelControlMode.DYNAMIC:
            await tg.start(_run_watcher, parts, watcher_scope)
        port, http_port = await _listen(parts, tg)
        running = RunningServer(
            parts=parts,
            port=port,
            host=ep.host,
            metrics_port=metrics_port,
            http_port=http_port,
        )
        log.info(
            "server_up",
            address=running.address,
            metrics_port=metrics_port or None,
            http_port=http_port or None,
            tls=ep.tls.logged,
            models=loaded,
            failed=failed,
            startup_seconds=round(time.monotonic() - started, 3),
            event_loop=running_event_loop(),
            http2_engine=ep.http2_engine,
            frontend_processes=ep.frontend_processes,
        )
        heartbeat.fire("up", config)
        try:
            yield running
        finally:
            with anyio.CancelScope(shield=True):
                watcher_scope.cancel()
                await _shutdown(parts)
                # the spans of the last requests go out (bounded; nothing without a tracer)
                await anyio.to_thread.run_sync(parts.tracing.close)
                tg.cancel_scope.cancel()
    log.info("server_down", address=running.address)
    heartbeat.fire("down", config)


@contextlib.asynccontextmanager
async def _weights_released(parts: WorkerParts) -> AsyncIterator[None]:
    """Once the tree has stopped (or failed to start): free every model's device buffers and
    release the host copies, so shared regions are unlinked by their last holder."""
    try:
        yield
    finally:
        try:
            parts.cache.close()
        except Exception as exc:
            log.warning("weight_release_failed", error=repr(exc))
        parts.repository.close()


async def _load_repository(parts: WorkerParts) -> tuple[list[str], list[str]]:
    """Start-up loading: compile every bundle, install them (device-pinned first), probe the
    weights; then the worker may turn ready. Returns the loaded and the failed names."""
    config, repository = parts.config, parts.repository
    bundles, failures = await anyio.to_thread.run_sync(
        lambda: load_repository(
            config.model_dirs,
            parts.backend,
            include=config.models_include,
            serve_without_hooks=config.serve_without_hooks,
        )
    )
    for name, failure in failures.items():  # RepositoryIndex lists them with the reason
        repository.record_failure(name, failure)
    for _, bundle in sorted(bundles.items(), key=lambda kv: _admission_order(config, kv[0])):
        # The same install a watcher reload goes through; with the cache on, the startup
        # probe below seeds the learned costs instead of a warmup.
        await repository.install(bundle, warm=not parts.cache.enabled)
    if parts.cache.enabled:
        await parts.scheduler.probe_weights()
    parts.state.loading = False
    return sorted(bundles), sorted(failures)


def _admission_order(config: ServerConfig, name: str) -> tuple[int, str]:
    """Device-pinned models first (loaded before any on-demand churn), then by name."""
    sched = config.scheduler.models.get(name)
    pinned = sched is not None and sched.residency is ResidencyState.PINNED_DEVICE
    return (0 if pinned else 1, name)


async def _run_watcher(
    parts: WorkerParts,
    scope: anyio.CancelScope,
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """The dynamic-mode watcher, seeded with what loaded at startup (failed bundles retry)."""
    config, repository = parts.config, parts.repository
    snapshot = await anyio.to_thread.run_sync(
        lambda: scan(config.model_dirs, config.models_include)
    )
    detector = ChangeDetector({n: s for n, s in snapshot.items() if n in repository})
    lifecycle = Lifecycle(repository, parts.backend, serve_without_hooks=config.serve_without_hooks)
    with scope:
        await watch(
            config.model_dirs,
            config.models_include,
            config.model_poll_seconds,
            lifecycle.apply,
            detector,
            task_status=task_status,
        )


async def _listen(parts: WorkerParts, tg: anyio.abc.TaskGroup) -> tuple[int, int]:
    """Open the public ports: the front ends, or the REST port (first: a taken REST port fails
    before gRPC listens) and the gRPC server. Returns the gRPC and REST ports (0: none)."""
    ep = parts.config.endpoints
    if parts.frontends is not None:
        return await tg.start(parts.frontends.serve)
    assert parts.grpc is not None  # build_worker sets one of the two
    http_port = 0
    if parts.rest is not None:
        http_port = await tg.start(_serve_rest, parts)
    port = await tg.start(parts.grpc.serve, ep.host, ep.port, parts.ssl_context)
    return port, http_port


async def _serve_rest(
    parts: WorkerParts, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED
) -> None:
    """The KServe V2 REST endpoint (``endpoints.http_port``, TLS like the gRPC port): the
    same service and inference core behind ``worker.rest``; bodies capped like gRPC messages
    and charged to the same bytes in flight (the admission's), connections and deadlines under
    ``config.limits``."""
    config = parts.config
    assert parts.rest is not None
    host, port = config.endpoints.host, config.endpoints.http_port
    try:
        await serve_app(
            host,
            port,
            parts.rest,
            max_body_bytes=config.grpc.max_recv_msg_bytes,
            ssl_context=parts.ssl_context,
            name="rest",
            limits=config.limits,
            stats=parts.edge_stats,
            connection_cap=parts.connection_cap,
            inflight=parts.state.admission.bytes,
            task_status=task_status,
        )
    except ListenError as exc:  # the bind: say which port (the CLI prints this one line)
        raise ListenError(exc.errno, f"REST port {host}:{port}: {exc.strerror or exc}") from None


async def _shutdown(parts: WorkerParts) -> None:
    state = parts.state
    state.admission.start_drain()
    state.streams.close()  # open ModelStreamInfer calls stop reading and end UNAVAILABLE
    await parts.scheduler.stop()
    # New calls are still accepted meanwhile and answered UNAVAILABLE "server is shutting
    # down", which tells a client more than a refused connection.
    deadline = time.monotonic() + DRAIN_SECONDS
    while (state.inflight > 0 or state.streams.count > 0) and time.monotonic() < deadline:
        await anyio.sleep(0.01)
    server = parts.frontends or parts.grpc
    assert server is not None
    cancelled = await server.shutdown(max(0.0, deadline - time.monotonic()))
    if cancelled:  # calls, or with front ends the front ends killed
        log.warning("shutdown_drain_timeout", cancelled=cancelled)
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

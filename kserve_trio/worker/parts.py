"""``build_worker``: the worker's composition root, every part constructed and wired, no task
started.

``build_worker(config)`` runs the serve guards, reads the TLS files (a bad PEM fails before
anything loads), plans the descriptor budget, opens the device backend and its weight cache and
builds the dispatch engine, the model repository, the admission, the metrics, the trace control,
the inference core, the RPC services and the servers that will listen: the gRPC server and the
REST adapter in one process, or the front-end processes (``endpoints.frontend_processes`` > 1).
It returns them as a ``WorkerParts``; ``worker.server.serve_async`` starts their tasks, loads the
repository and tears them down. It is called on the event loop the worker will serve on (the
servers' cancel scopes belong to it).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from kserve_trio.core.logging import get_logger
from kserve_trio.core.memory import BufferPool, ShmRegistry
from kserve_trio.core.process import ModelControlMode, ResidencyMode, Restrictions, ServerConfig
from kserve_trio.runtime.backend import JaxBackend, WorkerBackend
from kserve_trio.runtime.weight_cache import WeightCache
from kserve_trio.serving.edge_stats import EdgeStats
from kserve_trio.serving.fd_budget import FdBudget, open_file_limit
from kserve_trio.serving.grpc import GrpcServer, Limits, ServerSettings
from kserve_trio.serving.metrics_merge import merge_expositions
from kserve_trio.serving.restricted import restrict
from kserve_trio.serving.tls import server_ssl_context
from kserve_trio.serving.trace_control import TraceControl
from kserve_trio.worker import heartbeat
from kserve_trio.worker.admission import worker_admission
from kserve_trio.worker.control_service import ControlService
from kserve_trio.worker.frontends import FrontendProcesses
from kserve_trio.worker.inference import InferenceCore
from kserve_trio.worker.metrics import WorkerMetrics, gpu_label
from kserve_trio.worker.observer import RequestObserver
from kserve_trio.worker.repository import ModelRepository
from kserve_trio.worker.rest import WorkerRest
from kserve_trio.worker.scheduler import Scheduler
from kserve_trio.worker.service import InferenceService
from kserve_trio.worker.state import WorkerState

log = get_logger("kserve_trio.worker")


@dataclass
class WorkerParts:
    """One worker's parts as ``build_worker`` wired them (module docstring).

    Exactly one way to listen is set: ``frontends`` with front-end processes, else ``grpc``
    (and ``rest`` when ``endpoints.http_port`` is set; with front ends ``rest`` is what they
    forward REST requests to)."""

    config: ServerConfig
    backend: WorkerBackend
    cache: WeightCache
    scheduler: Scheduler
    repository: ModelRepository
    metrics: WorkerMetrics
    edge_stats: EdgeStats
    tracing: TraceControl
    state: WorkerState
    core: InferenceCore
    service: InferenceService
    control: ControlService
    ssl_context: ssl.SSLContext | None
    connection_cap: int
    rest: WorkerRest | None
    grpc: GrpcServer | None
    frontends: FrontendProcesses | None

    def exposition(self) -> bytes:
        """The worker's ``/metrics``: its own series, and with front ends theirs (each sample
        labelled ``frontend_process``)."""
        own = self.metrics.exposition()
        if self.frontends is None:
            return own
        return merge_expositions([own.decode(), *self.frontends.expositions()]).encode()


def build_worker(config: ServerConfig, *, backend: WorkerBackend | None = None) -> WorkerParts:
    """Every part of a worker for ``config``, constructed and wired; nothing runs yet.
    ``backend``: the device backend to use instead of the one ``config.runtime`` opens (tests
    pass a mock one)."""
    heartbeat.run_guards(config)  # before anything is allocated; a refusal propagates
    ep = config.endpoints
    ssl_context = server_ssl_context(ep.tls)  # a bad PEM fails before loading
    budget = FdBudget.plan(
        open_file_limit(),
        listeners=1 + sum(1 for p in (ep.metrics_port, ep.http_port) if p),
        worker=True,
    )
    budget.log("worker", config.limits.max_connections)
    cap = budget.connection_cap(config.limits.max_connections)
    if backend is None:
        backend = JaxBackend.from_config(config.runtime, config.cache_dir)
    cache = _weight_cache(backend, config)
    scheduler = Scheduler(config.scheduler, cache=cache)
    edge_stats = EdgeStats()
    metrics = WorkerMetrics(
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
        ep.max_concurrent_requests,
        on_shed=metrics.shed.inc,
        max_inflight_bytes=config.limits.max_inflight_bytes,
        max_inflight_bytes_per_connection=config.limits.max_inflight_bytes_per_connection,
    )
    edge_stats.inflight_bytes = lambda: admission.bytes.used
    tracing = TraceControl(
        config.tracing, role="worker", metric_prefix="worker", registry=metrics.registry
    )
    tracing.open_configured()  # OpenTelemetry is imported only here, or once turned on live
    tracing.when_started(scheduler.trace_executions)
    observer = RequestObserver(repository, metrics)
    shm_registry = ShmRegistry(max_regions=budget.shm_regions, policy=ep.shm_policy)
    state = WorkerState(
        repository=repository,
        observer=observer,
        config=config,
        limits=Limits(
            config.grpc.max_recv_msg_bytes,
            config.grpc.max_send_msg_bytes,
            config.grpc.compress_responses,
            config.limits,
            inflight=admission.bytes,
        ),
        shm_registry=shm_registry,
        admission=admission,
        metrics=metrics,
        cache=cache,
        backend=backend,
        tracing=tracing,
    )
    metrics.collect_from(state)
    meta = config.meta
    core = InferenceCore(
        repository=repository,
        observer=observer,
        shm_registry=shm_registry,
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
    restrictions = Restrictions.from_specs(ep.restricted_protocols)
    rest = (
        WorkerRest(service, core, restrictions, max_json_depth=config.limits.max_json_depth)
        if ep.http_port
        else None
    )
    grpc: GrpcServer | None = None
    frontends: FrontendProcesses | None = None
    if ep.frontend_processes > 1:
        frontends = FrontendProcesses(config, service, control, rest, ep.frontend_processes)
    else:
        grpc = GrpcServer(
            restrict({**service.methods(), **control.methods()}, restrictions),
            ServerSettings(limits=config.limits, http2_engine=ep.http2_engine),
            edge_stats,
            connection_cap=cap,
        )
    return WorkerParts(
        config=config,
        backend=backend,
        cache=cache,
        scheduler=scheduler,
        repository=repository,
        metrics=metrics,
        edge_stats=edge_stats,
        tracing=tracing,
        state=state,
        core=core,
        service=service,
        control=control,
        ssl_context=ssl_context,
        connection_cap=cap,
        rest=rest,
        grpc=grpc,
        frontends=frontends,
    )


def _weight_cache(backend: WorkerBackend, config: ServerConfig) -> WeightCache:
    """The worker's weight cache; warns about settings that cannot take effect."""
    cache = WeightCache.from_config(backend, config)
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


__all__ = ["WorkerParts", "build_worker"]

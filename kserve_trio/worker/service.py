"""The worker's ``inference.GRPCInferenceService``: KServe V2 RPCs mapped onto the scheduler.

Written by hand against grpclib (``grpc_adapter``) so handlers see the stream. Statuses: unknown
model or version NOT_FOUND; malformed or mismatching input INVALID_ARGUMENT; queue full or
concurrency cap RESOURCE_EXHAUSTED; expired deadline DEADLINE_EXCEEDED; shutting down
UNAVAILABLE; not resident in explicit mode FAILED_PRECONDITION.

Every bundle is served as version ``1`` (``""`` means the same); ``ServerMetadata`` lists
``EXTENSIONS`` by Triton's names, and every model reports platform ``jax`` (docs/protocol.md).

Explicit mode (``model_control_mode: explicit``): a model is ready only while its weights are
on the device; Triton's ``RepositoryModelLoad`` pins it there and ``RepositoryModelUnload``
unpins it (``control_service.set_model_residency``), so ``tritonclient.load_model`` /
``unload_model`` drive residency. In the other modes both answer FAILED_PRECONDITION.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from anyio import get_cancelled_exc_class

import kserve_trio
from kserve_trio.core import codec
from kserve_trio.core.config import ModelControlMode, ResidencyMode, ResidencyState
from kserve_trio.core.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServingError,
    Unavailable,
)
from kserve_trio.core.logging import debug_enabled, get_logger
from kserve_trio.core.shm import same_ipc_namespace
from kserve_trio.core.shm_names import check_key
from kserve_trio.core.validation import validate_inputs
from kserve_trio.proto import inference as pb
from kserve_trio.serving.grpc_adapter import CallContext, Limits, unary, unimplemented
from kserve_trio.worker import heartbeat
from kserve_trio.worker.control_service import set_model_residency
from kserve_trio.worker.meta import MetaCall, run_meta
from kserve_trio.worker.registry import ModelBundle, check_version, hidden_submodels
from kserve_trio.worker.scheduler import RequestTrace
from kserve_trio.worker.triton_views import (
    PLATFORM,
    RequestStats,
    model_config,
    model_statistics,
)

log = get_logger("kserve_trio.worker.service")

SERVER_NAME = "kserve_trio"
_PREFIX = "/inference.GRPCInferenceService/"

EXTENSIONS = (
    "model_repository",
    "model_configuration",
    "system_shared_memory",
    "parameters",
    "statistics",
)
"""What ``ServerMetadata`` lists, by Triton's names and in Triton's order: only extensions the
worker really answers (docs/protocol.md says why the others are left out)."""


@dataclass
class WorkerState:
    """Everything the RPC handlers share: bundles, scheduler, limits and lifecycle flags."""

    scheduler: object  # worker.scheduler.Scheduler
    bundles: dict[str, ModelBundle]
    platform: str = "cpu"  # the device platform (cpu/cuda); models report PLATFORM
    max_concurrent_requests: int = 64
    limits: Limits = field(default_factory=lambda: Limits(512 << 20, 512 << 20))
    shm_registry: object | None = None
    extensions: list[str] = field(default_factory=lambda: list(EXTENSIONS))
    shutting_down: bool = False
    inflight: int = 0  # ModelInfer handlers currently running
    config: object | None = None  # core.config.ServerConfig
    stats: dict[str, RequestStats] = field(default_factory=dict)
    _scratch: object | None = None
    metrics: object | None = None  # worker.metrics.WorkerMetrics
    cache: object | None = None  # runtime.weight_cache.WeightCache
    backend: object | None = None  # runtime.backend.JaxBackend (device memory statistics)

    def record(self, name: str, ok: bool, elapsed_ns: int, trace: RequestTrace) -> None:
        """Fold one finished request into the model's Triton statistics."""
        stats = self.stats.setdefault(name, RequestStats())
        if ok:
            stats.success.add(elapsed_ns)
            stats.queue.add(trace.queue_ns)
            stats.compute_input.add(trace.preprocess_ns)
            stats.compute_infer.add(trace.compute_ns)
            stats.compute_output.add(trace.postprocess_ns)
            stats.last_inference_ms = int(time.time() * 1000)
        else:
            stats.fail.add(elapsed_ns)

    def scratch_pool(self):
        """The meta models' scratch ``BufferPool``, created on first use (None when disabled)."""
        meta = getattr(self.config, "meta", None)
        if meta is None or not meta.pool_enabled:
            return None
        if self._scratch is None:
            from kserve_trio.core.buffer_pool import BufferPool

            self._scratch = BufferPool(meta.fanout_bytes, meta.fanout_slots, name="meta_scratch")
        return self._scratch

    def routable_names(self) -> list[str]:
        hidden = hidden_submodels(self.bundles)
        return sorted(n for n in self.bundles if n not in hidden)

    @property
    def externally_managed(self) -> bool:
        """Explicit mode: residency belongs to a control plane."""
        cfg = self.config
        return cfg is not None and cfg.residency_mode is ResidencyMode.EXTERNALLY_MANAGED

    def model_ready(self, name: str) -> bool:
        """Compiled; in explicit mode also device-resident (a meta: all its declared
        sub-models so)."""
        bundle = self.bundles.get(name)
        if bundle is None:
            return False
        if bundle.is_meta:
            if not self.externally_managed:
                return True
            return all(self._regular_ready(c) for c in bundle.manifest.meta_calls)
        return self._regular_ready(name)

    def _regular_ready(self, name: str) -> bool:
        bundle = self.bundles.get(name)
        if bundle is None or bundle.model is None or not self.scheduler.has_model(name):
            return False
        if self.externally_managed and self.cache is not None:
            return self.cache.is_servable(name)
        return True

    def model_compiled(self, name: str) -> bool:
        bundle = self.bundles.get(name)
        if bundle is None:
            return False
        return bundle.is_meta or self.scheduler.has_model(name)

    def server_ready(self) -> bool:
        """At least one model, every regular model compiled (residency does not count)."""
        if self.shutting_down or not self.bundles:
            return False
        return all(self.model_compiled(n) for n in self.bundles)

    def bundle(self, name: str, version: str = "") -> ModelBundle:
        """The bundle a request names; NOT_FOUND for an unknown model or version."""
        if not name:
            raise InvalidArgument("model_name is empty")
        bundle = self.bundles.get(name)
        if bundle is None:
            raise NotFound(f"unknown model: {name}")
        check_version(name, version)
        return bundle


class InferenceService:
    """grpclib servable for ``inference.GRPCInferenceService``."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state

    def __mapping__(self) -> dict:
        lim = self.state.limits
        rpcs = {
            "ServerLive": (self.server_live, pb.ServerLiveRequest),
            "ServerReady": (self.server_ready, pb.ServerReadyRequest),
            "ModelReady": (self.model_ready, pb.ModelReadyRequest),
            "ServerMetadata": (self.server_metadata, pb.ServerMetadataRequest),
            "ModelMetadata": (self.model_metadata, pb.ModelMetadataRequest),
            "ModelInfer": (self.model_infer, pb.ModelInferRequest),
            "RepositoryIndex": (self.repository_index, pb.RepositoryIndexRequest),
            "ModelConfig": (self.model_config, pb.ModelConfigRequest),
            "ModelStatistics": (self.model_statistics, pb.ModelStatisticsRequest),
            "SystemSharedMemoryStatus": (self.shm_status, pb.SystemSharedMemoryStatusRequest),
            "SystemSharedMemoryRegister": (self.shm_register, pb.SystemSharedMemoryRegisterRequest),
            "SystemSharedMemoryUnregister": (
                self.shm_unregister,
                pb.SystemSharedMemoryUnregisterRequest,
            ),
            "IsSameIPCNamespace": (self.is_same_ipc_namespace, pb.IsSameIpcNamespaceRequest),
            "RepositoryModelLoad": (self.repository_model_load, pb.RepositoryModelLoadRequest),
            "RepositoryModelUnload": (
                self.repository_model_unload,
                pb.RepositoryModelUnloadRequest,
            ),
        }
        mapping = {_PREFIX + rpc: unary(fn, req, lim, rpc) for rpc, (fn, req) in rpcs.items()}
        later = {
            "ModelStreamInfer": "streaming inference is not supported",
            "CudaSharedMemoryStatus": "CUDA shared memory is not supported",
            "CudaSharedMemoryRegister": "CUDA shared memory is not supported",
            "CudaSharedMemoryUnregister": "CUDA shared memory is not supported",
            "TraceSetting": "trace settings are not supported",
            "LogSettings": "log settings are not supported",
        }
        for rpc, reason in later.items():
            mapping.setdefault(_PREFIX + rpc, unimplemented(rpc, reason))
        return mapping

    async def server_live(self, request, ctx: CallContext):
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, request, ctx: CallContext):
        return pb.ServerReadyResponse(ready=self.state.server_ready())

    async def model_ready(self, request, ctx: CallContext):
        """An unknown model is not ready; a known one asked for another version is NOT_FOUND."""
        if request.name in self.state.bundles:
            check_version(request.name, request.version)
        return pb.ModelReadyResponse(ready=self.state.model_ready(request.name))

    async def server_metadata(self, request, ctx: CallContext):
        extensions = [
            e
            for e in self.state.extensions
            if e != "system_shared_memory" or self.state.shm_registry is not None
        ]
        return pb.ServerMetadataResponse(
            name=SERVER_NAME, version=kserve_trio.__version__, extensions=extensions
        )

    async def model_metadata(self, request, ctx: CallContext):
        bundle = self.state.bundle(request.name, request.version)
        return codec.encode_model_metadata(request.name, bundle.manifest, PLATFORM)

    async def repository_index(self, request, ctx: CallContext):
        pairs = [(n, self.state.model_ready(n)) for n in self.state.routable_names()]
        if request.ready:
            pairs = [(n, r) for n, r in pairs if r]
        return codec.encode_repository_index(pairs)

    async def shm_status(self, request, ctx: CallContext):
        # Register, Unregister and Status validate names and keys in ShmRegistry
        # (core/shm_names.py) before any OS call: INVALID_ARGUMENT naming the field.
        regions = self._shm().status(request.name)
        return pb.SystemSharedMemoryStatusResponse(
            regions={
                name: pb.SystemSharedMemoryStatusResponseRegionStatus(
                    name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size
                )
                for name, r in regions.items()
            }
        )

    async def shm_register(self, request, ctx: CallContext):
        self._shm().register(request.name, request.key, request.offset, request.byte_size)
        log.debug("shm_registered", region=request.name, key=request.key, bytes=request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def shm_unregister(self, request, ctx: CallContext):
        self._shm().unregister(request.name)
        log.debug("shm_unregistered", region=request.name or "<all>")
        return pb.SystemSharedMemoryUnregisterResponse()

    async def is_same_ipc_namespace(self, request, ctx: CallContext):
        # The name reaches posix_ipc only once it is a valid key (a NUL byte crashes it).
        check_key(request.name, rpc="IsSameIPCNamespace", field="name")
        return pb.IsSameIpcNamespaceResponse(same=same_ipc_namespace(request.name))

    # ---- Triton's repository control: residency in explicit mode ------------------------

    def _require_explicit(self, rpc: str) -> None:
        cfg = self.state.config
        mode = cfg.model_control_mode if cfg is not None else ModelControlMode.STATIC
        if mode is not ModelControlMode.EXPLICIT:
            raise FailedPrecondition(
                f"{rpc} requires model_control_mode 'explicit' (this worker runs '{mode.value}')"
            )

    async def repository_model_load(self, request, ctx: CallContext):
        """Explicit mode: pin the model's weights to the device (= SetModelResidency
        PINNED_DEVICE); the model is served and ready once this returns."""
        self._require_explicit("RepositoryModelLoad")
        if request.parameters:
            raise InvalidArgument(
                "RepositoryModelLoad parameters are not supported "
                f"({', '.join(sorted(request.parameters))}): models load from the repository"
            )
        await set_model_residency(self.state, request.model_name, ResidencyState.PINNED_DEVICE)
        log.info("model_load_requested", model=request.model_name)
        return pb.RepositoryModelLoadResponse()

    async def repository_model_unload(self, request, ctx: CallContext):
        """Explicit mode: unpin (= SetModelResidency UNPINNED): device and host copies are
        released; the model stays compiled but is not ready nor served until loaded again."""
        self._require_explicit("RepositoryModelUnload")
        await set_model_residency(self.state, request.model_name, ResidencyState.UNPINNED)
        log.info("model_unload_requested", model=request.model_name)
        return pb.RepositoryModelUnloadResponse()

    def _shm(self):
        if self.state.shm_registry is None:
            raise Unavailable("shared memory is not available on this server")
        return self.state.shm_registry

    async def model_infer(self, request, ctx: CallContext):
        state = self.state
        started = time.perf_counter_ns()
        status = "UNKNOWN"
        trace = RequestTrace()
        try:
            if state.shutting_down:
                raise Unavailable("server is shutting down")
            cap = state.max_concurrent_requests
            if cap > 0 and state.inflight >= cap:
                if state.metrics is not None:
                    state.metrics.shed.inc()
                raise ResourceExhausted(
                    f"server is at its concurrency cap ({cap} requests in flight)"
                )
            state.inflight += 1
            try:
                reply = await self._infer(request, ctx, trace)
            finally:
                state.inflight -= 1
            status = "OK"
            return reply
        except ServingError as exc:
            status = exc.status.name
            raise
        except TimeoutError:
            status = "DEADLINE_EXCEEDED"
            raise
        except BaseException as exc:
            status = "CANCELLED" if isinstance(exc, get_cancelled_exc_class()) else "INTERNAL"
            raise
        finally:
            elapsed = time.perf_counter_ns() - started
            name = request.model_name
            if state.metrics is not None:
                state.metrics.observe_request(name, status, elapsed / 1e9)
            if name in state.bundles:
                state.record(name, status == "OK", elapsed, trace)
            if debug_enabled():
                self._log_request(name, request.id, status, trace, elapsed)
            heartbeat.fire("request", name)

    @staticmethod
    def _log_request(name: str, request_id: str, status: str, trace, elapsed: int) -> None:
        log.debug(
            "request_done",
            model=name,
            request_id=request_id,
            status=status,
            batch_size=trace.batch_size,
            queue_ms=round(trace.queue_ns / 1e6, 3),
            compute_ms=round(trace.compute_ns / 1e6, 3),
            duration_ms=round(elapsed / 1e6, 3),
        )

    async def _infer(self, request, ctx: CallContext, trace: RequestTrace):
        state = self.state
        bundle = state.bundle(request.model_name, request.model_version)
        decoded = codec.decode_infer_request(request, state.shm_registry)
        try:
            validate_inputs(bundle.name, bundle.manifest.wire_inputs, decoded.inputs)
            _check_requested_outputs(bundle, decoded.requested_outputs)
            deadline = codec.combine_deadlines(decoded.deadline_ns, ctx.deadline_ns)
            if bundle.is_meta:
                outputs = await self._run_meta(bundle, decoded.inputs, deadline, trace)
            else:
                outputs = await state.scheduler.infer(
                    bundle.name,
                    decoded.inputs,
                    deadline_ns=deadline,
                    request_id=decoded.id,
                    trace=trace,
                )
            return codec.encode_infer_response(
                request.model_name,
                decoded.id,
                outputs,
                decoded.requested_outputs,
                state.shm_registry,
                model_version=codec.BUNDLE_VERSION,
                zero_copy=True,
            )
        finally:
            decoded.release()

    async def _run_meta(self, bundle: ModelBundle, inputs, deadline_ns: int, trace: RequestTrace):
        """A meta's ``run`` as one scheduled unit on the device thread."""
        state = self.state
        if deadline_ns and time.monotonic_ns() >= deadline_ns:
            raise DeadlineExceeded(bundle.name)

        def resolve(callee: str):
            sub = state.bundles.get(callee)
            if sub is None or sub.model is None:
                raise NotFound(f"meta model '{bundle.name}' calls '{callee}', which is not loaded")
            model = sub.model if state.cache is None else _Acquiring(sub.model, state.cache)
            return model, sub.preprocess, sub.postprocess

        call = MetaCall(
            bundle.name,
            bundle.manifest.meta_calls,
            resolve,
            deadline_ns=deadline_ns,
            pool=state.scratch_pool(),
        )
        queued = time.monotonic_ns()
        started: list[int] = []

        def unit():
            started.append(time.monotonic_ns())
            return run_meta(
                bundle.name, bundle.run, list(inputs), call, bundle.manifest.wire_outputs
            )

        outputs = await state.scheduler.run_on_device(unit)
        trace.queue_ns = (started[0] - queued) if started else 0
        trace.compute_ns = int(call.subcall_seconds * 1e9)
        trace.batch_size = 0
        return outputs

    # ---- Triton extensions: configuration and statistics -----------------------------

    async def model_config(self, request, ctx: CallContext):
        bundle = self.state.bundle(request.name, request.version)
        sizes: list[int] = []
        coalesces = False
        if bundle.model is not None:
            for variant in bundle.model.variants:
                sizes.extend(bundle.model.batch_keys(variant))
            coalesces = self.state.scheduler.has_model(bundle.name) and all(
                s.batch_axis is not None
                for s in (*bundle.manifest.executable_inputs, *bundle.manifest.executable_outputs)
            )
        return pb.ModelConfigResponse(
            config=model_config(
                request.name, bundle.manifest, sorted(set(sizes)), coalesces=coalesces
            )
        )

    async def model_statistics(self, request, ctx: CallContext):
        state = self.state
        if request.name:
            state.bundle(request.name, request.version)
            names = [request.name]
        else:
            if request.version and request.version != codec.BUNDLE_VERSION:
                raise NotFound(
                    f"no model has version '{request.version}' (every bundle is served as "
                    f"version {codec.BUNDLE_VERSION})"
                )
            names = state.routable_names()
        metrics = state.scheduler.scheduler_metrics()
        out = []
        for name in names:
            stats = state.stats.setdefault(name, RequestStats())
            m = metrics.get(name)
            if m is not None:
                batch = {
                    size: (count, int(m.batch_compute_seconds.get(size, 0.0) * 1e9))
                    for size, count in m.batch_size_hist.items()
                }
                out.append(
                    model_statistics(
                        name,
                        stats,
                        inference_count=m.rows_served,
                        execution_count=m.dispatch_count,
                        batch_compute=batch,
                    )
                )
            else:
                out.append(
                    model_statistics(
                        name,
                        stats,
                        inference_count=stats.success.count,
                        execution_count=stats.success.count,
                        batch_compute={},
                    )
                )
        return pb.ModelStatisticsResponse(model_stats=out)


class _Acquiring:
    """A sub-model as a meta's ``call`` sees it: each execution acquires its weights first
    (on the device thread, where the meta runs), like a scheduled batch does."""

    def __init__(self, model, cache) -> None:
        self._model = model
        self._cache = cache
        self.name = model.name
        self.manifest = model.manifest

    def batch_keys(self, variant):
        return self._model.batch_keys(variant)

    def execute(self, variant, batch_key, inputs):
        self._cache.acquire(self._model)
        return self._model.execute(variant, batch_key, inputs)


def _check_requested_outputs(bundle: ModelBundle, requested) -> None:
    """Refuse an unknown requested output before any device work is spent on the request."""
    if not requested:
        return
    known = {spec.name for spec in bundle.manifest.wire_outputs}
    for out in requested:
        if out.name not in known:
            raise InvalidArgument(
                f"model '{bundle.name}' has no output '{out.name}' "
                f"(outputs: {', '.join(sorted(known))})"
            )


__all__ = ["EXTENSIONS", "SERVER_NAME", "InferenceService", "WorkerState"]

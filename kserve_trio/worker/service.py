"""The worker's RPC layer: the KServe V2 ``inference.GRPCInferenceService`` on typed messages.

``InferenceService`` is transport-free: each method takes the RPC's request message and returns
its reply message (``ModelInfer`` also takes the call's deadline), and both transports wrap it:
``methods`` maps the gRPC paths to it (``serving.grpc.unary``), and the REST adapter
(``worker/rest.py``) calls the same methods on the messages it builds from JSON. So an RPC has
one implementation, one message for each fault and one status on both transports.
``ModelInfer`` hands the parsed request to the ``InferenceCore`` (``worker/inference.py``) and
its encoded reply back to the server layer as it is; ``ModelStreamInfer`` serves each message
of a stream the same way (``worker/stream.py``). Models are found in the ``ModelRepository``.
Statuses: unknown model or version NOT_FOUND; malformed or mismatching input INVALID_ARGUMENT;
queue full or concurrency cap RESOURCE_EXHAUSTED; expired deadline DEADLINE_EXCEEDED; shutting
down UNAVAILABLE; not resident in explicit mode FAILED_PRECONDITION.

Every bundle is served as version ``1`` (``""`` means the same); ``ServerMetadata`` lists
``EXTENSIONS`` by Triton's names, and every model reports platform ``jax`` (docs/protocol.md).

``LogSettings`` reads and changes what the process logs (``serving/log_settings.py``);
``TraceSetting`` reads and changes what it traces, globally and per model
(``serving/trace_settings.py``); CUDA shared memory answers UNIMPLEMENTED naming the RPC.

Explicit mode (``model_control_mode: explicit``): a model is ready only while its weights are
on the device; Triton's ``RepositoryModelLoad`` pins it there and ``RepositoryModelUnload``
unpins it (``control_service.set_model_residency``), so ``tritonclient.load_model`` /
``unload_model`` drive residency. In the other modes both answer FAILED_PRECONDITION.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING

import kserve_trio
from kserve_trio.core.errors import FailedPrecondition, InvalidArgument, NotFound
from kserve_trio.core.logging import get_logger
from kserve_trio.core.memory import check_key
from kserve_trio.core.process import ModelControlMode, ResidencyState
from kserve_trio.core.protocol import (
    BUNDLE_VERSION,
    check_model_name,
    encode_model_metadata,
    encode_repository_index,
)
from kserve_trio.proto import inference as pb
from kserve_trio.serving.grpc import Method, stream, unary, unimplemented
from kserve_trio.serving.log_settings import answer as answer_log_settings
from kserve_trio.serving.rpc_codec import TypedRpc
from kserve_trio.serving.surface import EXTENSIONS, SERVER_NAME, UNIMPLEMENTED_RPCS
from kserve_trio.serving.trace_control import tracing_installed
from kserve_trio.worker.control_service import set_model_residency
from kserve_trio.worker.inference import InferenceCore, InferReply
from kserve_trio.worker.state import WorkerState
from kserve_trio.worker.stream import StreamInfer
from kserve_trio.worker.triton_views import PLATFORM, model_config, model_statistics

if TYPE_CHECKING:
    from kserve_trio.worker.inference import ParsedInferRequest

log = get_logger("kserve_trio.worker.service")

PREFIX = "/inference.GRPCInferenceService/"
"""The path prefix of the service's RPCs."""


class InferenceService:
    """The worker's ``inference.GRPCInferenceService`` (``methods`` maps its paths)."""

    def __init__(self, state: WorkerState, core: InferenceCore) -> None:
        self.state = state
        self.repository = state.repository
        self.core = core
        self.stream_infer = StreamInfer(core, state.streams, state.admission)

    def typed_rpcs(self) -> dict[str, TypedRpc]:
        """The typed unary RPCs by name, each with its parse and encode (ModelInfer and
        ModelStreamInfer are served apart: ``methods``)."""
        return {
            "ServerLive": TypedRpc(self.server_live, pb.ServerLiveRequest),
            "ServerReady": TypedRpc(self.server_ready, pb.ServerReadyRequest),
            "ModelReady": TypedRpc(self.model_ready, pb.ModelReadyRequest),
            "ServerMetadata": TypedRpc(self.server_metadata, pb.ServerMetadataRequest),
            "ModelMetadata": TypedRpc(self.model_metadata, pb.ModelMetadataRequest),
            "RepositoryIndex": TypedRpc(self.repository_index, pb.RepositoryIndexRequest),
            "ModelConfig": TypedRpc(self.model_config, pb.ModelConfigRequest),
            "ModelStatistics": TypedRpc(self.model_statistics, pb.ModelStatisticsRequest),
            "SystemSharedMemoryStatus": TypedRpc(
                self.shm_status, pb.SystemSharedMemoryStatusRequest
            ),
            "SystemSharedMemoryRegister": TypedRpc(
                self.shm_register, pb.SystemSharedMemoryRegisterRequest
            ),
            "SystemSharedMemoryUnregister": TypedRpc(
                self.shm_unregister,
                pb.SystemSharedMemoryUnregisterRequest,
            ),
            "IsSameIPCNamespace": TypedRpc(
                self.is_same_ipc_namespace, pb.IsSameIpcNamespaceRequest
            ),
            "RepositoryModelLoad": TypedRpc(
                self.repository_model_load, pb.RepositoryModelLoadRequest
            ),
            "RepositoryModelUnload": TypedRpc(
                self.repository_model_unload,
                pb.RepositoryModelUnloadRequest,
            ),
            "LogSettings": TypedRpc(self.log_settings, pb.LogSettingsRequest),
            "TraceSetting": TypedRpc(self.trace_setting, pb.TraceSettingRequest),
        }

    def methods(self) -> dict[str, Method]:
        lim = self.state.limits
        mapping = {
            PREFIX + rpc: unary(m.handler, m.request_type, lim, rpc)
            for rpc, m in self.typed_rpcs().items()
        }
        tracing = self.state.tracing
        if tracing.tracer is not None or tracing_installed():
            # Tracing is on or can be turned on live: the caller's trace context, read only
            # once there is a tracer (``TraceControl.caller_context``).
            mapping[PREFIX + "ModelInfer"] = unary(
                self.model_infer_traced,
                pb.ModelInferRequest,
                lim,
                "ModelInfer",
                context=tracing.caller_context,
            )
        else:
            mapping[PREFIX + "ModelInfer"] = unary(
                self.model_infer, pb.ModelInferRequest, lim, "ModelInfer", with_deadline=True
            )
        mapping[PREFIX + "ModelStreamInfer"] = stream(self.stream_infer, lim, "ModelStreamInfer")
        for rpc, reason in UNIMPLEMENTED_RPCS.items():
            mapping.setdefault(PREFIX + rpc, unimplemented(rpc, reason, lim))
        return mapping

    async def server_live(self, request):
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, request):
        return pb.ServerReadyResponse(ready=self.state.server_ready())

    async def model_ready(self, request):
        """An unknown model, or a known one asked for another version, is not ready."""
        return pb.ModelReadyResponse(
            ready=self.repository.model_ready(request.name, request.version)
        )

    async def server_metadata(self, request):
        shm_on = self.state.shm_registry.policy.enabled
        extensions = [e for e in EXTENSIONS if e != "system_shared_memory" or shm_on]
        return pb.ServerMetadataResponse(
            name=SERVER_NAME, version=kserve_trio.__version__, extensions=extensions
        )

    async def model_metadata(self, request):
        bundle = self.repository.lookup(request.name, request.version)
        return encode_model_metadata(request.name, bundle.manifest, PLATFORM)

    async def repository_index(self, request):
        # Failed bundles too, with the reason; a deleted bundle's directory leaves it.
        return encode_repository_index(self.repository.index(ready_only=request.ready))

    async def shm_status(self, request):
        # Register, Unregister and Status validate names and keys in ShmRegistry
        # (core/memory/shm_names.py) before any OS call: INVALID_ARGUMENT naming the field; its
        # policy answers UNAVAILABLE with client shared memory off and refuses reserved keys.
        regions = self.state.shm_registry.status(request.name)
        return pb.SystemSharedMemoryStatusResponse(
            regions={
                name: pb.SystemSharedMemoryStatusResponseRegionStatus(
                    name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size
                )
                for name, r in regions.items()
            }
        )

    async def shm_register(self, request):
        self.state.shm_registry.register(
            request.name, request.key, request.offset, request.byte_size
        )
        log.debug("shm_registered", region=request.name, key=request.key, bytes=request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def shm_unregister(self, request):
        self.state.shm_registry.unregister(request.name)
        log.debug("shm_unregistered", region=request.name or "<all>")
        return pb.SystemSharedMemoryUnregisterResponse()

    async def is_same_ipc_namespace(self, request):
        # The name reaches posix_ipc only once it is a valid key (a NUL byte crashes it).
        check_key(request.name, rpc="IsSameIPCNamespace", field="name")
        same = self.state.shm_registry.same_ipc_namespace(request.name)
        return pb.IsSameIpcNamespaceResponse(same=same)

    # ---- Triton's repository control: residency in explicit mode ------------------------

    def _require_explicit(self, rpc: str) -> None:
        mode = self.state.config.model_control_mode
        if mode is not ModelControlMode.EXPLICIT:
            raise FailedPrecondition(
                f"{rpc} requires model_control_mode 'explicit' (this worker runs '{mode.value}')"
            )

    async def repository_model_load(self, request):
        """Explicit mode: pin the model's weights to the device (= SetModelResidency
        PINNED_DEVICE); the model is served and ready once this returns. A name that is not a
        model name (``core.protocol.request_bounds.check_model_name``) is INVALID_ARGUMENT first, in
        every mode, as the gateway answers it."""
        check_model_name("RepositoryModelLoad", request.model_name)
        self._require_explicit("RepositoryModelLoad")
        if request.parameters:
            raise InvalidArgument(
                "RepositoryModelLoad parameters are not supported "
                f"({', '.join(sorted(request.parameters))}): models load from the repository"
            )
        await set_model_residency(self.state, request.model_name, ResidencyState.PINNED_DEVICE)
        log.info("model_load_requested", model=request.model_name)
        return pb.RepositoryModelLoadResponse()

    async def repository_model_unload(self, request):
        """Explicit mode: unpin (= SetModelResidency UNPINNED): device and host copies are
        released; the model stays compiled but is not ready nor served until loaded again."""
        check_model_name("RepositoryModelUnload", request.model_name)
        self._require_explicit("RepositoryModelUnload")
        await set_model_residency(self.state, request.model_name, ResidencyState.UNPINNED)
        log.info("model_unload_requested", model=request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # ---- Triton's log settings ------------------------------------------------------------

    async def log_settings(self, request):
        """Change the settings the request names (all or nothing) and answer with every
        setting in force; a request without settings only reads them."""
        return answer_log_settings(request)

    # ---- Triton's trace settings ----------------------------------------------------------

    async def trace_setting(self, request):
        """Change the trace settings the request names, for its model or globally (all or
        nothing), and answer with every setting in force there; without settings, read them.
        A model name must be a model's name (NOT_FOUND otherwise). A change that turns tracing
        on in a worker started without it builds the tracer first (``TraceControl``)."""
        if request.model_name:
            self.repository.lookup(request.model_name, "")
        return await self.state.tracing.answer(request)

    def model_infer(self, request: ParsedInferRequest, deadline_ns: int) -> Awaitable[InferReply]:
        """The inference core does the work under the call's deadline; its encoded reply goes
        back to the server layer as it is. A plain method handing the layer the core's
        coroutine (one frame less per request than awaiting it here)."""
        return self.core.infer(request, transport_deadline_ns=deadline_ns)

    def model_infer_traced(
        self, request: ParsedInferRequest, deadline_ns: int, trace_context: str | None
    ) -> Awaitable[InferReply]:
        """``model_infer`` with the caller's W3C trace context (None until a tracer exists)."""
        return self.core.infer(
            request, transport_deadline_ns=deadline_ns, trace_context=trace_context
        )

    # ---- Triton extensions: configuration and statistics -----------------------------

    async def model_config(self, request):
        bundle = self.repository.lookup(request.name, request.version)
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

    async def model_statistics(self, request):
        state = self.state
        if request.name:
            self.repository.lookup(request.name, request.version)
            names = [request.name]
        else:
            if request.version and request.version != BUNDLE_VERSION:
                raise NotFound(
                    f"no model has version '{request.version}' (every bundle is served as "
                    f"version {BUNDLE_VERSION})"
                )
            names = self.repository.routable_names()
        metrics = state.scheduler.scheduler_metrics()
        out = []
        for name in names:
            stats = state.observer.stats_of(name)
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


__all__ = ["EXTENSIONS", "PREFIX", "SERVER_NAME", "InferenceService", "WorkerState"]

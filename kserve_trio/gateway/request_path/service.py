"""The gateway's RPC layer: ``inference.GRPCInferenceService`` and the fleet-wide part of
``reactant_control.ControlService``.

Every RPC but the two inference ones is a ``FleetRpc`` (``fleet_rpcs``): the request's bytes and
the caller's deadline in, the reply's bytes out, with no transport in sight. ``methods`` serves
them over gRPC (``over_grpc``: the call's message, uncompressed, and its deadline) and the REST
endpoint (``rest``) calls the same functions on the message it built from JSON. ModelInfer and
ModelStreamInfer are gRPC's own (``serving.grpc`` raw methods); REST forwards inference its way.

Where each answer comes from:

- ServerLive: the gateway itself (live while the process serves). ServerReady: ready while
  some worker is routable and the gateway is not draining.
- ServerMetadata: the gateway's own name, version and the extensions it answers.
- ModelInfer: ``forward.Forwarder`` (the request's bytes, never decoded). ModelStreamInfer:
  ``stream.StreamInfer``, each message like a ModelInfer.
- ModelReady, ModelMetadata, ModelConfig: a ready replica of the model, the request forwarded
  as it is (no ready replica: ModelReady answers not ready, the others NOT_FOUND).
- RepositoryIndex, ModelStatistics, IsSameIPCNamespace, RepositoryModelLoad / Unload and
  CompactMemory: every ready worker (``fanout.Fleet``). Under lpt_packing (``placement_managed``)
  RepositoryModelLoad / Unload answer FAILED_PRECONDITION naming SetModelPlacement.
- SystemSharedMemoryRegister / Unregister: every ready worker (``shm_fanout.ShmFanout``);
  SystemSharedMemoryStatus: the regions the gateway registered. With the gateway's
  ``client_shared_memory`` off all three are UNAVAILABLE, and IsSameIPCNamespace answers no
  without asking a worker for a key the gateway's policy would not register.
- LogSettings: the gateway process's own logging (read, or changed all or nothing).
- TraceSetting: read, the gateway's own trace settings; changed, the gateway's (a change that
  turns tracing on builds its tracer first, ``TraceControl``) and every routable worker's
  (``Fleet.trace_setting``), each of which turns its own on likewise.
- CUDA shared memory and the per-worker ControlService RPCs answer
  UNIMPLEMENTED by name.

Admission (``admission.Admission``): ModelInfer and stream messages count against the inbound
cap (a ModelInfer at the cap waits in the bounded queue within its deadline, a stream message
waits for a slot); every other RPC except ServerLive and ServerReady is refused UNAVAILABLE once the gateway
drains. A compressed request is read uncompressed (``Call.plain``) where the gateway must
read it; ModelInfer and stream messages are forwarded compressed, under their
``grpc-encoding``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from anyio import get_cancelled_exc_class

import kserve_trio
from kserve_trio.core.errors import FailedPrecondition, InvalidArgument, ServingError
from kserve_trio.core.process import EdgeLimits, TracingConfig
from kserve_trio.core.protocol import check_model_name
from kserve_trio.gateway.caller_headers import grpc_headers
from kserve_trio.gateway.request_path import aggregate
from kserve_trio.gateway.request_path.admission import Admission
from kserve_trio.gateway.request_path.fanout import Fleet
from kserve_trio.gateway.request_path.forward import Forwarder
from kserve_trio.gateway.request_path.shm_fanout import ShmFanout
from kserve_trio.gateway.request_path.stream import StreamInfer
from kserve_trio.proto import inference as pb
from kserve_trio.serving.grpc import (
    Call,
    Limits,
    Method,
    RawMessage,
    RawUnaryFn,
    raw_unary,
    stream,
    unimplemented,
)
from kserve_trio.serving.log_settings import answer as answer_log_settings
from kserve_trio.serving.message_check import check_bounds, scan_bounds
from kserve_trio.serving.surface import EXTENSIONS, SERVER_NAME, UNIMPLEMENTED_RPCS
from kserve_trio.serving.trace_control import TraceControl
from kserve_trio.serving.trace_settings import caller_context

if TYPE_CHECKING:
    from kserve_trio.serving.tracing import Tracing

INFERENCE = "/inference.GRPCInferenceService/"
CONTROL = "/reactant_control.ControlService/"

FleetRpc = Callable[[bytes, "float | None"], Awaitable[bytes]]
"""One RPC of the gateway's RPC layer: the request message's uncompressed bytes and the
caller's deadline (absolute ``anyio.current_time()``; ``None``: none) -> the reply's bytes. The
gateway forwards those bytes to workers as they are, which is why this layer speaks bytes, not
messages; it knows nothing of the transport, so gRPC and REST call the same functions."""


def forwarded_metadata(metadata: Mapping[str, Any]) -> dict[str, Any] | None:
    """The caller's custom metadata to pass on to the worker (``None`` when there is none):
    ``Call.metadata`` has already left out ``grpc-*`` and gRPC's reserved headers; HTTP
    hop-by-hop headers are dropped by ``caller_headers.grpc_headers``, the one rule for every
    call the gateway makes for a caller."""
    return grpc_headers(metadata) if metadata else None


def _plain(call: Call, message: RawMessage) -> bytes:
    """A request's bytes, uncompressed (the fleet RPCs' requests are small: a compressed one is
    copied into ``bytes`` once)."""
    data = call.plain(message)
    return data if type(data) is bytes else bytes(data)


def over_grpc(rpc: FleetRpc) -> RawUnaryFn:
    """The gRPC adapter of a fleet RPC: the call's message, uncompressed, and its deadline."""

    async def run(call: Call, message: RawMessage) -> bytes:
        return await rpc(_plain(call, message), call.deadline)

    return run


def _parse(cls: type, data: bytes, rpc: str, bounds: EdgeLimits) -> Any:
    """A request the gateway reads, under the names and repeated-field bounds
    (``message_check.scan_bounds`` on the wire, ``check_bounds`` once decoded)."""
    try:
        scan_bounds(data, cls, bounds)
        message = cls.parse(data)
    except InvalidArgument:
        raise
    except Exception as exc:
        raise InvalidArgument(f"malformed {rpc} request: {exc}") from None
    check_bounds(message, bounds)
    return message


class GatewayService:
    """The gateway's gRPC methods (``methods``; see the module docstring)."""

    def __init__(
        self,
        *,
        forwarder: Forwarder,
        shm: ShmFanout,
        fleet: Fleet,
        admission: Admission,
        limits: Limits,
        ready: Callable[[], bool],
        placement_managed: bool = False,
        tracing: TraceControl | None = None,
    ) -> None:
        self.placement_managed = placement_managed
        self.trace_control = tracing or TraceControl(
            TracingConfig(), role="gateway", metric_prefix="gateway"
        )
        """The gateway's trace settings, and its tracer once built (at start-up, or live)."""
        self.tracing: Tracing | None = None
        """The tracer ModelInfer goes through (None: tracing never turned on)."""
        self.forwarder = forwarder
        self.shm = shm
        self.fleet = fleet
        self.admission = admission
        self.limits = limits
        self._ready = ready
        self.stream_infer = StreamInfer(forwarder, admission, self.trace_control)
        self.trace_control.when_started(self._trace_with)

    def _trace_with(self, tracing: Tracing) -> None:
        self.tracing = tracing

    def fleet_rpcs(self) -> dict[str, FleetRpc]:
        """Every RPC but ModelInfer and ModelStreamInfer by its name, as both transports serve
        it: counted by the admission (so refused once the gateway drains) except the health
        checks."""
        admitted: dict[str, FleetRpc] = {
            "ModelReady": self.model_ready,
            "ModelMetadata": self.model_metadata,
            "ModelConfig": self.model_config,
            "ModelStatistics": self.model_statistics,
            "RepositoryIndex": self.repository_index,
            "RepositoryModelLoad": self.repository_model_load,
            "RepositoryModelUnload": self.repository_model_unload,
            "SystemSharedMemoryStatus": self.shm_status,
            "SystemSharedMemoryRegister": self.shm_register,
            "SystemSharedMemoryUnregister": self.shm_unregister,
            "IsSameIPCNamespace": self.is_same_ipc_namespace,
            "ServerMetadata": self.server_metadata,
            "LogSettings": self.log_settings,
            "TraceSetting": self.trace_setting,
            "CompactMemory": self.compact_memory,
        }
        rpcs = {rpc: self._admitted(fn) for rpc, fn in admitted.items()}
        rpcs["ServerLive"] = self.server_live
        rpcs["ServerReady"] = self.server_ready
        return rpcs

    def methods(self) -> dict[str, Method]:
        lim = self.limits
        mapping = {
            (CONTROL if rpc == "CompactMemory" else INFERENCE) + rpc: raw_unary(
                over_grpc(fn), lim, rpc
            )
            for rpc, fn in self.fleet_rpcs().items()
        }
        mapping[INFERENCE + "ModelInfer"] = raw_unary(self.model_infer, lim, "ModelInfer")
        mapping[INFERENCE + "ModelStreamInfer"] = stream(self.stream_infer, lim, "ModelStreamInfer")
        for rpc, reason in UNIMPLEMENTED_RPCS.items():
            mapping[INFERENCE + rpc] = unimplemented(rpc, reason, lim)
        for rpc in ("ModelControlStatus", "SetModelResidency", "SetModelPolicy"):
            mapping[CONTROL + rpc] = unimplemented(
                rpc, "it acts on one worker: call that worker's own port", lim
            )
        return mapping

    def _admitted(self, fn: FleetRpc) -> FleetRpc:
        async def run(data: bytes, deadline: float | None) -> bytes:
            with self.admission.call():
                return await fn(data, deadline)

        return run

    # -- the gateway's own answers -----------------------------------------------------------

    async def server_live(self, data: bytes, deadline: float | None) -> bytes:
        return bytes(pb.ServerLiveResponse(live=True))

    async def server_ready(self, data: bytes, deadline: float | None) -> bytes:
        ready = self._ready() and not self.admission.draining
        return bytes(pb.ServerReadyResponse(ready=ready))

    async def server_metadata(self, data: bytes, deadline: float | None) -> bytes:
        shm_on = self.shm.policy.enabled
        extensions = [e for e in EXTENSIONS if e != "system_shared_memory" or shm_on]
        return bytes(
            pb.ServerMetadataResponse(
                name=SERVER_NAME, version=kserve_trio.__version__, extensions=extensions
            )
        )

    async def log_settings(self, data: bytes, deadline: float | None) -> bytes:
        """The gateway process's own log settings (Triton's LogSettings): read, or change all
        or nothing. Workers keep theirs; change a worker's on its own port."""
        request = _parse(pb.LogSettingsRequest, data, "LogSettings", self.limits.edge)
        return bytes(answer_log_settings(request))

    async def trace_setting(self, data: bytes, deadline: float | None) -> bytes:
        """Triton's TraceSetting: a read answers the gateway's own settings; a change applies
        to the gateway's own and is fanned out to every routable worker (``Fleet``), so one
        call sets what the whole fleet traces. Answered with the gateway's settings."""
        request = _parse(pb.TraceSettingRequest, data, "TraceSetting", self.limits.edge)
        reply = await self.trace_control.answer(request)  # a turn-on builds the tracer first
        if not request.settings:
            return bytes(reply)
        await self.fleet.trace_setting(data, request.model_name, deadline)
        return bytes(reply)

    async def shm_status(self, data: bytes, deadline: float | None) -> bytes:
        self.shm.policy.check_enabled("SystemSharedMemoryStatus")
        request = _parse(pb.SystemSharedMemoryStatusRequest, data, "status", self.limits.edge)
        registered = [data for _, data in self.shm.registrations.items()]
        return bytes(aggregate.shm_status(registered, request.name))

    # -- inference ---------------------------------------------------------------------------

    async def model_infer(self, call: Call, message: RawMessage) -> bytes:
        """ModelInfer over gRPC: the message as it arrived (compressed or not) and the caller's
        metadata go to a replica (REST forwards its own way, ``rest_forward``)."""
        if self.tracing is not None:
            return await self._model_infer_traced(self.tracing, call, message)
        async with self.admission.queued(call.deadline):
            if message.compressed:
                return await self.forwarder.infer(
                    message.data,
                    plain=call.plain(message),  # peeked only
                    compressed_with=call.encoding,
                    deadline=call.deadline,
                    metadata=forwarded_metadata(call.metadata),
                )
            return await self.forwarder.infer(
                message.data,
                deadline=call.deadline,
                metadata=forwarded_metadata(call.metadata),
            )

    async def _model_infer_traced(self, tracing: Tracing, call: Call, message: RawMessage) -> bytes:
        """ModelInfer with tracing on: a server span continuing the caller's W3C context
        when the settings sample the request; each forward attempt is a client span whose
        context replaces the caller's ``traceparent`` (and ``tracestate``) on the way to the
        worker. Not sampled here, a caller's context goes on unchanged, and a request that came
        without one gets a sampled-out one (``Tracing.sampled_out``): the gateway's rate is
        the fleet's, the workers follow its decision."""
        async with self.admission.queued(call.deadline):
            plain = call.plain(message)
            head = self.forwarder.peek(plain)
            context = caller_context(call.header)
            span = tracing.begin(
                "ModelInfer",
                head.model_name,
                context,
                attributes={"kserve_trio.request_id": head.id},
            )
            metadata = forwarded_metadata(call.metadata)
            if span is None:
                if context is None:
                    metadata = {**(metadata or {}), **tracing.sampled_out()}
                return await self.forwarder.infer(
                    message.data,
                    plain=plain,
                    compressed_with=call.encoding if message.compressed else None,
                    head=head,
                    deadline=call.deadline,
                    metadata=metadata,
                )
            status, text = "OK", ""
            try:
                with span.in_logs():
                    return await self.forwarder.infer(
                        message.data,
                        plain=plain,
                        compressed_with=call.encoding if message.compressed else None,
                        head=head,
                        deadline=call.deadline,
                        metadata=metadata,
                        span=span,
                    )
            except ServingError as exc:
                status, text = exc.status.name, str(exc)
                raise
            except BaseException as exc:
                status, text = (
                    "CANCELLED" if isinstance(exc, get_cancelled_exc_class()) else "INTERNAL",
                    str(exc),
                )
                raise
            finally:
                span.end(status, text)

    # -- from a ready replica ----------------------------------------------------------------

    async def _from_replica(self, data: bytes, deadline: float | None, rpc: str, cls: type):
        request = _parse(cls, data, rpc, self.limits.edge)
        reply = await self.forwarder.call_replica(
            INFERENCE + rpc, request.name, data, deadline=deadline
        )
        return request, reply

    async def model_ready(self, data: bytes, deadline: float | None) -> bytes:
        _, reply = await self._from_replica(data, deadline, "ModelReady", pb.ModelReadyRequest)
        return bytes(pb.ModelReadyResponse(ready=False)) if reply is None else reply

    async def model_metadata(self, data: bytes, deadline: float | None) -> bytes:
        request, reply = await self._from_replica(
            data, deadline, "ModelMetadata", pb.ModelMetadataRequest
        )
        if reply is None:
            raise self.forwarder.state.missing(request.name)
        return reply

    async def model_config(self, data: bytes, deadline: float | None) -> bytes:
        request, reply = await self._from_replica(
            data, deadline, "ModelConfig", pb.ModelConfigRequest
        )
        if reply is None:
            raise self.forwarder.state.missing(request.name)
        return reply

    # -- fan-outs ----------------------------------------------------------------------------

    async def repository_index(self, data: bytes, deadline: float | None) -> bytes:
        _parse(pb.RepositoryIndexRequest, data, "RepositoryIndex", self.limits.edge)
        return await self.fleet.repository_index(data, deadline)

    async def model_statistics(self, data: bytes, deadline: float | None) -> bytes:
        request = _parse(pb.ModelStatisticsRequest, data, "ModelStatistics", self.limits.edge)
        return await self.fleet.model_statistics(data, request.name, deadline)

    async def repository_model_load(self, data: bytes, deadline: float | None) -> bytes:
        return await self._load_or_unload(
            data, deadline, "RepositoryModelLoad", pb.RepositoryModelLoadRequest
        )

    async def repository_model_unload(self, data: bytes, deadline: float | None) -> bytes:
        return await self._load_or_unload(
            data, deadline, "RepositoryModelUnload", pb.RepositoryModelUnloadRequest
        )

    async def _load_or_unload(
        self, data: bytes, deadline: float | None, rpc: str, cls: type
    ) -> bytes:
        request = _parse(cls, data, rpc, self.limits.edge)
        check_model_name(rpc, request.model_name)  # the worker's rule, so the same status
        if self.placement_managed:  # a fan-out pin on every worker would undo the placement
            raise FailedPrecondition(
                f"{rpc} through the gateway is refused under lpt_packing scheduling: the "
                "gateway places models; use GatewayControlService/SetModelPlacement (or call "
                "a worker's own port)"
            )
        return await self.fleet.load_or_unload(rpc, data, request.model_name, deadline)

    async def is_same_ipc_namespace(self, data: bytes, deadline: float | None) -> bytes:
        request = _parse(pb.IsSameIpcNamespaceRequest, data, "IsSameIPCNamespace", self.limits.edge)
        if not self.shm.policy.may_register(request.name):  # the client then goes inline
            return bytes(pb.IsSameIpcNamespaceResponse(same=False))
        return await self.fleet.same_ipc_namespace(data)

    async def compact_memory(self, data: bytes, deadline: float | None) -> bytes:
        return await self.fleet.compact_memory(data)

    async def shm_register(self, data: bytes, deadline: float | None) -> bytes:
        return await self.shm.register(data, deadline=deadline)

    async def shm_unregister(self, data: bytes, deadline: float | None) -> bytes:
        return await self.shm.unregister(data, deadline=deadline)


__all__ = ["CONTROL", "EXTENSIONS", "INFERENCE", "SERVER_NAME", "FleetRpc", "GatewayService"]

"""The gateway's gRPC surface: ``inference.GRPCInferenceService`` and the fleet-wide part of
``reactant_control.ControlService``, as raw-bytes ``serving.grpc`` methods.

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
  SystemSharedMemoryStatus: the regions the gateway registered.
- LogSettings: the gateway process's own logging (read, or changed all or nothing).
- CUDA shared memory, trace settings, and the per-worker ControlService RPCs answer
  UNIMPLEMENTED by name.

Admission (``admission.Admission``): ModelInfer and stream messages count against the inbound
cap; every other RPC except ServerLive and ServerReady is refused UNAVAILABLE once the gateway
drains. A compressed request is read uncompressed (``Call.plain``) where the gateway must
read it; ModelInfer and stream messages are forwarded compressed, under their
``grpc-encoding``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import kserve_trio
from kserve_trio.core.config import EdgeLimits
from kserve_trio.core.errors import FailedPrecondition, InvalidArgument, NotFound
from kserve_trio.core.request_bounds import check_model_name, shown
from kserve_trio.gateway import aggregate
from kserve_trio.gateway.admission import Admission
from kserve_trio.gateway.caller_headers import grpc_headers
from kserve_trio.gateway.fanout import Fleet
from kserve_trio.gateway.forward import Forwarder
from kserve_trio.gateway.shm_fanout import ShmFanout
from kserve_trio.gateway.stream import StreamInfer
from kserve_trio.proto import inference as pb
from kserve_trio.serving.grpc import (
    Call,
    Limits,
    Method,
    RawMessage,
    raw_unary,
    stream,
    unimplemented,
)
from kserve_trio.serving.log_settings import answer as answer_log_settings
from kserve_trio.serving.message_check import check_bounds, scan_bounds
from kserve_trio.serving.surface import EXTENSIONS, SERVER_NAME, UNIMPLEMENTED_RPCS

INFERENCE = "/inference.GRPCInferenceService/"
CONTROL = "/reactant_control.ControlService/"

Handler = Callable[[Call, RawMessage], Awaitable[bytes]]


def forwarded_metadata(metadata: Mapping[str, Any]) -> dict[str, Any] | None:
    """The caller's custom metadata to pass on to the worker (``None`` when there is none):
    ``Call.metadata`` has already left out ``grpc-*`` and gRPC's reserved headers; HTTP
    hop-by-hop headers are dropped by ``caller_headers.grpc_headers``, the one rule for every
    call the gateway makes for a caller."""
    return grpc_headers(metadata) if metadata else None


def _plain(call: Call, message: RawMessage) -> bytes:
    """A control request's bytes, uncompressed (these are small: a compressed one is copied
    into ``bytes`` once)."""
    data = call.plain(message)
    return data if type(data) is bytes else bytes(data)


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
    ) -> None:
        self.placement_managed = placement_managed
        self.forwarder = forwarder
        self.shm = shm
        self.fleet = fleet
        self.admission = admission
        self.limits = limits
        self._ready = ready
        self.stream_infer = StreamInfer(forwarder, admission)

    def methods(self) -> dict[str, Method]:
        lim = self.limits
        inference: dict[str, Handler] = {
            "ModelInfer": self.model_infer,
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
        }
        mapping = {
            INFERENCE + rpc: raw_unary(fn if rpc == "ModelInfer" else self._admitted(fn), lim, rpc)
            for rpc, fn in inference.items()
        }
        mapping[INFERENCE + "ServerLive"] = raw_unary(self.server_live, lim, "ServerLive")
        mapping[INFERENCE + "ServerReady"] = raw_unary(self.server_ready, lim, "ServerReady")
        mapping[INFERENCE + "ModelStreamInfer"] = stream(self.stream_infer, lim, "ModelStreamInfer")
        mapping[INFERENCE + "LogSettings"] = raw_unary(self.log_settings, lim, "LogSettings")
        mapping[CONTROL + "CompactMemory"] = raw_unary(
            self._admitted(self.compact_memory), lim, "CompactMemory"
        )
        for rpc, reason in UNIMPLEMENTED_RPCS.items():
            mapping[INFERENCE + rpc] = unimplemented(rpc, reason, lim)
        for rpc in ("ModelControlStatus", "SetModelResidency", "SetModelPolicy"):
            mapping[CONTROL + rpc] = unimplemented(
                rpc, "it acts on one worker: call that worker's own port", lim
            )
        return mapping

    async def log_settings(self, call: Call, message: RawMessage) -> bytes:
        """The gateway process's own log settings (Triton's LogSettings): read, or change all
        or nothing. Workers keep theirs; change a worker's on its own port."""
        request = _parse(
            pb.LogSettingsRequest, _plain(call, message), "LogSettings", self.limits.edge
        )
        return bytes(answer_log_settings(request))

    def _admitted(self, fn: Handler) -> Handler:
        async def run(call: Call, message: RawMessage) -> bytes:
            with self.admission.call():
                return await fn(call, message)

        return run

    # -- the gateway's own answers -----------------------------------------------------------

    async def server_live(self, call: Call, message: RawMessage) -> bytes:
        return bytes(pb.ServerLiveResponse(live=True))

    async def server_ready(self, call: Call, message: RawMessage) -> bytes:
        ready = self._ready() and not self.admission.draining
        return bytes(pb.ServerReadyResponse(ready=ready))

    async def server_metadata(self, call: Call, message: RawMessage) -> bytes:
        return bytes(
            pb.ServerMetadataResponse(
                name=SERVER_NAME, version=kserve_trio.__version__, extensions=list(EXTENSIONS)
            )
        )

    async def shm_status(self, call: Call, message: RawMessage) -> bytes:
        request = _parse(
            pb.SystemSharedMemoryStatusRequest, _plain(call, message), "status", self.limits.edge
        )
        registered = [data for _, data in self.shm.registrations.items()]
        return bytes(aggregate.shm_status(registered, request.name))

    # -- inference ---------------------------------------------------------------------------

    async def model_infer(self, call: Call, message: RawMessage) -> bytes:
        with self.admission.inference():
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

    # -- from a ready replica ----------------------------------------------------------------

    async def _from_replica(self, call: Call, message: RawMessage, rpc: str, cls: type):
        data = _plain(call, message)
        request = _parse(cls, data, rpc, self.limits.edge)
        reply = await self.forwarder.call_replica(
            INFERENCE + rpc, request.name, data, deadline=call.deadline
        )
        return request, reply

    async def model_ready(self, call: Call, message: RawMessage) -> bytes:
        _, reply = await self._from_replica(call, message, "ModelReady", pb.ModelReadyRequest)
        return bytes(pb.ModelReadyResponse(ready=False)) if reply is None else reply

    async def model_metadata(self, call: Call, message: RawMessage) -> bytes:
        request, reply = await self._from_replica(
            call, message, "ModelMetadata", pb.ModelMetadataRequest
        )
        if reply is None:
            raise NotFound(f"model {shown(request.name)} not found on any worker")
        return reply

    async def model_config(self, call: Call, message: RawMessage) -> bytes:
        request, reply = await self._from_replica(
            call, message, "ModelConfig", pb.ModelConfigRequest
        )
        if reply is None:
            raise NotFound(f"model {shown(request.name)} not found on any worker")
        return reply

    # -- fan-outs ----------------------------------------------------------------------------

    async def repository_index(self, call: Call, message: RawMessage) -> bytes:
        data = _plain(call, message)
        _parse(pb.RepositoryIndexRequest, data, "RepositoryIndex", self.limits.edge)
        return await self.fleet.repository_index(data, call.deadline)

    async def model_statistics(self, call: Call, message: RawMessage) -> bytes:
        data = _plain(call, message)
        request = _parse(pb.ModelStatisticsRequest, data, "ModelStatistics", self.limits.edge)
        return await self.fleet.model_statistics(data, request.name, call.deadline)

    async def repository_model_load(self, call: Call, message: RawMessage) -> bytes:
        return await self._load_or_unload(
            call, message, "RepositoryModelLoad", pb.RepositoryModelLoadRequest
        )

    async def repository_model_unload(self, call: Call, message: RawMessage) -> bytes:
        return await self._load_or_unload(
            call, message, "RepositoryModelUnload", pb.RepositoryModelUnloadRequest
        )

    async def _load_or_unload(self, call: Call, message: RawMessage, rpc: str, cls: type) -> bytes:
        data = _plain(call, message)
        request = _parse(cls, data, rpc, self.limits.edge)
        check_model_name(rpc, request.model_name)  # the worker's rule, so the same status
        if self.placement_managed:  # a fan-out pin on every worker would undo the placement
            raise FailedPrecondition(
                f"{rpc} through the gateway is refused under lpt_packing scheduling: the "
                "gateway places models; use GatewayControlService/SetModelPlacement (or call "
                "a worker's own port)"
            )
        return await self.fleet.load_or_unload(rpc, data, request.model_name, call.deadline)

    async def is_same_ipc_namespace(self, call: Call, message: RawMessage) -> bytes:
        data = _plain(call, message)
        _parse(pb.IsSameIpcNamespaceRequest, data, "IsSameIPCNamespace", self.limits.edge)
        return await self.fleet.same_ipc_namespace(data)

    async def compact_memory(self, call: Call, message: RawMessage) -> bytes:
        return await self.fleet.compact_memory(_plain(call, message))

    async def shm_register(self, call: Call, message: RawMessage) -> bytes:
        return await self.shm.register(_plain(call, message), deadline=call.deadline)

    async def shm_unregister(self, call: Call, message: RawMessage) -> bytes:
        return await self.shm.unregister(_plain(call, message), deadline=call.deadline)


__all__ = ["CONTROL", "EXTENSIONS", "INFERENCE", "SERVER_NAME", "GatewayService"]

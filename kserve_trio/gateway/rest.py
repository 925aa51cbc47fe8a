"""The gateway's KServe V2 REST endpoint (``listen.http``): a thin adapter over its gRPC service.

A REST request is the gRPC RPC it stands for (``serving.rest_routes``) and runs through the
same ``GatewayService`` handler a gRPC call of that RPC runs through, so routing, failover,
admission and drain, the fan-outs and merges, shared-memory registration and its replay, and
every status and message are the gRPC ones by construction. The workers are reached over gRPC
as always; only the edge speaks REST:

- ModelInfer: the JSON (+ binary) body becomes the ``ModelInferRequest`` a gRPC client would
  send (``core.rest_codec``), the forwarder routes it by model, and the worker's reply is
  written back as REST JSON and binary, outputs binary where the request asked;
- every other RPC: the path and JSON body become its request message, the handler's reply
  bytes are parsed with the RPC's reply type and written as Triton's JSON.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from kserve_trio.core import rest_codec
from kserve_trio.core.errors import Internal, Unimplemented
from kserve_trio.core.infer_wire import parse_infer_response
from kserve_trio.gateway.service import GatewayService
from kserve_trio.serving import compression
from kserve_trio.serving.grpc_adapter import Limits
from kserve_trio.serving.http import HttpRequest, HttpResponse, error_response
from kserve_trio.serving.raw import RawCall, RawMessage
from kserve_trio.serving.rest_routes import (
    REPLY_TYPES,
    RestCall,
    compressed_reply,
    grpc_request,
    header_length,
    reply_response,
    request_body,
    route,
    unsupported,
)

Handler = Callable[[RawCall, RawMessage], Awaitable[bytes]]

LOG_SETTINGS = "the gateway's log settings are its configuration's"


class RestRawCall(RawCall):
    """A REST request as a raw gRPC handler sees its call: an uncompressed message, no custom
    metadata, no deadline of its own (the attempt timeouts of the worker clients apply)."""

    __slots__ = ()

    def __init__(self, rpc: str, limits: Limits) -> None:
        self.stream = None
        self.rpc = rpc
        self.limits = limits
        self.encoding = compression.IDENTITY
        self._send_lock = None

    @property
    def metadata(self) -> Mapping[str, Any]:
        return {}

    @property
    def deadline(self) -> float | None:
        return None


class GatewayRest:
    """The REST ``App`` of a gateway (``serving.http.serve_app`` serves it)."""

    def __init__(self, service: GatewayService) -> None:
        self.service = service
        self.limits = service.limits
        s = service

        def admitted(fn: Handler) -> Handler:
            """Counted by the gateway's admission like the gRPC call (refused once it
            drains)."""

            async def run(call: RawCall, message: RawMessage) -> bytes:
                with s.admission.call():
                    return await fn(call, message)

            return run

        self._handlers: dict[str, Handler] = {
            "ServerLive": s.server_live,
            "ServerReady": s.server_ready,
            "ServerMetadata": admitted(s.server_metadata),
            "ModelReady": admitted(s.model_ready),
            "ModelMetadata": admitted(s.model_metadata),
            "ModelConfig": admitted(s.model_config),
            "ModelStatistics": admitted(s.model_statistics),
            "RepositoryIndex": admitted(s.repository_index),
            "RepositoryModelLoad": admitted(s.repository_model_load),
            "RepositoryModelUnload": admitted(s.repository_model_unload),
            "SystemSharedMemoryStatus": admitted(s.shm_status),
            "SystemSharedMemoryRegister": admitted(s.shm_register),
            "SystemSharedMemoryUnregister": admitted(s.shm_unregister),
        }

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        try:
            call = route(request.method, request.path)
            if call.rpc == "ModelInfer":
                return await self.infer(call, request)
            if call.rpc == "LogSettings":
                raise Unimplemented(f"LogSettings is not implemented: {LOG_SETTINGS}")
            handler = self._handlers.get(call.rpc)
            if handler is None:
                raise Unimplemented(unsupported(call.rpc))
            message = grpc_request(call, request_body(request, self.limits.max_recv_bytes))
            data = await handler(RestRawCall(call.rpc, self.limits), RawMessage(bytes(message)))
            return reply_response(call, REPLY_TYPES[call.rpc]().parse(data))
        except Exception as exc:
            return error_response(exc)

    async def infer(self, call: RestCall, request: HttpRequest) -> HttpResponse:
        parsed = rest_codec.parse_infer_request(
            request_body(request, self.limits.max_recv_bytes),
            header_length(request),
            call.model,
            call.version,
        )
        data = bytes(parsed.message)
        reply = await self.service.model_infer(
            RestRawCall("ModelInfer", self.limits), RawMessage(data)
        )
        response = parse_infer_response(reply)
        if len(response.raw_output_contents) != len(response.outputs):
            raise Internal(
                f"worker reply has {len(response.raw_output_contents)} raw_output_contents "
                f"entries for {len(response.outputs)} outputs"
            )
        rest = rest_codec.encode_infer_response(
            response.model_name,
            response.model_version,
            response.id,
            response.outputs,
            response.raw_output_contents,
            parsed.wants_binary,
            response.parameters,
        )
        response = HttpResponse(200, rest.pieces, rest.content_type, rest.headers())
        return compressed_reply(request, response)


__all__ = ["GatewayRest", "RestRawCall"]

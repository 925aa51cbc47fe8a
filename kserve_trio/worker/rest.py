"""The worker's KServe V2 REST endpoint (``endpoints.http_port``): a thin adapter.

Every request is the gRPC RPC it stands for (``serving.rest_routes``), answered by the same
code: ModelInfer goes to the transport-free ``InferenceCore`` (admission, lookup, decode, one
validation pass, scheduling, metrics and statistics, shared-memory leases, all shared with
gRPC) with the REST encoder in place of the gRPC one; every other RPC is the
``InferenceService`` method gRPC calls. So a fault has the same message on both transports,
and its HTTP status is the gRPC status mapped (``serving.http``).

REST's own parts: the body is JSON, or JSON plus Triton's binary section
(``core.protocol.rest_codec``), optionally compressed (``Content-Encoding: gzip|deflate``, decompressed
under ``grpc.max_recv_msg_bytes``: 413 past it), nested at most ``limits.max_json_depth`` deep
(400, logged once per request); outputs come back as JSON ``data`` or, on request, binary,
compressed when the request's ``Accept-Encoding`` asks for gzip or deflate.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kserve_trio.core.errors import Unimplemented
from kserve_trio.core.process import Restrictions, group_of
from kserve_trio.core.protocol import (
    DEFAULT_JSON_DEPTH,
    RequestedOutput,
    RestInferRequest,
    RestReply,
    ShmRegistryLike,
    check_path_names,
    encode_rest_response,
    parse_rest_request,
    response_outputs,
)
from kserve_trio.core.tensors import NamedTensor
from kserve_trio.serving.http import HttpRequest, HttpResponse, error_response
from kserve_trio.serving.message_check import check_bounds
from kserve_trio.serving.rest_routes import (
    RestCall,
    compressed_reply,
    grpc_request,
    header_length,
    infer_route,
    note_refusal,
    reply_response,
    request_body,
    route,
    unsupported,
)
from kserve_trio.serving.trace_settings import caller_context
from kserve_trio.worker.inference import InferenceCore, ResponseEncoder
from kserve_trio.worker.service import InferenceService

RpcMethod = Callable[[Any], Awaitable[Any]]


def rest_encoder(parsed: RestInferRequest) -> ResponseEncoder[RestReply]:
    """The core's response encoder for one REST request: the outputs the gRPC encoder would
    write (same selection, same shared-memory writes), as REST JSON and binary."""

    def encode(
        model_name: str,
        request_id: str,
        outputs: Sequence[NamedTensor],
        requested: Sequence[RequestedOutput] | None = None,
        registry: ShmRegistryLike | None = None,
        *,
        model_version: str = "",
        zero_copy: bool = False,
    ) -> RestReply:
        tensors, payloads = response_outputs(
            model_name, outputs, requested, registry, zero_copy=zero_copy
        )
        return encode_rest_response(
            model_name, model_version, request_id, tensors, payloads, parsed.wants_binary
        )

    return encode


class WorkerRest:
    """The REST ``App`` of one worker (``serving.http.serve_app`` serves it)."""

    def __init__(
        self,
        service: InferenceService,
        core: InferenceCore,
        restrictions: Restrictions | None = None,
        *,
        max_json_depth: int = DEFAULT_JSON_DEPTH,
    ) -> None:
        self.service = service
        self.core = core
        self.restrictions = restrictions or Restrictions()
        self.max_recv_bytes = service.state.limits.max_recv_bytes
        self.max_json_depth = max_json_depth
        self.stats = service.state.metrics.edge
        self.bounds = service.state.limits.edge
        s = service
        self._rpcs: dict[str, RpcMethod] = {
            "ServerLive": s.server_live,
            "ServerReady": s.server_ready,
            "ServerMetadata": s.server_metadata,
            "ModelMetadata": s.model_metadata,
            "ModelReady": s.model_ready,
            "ModelConfig": s.model_config,
            "ModelStatistics": s.model_statistics,
            "RepositoryIndex": s.repository_index,
            "RepositoryModelLoad": s.repository_model_load,
            "RepositoryModelUnload": s.repository_model_unload,
            "SystemSharedMemoryStatus": s.shm_status,
            "SystemSharedMemoryRegister": s.shm_register,
            "SystemSharedMemoryUnregister": s.shm_unregister,
            "LogSettings": s.log_settings,
            "TraceSetting": s.trace_setting,
        }

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        try:
            call = route(request.method, request.path)
            self.restrictions.check(group_of(call.rpc), request.headers)
            check_path_names(call.model, call.version, call.region, self.bounds.max_name_bytes)
            if call.rpc == "ModelInfer":
                return await self.infer(call, request)
            method = self._rpcs.get(call.rpc)
            if method is None:
                raise Unimplemented(unsupported(call.rpc))
            body = request_body(request, self.max_recv_bytes)
            message = grpc_request(call, body, self.max_json_depth)
            check_bounds(message, self.bounds)  # what gRPC's parse_message checks
            reply = await method(message)
            return reply_response(call, reply)
        except Exception as exc:
            note_refusal(exc, request, self.max_json_depth, self.stats)
            return error_response(exc)

    async def infer(self, call: RestCall, request: HttpRequest) -> HttpResponse:
        body = request_body(request, self.max_recv_bytes)
        parsed = parse_rest_request(
            body,
            header_length(request),
            call.model,
            call.version,
            max_json_depth=self.max_json_depth,
        )
        reply = await self.core.infer(
            parsed.message,
            encode=rest_encoder(parsed),
            trace_context=caller_context(request.headers.get) if self.core.traced else None,
            http_route=infer_route(call.version),
        )
        response = HttpResponse(200, reply.pieces, reply.content_type, reply.headers())
        return compressed_reply(request, response)


__all__ = ["WorkerRest", "rest_encoder"]

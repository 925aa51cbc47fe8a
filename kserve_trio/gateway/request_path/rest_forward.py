"""REST requests that name a model, forwarded to a replica's own REST port.

The gateway answers ModelInfer, ModelReady, ModelMetadata and ModelConfig over REST
(``/v2/models/{m}[/versions/{v}][/infer|/ready|/config]``) from one replica of the model, chosen,
reserved, failed over and refreshed by ``forward.Forwarder`` exactly as for gRPC (ModelInfer by
the routing policy, the others by ``Forwarder.on_replica``). Only the attempt on one worker is
REST's own (``ModelRequests.attempt``), by one rule:

- a worker with a REST endpoint (``worker_http_endpoints``, paired per discovered address) gets
  the request as it arrived: the same method (a HEAD as a GET, answered without the body), path
  and query, the body byte for byte (still
  compressed under its ``Content-Encoding``), and the end-to-end headers
  (``Inference-Header-Content-Length``, ``Content-Type``, ``Content-Encoding``,
  ``Accept-Encoding``, custom ones; hop-by-hop ones dropped). Its status, body and headers come
  back unchanged;
- a worker without one is reached over gRPC: the request is translated to the RPC's message and
  the reply back to Triton's JSON (``core.protocol.rest_codec``, ``serving.rest_routes``), so a fleet
  that publishes no REST ports still serves REST.

The failover rules read a worker's REST status as the gRPC status it stands for
(``serving.http.grpc_status``): 404 (NOT_FOUND) refreshes the routing table and tries the next
replica, 503 (UNAVAILABLE, and a connection that fails) tries the next, any other status is the
answer. A 400 whose error says ``unregistered shared memory region`` is FAILED_PRECONDITION, so
the gateway re-registers its regions on that worker and retries once, as for gRPC. When every
replica failed, the last worker's own answer is passed back as it came (``WorkerHttpError``); a
failure of the gateway's own (unreachable worker, deadline) is its JSON error.

The HTTP client is the project's own (``serving.http.HttpClient``: httptools on anyio streams,
so forwarding runs on asyncio, uvloop and trio; measured in docs/benchmarks.md "REST through the
gateway"): a keep-alive pool per worker REST address, at most
``worker_client.max_concurrent_streams`` connections each (a request waits for a free one within
its deadline, like a gRPC call for a stream slot), TLS with the worker clients' context.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import anyio

from kserve_trio.client.errors import STALE_REGION_PREFIX, RpcError
from kserve_trio.core.errors import Internal, InvalidArgument, ServingError, StatusCode
from kserve_trio.core.protocol import (
    DEFAULT_JSON_DEPTH,
    encode_rest_response,
    input_shape,
    load_json,
    parse_infer_response,
    parse_rest_request,
)
from kserve_trio.gateway.caller_headers import rest_headers
from kserve_trio.gateway.fleet import WorkerClient
from kserve_trio.gateway.request_path.forward import MODEL_INFER, Forwarder
from kserve_trio.gateway.request_path.peek import PeekedRequest
from kserve_trio.proto import inference as pb
from kserve_trio.serving.http import (
    JSON_TYPE,
    HttpClient,
    HttpClientError,
    HttpRequest,
    HttpResponse,
    grpc_status,
)
from kserve_trio.serving.rest_routes import (
    REPLY_TYPES,
    RestCall,
    compressed_reply,
    grpc_request,
    header_length,
    infer_route,
    reply_response,
    request_body,
)
from kserve_trio.serving.trace_settings import caller_context

if TYPE_CHECKING:
    from kserve_trio.serving.trace_control import TraceControl
    from kserve_trio.serving.tracing import RequestSpan, Tracing

MODEL_RPCS = frozenset({"ModelInfer", "ModelReady", "ModelMetadata", "ModelConfig"})
"""The REST RPCs answered by one replica of the model their path names."""

INFERENCE = "/inference.GRPCInferenceService/"

_NOT_FORWARDED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "expect",
    }
)
"""Hop-by-hop headers, and those the client connection to the worker sets itself."""


# ---------------------------------------------------------------------------------- pure parts


def forwarded_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The request headers passed on to the worker: every end-to-end header."""
    return {k: v for k, v in headers.items() if k not in _NOT_FORWARDED}


def reply_headers(raw: Sequence[tuple[bytes, bytes]]) -> tuple[str, tuple[tuple[str, str], ...]]:
    """A worker reply's content type and the other headers to pass back (hop-by-hop ones and
    ``Content-Length``, which the gateway's server writes, dropped)."""
    content_type = JSON_TYPE
    out: list[tuple[str, str]] = []
    for name, value in raw:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        if key == "content-type":
            content_type = text
        elif key not in _NOT_FORWARDED:
            out.append((key, text))
    return content_type, tuple(out)


def error_message(body: bytes) -> str:
    """The ``error`` of a worker's JSON error body ("" when it has none)."""
    try:
        doc = load_json(body, "a worker's error reply")
    except InvalidArgument:
        return ""
    error = doc.get("error") if isinstance(doc, dict) else None
    return error if isinstance(error, str) else ""


def reply_status(http: int, body: bytes) -> StatusCode:
    """The gRPC status a worker's REST error status stands for; a 400 that says the worker lost
    a shared-memory registration is FAILED_PRECONDITION (the replay signal)."""
    if http == 400 and error_message(body).startswith(STALE_REGION_PREFIX):
        return StatusCode.FAILED_PRECONDITION
    return grpc_status(http)


def peek_shape(
    body: bytes | bytearray,
    header_length: int | None,
    input_name: str,
    max_json_depth: int = DEFAULT_JSON_DEPTH,
) -> tuple[int, ...] | None:
    """The shape of input ``input_name`` in a REST inference body (uncompressed), ``None`` when
    it cannot be read: a malformed request is still forwarded, and the worker answers it. The
    body's depth is checked before it is parsed and its tensor data is not decoded
    (``input_shape``)."""
    return input_shape(body, header_length, input_name, max_json_depth)


@dataclass(frozen=True)
class WorkerReply:
    """A worker's REST answer as it came."""

    status: int
    body: bytes
    content_type: str
    headers: tuple[tuple[str, str], ...]

    def response(self) -> HttpResponse:
        return HttpResponse(self.status, self.body, self.content_type, self.headers)


class WorkerHttpError(RpcError):
    """A worker's REST answer with an error status: ``status`` is the gRPC status the failover
    rules read, ``reply`` what the client gets when this is the answer."""

    def __init__(self, status: StatusCode, message: str, reply: WorkerReply, method: str) -> None:
        super().__init__(status, message, method=method)
        self.reply = reply


# ------------------------------------------------------------------------------ the HTTP client


class RestUpstream:
    """The gateway's HTTP client to its workers' REST ports (one ``HttpClient``, a keep-alive
    pool per worker address); opened on first use, closed by ``aclose``."""

    def __init__(self, *, per_worker: int, ssl_context: ssl.SSLContext | None = None) -> None:
        self.per_worker = per_worker
        self.ssl_context = ssl_context
        self._client: HttpClient | None = None

    def _open(self) -> HttpClient:
        if self._client is None:
            self._client = HttpClient(per_host=self.per_worker, ssl_context=self.ssl_context)
        return self._client

    async def send(
        self, client: WorkerClient, request: HttpRequest, deadline: float, rpc: str
    ) -> WorkerReply:
        """``request`` to ``client``'s REST port, within ``deadline`` (absolute,
        ``anyio.current_time()``). An error status raises ``WorkerHttpError``; no answer raises
        ``RpcError`` UNAVAILABLE (unreachable, the connection broke) or DEADLINE_EXCEEDED."""
        spec = client.spec
        assert spec.http is not None
        host, port = spec.http
        target = request.path + (f"?{request.query}" if request.query else "")
        left = max(deadline - anyio.current_time(), 0.001)
        try:
            answer = await self._open().request(
                host,
                port,
                # A HEAD is asked of the worker as a GET: the gateway's server then answers it
                # with the GET's headers (Content-Length included) and no body, as the worker would.
                "GET" if request.method == "HEAD" else request.method,
                target,
                headers=forwarded_headers(request.headers).items(),
                body=request.body,
                timeout=left,
            )
        except TimeoutError:
            raise RpcError(
                StatusCode.DEADLINE_EXCEEDED,
                f"deadline exceeded at the gateway waiting for {spec.label}'s REST answer",
                method=rpc,
            ) from None
        except HttpClientError as exc:
            raise RpcError(
                StatusCode.UNAVAILABLE,
                f"worker {spec.label} REST endpoint {spec.http_target} failed: {exc}",
                method=rpc,
            ) from None
        status, body = answer.status, answer.body
        content_type, headers = reply_headers(answer.headers)
        reply = WorkerReply(status, body, content_type, headers)
        if status >= 400:
            code = reply_status(status, body)
            message = error_message(body) or f"worker {spec.label} answered HTTP {status}"
            raise WorkerHttpError(code, message, reply, rpc)
        return reply

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()


# ------------------------------------------------------------------------- one model's request


class ModelRequests:
    """The REST RPCs that name a model (``MODEL_RPCS``), by the module docstring's rule."""

    def __init__(
        self,
        forwarder: Forwarder,
        upstream: RestUpstream,
        max_recv_bytes: int,
        max_json_depth: int = DEFAULT_JSON_DEPTH,
        tracing: TraceControl | None = None,
    ) -> None:
        self.forwarder = forwarder
        self.upstream = upstream
        self.max_recv_bytes = max_recv_bytes
        self.max_json_depth = max_json_depth
        self.tracing: Tracing | None = None
        """The gateway's tracer once built (at start-up, or turned on live)."""
        if tracing is not None:
            tracing.when_started(self._trace_with)

    def _trace_with(self, tracing: Tracing) -> None:
        self.tracing = tracing

    async def answer(self, call: RestCall, request: HttpRequest) -> HttpResponse:
        """The reply to ``request`` (errors raised as ``ServingError``; a worker's own error
        answer passed back as it came)."""
        try:
            if call.rpc == "ModelInfer":
                return await self._infer(call, request)
            return await self._from_replica(call, request)
        except WorkerHttpError as exc:
            return exc.reply.response()

    async def _infer(self, call: RestCall, request: HttpRequest) -> HttpResponse:
        """ModelInfer, traced as gRPC's is (``GatewayService``): a server span with the HTTP
        attributes when the settings sample it, each attempt a ``forward`` client span whose
        context the worker continues; not sampled, a request without a context of its own
        goes on with a sampled-out one."""
        tracing = self.tracing
        if tracing is None:
            return await self._forward_infer(call, request, None)
        context = caller_context(request.headers.get)
        span = tracing.begin(
            "ModelInfer",
            call.model,
            context,
            attributes={"http.request.method": "POST", "http.route": infer_route(call.version)},
        )
        if span is None:
            if context is None:
                request = replace(request, headers={**request.headers, **tracing.sampled_out()})
            return await self._forward_infer(call, request, None)
        status, text = "OK", ""
        try:
            with span.in_logs():
                return await self._forward_infer(call, request, span)
        except ServingError as exc:  # a worker's failure (RpcError) too
            status, text = exc.status.name, exc.message
            raise
        except BaseException as exc:
            status, text = "INTERNAL", str(exc)
            raise
        finally:
            span.end(status, text, http=True)

    async def _forward_infer(
        self, call: RestCall, request: HttpRequest, span: RequestSpan | None
    ) -> HttpResponse:
        translated: list[Any] = []

        def peeked() -> PeekedRequest:
            spec = self.forwarder.policy.batch_input(call.model)
            shape = None
            if spec is not None:
                body = request_body(request, self.max_recv_bytes)
                shape = peek_shape(body, _length_or_none(request), spec[0], self.max_json_depth)
            return PeekedRequest(call.model, "", shape)

        async def attempt(client: WorkerClient, deadline: float) -> HttpResponse:
            if span is None:
                return await one(client, deadline, request)
            forward = span.start_child("forward", client_rpc="ModelInfer", worker=client.label)
            status, text = "OK", ""
            try:
                carried = replace(request, headers={**request.headers, **forward.headers()})
                return await one(client, deadline, carried)
            except RpcError as exc:
                status, text = exc.status.name, exc.message
                raise
            finally:
                forward.end(status, text)

        async def one(client: WorkerClient, deadline: float, request: HttpRequest) -> HttpResponse:
            if client.spec.http is not None:
                reply = await self.upstream.send(client, request, deadline, "ModelInfer")
                return reply.response()
            if not translated:  # once, whichever attempt needs it first
                translated.append(
                    parse_rest_request(
                        request_body(request, self.max_recv_bytes),
                        header_length(request),
                        call.model,
                        call.version,
                        max_json_depth=self.max_json_depth,
                    )
                )
            parsed = translated[0]
            data = await client.call_raw(
                MODEL_INFER,
                bytes(parsed.message),
                deadline=deadline,
                metadata=rest_headers(request.headers),  # with this attempt's trace context
            )
            return compressed_reply(request, _infer_reply(data, parsed.wants_binary))

        return await self.forwarder.routed(peeked, attempt, rpc="ModelInfer")

    async def _from_replica(self, call: RestCall, request: HttpRequest) -> HttpResponse:
        async def attempt(client: WorkerClient, deadline: float) -> HttpResponse:
            if client.spec.http is not None:
                reply = await self.upstream.send(client, request, deadline, call.rpc)
                return reply.response()
            body = request_body(request, self.max_recv_bytes)
            message = grpc_request(call, body, self.max_json_depth)
            data = await client.call_raw(INFERENCE + call.rpc, bytes(message), deadline=deadline)
            return reply_response(call, REPLY_TYPES[call.rpc]().parse(data))

        reply = await self.forwarder.on_replica(call.model, attempt, rpc=call.rpc)
        if reply is not None:
            return reply
        if call.rpc == "ModelReady":
            return reply_response(call, pb.ModelReadyResponse(ready=False))
        raise self.forwarder.state.missing(call.model)


def _length_or_none(request: HttpRequest) -> int | None:
    try:
        return header_length(request)
    except Exception:
        return None


def _infer_reply(data: bytes, wants_binary: Any) -> HttpResponse:
    """A worker's gRPC ModelInfer reply as the REST reply (the translated path)."""
    response = parse_infer_response(data)
    if len(response.raw_output_contents) != len(response.outputs):
        raise Internal(
            f"worker reply has {len(response.raw_output_contents)} raw_output_contents "
            f"entries for {len(response.outputs)} outputs"
        )
    rest = encode_rest_response(
        response.model_name,
        response.model_version,
        response.id,
        response.outputs,
        response.raw_output_contents,
        wants_binary,
        response.parameters,
    )
    return HttpResponse(200, rest.pieces, rest.content_type, rest.headers())


__all__ = [
    "MODEL_RPCS",
    "ModelRequests",
    "RestUpstream",
    "WorkerHttpError",
    "WorkerReply",
    "error_message",
    "forwarded_headers",
    "peek_shape",
    "reply_headers",
    "reply_status",
]

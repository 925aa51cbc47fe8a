"""The gateway's KServe V2 REST endpoint (``listen.http``).

Two kinds of request, by what the path names:

- a model (``/v2/models/{m}[/versions/{v}]``, ``.../infer``, ``.../ready``, ``.../config``):
  ModelInfer, ModelReady, ModelMetadata and ModelConfig go to one replica of the model, chosen
  and failed over by the gRPC forwarder's rules, on the replica's own REST port when the gateway
  knows it (``worker_http_endpoints``), else translated to gRPC (``rest_forward``);
- the fleet (server health and metadata, ``/v2/models/stats`` and ``.../stats``, the repository
  index, load and unload, system shared memory): the path and JSON body become the RPC's request
  message and run through the same ``GatewayService`` handler a gRPC call runs through, and the
  reply is written as Triton's JSON. These answers are the fleet's, not one worker's: a
  shared-memory registration must reach every worker (and be replayed to one that restarts),
  a load or unload acts on every worker, statistics are summed over the workers; the gRPC
  fan-outs already do exactly that, with the same statuses and messages.

Admission is the gRPC one: ModelInfer counts against the inbound cap, every other request but
health is refused once the gateway drains.
"""

from __future__ import annotations

import ssl

import anyio
import anyio.abc

from kserve_trio.core.errors import Unimplemented
from kserve_trio.core.process import EdgeLimits, Restrictions, group_of
from kserve_trio.core.protocol import DEFAULT_JSON_DEPTH, check_path_names
from kserve_trio.gateway.caller_headers import passing_on, rest_headers
from kserve_trio.gateway.request_path.rest_forward import MODEL_RPCS, ModelRequests, RestUpstream
from kserve_trio.gateway.request_path.service import GatewayService
from kserve_trio.serving.accept import ListenError
from kserve_trio.serving.admission import InflightBytes
from kserve_trio.serving.edge_stats import EdgeStats
from kserve_trio.serving.http import HttpRequest, HttpResponse, error_response, serve_app
from kserve_trio.serving.rest_routes import (
    REPLY_TYPES,
    RestCall,
    grpc_request,
    note_refusal,
    reply_response,
    request_body,
    route,
    unsupported,
)


class GatewayRest:
    """The REST ``App`` of a gateway (``serving.http.serve_app`` serves it); ``aclose`` closes
    its connections to the workers' REST ports."""

    def __init__(
        self,
        service: GatewayService,
        upstream: RestUpstream | None = None,
        restrictions: Restrictions | None = None,
        *,
        max_json_depth: int = DEFAULT_JSON_DEPTH,
        stats: EdgeStats | None = None,
    ) -> None:
        self.service = service
        self.restrictions = restrictions or Restrictions()
        self.limits = service.limits
        self.max_json_depth = max_json_depth
        self.stats = stats
        pool = service.forwarder.pool
        self.upstream = upstream or RestUpstream(
            per_worker=pool.settings.max_concurrent_streams,
            ssl_context=pool.settings.ssl_context,
        )
        self.models = ModelRequests(
            service.forwarder,
            self.upstream,
            self.limits.max_recv_bytes,
            max_json_depth,
            tracing=service.trace_control,
        )
        self._rpcs = service.fleet_rpcs()

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        try:
            call = route(request.method, request.path)
            self.restrictions.check(group_of(call.rpc), request.headers)
            with passing_on(rest_headers(request.headers)):
                return await self._answer(call, request)
        except Exception as exc:
            note_refusal(exc, request, self.max_json_depth, self.stats)
            return error_response(exc)

    async def _answer(self, call: RestCall, request: HttpRequest) -> HttpResponse:
        """The reply to one routed, permitted request (errors raised)."""
        check_path_names(call.model, call.version, call.region, self.limits.edge.max_name_bytes)
        if call.rpc in MODEL_RPCS:
            admission = self.service.admission
            if call.rpc == "ModelInfer":  # waits in the queue like gRPC's (no deadline of its own)
                async with admission.queued(None):
                    return await self.models.answer(call, request)
            with admission.call():
                return await self.models.answer(call, request)
        rpc = self._rpcs.get(call.rpc)
        if rpc is None:
            raise Unimplemented(unsupported(call.rpc))
        body = request_body(request, self.limits.max_recv_bytes)
        message = grpc_request(call, body, self.max_json_depth)
        data = await rpc(bytes(message), None)  # no deadline of its own: the workers' timeouts
        return reply_response(call, REPLY_TYPES[call.rpc]().parse(data))

    async def aclose(self) -> None:
        await self.upstream.aclose()


async def serve_rest(
    host: str,
    port: int,
    service: GatewayService,
    restrictions: Restrictions | None = None,
    *,
    max_body_bytes: int,
    max_json_depth: int = DEFAULT_JSON_DEPTH,
    ssl_context: ssl.SSLContext | None = None,
    limits: EdgeLimits | None = None,
    stats: EdgeStats | None = None,
    connection_cap: int | None = None,
    reuse_port: bool = False,
    inflight: InflightBytes | None = None,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the gateway's REST endpoint until cancelled (``task_status.started(port)``), then
    close its connections to the workers. Bodies are capped at ``max_body_bytes`` as sent and
    decompressed (413), and nested at most ``max_json_depth`` deep wherever the gateway parses
    them (400). ``limits``, ``stats``, ``connection_cap``: as ``serve_app`` takes them;
    ``reuse_port``: the port is shared (SO_REUSEPORT); ``inflight``: the process's bytes in
    flight the bodies are charged to (the admission's, as the gRPC messages are)."""
    rest = GatewayRest(
        service, restrictions=restrictions, max_json_depth=max_json_depth, stats=stats
    )
    try:
        await serve_app(
            host,
            port,
            rest,
            max_body_bytes=max_body_bytes,
            ssl_context=ssl_context,
            name="rest",
            limits=limits,
            stats=stats,
            connection_cap=connection_cap,
            reuse_port=reuse_port,
            inflight=inflight,
            task_status=task_status,
        )
    except ListenError as exc:  # the bind: say which address (the CLI prints this one line)
        raise ListenError(exc.errno, f"listen.http {host}:{port}: {exc.strerror or exc}") from None
    finally:
        with anyio.CancelScope(shield=True):
            await rest.aclose()


__all__ = ["GatewayRest", "serve_rest"]

"""``KServeModel``: a handle to one model on a KServe V2 gRPC endpoint.

The handle is configuration plus connections: the endpoint (``host:port``, TLS or not, message
caps), the model name, the chunking and deadline options of the drivers, the shared-memory mode
and the retry policy. Connections are opened lazily, one per event loop the handle is used from
(a transport belongs to the loop that made it), and closed by ``close``/``aclose`` or the
context managers. ``await model.infer(inputs)`` is the async one-shot call.
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from kserve_trio.client.endpoint import check_compression, resolve_http2_engine
from kserve_trio.client.errors import RpcError
from kserve_trio.client.io import InferInput
from kserve_trio.client.loop_thread import current_loop_key, loop_closed
from kserve_trio.client.retry import RetryPolicy, call_with_retry
from kserve_trio.client.runtime import EndpointState, get_state
from kserve_trio.client.tls import PemSource, client_ssl_context
from kserve_trio.client.transport import (
    ENV_MAX_RECV,
    ENV_MAX_SEND,
    Endpoint,
    Transport,
    TransportFactory,
    default_transport_factory,
    method_path,
    parse_url,
    resolve_message_cap,
)
from kserve_trio.core.errors import StatusCode
from kserve_trio.core.protocol import (
    TIMEOUT_NS_PARAM,
    InferRequestMessage,
    InferResponseMessage,
    RequestedOutput,
    deadline_params,
    encode_infer_request,
    parse_infer_request,
)
from kserve_trio.proto import inference as pb

R = TypeVar("R")

SHARED_MEMORY_MODES = ("auto", "on", "off")


def _check_model_name(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"KServeModel needs a non-empty model name, got {name!r}")
    return name


class KServeModel:
    """A model served over KServe V2 gRPC (a kserve_trio worker, the gateway, or Triton).

    ``KServeModel("host:port", "m")``, ``KServeModel("grpc://host:port", "m")`` (``grpcs://`` or
    ``https://`` for TLS) or ``KServeModel("host", 8001, "m")``.

    - ``max_batch_size``: items per chunk of the ``infer_async``/``infer_sync`` drivers.
    - ``deadline``: seconds per request (per chunk), also the retry budget; ``<= 0`` means none
      (and no retries).
    - ``shared_memory``: ``"auto"`` (probe, use shared memory when the server shares this IPC
      namespace), ``"on"`` (force; a server in another namespace is an error) or ``"off"``.
    - ``retry``: a ``RetryPolicy`` for shed (RESOURCE_EXHAUSTED / UNAVAILABLE) requests.
    - ``max_send_message_length`` / ``max_receive_message_length``: caps on one gRPC message;
      default ``KSERVE_TRIO_CLIENT_GRPC_MAX_SEND_MSG_BYTES`` / ``..._RECV_...`` or 512 MiB.
    - ``compression``: ``None`` (default), ``"gzip"`` or ``"deflate"``: every request message
      is sent compressed with it, and the server may compress its replies (they are
      decompressed within ``max_receive_message_length``). Worth it for large, compressible
      tensors over a slow link; it costs CPU on both sides.
    - ``http2_engine``: ``"ngh2"`` (libnghttp2, the default) or ``"h2"`` (pure Python), the
      HTTP/2 engine of the connections; default ``KSERVE_TRIO_CLIENT_HTTP2_ENGINE`` or ngh2.
    - ``transport_factory``: builds the ``Transport`` for the running event loop (default:
      the h2 transport on trio, ``transport.asyncio_transport_name()`` on asyncio).
    - TLS (any of these implies ``secure=True``): ``root_certificates`` (the CA bundle the
      server's certificate must chain to; default: the system's), ``certificate_chain`` and
      ``private_key`` (a client certificate, for mutual TLS), each PEM bytes or a file path;
      or a ready ``ssl_context`` instead of the three.
    """

    def __init__(
        self,
        target: str,
        port_or_model: int | str | None = None,
        model_name: str | None = None,
        *,
        secure: bool = False,
        max_batch_size: int = 1,
        deadline: float = 10.0,
        shared_memory: str = "auto",
        retry: RetryPolicy | None = None,
        max_send_message_length: int | None = None,
        max_receive_message_length: int | None = None,
        compression: str | None = None,
        transport_factory: TransportFactory | None = None,
        root_certificates: PemSource | None = None,
        certificate_chain: PemSource | None = None,
        private_key: PemSource | None = None,
        ssl_context: ssl.SSLContext | None = None,
        http2_engine: str | None = None,
    ) -> None:
        if isinstance(port_or_model, int) and not isinstance(port_or_model, bool):
            if not isinstance(target, str) or not target.strip():
                raise ValueError(f"KServeModel needs a host, got {target!r}")
            host, port = target.strip(), port_or_model
            if host.startswith("[") and host.endswith("]"):
                host = host[1:-1]
            if not 0 < port < 65536:
                raise ValueError(f"port {port} is outside [1, 65535]")
            name = _check_model_name(model_name)
            url_secure = False
        else:
            if port_or_model is not None and model_name is not None:
                raise TypeError(
                    "KServeModel(url, model_name): a second model name was given "
                    f"({port_or_model!r} and {model_name!r})"
                )
            name = _check_model_name(port_or_model if port_or_model is not None else model_name)
            host, port, url_secure = parse_url(target)
        if (
            isinstance(max_batch_size, bool)
            or not isinstance(max_batch_size, int)
            or max_batch_size < 1
        ):
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        if shared_memory not in SHARED_MEMORY_MODES:
            raise ValueError(f"shared_memory must be 'auto', 'on' or 'off', got {shared_memory!r}")
        retry = RetryPolicy() if retry is None else retry
        if not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry must be a RetryPolicy, got {type(retry).__name__}")
        pem = (root_certificates, certificate_chain, private_key)
        if ssl_context is not None and any(p is not None for p in pem):
            raise ValueError(
                "pass either ssl_context or root_certificates/certificate_chain/private_key, "
                "not both"
            )
        if ssl_context is not None and not isinstance(ssl_context, ssl.SSLContext):
            raise TypeError(f"ssl_context must be an ssl.SSLContext, got {ssl_context!r}")
        secure = bool(secure or url_secure or ssl_context is not None)
        secure = secure or any(p is not None for p in pem)
        if secure and ssl_context is None:
            ssl_context = client_ssl_context(*pem)
        self.endpoint = Endpoint(
            host,
            port,
            secure,
            resolve_message_cap(max_send_message_length, ENV_MAX_SEND),
            resolve_message_cap(max_receive_message_length, ENV_MAX_RECV),
            ssl_context,
            check_compression(compression),
            resolve_http2_engine(http2_engine),
        )
        self.model_name = name
        self.max_batch_size = max_batch_size
        self.deadline = float(deadline)
        self.shared_memory = shared_memory
        self.retry = retry
        self.transport_factory = transport_factory or default_transport_factory
        self._lock = threading.Lock()
        self._transports: list[tuple[object, Transport]] = []
        self._last: tuple[object, Transport] | None = None  # the most recent loop's, fast path

    # -- identity ----------------------------------------------------------------------------

    @property
    def host(self) -> str:
        return self.endpoint.host

    @property
    def port(self) -> int:
        return self.endpoint.port

    @property
    def secure(self) -> bool:
        return self.endpoint.secure

    @property
    def url(self) -> str:
        return f"{'grpcs' if self.secure else 'grpc'}://{self.endpoint.address}"

    @property
    def max_send_message_length(self) -> int:
        return self.endpoint.max_send_message_length

    @property
    def max_receive_message_length(self) -> int:
        return self.endpoint.max_receive_message_length

    @property
    def compression(self) -> str | None:
        """The ``grpc-encoding`` requests are compressed with (``None``: none)."""
        return self.endpoint.compression

    def __repr__(self) -> str:
        return f"KServeModel({self.url!r}, {self.model_name!r})"

    # -- transports --------------------------------------------------------------------------

    def transport(self) -> Transport:
        """This handle's transport for the running event loop (made on first use)."""
        key = current_loop_key()
        last = self._last
        if last is not None and last[0] is key:
            return last[1]
        with self._lock:
            for owner, transport in self._transports:
                if owner is key:
                    self._last = (owner, transport)
                    return transport
        transport = self.transport_factory(self.endpoint)
        with self._lock:
            self._transports = [(o, t) for o, t in self._transports if not loop_closed(o)]
            self._transports.append((key, transport))
            self._last = (key, transport)
        return transport

    async def aclose(self) -> None:
        """Close the connection of the running loop (and, best effort, of the others)."""
        key = current_loop_key()
        with self._lock:
            transports, self._transports = self._transports, []
            self._last = None
        for owner, transport in transports:
            if owner is key:
                await transport.aclose()
            else:
                transport.close()

    def close(self) -> None:
        """Close every connection, from any thread (each on its own loop, best effort)."""
        with self._lock:
            transports, self._transports = self._transports, []
            self._last = None
        for _owner, transport in transports:
            transport.close()

    def __del__(self) -> None:
        # a forgotten handle still closes its connections (each on its own loop)
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> KServeModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> KServeModel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- calls -------------------------------------------------------------------------------

    async def call(
        self,
        rpc: str,
        request: Any,
        reply_type: type[R],
        *,
        timeout: float | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> R:
        """One unary ``inference.GRPCInferenceService`` RPC by name (``"ServerLive"``...),
        with ``timeout`` defaulting to the handle's deadline; no retry."""
        if timeout is None and self.deadline > 0:
            timeout = self.deadline
        return await self.transport().unary(
            method_path(rpc), request, reply_type, timeout=timeout, metadata=metadata
        )

    async def infer(
        self,
        inputs: Sequence[InferInput],
        *,
        outputs: Sequence[str] = (),
        id: str = "",
        parameters: Mapping[str, Any] | None = None,
    ) -> InferResponseMessage:
        """One inline ``ModelInfer`` with retry inside the deadline budget; returns the response
        (read it with ``InferOutput``). ``outputs`` names the outputs wanted (default: all);
        ``parameters`` are request parameters as plain values (``bool``, ``int``, ``float``,
        ``str``; betterproto2 ``InferParameter``s are accepted too). The input arrays are sent
        from their own memory: leave them unchanged until the call returns."""
        tensors = []
        for item in inputs:
            if not isinstance(item, InferInput):
                raise TypeError(f"infer() takes InferInput values, got {type(item).__name__}")
            tensors.append(item.to_tensor())
        request = encode_infer_request(
            self.model_name,
            tensors,
            requested_outputs=[RequestedOutput(n) for n in outputs],
            id=id,
            parameters=parameters,
        )
        return await self.infer_request(request)

    async def infer_request(
        self, request: InferRequestMessage | pb.ModelInferRequest
    ) -> InferResponseMessage:
        """Send a prepared ``ModelInferRequest`` (``codec.encode_infer_request``'s, or a
        betterproto2 one) with retry; each attempt carries the remaining budget as the gRPC
        timeout and as ``reactant_timeout_ns``."""
        transport = self.transport()
        return await send_infer(transport, request, self.retry, self.deadline)

    async def server_live(self) -> bool:
        reply = await self.call("ServerLive", pb.ServerLiveRequest(), pb.ServerLiveResponse)
        return bool(reply.live)

    async def server_ready(self) -> bool:
        reply = await self.call("ServerReady", pb.ServerReadyRequest(), pb.ServerReadyResponse)
        return bool(reply.ready)

    async def model_ready(self) -> bool:
        reply = await self.call(
            "ModelReady", pb.ModelReadyRequest(name=self.model_name), pb.ModelReadyResponse
        )
        return bool(reply.ready)

    async def metadata(self) -> pb.ModelMetadataResponse:
        """The raw ``ModelMetadata`` reply (see ``io_spec`` for the parsed form)."""
        return await self.call(
            "ModelMetadata", pb.ModelMetadataRequest(name=self.model_name), pb.ModelMetadataResponse
        )

    async def io_spec(self):
        """The model's ``ModelIOSpec`` from the ModelMetadata RPC (fails loudly if the server
        does not implement it)."""
        from kserve_trio.client.spec import io_spec_from_metadata

        return io_spec_from_metadata(await self.metadata())

    async def shm_status(self) -> dict[str, pb.SystemSharedMemoryStatusResponseRegionStatus]:
        """The server's registered system shared-memory regions, by name."""
        reply = await self.call(
            "SystemSharedMemoryStatus",
            pb.SystemSharedMemoryStatusRequest(),
            pb.SystemSharedMemoryStatusResponse,
        )
        return dict(reply.regions)

    def endpoint_state(self) -> EndpointState:
        """This process's shared state for the model's server (its shm route and registrations),
        which the drivers consult before planning a run."""
        return get_state().endpoint(self.endpoint, self.transport_factory)


async def send_infer(
    transport: Transport,
    request: InferRequestMessage | pb.ModelInferRequest,
    policy: RetryPolicy,
    deadline: float,
    *,
    deadline_at: float | None = None,
) -> InferResponseMessage:
    """``ModelInfer`` with ``policy`` inside ``deadline`` seconds (or until the absolute
    ``time.monotonic()`` ``deadline_at``); the request's ``reactant_timeout_ns`` is set to each
    attempt's budget (removed when there is none). Each attempt encodes the request once
    (``core.protocol.infer_wire``); the reply is parsed with its payloads as views of the received
    bytes."""
    if isinstance(request, pb.ModelInferRequest):
        request = parse_infer_request(bytes(request))
    if deadline_at is not None:
        deadline = deadline_at - time.monotonic()
        if deadline <= 0:
            raise RpcError(
                StatusCode.DEADLINE_EXCEEDED,
                f"deadline exhausted before ModelInfer for model '{request.model_name}' was sent",
                method="ModelInfer",
            )

    async def attempt(budget: float | None) -> InferResponseMessage:
        request.parameters.pop(TIMEOUT_NS_PARAM, None)
        if budget is not None:
            request.parameters.update(deadline_params(int(budget * 1e9)))
        return await transport.unary(
            method_path("ModelInfer"), request, InferResponseMessage, timeout=budget
        )

    return await call_with_retry(attempt, policy, deadline)


__all__ = ["SHARED_MEMORY_MODES", "KServeModel", "send_infer"]

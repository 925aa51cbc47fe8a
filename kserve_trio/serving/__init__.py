"""The server stack the worker and the gateway share.

What lives here is everything a server process needs that is not about models: our gRPC server
(``serving.grpc``: gRPC over HTTP/2 on h2 and anyio), the HTTP/1.1 stack (``serving.http``),
server-side TLS contexts (``tls``), inbound admission and drain (``admission``), the admin HTTP endpoints ``/metrics``, ``/healthz`` and
``/readyz`` (``admin_http``), the event loop choice (``background``) and process tuning
(``process_tuning``). It imports nothing from ``worker`` or ``runtime`` and never jax, so the
gateway and the node supervisor stand on it without the compiler stack.
"""

from __future__ import annotations

from kserve_trio.serving.admin_http import route, serve_http
from kserve_trio.serving.admission import Admission
from kserve_trio.serving.grpc import MAX_FRAME_BYTES, WINDOW_BYTES, GrpcServer, ServerSettings
from kserve_trio.serving.process_tuning import tune_allocator
from kserve_trio.serving.tls import server_ssl_context

__all__ = [
    "MAX_FRAME_BYTES",
    "WINDOW_BYTES",
    "Admission",
    "GrpcServer",
    "ServerSettings",
    "route",
    "serve_http",
    "server_ssl_context",
    "tune_allocator",
]

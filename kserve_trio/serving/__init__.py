"""The server stack the worker and the gateway share.

What lives here is everything a gRPC server process needs that is not about models: the HTTP/2
settings our grpclib servers run with (``h2_settings``), server-side TLS contexts (``tls``), the
admin HTTP endpoints ``/metrics``, ``/healthz`` and ``/readyz`` (``admin_http``) and process
tuning (``process_tuning``). It imports nothing from ``worker`` or ``runtime`` and never jax, so
the gateway and the node supervisor stand on it without the compiler stack.
"""

from __future__ import annotations

from kserve_trio.serving.admin_http import route, serve_http
from kserve_trio.serving.h2_settings import MAX_FRAME_BYTES, WINDOW_BYTES, server_config
from kserve_trio.serving.process_tuning import tune_allocator
from kserve_trio.serving.tls import server_ssl_context

__all__ = [
    "MAX_FRAME_BYTES",
    "WINDOW_BYTES",
    "route",
    "serve_http",
    "server_config",
    "server_ssl_context",
    "tune_allocator",
]

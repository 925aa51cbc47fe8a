"""The project's one HTTP/1.1 stack: the REST endpoints of the worker and the gateway and the
admin endpoints (``/metrics``, ``/healthz``, ``/readyz``) all stand on it.

- ``serve_app``: serve an ``App`` (``HttpRequest`` -> ``HttpResponse``) on a port, inside the
  caller's task tree, optionally over TLS (``_server``: httptools' parser, anyio streams),
  its request bodies charged to the process's bytes in flight when given ``inflight`` (429
  past them, as gRPC's RESOURCE_EXHAUSTED; ``_body.BodyCharges``);
- ``PayloadTooLarge``: a body over the cap, as sent or decompressed (413; ``_body``);
- ``HttpClient``: keep-alive connections pooled per host, the same parser library and anyio
  streams (``_client``, one connection in ``_connection``; the gateway's REST forwarding and
  its scrape of worker ``/metrics``);
- ``http_status`` / ``error_body`` / ``error_response``: one HTTP status per gRPC status and the
  ``{"error": ...}`` body, so a fault reads the same on both transports (``_status``).
"""

from __future__ import annotations

from kserve_trio.serving.http._body import PayloadTooLarge, inflate_body, too_large
from kserve_trio.serving.http._client import HttpClient
from kserve_trio.serving.http._connection import HttpClientError, HttpReply
from kserve_trio.serving.http._server import (
    App,
    HttpRequest,
    HttpResponse,
    error_response,
    serve_app,
    serve_connection,
)
from kserve_trio.serving.http._status import (
    HTTP_STATUS,
    JSON_TYPE,
    error_body,
    error_of,
    grpc_status,
    http_status,
)

__all__ = [
    "HTTP_STATUS",
    "JSON_TYPE",
    "App",
    "HttpClient",
    "HttpClientError",
    "HttpReply",
    "HttpRequest",
    "HttpResponse",
    "PayloadTooLarge",
    "error_body",
    "error_of",
    "error_response",
    "grpc_status",
    "http_status",
    "inflate_body",
    "serve_app",
    "serve_connection",
    "too_large",
]

"""The admin HTTP endpoints of a server process (the worker's ``endpoints.metrics_port``).

Served by the project's HTTP stack (``serving.http``) inside the caller's task tree:
``GET /metrics`` (Prometheus text), ``/healthz`` (200 ``ok`` while the process is up),
``/readyz`` (200 ``ok`` / 503 ``not ready`` with ServerReady semantics), 404 otherwise; any
method but GET and HEAD is 405. Connections are kept alive like any HTTP/1.1 client expects,
under the same edge limits as the REST port (``serve_app``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import anyio
import anyio.abc

from kserve_trio.core.process import EdgeLimits
from kserve_trio.serving.edge_stats import EdgeStats
from kserve_trio.serving.http import HttpRequest, HttpResponse, serve_app

MAX_BODY_BYTES = 64 << 10
"""Admin requests carry no body; anything larger is refused before it is read."""

Route = Callable[[], Awaitable[tuple[int, str, bytes]]]
"""An extra endpoint: ``async () -> (status, content type, body)``."""


def route(
    path: str, *, exposition: Callable[[], bytes], ready: Callable[[], bool]
) -> tuple[int, str, bytes]:
    """Pure routing: path -> (status, content type, body)."""
    path = path.split("?", 1)[0]
    if path == "/metrics":
        return 200, "text/plain; version=0.0.4; charset=utf-8", exposition()
    if path == "/healthz":
        return 200, "text/plain; charset=utf-8", b"ok"
    if path == "/readyz":
        if ready():
            return 200, "text/plain; charset=utf-8", b"ok"
        return 503, "text/plain; charset=utf-8", b"not ready"
    return 404, "text/plain; charset=utf-8", b"not found"


def admin_app(
    exposition: Callable[[], bytes],
    ready: Callable[[], bool],
    routes: Mapping[str, Route] | None = None,
) -> Callable[[HttpRequest], Awaitable[HttpResponse]]:
    """The admin endpoints as an ``App``: ``routes`` first, then ``route``."""

    async def app(request: HttpRequest) -> HttpResponse:
        if request.method not in ("GET", "HEAD"):
            return HttpResponse(405, b"method not allowed", "text/plain; charset=utf-8")
        extra = routes.get(request.path) if routes else None
        if extra is not None:
            status, ctype, body = await extra()
        else:
            status, ctype, body = route(request.path, exposition=exposition, ready=ready)
        return HttpResponse(status, body, ctype)

    return app


async def serve_http(
    host: str,
    port: int,
    *,
    exposition: Callable[[], bytes],
    ready: Callable[[], bool],
    routes: Mapping[str, Route] | None = None,
    limits: EdgeLimits | None = None,
    stats: EdgeStats | None = None,
    connection_cap: int | None = None,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled; ``task_status.started(bound_port)``. ``routes`` adds endpoints
    (path -> async handler), checked before the built-in ones, so a server can serve its own
    ``/metrics`` (the gateway merges its workers' expositions into it). ``limits``, ``stats``
    and ``connection_cap`` are ``serve_app``'s: the admin port is as public as the others."""
    await serve_app(
        host,
        port,
        admin_app(exposition, ready, routes),
        max_body_bytes=MAX_BODY_BYTES,
        name="metrics",
        limits=limits,
        stats=stats,
        connection_cap=connection_cap,
        task_status=task_status,
    )


__all__ = ["Route", "admin_app", "route", "serve_http"]

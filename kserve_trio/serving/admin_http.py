"""The admin HTTP endpoints of a server process (the worker's ``endpoints.metrics_port``).

A small HTTP/1.1 server on anyio streams, run inside the worker's nursery tree:
``GET /metrics`` (Prometheus text), ``/healthz`` (200 ``ok`` while the process is up),
``/readyz`` (200 ``ok`` / 503 ``not ready`` with ServerReady semantics), 404 otherwise.
One request per connection; no keep-alive is needed for scrapers and probes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import anyio
import anyio.abc

from kserve_trio.core.logging import get_logger

log = get_logger("kserve_trio.serving.admin_http")

MAX_HEADER_BYTES = 16 << 10

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


_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    503: "Service Unavailable",
}


async def _handle(
    stream: anyio.abc.ByteStream, exposition, ready, routes: Mapping[str, Route] | None = None
) -> None:
    async with stream:
        buf = b""
        with anyio.move_on_after(10):
            while b"\r\n\r\n" not in buf and len(buf) < MAX_HEADER_BYTES:
                try:
                    chunk = await stream.receive(4096)
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return
                buf += chunk
        line = buf.split(b"\r\n", 1)[0].decode("latin-1")
        parts = line.split()
        if len(parts) < 2:
            status, ctype, body = 400, "text/plain", b"bad request"
        elif parts[0] not in ("GET", "HEAD"):
            status, ctype, body = 405, "text/plain", b"method not allowed"
        elif routes and parts[1].split("?", 1)[0] in routes:
            status, ctype, body = await routes[parts[1].split("?", 1)[0]]()
            if parts[0] == "HEAD":
                body = b""
        else:
            status, ctype, body = route(parts[1], exposition=exposition, ready=ready)
            if parts[0] == "HEAD":
                body = b""
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\n"
            f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        try:
            await stream.send(head + body)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass


async def serve_http(
    host: str,
    port: int,
    *,
    exposition: Callable[[], bytes],
    ready: Callable[[], bool],
    routes: Mapping[str, Route] | None = None,
    task_status=anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled; ``task_status.started(bound_port)``. ``routes`` adds endpoints
    (path -> async handler), checked before the built-in ones, so a server can serve its own
    ``/metrics`` (the gateway merges its workers' expositions into it)."""
    listener = await anyio.create_tcp_listener(local_host=host, local_port=port, reuse_port=False)
    bound = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener:
        log.info("metrics_endpoint_up", host=host, port=bound)
        task_status.started(bound)

        async def handler(stream):
            try:
                await _handle(stream, exposition, ready, routes)
            except Exception as exc:  # one bad client never stops the endpoint
                log.warning("metrics_request_failed", error=repr(exc))

        await listener.serve(handler)


__all__ = ["route", "serve_http"]

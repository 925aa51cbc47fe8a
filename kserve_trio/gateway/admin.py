"""The gateway's admin HTTP endpoints (on ``listen.metrics``, served by ``serving.admin_http``).

- ``/metrics``: the gateway's own exposition, merged with each worker's when ``worker_metrics``
  is set. Every paired worker's ``/metrics`` is fetched concurrently at scrape time (5 s each);
  ``gateway_worker_metrics_up{worker}`` says which answered; a worker's samples that carry no
  ``worker`` label get one; ``metrics_merge.merge_expositions`` makes one valid exposition.
- ``/routing``: a JSON object: ``models`` maps each model to its ready replicas' labels,
  ``workers`` lists every known worker with its readiness.
- ``/healthz``: 200 ``ok`` while the process serves. ``/readyz``: 200 ``ok`` while a worker is
  routable and the gateway is not draining, else 503 ``not ready``.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import anyio

from kserve_trio.core.logging import get_logger
from kserve_trio.gateway.addresses import format_host_port
from kserve_trio.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from kserve_trio.gateway.metrics_merge import ExpositionError, add_worker_label, merge_expositions
from kserve_trio.gateway.pool import WorkerPool
from kserve_trio.gateway.routing import RoutingState
from kserve_trio.serving.admin_http import Route
from kserve_trio.serving.http import parse_response

SCRAPE_TIMEOUT_SECONDS = 5.0
MAX_SCRAPE_BYTES = 64 << 20
"""A worker exposition larger than this is refused (a scrape must not exhaust the gateway)."""

_log = get_logger(__name__)


class ScrapeError(Exception):
    """A worker's metrics endpoint could not be read."""


def parse_http_response(raw: bytes) -> tuple[int, bytes]:
    """``(status, body)`` of an HTTP/1.1 response read to the end of the connection; the body
    is de-chunked under ``Transfer-Encoding: chunked`` and cut to ``Content-Length``
    (``serving.http.parse_response``: the HTTP stack's own parser library)."""
    try:
        return parse_response(raw)
    except ValueError as exc:
        raise ScrapeError(str(exc)) from None


async def scrape(host: str, port: int, timeout: float = SCRAPE_TIMEOUT_SECONDS) -> str:
    """``GET /metrics`` from ``host:port``; the exposition text, or ``ScrapeError``."""
    target = format_host_port(host, port)
    chunks: list[bytes] = []
    size = 0
    with anyio.move_on_after(timeout) as scope:
        try:
            async with await anyio.connect_tcp(host, port) as sock:
                await sock.send(
                    f"GET /metrics HTTP/1.1\r\nHost: {target}\r\nAccept: text/plain\r\n"
                    "Connection: close\r\n\r\n".encode("ascii")
                )
                while True:
                    try:
                        chunk = await sock.receive(1 << 16)
                    except anyio.EndOfStream:
                        break
                    size += len(chunk)
                    if size > MAX_SCRAPE_BYTES:
                        raise ScrapeError(f"exposition of {target} over {MAX_SCRAPE_BYTES} bytes")
                    chunks.append(chunk)
        except (OSError, anyio.BrokenResourceError) as exc:
            raise ScrapeError(f"cannot read {target}/metrics: {exc}") from None
    if scope.cancelled_caught:
        raise ScrapeError(f"{target}/metrics did not answer within {timeout:g}s")
    status, body = parse_http_response(b"".join(chunks))
    if status != 200:
        raise ScrapeError(f"{target}/metrics answered HTTP {status}")
    return body.decode("utf-8", "replace")


class AdminEndpoints:
    """The async routes of the admin server (see the module docstring)."""

    def __init__(
        self,
        *,
        metrics: GatewayMetrics,
        pool: WorkerPool,
        state: RoutingState,
        ready: Callable[[], bool],
    ) -> None:
        self.metrics = metrics
        self.pool = pool
        self.state = state
        self._ready = ready

    def ready(self) -> bool:
        return self._ready()

    def routes(self) -> dict[str, Route]:
        return {"/metrics": self.metrics_page, "/routing": self.routing_page}

    async def worker_expositions(self) -> list[str]:
        """Each paired worker's exposition (labelled), in worker label order; sets
        ``gateway_worker_metrics_up`` for each."""
        targets = [
            (label, client.spec.metrics)
            for label, client in sorted(self.pool.clients.items())
            if client.spec.metrics is not None
        ]
        texts: dict[str, str] = {}

        async def one(label: str, host: str, port: int) -> None:
            try:
                text = await scrape(host, port)
                texts[label] = add_worker_label(text, label)
            except (ScrapeError, ExpositionError, ValueError) as exc:
                _log.warning("worker_metrics_scrape_failed", worker=label, error=str(exc))
            self.metrics.set_worker_metrics_up(label, label in texts)

        async with anyio.create_task_group() as tg:
            for label, (host, port) in targets:
                tg.start_soon(one, label, host, port)
        return [texts[label] for label, _ in targets if label in texts]

    async def metrics_page(self) -> tuple[int, str, bytes]:
        workers = await self.worker_expositions()
        own = self.metrics.exposition().decode("utf-8")
        if not workers:
            return 200, CONTENT_TYPE, own.encode("utf-8")
        try:
            merged = merge_expositions([own, *workers])
        except ExpositionError as exc:  # a worker's text is malformed: serve our own
            _log.warning("worker_metrics_merge_failed", error=str(exc))
            merged = own
        return 200, CONTENT_TYPE, merged.encode("utf-8")

    async def routing_page(self) -> tuple[int, str, bytes]:
        readiness = {label: c.health.ready for label, c in self.pool.clients.items()}
        body = json.dumps(self.state.table.to_json(readiness), indent=1).encode("utf-8")
        return 200, "application/json", body


__all__ = ["AdminEndpoints", "ScrapeError", "parse_http_response", "scrape"]

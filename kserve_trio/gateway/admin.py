"""The gateway's admin HTTP endpoints (on ``listen.metrics``, served by ``serving.admin_http``).

- ``/metrics``: the gateway's own exposition, merged with each worker's when ``worker_metrics``
  is set. Every paired worker's ``/metrics`` is fetched concurrently at scrape time (5 s each);
  ``gateway_worker_metrics_up{worker}`` says which answered; a worker's samples that carry no
  ``worker`` label get one; ``metrics_merge.merge_expositions`` makes one valid exposition.
- ``/metrics/own`` and ``/metrics/workers``: the two halves of ``/metrics`` (the gateway's
  own series; the workers' merged), which the parent of several gateway processes combines.
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
from kserve_trio.gateway.fleet import RoutingState, WorkerPool
from kserve_trio.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from kserve_trio.serving.admin_http import Route
from kserve_trio.serving.http import HttpClient, HttpClientError
from kserve_trio.serving.metrics_merge import ExpositionError, add_worker_label, merge_expositions

SCRAPE_TIMEOUT_SECONDS = 5.0
MAX_SCRAPE_BYTES = 64 << 20
"""A worker exposition larger than this is refused (a scrape must not exhaust the gateway)."""

_log = get_logger(__name__)


class ScrapeError(Exception):
    """A worker's metrics endpoint could not be read."""


async def fetch(
    host: str, port: int, path: str, timeout: float = SCRAPE_TIMEOUT_SECONDS
) -> tuple[int, bytes]:
    """``GET path`` from ``host:port`` (``serving.http.HttpClient``, the project's one HTTP
    client, one connection closed after the answer): the status and body, or ``ScrapeError``
    when nothing answered."""
    target = format_host_port(host, port)
    headers = (("accept", "text/plain"), ("connection", "close"))
    try:
        async with HttpClient(per_host=1, max_body_bytes=MAX_SCRAPE_BYTES) as client:
            reply = await client.request(host, port, "GET", path, headers=headers, timeout=timeout)
    except TimeoutError:
        raise ScrapeError(f"{target}{path} did not answer within {timeout:g}s") from None
    except HttpClientError as exc:
        raise ScrapeError(f"cannot read {target}{path}: {exc}") from None
    return reply.status, reply.body


async def scrape(
    host: str, port: int, timeout: float = SCRAPE_TIMEOUT_SECONDS, path: str = "/metrics"
) -> str:
    """``GET /metrics`` (or ``path``) from ``host:port``: the exposition text, or
    ``ScrapeError``."""
    status, body = await fetch(host, port, path, timeout)
    if status != 200:
        raise ScrapeError(f"{format_host_port(host, port)}{path} answered HTTP {status}")
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
        return {
            "/metrics": self.metrics_page,
            "/metrics/own": self.own_metrics_page,
            "/metrics/workers": self.worker_metrics_page,
            "/routing": self.routing_page,
        }

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

    async def own_metrics_page(self) -> tuple[int, str, bytes]:
        """The gateway's own series alone (what a parent of several processes labels)."""
        return 200, CONTENT_TYPE, self.metrics.exposition()

    async def worker_metrics_page(self) -> tuple[int, str, bytes]:
        """The workers' expositions alone, merged (a parent asks one child for these)."""
        workers = await self.worker_expositions()
        try:
            merged = merge_expositions(workers)
        except ExpositionError as exc:
            _log.warning("worker_metrics_merge_failed", error=str(exc))
            merged = ""
        return 200, CONTENT_TYPE, merged.encode("utf-8")

    async def routing_page(self) -> tuple[int, str, bytes]:
        readiness = {label: c.health.ready for label, c in self.pool.clients.items()}
        body = json.dumps(self.state.table.to_json(readiness), indent=1).encode("utf-8")
        return 200, "application/json", body


__all__ = ["AdminEndpoints", "ScrapeError", "fetch", "scrape"]

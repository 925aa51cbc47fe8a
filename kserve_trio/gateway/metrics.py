"""Prometheus metrics of one gateway, on one ``CollectorRegistry`` per gateway instance (tests
run several gateways in one process).

Series updated as requests finish: ``gateway_requests_total{rpc,model,status}``,
``gateway_request_latency_seconds{rpc,model}``, ``gateway_worker_latency_seconds{rpc,worker}``
(same buckets), ``gateway_requests_shed_total``. Series the prober sets each round:
``gateway_routing_table_size``, ``gateway_worker_ready{worker}``,
``gateway_worker_metrics_up{worker}``. Read at scrape time: ``gateway_inflight_requests``,
``gateway_queued_requests``, ``gateway_max_concurrent_requests`` and, for a policy that keeps load counters,
``gateway_worker_inflight_work{worker,basis}`` (every known worker, in label order).

Under lpt_packing the scheduler's series join the same registry (``add_collector``;
``placement.metrics``).

``model`` is the model name for ModelInfer, the region name for the shared-memory RPCs and
``""`` otherwise; ``status`` is the gRPC status in CamelCase (``OK``, ``NotFound``,
``InvalidArgument``, ...; ``status_label``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import anyio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from kserve_trio.core.errors import ServingError, StatusCode
from kserve_trio.serving.edge_stats import EdgeCollector, EdgeStats

if TYPE_CHECKING:
    # A type only: the fleet's prober records into these metrics, so the fleet is above them.
    from kserve_trio.gateway.fleet import RoutingPolicy

LATENCY_BUCKETS = tuple(0.00025 * 2**k for k in range(18))
"""250 us to about 33 s, doubling: the added latency of a hop is sub-millisecond."""
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def status_label(status: StatusCode | int) -> str:
    """A status as the ``status`` label spells it: ``OK``, ``NotFound``, ``DeadlineExceeded``."""
    code = StatusCode(status)
    if code is StatusCode.OK:
        return "OK"
    return "".join(part.capitalize() for part in code.name.split("_"))


MAX_MODEL_LABELS = 1024
"""Distinct ``model`` label values the gateway's request series keep before folding new ones."""
UNKNOWN_MODEL = "<unknown>"
OTHER_MODELS = "<other>"


class GatewayMetrics:
    """The gateway's metric objects, its registry and its scrape-time series.

    ``inflight``, ``queued`` and ``max_concurrent`` report admission (requests in flight,
    requests waiting in its queue, the cap; 0 = uncapped); ``policy`` and ``workers`` give the per-worker outstanding work.
    """

    def __init__(
        self,
        *,
        inflight: Callable[[], int] = lambda: 0,
        max_concurrent: Callable[[], int] = lambda: 0,
        queued: Callable[[], int] = lambda: 0,
        policy: RoutingPolicy | None = None,
        workers: Callable[[], Iterable[str]] = tuple,
        edge: EdgeStats | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.edge = edge or EdgeStats()
        """What the edge defences of the gateway's servers did (exported as gateway_edge_*)."""
        self.registry.register(EdgeCollector(self.edge, "gateway"))
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.requests = Counter(
            "gateway_requests_total",
            "Requests by RPC, model (or shared-memory region) and gRPC status",
            ["rpc", "model", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "gateway_request_latency_seconds",
            "Request latency at the gateway, receive to reply",
            ["rpc", "model"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.worker_latency = Histogram(
            "gateway_worker_latency_seconds",
            "Latency of the gateway's calls to each worker",
            ["rpc", "worker"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.shed = Counter(
            "gateway_requests_shed_total",
            "Requests refused RESOURCE_EXHAUSTED at the admission cap",
            registry=self.registry,
        )
        self.routing_table_size = Gauge(
            "gateway_routing_table_size", "Models with at least one ready replica",
            registry=self.registry,
        )  # fmt: skip
        self.worker_ready = Gauge(
            "gateway_worker_ready", "1 if the worker answered ServerReady ready in the last round",
            ["worker"], registry=self.registry,
        )  # fmt: skip
        self.worker_metrics_up = Gauge(
            "gateway_worker_metrics_up", "1 if the worker's metrics endpoint answered the scrape",
            ["worker"], registry=self.registry,
        )  # fmt: skip
        self.registry.register(_ScrapeCollector(inflight, max_concurrent, policy, workers, queued))
        self._request_children: dict[tuple[str, str, str], Any] = {}
        self._model_labels: set[str] = set()
        self._latency_children: dict[tuple[str, str], Any] = {}
        self._worker_children: dict[tuple[str, str], Any] = {}

    def _model_label(self, model: str, status: StatusCode) -> str:
        """The ``model`` label of a request, bounded: a client picks the name it sends, so a
        NOT_FOUND (no worker has it) is labelled ``<unknown>`` and, past ``MAX_MODEL_LABELS``
        distinct names, further new names are ``<other>`` (the series set cannot grow without
        bound however many names a hostile client invents)."""
        if status is StatusCode.NOT_FOUND:
            return UNKNOWN_MODEL
        if model in self._model_labels:
            return model
        if len(self._model_labels) >= MAX_MODEL_LABELS:
            return OTHER_MODELS
        self._model_labels.add(model)
        return model

    def observe_request(self, rpc: str, model: str, status: StatusCode, seconds: float) -> None:
        """One finished client request (label children cached: this is the hot path)."""
        model = self._model_label(model, status)
        key = (rpc, model, status_label(status))
        counter = self._request_children.get(key)
        if counter is None:
            counter = self._request_children[key] = self.requests.labels(*key)
        counter.inc()
        hist = self._latency_children.get(key[:2])
        if hist is None:
            hist = self._latency_children[key[:2]] = self.latency.labels(rpc, model)
        hist.observe(seconds)

    def observe_worker_call(self, rpc: str, worker: str, seconds: float) -> None:
        """One call from the gateway to a worker (``rpc``: ``ModelInfer``,
        ``SystemSharedMemory``, ``CompactMemory``, ...)."""
        key = (rpc, worker)
        hist = self._worker_children.get(key)
        if hist is None:
            hist = self._worker_children[key] = self.worker_latency.labels(rpc, worker)
        hist.observe(seconds)

    def set_worker_ready(self, worker: str, ready: bool) -> None:
        self.worker_ready.labels(worker).set(1.0 if ready else 0.0)

    def set_worker_metrics_up(self, worker: str, up: bool) -> None:
        self.worker_metrics_up.labels(worker).set(1.0 if up else 0.0)

    def forget_worker(self, worker: str) -> None:
        """Drop a worker's series (discovery no longer lists it)."""
        for gauge in (self.worker_ready, self.worker_metrics_up):
            try:
                gauge.remove(worker)
            except KeyError:
                pass
        for key in [k for k in self._worker_children if k[1] == worker]:
            del self._worker_children[key]
            self.worker_latency.remove(*key)

    def add_collector(self, collector: Any) -> None:
        """Register a scrape-time collector of another part (lpt_packing's series)."""
        self.registry.register(collector)

    def exposition(self) -> bytes:
        """The gateway's own exposition (``CONTENT_TYPE``)."""
        return generate_latest(self.registry)


class _ScrapeCollector:
    """Admission and per-worker work, read when scraped."""

    def __init__(
        self,
        inflight: Callable[[], int],
        max_concurrent: Callable[[], int],
        policy: RoutingPolicy | None,
        workers: Callable[[], Iterable[str]],
        queued: Callable[[], int],
    ) -> None:
        self._queued = queued
        self._inflight = inflight
        self._max = max_concurrent
        self._policy = policy
        self._workers = workers

    def describe(self) -> list:
        return []

    def collect(self):
        yield _gauge("gateway_inflight_requests", "Requests in flight", self._inflight())
        yield _gauge(
            "gateway_queued_requests", "Requests waiting for an admission slot", self._queued()
        )
        yield _gauge(
            "gateway_max_concurrent_requests", "Inbound admission cap (0 = none)", self._max()
        )
        policy = self._policy
        if policy is None or policy.basis is None:
            return
        work = policy.inflight_work()
        family = GaugeMetricFamily(
            "gateway_worker_inflight_work",
            "Outstanding work per worker on the routing basis",
            labels=["worker", "basis"],
        )
        for worker in sorted(set(self._workers()) | set(work)):
            family.add_metric([worker, policy.basis.value], work.get(worker, 0.0))
        yield family


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation)
    family.add_metric([], value)
    return family


class ObservedRequest:
    """``with ObservedRequest(metrics, rpc) as seen:`` counts one client request when the block
    ends: OK if it returned, a ``ServingError``'s own status, INTERNAL for anything else
    (cancellation included), under ``seen.name`` (the model or region, set once known)."""

    __slots__ = ("metrics", "name", "rpc", "started")

    def __init__(self, metrics: GatewayMetrics | None, rpc: str) -> None:
        self.metrics = metrics
        self.rpc = rpc
        self.name = ""
        self.started = 0.0

    def __enter__(self) -> ObservedRequest:
        self.started = anyio.current_time()
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if self.metrics is None:
            return
        if kind is None:
            status = StatusCode.OK
        else:
            status = exc.status if isinstance(exc, ServingError) else StatusCode.INTERNAL
        self.metrics.observe_request(
            self.rpc, self.name, status, anyio.current_time() - self.started
        )


__all__ = ["CONTENT_TYPE", "LATENCY_BUCKETS", "GatewayMetrics", "ObservedRequest", "status_label"]

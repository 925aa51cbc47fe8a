"""Prometheus metrics of one worker, one ``CollectorRegistry`` per server instance.

Hot-path series (``worker_requests_total``, ``worker_request_latency_seconds``, shedding) are
updated as requests finish; everything else is pulled from the scheduler and the registry at
scrape time by ``_ScrapeCollector``, so a model that is unloaded disappears from the exposition.
``inject_labels`` adds the constant ``worker``/``gpu`` labels to every sample line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sized
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from kserve_trio.serving.edge_stats import EdgeCollector, EdgeStats

if TYPE_CHECKING:
    from kserve_trio.core.process import ServerConfig
    from kserve_trio.runtime.backend import Backend
    from kserve_trio.runtime.weight_cache import WeightCache
    from kserve_trio.worker.scheduler import Scheduler

LATENCY_BUCKETS = tuple(0.001 * 2**k for k in range(14))
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ScrapeSource(Protocol):
    """What a scrape reads from a worker (its ``WorkerState``); a structural type, so this module
    depends on nothing above the scheduler."""

    @property
    def scheduler(self) -> Scheduler: ...

    @property
    def repository(self) -> Sized: ...

    @property
    def config(self) -> ServerConfig: ...

    @property
    def cache(self) -> WeightCache: ...

    @property
    def backend(self) -> Backend: ...

    @property
    def inflight(self) -> int: ...

    @property
    def max_concurrent_requests(self) -> int: ...


class WorkerMetrics:
    """The metric objects and the registry of one worker."""

    def __init__(
        self,
        *,
        worker: str = "",
        gpu: str = "",
        edge: EdgeStats | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.worker = worker
        self.gpu = gpu
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.requests = Counter(
            "worker_requests_total",
            "ModelInfer requests by model and gRPC status",
            ["model", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "worker_request_latency_seconds",
            "ModelInfer latency, receive to reply",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.shed = Counter(
            "worker_requests_shed",
            "Requests shed at the concurrency cap",
            registry=self.registry,
        )
        self.compilations = Counter(
            "worker_model_compilations",
            "Bundle compilations by model",
            ["model"],
            registry=self.registry,
        )
        self.edge = edge or EdgeStats()
        """What the edge defences of this worker's servers did (exported as worker_edge_*)."""
        self.registry.register(EdgeCollector(self.edge, "worker"))
        self._request_children: dict[tuple[str, str], Counter] = {}
        self._latency_children: dict[str, Histogram] = {}

    def collect_from(self, source: ScrapeSource) -> None:
        """Scrapes read ``source`` (the worker's ``WorkerState``, built after these metrics:
        its repository counts compilations here)."""
        self.registry.register(_ScrapeCollector(source))

    def observe_request(self, model: str, status: str, seconds: float) -> None:
        """Record one finished ModelInfer call (label children cached: this is the hot path)."""
        key = (model, status)
        counter = self._request_children.get(key)
        if counter is None:
            counter = self._request_children[key] = self.requests.labels(model=model, status=status)
        counter.inc()
        hist = self._latency_children.get(model)
        if hist is None:
            hist = self._latency_children[model] = self.latency.labels(model=model)
        hist.observe(seconds)

    def exposition(self) -> bytes:
        """The Prometheus text exposition with the constant labels injected."""
        labels = {k: v for k, v in (("worker", self.worker), ("gpu", self.gpu)) if v}
        return inject_labels(generate_latest(self.registry).decode(), labels).encode()


class _ScrapeCollector:
    """Pulls scheduler and registry state at scrape time."""

    def __init__(self, source: ScrapeSource) -> None:
        self._source = source

    def describe(self):
        return []

    def collect(self):
        state = self._source
        metrics = state.scheduler.scheduler_metrics()
        per_model = {
            "dispatch": CounterMetricFamily(
                "worker_dispatch", "Device executions", labels=["model"]
            ),
            "compute": CounterMetricFamily(
                "worker_compute_seconds", "Device compute time", labels=["model"]
            ),
            "served": CounterMetricFamily(
                "worker_requests_served", "Requests served by the scheduler", labels=["model"]
            ),
            "rows": CounterMetricFamily(
                "worker_rows_served", "Batch rows served", labels=["model"]
            ),
            "depth": GaugeMetricFamily("worker_queue_depth", "Queued requests", labels=["model"]),
            "maxb": GaugeMetricFamily(
                "worker_model_max_batch_size", "Effective max batch size", labels=["model"]
            ),
            "wait": GaugeMetricFamily(
                "worker_queue_wait_seconds",
                "Queue wait percentiles (recent requests)",
                labels=["model", "quantile"],
            ),
            "resident": GaugeMetricFamily(
                "worker_model_resident", "Weights resident on the device", labels=["model"]
            ),
            "pinned": GaugeMetricFamily("worker_model_pinned", "Weights pinned", labels=["model"]),
            "wbytes": GaugeMetricFamily(
                "worker_model_weight_bytes", "Weight footprint", labels=["model"]
            ),
        }
        resident_models = 0
        resident_bytes = 0
        for name, m in sorted(metrics.items()):
            per_model["dispatch"].add_metric([name], m.dispatch_count)
            per_model["compute"].add_metric([name], m.total_compute)
            per_model["served"].add_metric([name], m.requests_served)
            per_model["rows"].add_metric([name], m.rows_served)
            per_model["depth"].add_metric([name], m.queue_depth)
            per_model["maxb"].add_metric([name], m.max_batch_size)
            per_model["wait"].add_metric([name, "0.5"], m.wait_p50)
            per_model["wait"].add_metric([name, "0.99"], m.wait_p99)
            resident = bool(m.resident)
            nbytes = int(m.weight_nbytes)
            per_model["resident"].add_metric([name], 1.0 if resident else 0.0)
            per_model["pinned"].add_metric([name], 1.0 if m.pinned else 0.0)
            per_model["wbytes"].add_metric([name], nbytes)
            resident_models += resident
            resident_bytes += nbytes if resident else 0
        yield from per_model.values()
        yield _gauge("worker_models_loaded", "Models loaded", len(state.repository))
        yield _gauge(
            "worker_models_resident", "Models with device-resident weights", resident_models
        )
        yield _gauge("worker_resident_weight_bytes", "Device-resident weight bytes", resident_bytes)
        yield from _cache_series(state.cache)
        yield from _device_series(state.backend)
        yield _gauge("worker_inflight_requests", "ModelInfer calls in flight", state.inflight)
        yield _gauge(
            "worker_max_concurrent_requests",
            "Concurrency cap (0 = none)",
            state.max_concurrent_requests,
        )
        info = GaugeMetricFamily(
            "worker_info",
            "Worker identity",
            labels=["worker", "device_ordinal", "control_mode", "discipline", "residency_mode"],
        )
        cfg = state.config
        info.add_metric(
            [
                cfg.worker_name or "",
                str(cfg.runtime.device_ordinal),
                cfg.model_control_mode.value,
                cfg.scheduler.discipline.value,
                cfg.residency_mode.value,
            ],
            1.0,
        )
        yield info


def _cache_series(cache: WeightCache) -> list:
    """The weight cache's series, only when the cache is enabled."""
    if not cache.enabled:
        return []
    st = cache.stats()
    loads = CounterMetricFamily("worker_weight_loads", "On-demand weight loads")
    loads.add_metric([], st.loads)
    evicts = CounterMetricFamily("worker_weight_evicts", "On-demand weight evictions")
    evicts.add_metric([], st.evicts)
    seconds = CounterMetricFamily("worker_weight_load_seconds", "Time spent in on-demand loads")
    seconds.add_metric([], st.load_seconds)
    return [
        _gauge(
            "worker_weight_cache_resident_bytes",
            "On-demand weight bytes on the device",
            st.resident_bytes,
        ),
        _gauge("worker_weight_cache_max_bytes", "On-demand weight budget", st.max_bytes),
        _gauge("worker_weight_cache_pinned_bytes", "Device-pinned weight bytes", st.pinned_bytes),
        _gauge(
            "worker_weight_cache_max_scratch_bytes",
            "Largest execution scratch measured by the startup probe",
            st.max_scratch_bytes,
        ),
        _gauge("worker_weight_pool_bytes", "Pinned + on-demand weight pool", st.weight_pool_bytes),
        loads,
        evicts,
        seconds,
    ]


_DEVICE_STATS = (
    ("in_use", "bytes_in_use", "Device memory in use"),
    ("limit", "bytes_limit", "Device memory pool limit"),
    ("peak_in_use", "peak_bytes_in_use", "Peak device memory in use"),
    ("pool", "pool_bytes", "Device memory held by the allocator's pool"),
)


def _device_series(backend: Backend) -> list:
    """Device memory gauges, only when the backend reports an arena (``bytes_limit > 0``)."""
    if not hasattr(backend, "memory_stats"):
        return []
    try:
        stats = backend.memory_stats()
    except Exception:
        return []
    limit = int(stats.get("bytes_limit", 0) or 0)
    if limit <= 0:
        return []
    out = []
    for suffix, key, doc in _DEVICE_STATS:
        if key in stats:
            out.append(_gauge(f"worker_device_memory_{suffix}_bytes", doc, stats[key]))
    free = max(limit - int(stats.get("bytes_in_use", 0)), 0)
    out.append(_gauge("worker_device_memory_free_bytes", "Device memory pool free", free))
    return out


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?(\s.*)$")


def inject_labels(text: str, labels: dict[str, str]) -> str:
    """Add ``labels`` to every sample line (comments untouched; existing keys not duplicated)."""
    if not labels:
        return text
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if line.startswith("#") or not m:
            out.append(line)
            continue
        name, _, inner, rest = m.groups()
        present = (
            {p.split("=", 1)[0].strip() for p in inner.split(",") if "=" in p} if inner else set()
        )
        extra = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items() if k not in present)
        if not extra:
            out.append(line)
            continue
        merged = f"{inner},{extra}" if inner else extra
        out.append(f"{name}{{{merged}}}{rest}")
    return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def gpu_label(backend: str, device_ordinal: int, env: Mapping[str, str] | None = None) -> str:
    """The ``gpu`` label: CUDA only; the visible-devices token at the ordinal, else the ordinal."""
    if backend not in ("cuda", "gpu"):
        return ""
    env = os.environ if env is None else env
    tokens = [t.strip() for t in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if t.strip()]
    if len(tokens) == 1:
        return tokens[0]
    if len(tokens) > device_ordinal:
        return tokens[device_ordinal]
    return str(device_ordinal)


__all__ = [
    "CONTENT_TYPE",
    "LATENCY_BUCKETS",
    "ScrapeSource",
    "WorkerMetrics",
    "gpu_label",
    "inject_labels",
]

"""What a server's edge defences did: the counts behind the refused-connection, GOAWAY and
stream-reset metrics.

One ``EdgeStats`` per process, made by the composition root (worker or gateway) and handed to
every server it runs (gRPC, REST, admin), so the metrics endpoint reads one object. The servers
only count; the metrics modules (``worker.metrics``, ``gateway.metrics``) export. Counting is
a dict increment on the event loop, so it costs nothing on the paths that never refuse.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


class EdgeStats:
    """Counters of one process's edge defences (module docstring)."""

    def __init__(self) -> None:
        self.refused_connections: Counter[str] = Counter()
        """Connections closed by a defence, by reason (``max_connections``, ``evicted_idle``,
        ``fd_budget``, ``handshake_timeout``, ``idle``, ...)."""
        self.goaways: Counter[str] = Counter()
        """GOAWAY frames sent, by error code name (``NO_ERROR``, ``ENHANCE_YOUR_CALM``, ...)."""
        self.refused_streams = 0
        """Streams answered RST_STREAM(REFUSED_STREAM) (beyond the concurrent-stream limit, or
        after a GOAWAY)."""
        self.premature_resets = 0
        """Streams the client reset within ``limits.premature_reset_seconds`` of opening them."""
        self.refused_requests: Counter[str] = Counter()
        """REST requests refused by a body defence, by reason (``body_too_large``,
        ``chunk_extensions``, ``json_too_deep``, ``inflight_bytes``)."""
        self.inflight_bytes: Callable[[], int] = lambda: 0
        """The bytes of requests being received and queued now (the admission's gauge; set by
        whoever owns the byte admission)."""

    def refuse_connection(self, reason: str) -> None:
        self.refused_connections[reason] += 1

    def goaway(self, code: str) -> None:
        self.goaways[code] += 1

    def refuse_request(self, reason: str) -> None:
        self.refused_requests[reason] += 1


class EdgeCollector:
    """Exports an ``EdgeStats`` as ``<prefix>_edge_*`` series (prefix ``worker`` or ``gateway``)."""

    def __init__(self, stats: EdgeStats, prefix: str) -> None:
        self._stats = stats
        self._prefix = prefix

    def collect(self) -> Iterator[Metric]:
        s, p = self._stats, self._prefix
        refused = CounterMetricFamily(
            f"{p}_edge_refused_connections", "Connections closed by a defence", labels=["reason"]
        )
        for reason, count in sorted(s.refused_connections.items()):
            refused.add_metric([reason], count)
        yield refused
        goaways = CounterMetricFamily(f"{p}_edge_goaways", "GOAWAY frames sent", labels=["code"])
        for code, count in sorted(s.goaways.items()):
            goaways.add_metric([code], count)
        yield goaways
        requests = CounterMetricFamily(
            f"{p}_edge_refused_requests", "REST requests refused by a defence", labels=["reason"]
        )
        for reason, count in sorted(s.refused_requests.items()):
            requests.add_metric([reason], count)
        yield requests
        yield CounterMetricFamily(
            f"{p}_edge_refused_streams", "Streams refused (REFUSED_STREAM)", value=s.refused_streams
        )
        yield CounterMetricFamily(
            f"{p}_edge_premature_resets",
            "Streams reset by the client right after opening them",
            value=s.premature_resets,
        )
        yield GaugeMetricFamily(
            f"{p}_edge_inflight_bytes",
            "Bytes of requests being received and queued",
            value=s.inflight_bytes(),
        )


__all__ = ["EdgeCollector", "EdgeStats"]

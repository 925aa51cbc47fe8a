"""What the worker records about each finished inference request, in one call.

``RequestObserver.finished`` is called exactly once per request that reached the inference core,
whatever its outcome, and feeds every bookkeeping that follows a request: the Prometheus series
(``worker_requests_total``, ``worker_request_latency_seconds``), Triton's per-model statistics
(``RequestStats``, read by ``ModelStatistics`` and the control plane), the ``request`` heartbeat
and, with debug logging on, the ``request_done`` event. Transports (unary gRPC, streams, REST)
never record anything themselves, so every request is counted once and the same way.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kserve_trio.core.logging import debug_enabled, get_logger
from kserve_trio.worker import heartbeat
from kserve_trio.worker.triton_views import RequestStats

UNKNOWN_MODEL = "<unknown>"
"""The ``model`` label of a request for a model this worker does not have: one fixed value, so
made-up names cannot add label sets (each costs memory for the life of the process)."""

if TYPE_CHECKING:
    from kserve_trio.worker.metrics import WorkerMetrics
    from kserve_trio.worker.repository import ModelRepository
    from kserve_trio.worker.scheduler import RequestTrace

log = get_logger("kserve_trio.worker.observer")


class RequestObserver:
    """Folds finished requests into the metrics, the Triton statistics and the heartbeat."""

    def __init__(self, repository: ModelRepository, metrics: WorkerMetrics | None = None) -> None:
        self._loaded = repository.bundles
        self._metrics = metrics
        self.stats: dict[str, RequestStats] = {}
        """Triton statistics by model name (kept for a model that was unloaded since)."""

    def stats_of(self, name: str) -> RequestStats:
        """The model's Triton statistics (zeroes until its first finished request)."""
        stats = self.stats.get(name)
        if stats is None:
            stats = self.stats[name] = RequestStats()
        return stats

    def finished(
        self, model: str, status: str, elapsed_ns: int, trace: RequestTrace, request_id: str
    ) -> None:
        """Record one finished request.

        Rules:
        1. The Prometheus request counter and latency histogram get ``model``/``status``:
           ``model`` is the name the client sent when the worker has that model, and
           ``UNKNOWN_MODEL`` otherwise (empty, made-up, unloaded since), so a hostile client
           cannot grow the label sets; ``status`` is one of the gRPC status names.
        2. Triton statistics are kept only for a loaded model, so a client cannot grow them
           with made-up names: success time plus the trace's queue and compute split when
           ``status`` is ``OK``, fail time otherwise.
        3. With debug logging on, ``request_done`` carries the id, status, batch and timings.
        4. The ``request`` heartbeat fires with the model name.
        """
        loaded = model in self._loaded
        if self._metrics is not None:
            label = model if loaded else UNKNOWN_MODEL
            self._metrics.observe_request(label, status, elapsed_ns / 1e9)
        if loaded:
            stats = self.stats.get(model)
            if stats is None:
                stats = self.stats[model] = RequestStats()
            if status == "OK":
                stats.success.add(elapsed_ns)
                stats.queue.add(trace.queue_ns)
                stats.compute_input.add(trace.preprocess_ns)
                stats.compute_infer.add(trace.compute_ns)
                stats.compute_output.add(trace.postprocess_ns)
                stats.last_inference_ms = int(time.time() * 1000)
            else:
                stats.fail.add(elapsed_ns)
        if debug_enabled():
            log.debug(
                "request_done",
                model=model,
                request_id=request_id,
                status=status,
                batch_size=trace.batch_size,
                queue_ms=round(trace.queue_ns / 1e6, 3),
                compute_ms=round(trace.compute_ns / 1e6, 3),
                duration_ms=round(elapsed_ns / 1e6, 3),
            )
        heartbeat.fire("request", model)


__all__ = ["UNKNOWN_MODEL", "RequestObserver"]

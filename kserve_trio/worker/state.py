"""``WorkerState``: what the composition root (``worker.parts.build_worker``) built, as the
RPC adapters (services, REST, metrics) read it.

One instance per running worker: the model repository (which owns the bundles and the
scheduler's membership), the request observer, the configuration, the message limits, the
shared-memory registry, the admission (``serving.admission.Admission``), the metrics, the
weight cache, the backend and the trace control; every one is given (a test that needs a worker
runs one). The inference core does not take it: it gets its collaborators by name. It holds no
behaviour of its own beyond server readiness; everything runs on the event loop thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kserve_trio.serving.admission import Admission
from kserve_trio.serving.grpc import Limits
from kserve_trio.serving.trace_control import TraceControl
from kserve_trio.worker.stream import OpenStreams

if TYPE_CHECKING:
    from kserve_trio.core.memory import ShmRegistry
    from kserve_trio.core.process import ServerConfig
    from kserve_trio.runtime.backend import Backend
    from kserve_trio.runtime.weight_cache import WeightCache
    from kserve_trio.worker.metrics import WorkerMetrics
    from kserve_trio.worker.observer import RequestObserver
    from kserve_trio.worker.repository import ModelRepository
    from kserve_trio.worker.scheduler import Scheduler


@dataclass
class WorkerState:
    """What the RPC adapters share: the parts ``build_worker`` made, and the start-up flag."""

    repository: ModelRepository
    observer: RequestObserver
    config: ServerConfig
    limits: Limits
    shm_registry: ShmRegistry
    admission: Admission
    metrics: WorkerMetrics
    cache: WeightCache
    backend: Backend  # device memory statistics
    tracing: TraceControl  # what TraceSetting reads and changes; the tracer once one is built
    loading: bool = True  # start-up loading (and the weight probe) still running: not ready
    streams: OpenStreams = field(default_factory=OpenStreams)  # open ModelStreamInfer calls

    @property
    def scheduler(self) -> Scheduler:
        """The dispatch engine, whose model membership the repository owns."""
        return self.repository.scheduler

    @property
    def shutting_down(self) -> bool:
        """The admission is draining: new requests are answered UNAVAILABLE."""
        return self.admission.draining

    @property
    def inflight(self) -> int:
        """Requests inside the inference core right now."""
        return self.admission.inflight

    @property
    def max_concurrent_requests(self) -> int:
        """The admission's cap (0 = none)."""
        return self.admission.cap

    def server_ready(self) -> bool:
        """Start-up loading done, not shutting down, at least one model, every regular model
        compiled (residency does not count)."""
        return not (self.loading or self.shutting_down) and self.repository.ready()


__all__ = ["WorkerState"]

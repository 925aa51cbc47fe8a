"""``WorkerState``: what the composition root (``worker/server.py``) built, as the RPC adapters
(services, REST, metrics) read it.

One instance per running worker, built by ``serve_async``: the model repository (which owns the
bundles and the scheduler's membership), the request observer, the shared-memory registry, the
message limits and the admission (``serving.admission.Admission``). The inference core does not
take it: it gets its collaborators by name. It holds no behaviour of its own beyond server
readiness; everything runs on the event loop thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kserve_trio.core.process.config import TracingConfig
from kserve_trio.serving.admission import Admission
from kserve_trio.serving.grpc import Limits
from kserve_trio.serving.trace_control import TraceControl
from kserve_trio.worker.stream import OpenStreams

if TYPE_CHECKING:
    from kserve_trio.core.memory.shm import ShmRegistry
    from kserve_trio.core.process.config import ServerConfig
    from kserve_trio.runtime.backend import Backend
    from kserve_trio.runtime.weight_cache import WeightCache
    from kserve_trio.worker.metrics import WorkerMetrics
    from kserve_trio.worker.observer import RequestObserver
    from kserve_trio.worker.repository import ModelRepository
    from kserve_trio.worker.scheduler import Scheduler


@dataclass
class WorkerState:
    """Everything the RPC handlers share: repository, observer, limits and lifecycle flags."""

    repository: ModelRepository
    observer: RequestObserver
    config: ServerConfig | None = None
    platform: str = "cpu"  # the device platform (cpu/cuda); models report PLATFORM
    limits: Limits = field(default_factory=lambda: Limits(512 << 20, 512 << 20))
    shm_registry: ShmRegistry | None = None
    admission: Admission | None = None  # None: uncapped, never draining (a bare state in tests)
    loading: bool = True  # start-up loading (and the weight probe) still running: not ready
    streams: OpenStreams = field(default_factory=OpenStreams)  # open ModelStreamInfer calls
    metrics: WorkerMetrics | None = None
    cache: WeightCache | None = None
    backend: Backend | None = None  # device memory statistics
    # What TraceSetting reads and changes: the trace settings, and the tracer once one is built.
    tracing: TraceControl = field(
        default_factory=lambda: TraceControl(TracingConfig(), role="worker", metric_prefix="worker")
    )

    @property
    def scheduler(self) -> Scheduler:
        """The dispatch engine, whose model membership the repository owns."""
        return self.repository.scheduler

    @property
    def shutting_down(self) -> bool:
        """The admission is draining: new requests are answered UNAVAILABLE."""
        return self.admission is not None and self.admission.draining

    @property
    def inflight(self) -> int:
        """Requests inside the inference core right now."""
        return self.admission.inflight if self.admission is not None else 0

    @property
    def max_concurrent_requests(self) -> int:
        """The admission's cap (0 = none)."""
        return self.admission.cap if self.admission is not None else 0

    def server_ready(self) -> bool:
        """Start-up loading done, not shutting down, at least one model, every regular model
        compiled (residency does not count)."""
        return not (self.loading or self.shutting_down) and self.repository.ready()


__all__ = ["WorkerState"]

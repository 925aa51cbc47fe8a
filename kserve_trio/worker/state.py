"""``WorkerState``: what a worker's RPC handlers and its inference core share.

One instance per running worker, built by ``serve_async``: the model repository (which owns the
bundles and the scheduler's membership), the request observer, the shared-memory registry, the
message limits and the two admission facts every request reads (``shutting_down``, ``inflight``
against ``max_concurrent_requests``). It holds no behaviour of its own beyond server readiness; everything runs on the event
loop thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kserve_trio.serving.grpc import Limits
from kserve_trio.worker.stream import OpenStreams

if TYPE_CHECKING:
    from kserve_trio.core.config import ServerConfig
    from kserve_trio.core.shm import ShmRegistry
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
    max_concurrent_requests: int = 64
    limits: Limits = field(default_factory=lambda: Limits(512 << 20, 512 << 20))
    shm_registry: ShmRegistry | None = None
    loading: bool = True  # start-up loading (and the weight probe) still running: not ready
    shutting_down: bool = False
    inflight: int = 0  # requests inside the inference core right now
    streams: OpenStreams = field(default_factory=OpenStreams)  # open ModelStreamInfer calls
    metrics: WorkerMetrics | None = None
    cache: WeightCache | None = None
    backend: Backend | None = None  # device memory statistics

    @property
    def scheduler(self) -> Scheduler:
        """The dispatch engine, whose model membership the repository owns."""
        return self.repository.scheduler

    def server_ready(self) -> bool:
        """Start-up loading done, not shutting down, at least one model, every regular model
        compiled (residency does not count)."""
        return not (self.loading or self.shutting_down) and self.repository.ready()


__all__ = ["WorkerState"]

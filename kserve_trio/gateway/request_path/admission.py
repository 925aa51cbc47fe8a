"""The gateway's admission rule over the shared ``serving.admission.Admission``: the inbound cap
is ``max_concurrent_requests_per_worker`` times the number of workers the gateway currently
knows (at least one), so it follows discovery as workers come and go; 0 means uncapped. Past it
a ModelInfer waits in arrival order for a slot, within its deadline (DEADLINE_EXCEEDED when it
passes), while fewer than ``max_queued_requests_per_worker`` times the workers wait already;
beyond that queue it is refused RESOURCE_EXHAUSTED. A burst that the workers would serve is
thus queued, not shed: stock clients (tritonclient) never retry RESOURCE_EXHAUSTED. A stream's
messages wait for a slot without that bound (the stream is backpressured). Once draining,
UNAVAILABLE ``gateway is shutting down``. Its ``bytes`` cap the request bytes in flight
(``limits.max_inflight_bytes``).
"""

from __future__ import annotations

from collections.abc import Callable

from kserve_trio.serving.admission import Admission as _Admission

SHUTTING_DOWN = "gateway is shutting down"


class Admission(_Admission):
    """The gateway's ``Admission``: the per-worker cap (see the module docstring)."""

    def __init__(
        self,
        per_worker: int,
        workers: Callable[[], int],
        *,
        queued_per_worker: int = 0,
        on_shed: Callable[[], None] = lambda: None,
        max_inflight_bytes: int = 0,
        max_inflight_bytes_per_connection: int = 0,
    ) -> None:
        self.per_worker = per_worker
        self.queued_per_worker = queued_per_worker
        self._workers = workers
        super().__init__(
            self._per_worker_cap,
            shutting_down=SHUTTING_DOWN,
            over_cap=self._over_cap_message,
            on_shed=on_shed,
            max_inflight_bytes=max_inflight_bytes,
            max_inflight_bytes_per_connection=max_inflight_bytes_per_connection,
            queue=self._per_worker_queue,
            over_queue=self._over_queue_message,
        )

    def _per_worker_queue(self) -> int:
        return self.queued_per_worker * max(self._workers(), 1)

    def _per_worker_cap(self) -> int:
        if self.per_worker <= 0:
            return 0
        return self.per_worker * max(self._workers(), 1)

    def _over_cap_message(self, cap: int) -> str:
        return (
            f"gateway is at its admission cap ({cap} requests in flight: "
            f"{self.per_worker} per worker x {max(self._workers(), 1)} workers)"
        )

    def _over_queue_message(self, cap: int, queue: int) -> str:
        return (
            f"{self._over_cap_message(cap)} and its queue is full ({queue} requests waiting: "
            f"{self.queued_per_worker} per worker x {max(self._workers(), 1)} workers)"
        )


__all__ = ["SHUTTING_DOWN", "Admission"]

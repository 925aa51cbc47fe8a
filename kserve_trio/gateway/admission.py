"""Inbound admission and drain: how many requests the gateway takes, and how it stops taking
them.

``Admission`` is a small state machine on the gateway's event loop (no locks: its counters
change only between awaits). Rules:

1. The cap is ``max_concurrent_requests_per_worker`` times the number of workers the gateway
   currently knows (at least one), so it follows discovery as workers come and go; 0 means
   uncapped.
2. ``admit_inference`` admits one inference request (a ModelInfer call, or one ModelStreamInfer
   message while it is in flight): past the cap it raises RESOURCE_EXHAUSTED and counts the
   shed request; ``release_inference`` ends it.
3. ``admit_call`` admits any other RPC (metadata, shared memory, fan-outs): never capped, but
   counted, so a drain waits for it too; ``release_call`` ends it.
4. ``start_drain`` stops admission for good: from then on every admit raises UNAVAILABLE
   ``gateway is shutting down`` (a client retries elsewhere), ``draining`` is true (``/readyz``
   turns 503 and ServerReady answers false), and ``drained`` waits until nothing admitted is
   left in flight, within a bound.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import anyio

from kserve_trio.core.errors import ResourceExhausted, Unavailable

SHUTTING_DOWN = "gateway is shutting down"


class Admission:
    """See the module docstring."""

    def __init__(
        self,
        per_worker: int,
        workers: Callable[[], int],
        *,
        on_shed: Callable[[], None] = lambda: None,
    ) -> None:
        self.per_worker = per_worker
        self._workers = workers
        self._on_shed = on_shed
        self.inflight = 0
        """Inference requests in flight (what the cap counts)."""
        self.calls = 0
        """Other admitted RPCs in flight."""
        self.shed = 0
        self.draining = False
        self.drain_started = anyio.Event()
        self._idle: anyio.Event | None = None

    @property
    def cap(self) -> int:
        """Rule 1 (0 = uncapped)."""
        if self.per_worker <= 0:
            return 0
        return self.per_worker * max(self._workers(), 1)

    def admit_inference(self) -> None:
        """Rule 2 (and 4)."""
        if self.draining:
            raise Unavailable(SHUTTING_DOWN)
        cap = self.cap
        if cap and self.inflight >= cap:
            self.shed += 1
            self._on_shed()
            raise ResourceExhausted(
                f"gateway is at its admission cap ({cap} requests in flight: "
                f"{self.per_worker} per worker x {max(self._workers(), 1)} workers)"
            )
        self.inflight += 1

    def release_inference(self) -> None:
        self.inflight -= 1
        self._check_idle()

    def admit_call(self) -> None:
        """Rule 3 (and 4)."""
        if self.draining:
            raise Unavailable(SHUTTING_DOWN)
        self.calls += 1

    def release_call(self) -> None:
        self.calls -= 1
        self._check_idle()

    @contextlib.contextmanager
    def inference(self) -> Iterator[None]:
        self.admit_inference()
        try:
            yield
        finally:
            self.release_inference()

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        self.admit_call()
        try:
            yield
        finally:
            self.release_call()

    @property
    def busy(self) -> int:
        return self.inflight + self.calls

    def start_drain(self) -> None:
        """Rule 4: refuse from now on."""
        if not self.draining:
            self.draining = True
            self.drain_started.set()

    async def drained(self, timeout: float) -> bool:
        """Wait until nothing admitted is in flight, at most ``timeout`` seconds; whether it
        got there."""
        with anyio.move_on_after(timeout):
            while self.busy > 0:
                self._idle = anyio.Event()
                await self._idle.wait()
        return self.busy == 0

    def _check_idle(self) -> None:
        if self._idle is not None and self.busy == 0:
            self._idle.set()


__all__ = ["SHUTTING_DOWN", "Admission"]

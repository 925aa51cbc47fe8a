"""Inbound admission and drain: how many requests a server (worker or gateway) takes, and how it
stops taking them.

``Admission`` is a small state machine on the server's event loop (no locks: its counters
change only between awaits). What differs between the worker and the gateway is the cap and
the wording of the refusals; the rules are these:

1. ``cap()`` is asked on every admission (0 = uncapped), so a cap that follows the number of
   workers (the gateway's) moves as they come and go.
2. ``admit_inference`` admits one inference request (a ModelInfer call, or one ModelStreamInfer
   message while it is in flight): at the cap it raises RESOURCE_EXHAUSTED with
   ``over_cap(cap)`` and counts the shed request (``shed``, ``on_shed``); ``release_inference``
   ends it.
3. ``admit_call`` admits any other RPC (metadata, shared memory, fan-outs): never capped, but
   counted, so a drain waits for it too; ``release_call`` ends it.
4. ``start_drain`` stops admission for good: from then on every admit raises UNAVAILABLE with
   the ``shutting_down`` message (a client retries elsewhere), ``draining`` is true (readiness
   turns false), and ``drained`` waits until nothing admitted is left in flight, within a bound.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import anyio

from kserve_trio.core.errors import ResourceExhausted, Unavailable


class Admission:
    """See the module docstring."""

    def __init__(
        self,
        cap: Callable[[], int],
        *,
        shutting_down: str,
        over_cap: Callable[[int], str],
        on_shed: Callable[[], None] = lambda: None,
    ) -> None:
        self._cap = cap
        self.shutting_down = shutting_down
        """The UNAVAILABLE message once draining (rule 4)."""
        self._over_cap = over_cap
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
        return self._cap()

    def admit_inference(self) -> None:
        """Rule 2 (and 4)."""
        if self.draining:
            raise Unavailable(self.shutting_down)
        cap = self._cap()
        if cap and self.inflight >= cap:
            self.shed += 1
            self._on_shed()
            raise ResourceExhausted(self._over_cap(cap))
        self.inflight += 1

    def release_inference(self) -> None:
        self.inflight -= 1
        self._check_idle()

    def admit_call(self) -> None:
        """Rule 3 (and 4)."""
        if self.draining:
            raise Unavailable(self.shutting_down)
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


__all__ = ["Admission"]

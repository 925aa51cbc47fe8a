"""Inbound admission and drain: how many requests a server (worker or gateway) takes, and how it
stops taking them.

``Admission`` is a small state machine on the server's event loop (no locks: its counters
change only between awaits). What differs between the worker and the gateway is the cap and
the wording of the refusals; the rules are these:

1. *Moving cap*: ``cap()`` is asked on every admission (0 = uncapped), so a cap that follows the
   number of workers (the gateway's) moves as they come and go.
2. *Shed at the cap*: ``admit_inference`` admits one inference request (a ModelInfer call, or one
   ModelStreamInfer message while it is in flight): at the cap it raises RESOURCE_EXHAUSTED with
   ``over_cap(cap)`` and counts the shed request (``shed``, ``on_shed``); ``release_inference`` ends
   it.
3. *Other calls*: ``admit_call`` admits any other RPC (metadata, shared memory, fan-outs): never
   capped, but counted, so a drain waits for it too; ``release_call`` ends it.
4. *Drain*: ``start_drain`` stops admission for good: from then on every admit raises UNAVAILABLE
   with the ``shutting_down`` message (a client retries elsewhere), ``draining`` is true (readiness
   turns false), and ``drained`` waits until nothing admitted is left in flight, within a bound.
5. *Streams wait*: ``wait_inference`` admits one message of a stream: at the cap it waits for a slot
   instead of refusing (the stream is backpressured: it reads nothing more meanwhile), so a stream's
   requests count against the same cap as unary ones and a stream is never failed for it.
6. *Bytes in flight*: ``bytes`` (``InflightBytes``) is the byte side of admission: the bytes of the
   request messages being received and queued in the whole process (``limits.max_inflight_bytes``).
   A message is charged as its bytes arrive (never as its length prefix or ``Content-Length``
   announces them: an announcement alone holds nothing) and given back when its request is done;
   past the cap a unary request is refused RESOURCE_EXHAUSTED and a stream's message waits. A
   request is always admitted when nothing but its own bytes is in flight, so one message up to the
   message cap always gets through.
7. *Connection share*: ``ConnectionShare`` is one connection's part of those bytes
   (``limits.max_inflight_bytes_per_connection``): the bytes of its messages still arriving
   (charged, not yet whole). So that a few connections cannot hold the whole budget by sending
   most of large messages and stopping, a connection at its share stops being read (it waits:
   backpressure, never an error) until:

   a. *back within the share*: its own arriving bytes drop back under the share (one of its messages
      is whole, or its call ended), or
   b. *the lane*: it takes the lane, one connection of the process at a time may go past its share,
      so a message larger than the share still arrives (the others wait for the lane to free, which
      it does when that connection is back within its share), and messages larger than the share on
      several connections never wait for each other for good.

   A message that is whole no longer counts in the share (the server's work holds it, not the
   client), only in *bytes in flight*. 0 turns the share off.
8. *Bounded queue*: ``queue_inference(deadline)`` admits a unary request that may wait (the
   gateway's): at the cap it waits for a slot while fewer than ``queue()`` requests wait already (0
   = none), else it is shed as at the cap (*shed at the cap*) with ``over_queue(cap, queue)``. A
   request whose deadline passes while it waits is DEADLINE_EXCEEDED; one cancelled while it waits
   leaves the queue.
9. *Arrival order*: waiters (*streams wait* and *bounded queue*) are served in arrival order: a
   freed slot goes to the oldest one, handed over directly (no herd of wake-ups, nobody overtakes),
   and a new request never takes a slot while someone waits. ``start_drain`` wakes them all with
   UNAVAILABLE.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator

import anyio

from kserve_trio.core.errors import DeadlineExceeded, ResourceExhausted, Unavailable

WAITED_TOO_LONG = "deadline exceeded waiting for an admission slot"


class _Waiter:
    """One request waiting for a slot (*arrival order*): ``granted`` once a slot is handed to it."""

    __slots__ = ("bounded", "event", "granted")

    def __init__(self, bounded: bool) -> None:
        self.event = anyio.Event()
        self.granted = False
        self.bounded = bounded


class InflightBytes:
    """*Bytes in flight*: the process's request bytes in flight against ``cap`` (0 = uncapped);
    *connection share*'s ``per_connection`` share (0 = none) and its lane."""

    def __init__(self, cap: int, per_connection: int = 0) -> None:
        self.cap = cap
        self.per_connection = per_connection
        self.lane: ConnectionShare | None = None
        """*The lane*: the one connection that may be past its share now."""
        self._turn: anyio.Event | None = None
        self.used = 0
        """Bytes charged now (the ``inflight_bytes`` gauge)."""
        self.refused = 0
        """Charges refused RESOURCE_EXHAUSTED."""
        self._room: anyio.Event | None = None

    def fits(self, n: int, own: int = 0) -> bool:
        """Whether ``n`` more bytes may be charged by a holder that has ``own`` charged."""
        return not self.cap or self.used + n <= self.cap or self.used <= own

    def charge(self, n: int, own: int = 0) -> None:
        """Charge ``n`` bytes now, or RESOURCE_EXHAUSTED (a unary request)."""
        if not self.fits(n, own):
            self.refused += 1
            raise ResourceExhausted(
                f"server is at its in-flight bytes cap ({self.used} of {self.cap} bytes of "
                f"requests in flight; this message needs {n})"
            )
        self.used += n

    async def charge_waiting(self, n: int, own: int = 0) -> None:
        """Charge ``n`` bytes once they fit (a stream's message: backpressure, not an error)."""
        while not self.fits(n, own):
            room = self._room
            if room is None:
                room = self._room = anyio.Event()
            await room.wait()
        self.used += n

    def release(self, n: int) -> None:
        """Give back ``n`` charged bytes (their request is done) and wake the waiters."""
        if n:
            self.used -= n
            room = self._room
            if room is not None:
                self._room = None
                room.set()

    def connection(self) -> ConnectionShare:
        """A new connection's share (*connection share*)."""
        return ConnectionShare(self)

    async def turn_moved(self) -> None:
        """Return at the next change of the connections' arriving bytes (*connection share*)."""
        turn = self._turn
        if turn is None:
            turn = self._turn = anyio.Event()
        await turn.wait()

    def wake_turn(self) -> None:
        turn = self._turn
        if turn is not None:
            self._turn = None
            turn.set()


class ConnectionShare:
    """*Connection share*: what one connection's messages still arriving hold of the bytes in
    flight."""

    __slots__ = ("arriving", "budget")

    def __init__(self, budget: InflightBytes) -> None:
        self.budget = budget
        self.arriving = 0
        """Bytes of this connection's messages charged and not yet whole."""

    def fits(self, n: int) -> bool:
        """Whether ``n`` more arriving bytes may be taken now: within the share, or past it
        with the lane (*the lane*; taken here when free)."""
        budget = self.budget
        share = budget.per_connection
        if not share or self.arriving + n <= share:
            return True
        lane = budget.lane
        if lane is None:
            budget.lane = self
            return True
        return lane is self

    async def wait(self, n: int) -> None:
        """Return once ``n`` more arriving bytes fit (*connection share*): the caller reads no more
        meanwhile."""
        while not self.fits(n):
            await self.budget.turn_moved()

    def add(self, n: int) -> None:
        """``n`` more bytes arrived and were charged (past the share: the lane, when free)."""
        self.arriving += n
        budget = self.budget
        if budget.lane is None and budget.per_connection and self.arriving > budget.per_connection:
            budget.lane = self

    def give(self, n: int) -> None:
        """``n`` arriving bytes are no longer arriving (their message is whole, or gone): the
        lane is given up once back within the share (*back within the share*), and the waiters look
        again."""
        self.arriving -= n
        budget = self.budget
        if budget.lane is self and self.arriving <= budget.per_connection:
            budget.lane = None
        budget.wake_turn()


class Admission:
    """See the module docstring."""

    def __init__(
        self,
        cap: Callable[[], int],
        *,
        shutting_down: str,
        over_cap: Callable[[int], str],
        on_shed: Callable[[], None] = lambda: None,
        max_inflight_bytes: int = 0,
        max_inflight_bytes_per_connection: int = 0,
        queue: Callable[[], int] = lambda: 0,
        over_queue: Callable[[int, int], str] | None = None,
    ) -> None:
        self._cap = cap
        self._queue = queue
        self._over_queue = over_queue or (lambda cap, queue: over_cap(cap))
        self._waiters: deque[_Waiter] = deque()
        self.waiting = 0
        """Requests waiting under *bounded queue* now (what the queue bound counts)."""
        self.shutting_down = shutting_down
        """The UNAVAILABLE message once draining (*drain*)."""
        self._over_cap = over_cap
        self._on_shed = on_shed
        self.inflight = 0
        """Inference requests in flight (what the cap counts)."""
        self.admitted = 0
        """Inference requests admitted since the start (the idle trim's activity,
        ``process_tuning.IdleTrim``: the other RPCs, a gateway's probes among them, do not
        count)."""
        self.calls = 0
        """Other admitted RPCs in flight."""
        self.shed = 0
        self.draining = False
        self.drain_started = anyio.Event()
        self._idle: anyio.Event | None = None
        self.bytes = InflightBytes(max_inflight_bytes, max_inflight_bytes_per_connection)
        """*Bytes in flight* and *connection share* (``limits.max_inflight_bytes``,
        ``..._per_connection``)."""

    @property
    def cap(self) -> int:
        """*Moving cap* (0 = uncapped)."""
        return self._cap()

    def _free_slot(self) -> bool:
        """Whether a request may take a slot now (after the waiters got theirs, *arrival order*)."""
        self._grant()
        cap = self._cap()
        return not cap or (self.inflight < cap and not self._waiters)

    def _take(self) -> None:
        self.inflight += 1
        self.admitted += 1

    def _refuse(self, message: str) -> ResourceExhausted:
        self.shed += 1
        self._on_shed()
        return ResourceExhausted(message)

    def admit_inference(self) -> None:
        """*Shed at the cap* (and *drain*)."""
        if self.draining:
            raise Unavailable(self.shutting_down)
        if not self._free_slot():
            raise self._refuse(self._over_cap(self._cap()))
        self._take()

    async def wait_inference(self) -> None:
        """*Streams wait* (and *drain*): a stream's message waits for a slot at the cap."""
        if self.draining:
            raise Unavailable(self.shutting_down)
        if self._free_slot():
            self._take()
            return
        await self._wait(_Waiter(bounded=False), None)

    async def queue_inference(self, deadline: float | None) -> None:
        """*Bounded queue* (and *drain*): ``deadline`` absolute on the ``anyio.current_time()``
        clock (``None``: none)."""
        if self.draining:
            raise Unavailable(self.shutting_down)
        if self._free_slot():
            self._take()
            return
        bound = self._queue()
        if self.waiting >= bound:
            raise self._refuse(self._over_queue(self._cap(), bound))
        await self._wait(_Waiter(bounded=True), deadline)

    async def _wait(self, waiter: _Waiter, deadline: float | None) -> None:
        """*Arrival order*: wait in line until a slot is handed over, the deadline passes (*bounded
        queue*) or the drain starts (*drain*)."""
        self._waiters.append(waiter)
        if waiter.bounded:
            self.waiting += 1
        try:
            with anyio.CancelScope(deadline=math.inf if deadline is None else deadline):
                await waiter.event.wait()
        except BaseException:
            if waiter.granted:  # cancelled as its slot came: the slot goes to the next one
                self.release_inference()
            raise
        finally:
            if waiter.bounded:
                self.waiting -= 1
            if not waiter.granted:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
        if not waiter.granted:
            if self.draining:
                raise Unavailable(self.shutting_down)
            raise DeadlineExceeded("", WAITED_TOO_LONG)

    def _grant(self) -> None:
        """Hand free slots to the oldest waiters (*arrival order*)."""
        waiters = self._waiters
        while waiters:
            cap = self._cap()
            if cap and self.inflight >= cap:
                return
            waiter = waiters.popleft()
            waiter.granted = True
            self._take()
            waiter.event.set()

    def release_inference(self) -> None:
        self.inflight -= 1
        self._grant()
        self._check_idle()

    def admit_call(self) -> None:
        """*Other calls* (and *drain*)."""
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

    @contextlib.asynccontextmanager
    async def queued(self, deadline: float | None) -> AsyncIterator[None]:
        """*Bounded queue* around a request, released when it is done."""
        await self.queue_inference(deadline)
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
        """*Drain*: refuse from now on."""
        if not self.draining:
            self.draining = True
            self.drain_started.set()
            waiters, self._waiters = self._waiters, deque()
            for waiter in waiters:
                waiter.event.set()

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


__all__ = ["WAITED_TOO_LONG", "Admission", "ConnectionShare", "InflightBytes"]

"""The wedge rule: the gateway is wedged when its own event loop stops making progress, and only
then. Workers that are frozen, unreachable or silent are the fleet's trouble, which the prober
reports (they stop being routable, their models answer UNAVAILABLE); restarting the gateway
would not bring them back, and it would drop every client connection for nothing.

A task on the loop (``LoopWatchdog.run``) counts beats; a daemon thread, which a stuck loop
cannot hold up, checks the count. The rules (``StallTracker.observe``, pure, called by the
thread with the monotonic time and the beat count):

1. *A beat ends the stall*: a check that finds a new beat ends any stall.
2. *The stall grows*: a check that finds no new beat adds the time since the previous check to the
   stall.
3. *A paused process*: a gap between two checks longer than half the limit means the whole process
   was not running (suspended with SIGSTOP, a paused VM, a starved host): the stall starts over,
   since the loop had no chance to beat either.
4. *Wedged*: when the stall reaches the limit the loop is wedged: the thread logs ``gateway_wedged``
   and ends the process with status 1 (nothing on a stuck loop can run a clean shutdown), so its
   supervisor restarts it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import anyio
import anyio.abc

from kserve_trio.core.logging import get_logger

MIN_LIMIT_SECONDS = 10.0
"""The shortest stall that counts as a wedge: a loaded host can hold a healthy loop up for
seconds (a large message copied, a garbage collection under memory pressure)."""

_log = get_logger(__name__)


def wedge_limit(rounds: int, interval: float) -> float:
    """The stall that is a wedge: ``rounds`` prober intervals, never under
    ``MIN_LIMIT_SECONDS``; 0 (``rounds`` 0) never."""
    if rounds <= 0:
        return 0.0
    return max(rounds * interval, MIN_LIMIT_SECONDS)


class StallTracker:
    """*A beat ends the stall*, *the stall grows* and *a paused process* of the module docstring;
    ``observe`` returns True when the loop is *wedged*."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.stalled = 0.0
        self._checked: float | None = None
        self._seen = -1

    def observe(self, now: float, beats: int) -> bool:
        previous, self._checked = self._checked, now
        if previous is None or beats != self._seen:
            self._seen = beats
            self.stalled = 0.0
            return False
        gap = now - previous
        if gap > self.limit / 2:
            self.stalled = 0.0
            return False
        self.stalled += gap
        return self.stalled >= self.limit


def exit_wedged(stalled: float) -> None:
    """What *wedged* does in a gateway process."""
    _log.error(
        "gateway_wedged",
        error=f"the gateway's event loop made no progress for {stalled:.1f}s",
    )
    os._exit(1)


class LoopWatchdog:
    """The beating task and the checking thread (see the module docstring)."""

    def __init__(
        self,
        limit: float,
        *,
        on_wedge: Callable[[float], None] = exit_wedged,
        period: float | None = None,
    ) -> None:
        self.limit = limit
        self.period = period if period is not None else min(1.0, limit / 10)
        self.beats = 0
        self._on_wedge = on_wedge

    def _check(self, stop: threading.Event) -> None:
        tracker = StallTracker(self.limit)
        tracker.observe(time.monotonic(), self.beats)
        while not stop.wait(self.period):
            if tracker.observe(time.monotonic(), self.beats):
                self._on_wedge(tracker.stalled)
                return

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Beat until cancelled, with the checking thread alive meanwhile (a limit of 0: no
        thread, nothing to check)."""
        if not self.limit > 0:
            task_status.started()
            await anyio.sleep_forever()
        stop = threading.Event()
        thread = threading.Thread(
            target=self._check, args=(stop,), name="gateway-watchdog", daemon=True
        )
        thread.start()
        try:
            task_status.started()
            while True:
                self.beats += 1
                await anyio.sleep(self.period)
        finally:
            stop.set()
            thread.join()


__all__ = ["MIN_LIMIT_SECONDS", "LoopWatchdog", "StallTracker", "exit_wedged", "wedge_limit"]

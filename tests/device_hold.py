"""Holding a running worker's device thread, so that requests queue behind it.

``hold_device(running)`` returns once the device thread runs the holding job, and the job ends
when the test calls ``release`` (or after ``seconds``, a bound for a test that fails before it
releases). The test decides when the device frees up, after it has seen what it waits for
(requests queued, a request cancelled): never a hold of a fixed length that a loaded machine
can outlast before the test has done its part.
"""

from __future__ import annotations

import threading

import anyio.from_thread

HOLD_BOUND_SECONDS = 60.0


class DeviceHold(threading.Thread):
    """The holding job's thread; ``on_device`` is set once the device thread runs it."""

    def __init__(self, running, seconds: float = HOLD_BOUND_SECONDS) -> None:
        super().__init__(daemon=True)
        self.running, self.seconds = running, seconds
        self.on_device, self.released = threading.Event(), threading.Event()

    def _hold(self) -> None:
        self.on_device.set()
        self.released.wait(self.seconds)

    def run(self) -> None:
        anyio.from_thread.run(
            self.running.scheduler.run_on_device, self._hold, token=self.running._portal
        )

    def release(self) -> None:
        """Let the device thread go and wait until the holding job has ended."""
        self.released.set()
        self.join(30)
        assert not self.is_alive(), "the device thread never ended the holding job"


def hold_device(running, seconds: float = HOLD_BOUND_SECONDS) -> DeviceHold:
    """Hold ``running``'s device thread until ``release`` (``seconds`` at most)."""
    hold = DeviceHold(running, seconds)
    hold.start()
    assert hold.on_device.wait(30), "the device thread never took the holding job"
    return hold


__all__ = ["HOLD_BOUND_SECONDS", "DeviceHold", "hold_device"]

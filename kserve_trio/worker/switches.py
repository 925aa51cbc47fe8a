"""The worker's A/B switches: the environment variables that change how the request path runs,
in one place.

Each is kept because its alternative is worth measuring again on another machine (a device
machine, more cores) side by side with the default: ``tools/bench/peers.py --variant
LABEL:VAR=VALUE`` starts a worker with it. None is configuration: the defaults are what the
measurements in docs/benchmarks/history.md chose, and a value that cannot be read is logged
and ignored.
They are read when a scheduler is built (``HotPathSwitches.from_environment``).
"""

from __future__ import annotations

import dataclasses
import os

from kserve_trio.core.logging import get_logger

log = get_logger("kserve_trio.worker.switches")

INLINE_ENV = "KSERVE_TRIO_INLINE_EXEC_US"
"""The direct lane's bound: a request that finds the dispatch loop idle runs at once in its own
task, on the event loop's thread, when its batch's fastest execution seen is at most this many
microseconds (``DispatchLoop.serve_directly``); 0 sends every batch through the loop to the
device thread."""
INLINE_DEFAULT_US = 200.0

HANDBACK_ENV = "KSERVE_TRIO_DEVICE_HANDBACK"
"""How the device thread hands a finished job back to the event loop: ``post`` (queue the
result and wake the loop, without waiting) or ``block`` (wait until the loop has run the
wake-up, as ``anyio.from_thread.run_sync`` does)."""
HANDBACKS = ("post", "block")
HANDBACK_DEFAULT = "post"

COALESCE_ENV = "KSERVE_TRIO_COALESCE_YIELDS"
"""How many times the dispatch loop yields to the event loop before planning a batch that is
not full, so requests already read but still being decoded join it; 0 plans at once."""


@dataclasses.dataclass(frozen=True, slots=True)
class HotPathSwitches:
    """What the switches say; the dispatch loop and the device thread take this, not the
    environment, so a test sets them directly."""

    inline_seconds: float = INLINE_DEFAULT_US / 1e6
    handback: str = HANDBACK_DEFAULT
    coalesce_yields: int = 0

    @classmethod
    def from_environment(cls) -> HotPathSwitches:
        inline_us = _number(INLINE_ENV, INLINE_DEFAULT_US)
        coalesce = int(_number(COALESCE_ENV, 0))
        handback = os.environ.get(HANDBACK_ENV, HANDBACK_DEFAULT)
        if handback not in HANDBACKS:
            log.warning("bad_environment_value", variable=HANDBACK_ENV, value=handback)
            handback = HANDBACK_DEFAULT
        return cls(inline_seconds=inline_us / 1e6, handback=handback, coalesce_yields=coalesce)


def _number(name: str, default: float) -> float:
    """A non-negative number from the environment, ``default`` when unset or unreadable."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return max(0.0, float(raw))
    except ValueError:
        log.warning("bad_environment_value", variable=name, value=raw)
        return default


__all__ = [
    "COALESCE_ENV",
    "HANDBACKS",
    "HANDBACK_DEFAULT",
    "HANDBACK_ENV",
    "INLINE_DEFAULT_US",
    "INLINE_ENV",
    "HotPathSwitches",
]

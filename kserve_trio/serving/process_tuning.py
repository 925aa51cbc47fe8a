"""Process-wide memory-allocator policy for a server process (Linux/glibc): keep the heap warm
while requests flow, give it back once they stop.

XLA:CPU allocates a fresh buffer for every execution's outputs (and for unaligned inputs). glibc
serves allocations above 32 MiB with a new ``mmap`` and returns them with ``munmap`` on free, so
every large tensor pays a first-touch page fault per 4 KiB page, every time, and those faults
dominate a large execution (docs/benchmarks/history.md, "Hot path"). Serving large blocks from the
heap instead (``M_MMAP_MAX=0``) and not trimming freed heap memory back to the kernel
(``M_TRIM_THRESHOLD``) lets them be reused warm. The cost is that freed memory stays with the
process at its high-water mark, which after a burst or an attack is far above what it needs.

So the idle trim (``run_idle_trim``, started by the worker, each front end and each gateway
process) gives the freed heap back with ``malloc_trim(0)`` once the process has served nothing
for ``IDLE_SECONDS`` (rules in ``IdleTrim``): never while requests flow, so the hot path keeps
its warm heap, and at most once per quiet period. Knowing "nothing was served" costs the
request path one integer increment (the caller's count of admitted requests); the trim runs
in a worker thread, off the event loop.

``tune_allocator`` is applied by the worker and gateway CLIs at start-up;
``KSERVE_TRIO_MALLOC_TUNING=0`` turns both the tuning and the idle trim off. Embedding
programs call ``tune_allocator()`` themselves if they want it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
import time
from collections.abc import Callable

import anyio

from kserve_trio.core.logging import get_logger

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD_BYTES = 1 << 40  # effectively never trim

IDLE_SECONDS = 5.0
"""Quiet time before the freed heap goes back: longer than the pauses inside a burst, so a
burst does not page its heap in again after each pause."""
TICK_SECONDS = 1.0
"""How often the idle trim reads the served count and the resident size."""
REGROWTH_BYTES = 32 << 20
"""Resident growth that counts as activity though nothing was served: an attack refused
before admission (a decompression bomb, stalled messages) grows the heap without a request."""

_log = get_logger("kserve_trio.serving.process_tuning")


def tuning_enabled(env=os.environ) -> bool:
    value = env.get("KSERVE_TRIO_MALLOC_TUNING", "1").strip().lower()
    return value not in ("0", "false", "no", "off")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    path = ctypes.util.find_library("c")
    if not path:
        return None
    try:
        return ctypes.CDLL(path)
    except OSError:
        return None


def tune_allocator() -> bool:
    """Apply the glibc settings above; returns whether they took effect (False off Linux/glibc)."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_MMAP_MAX, 0) == 1
    ok = mallopt(M_TRIM_THRESHOLD, min(TRIM_THRESHOLD_BYTES, 2**31 - 1)) == 1 and ok
    return ok


def malloc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)`` (returns every free page of every arena to the kernel), or
    None where there is none (another C library, another system)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return functools.partial(trim, 0)


def resident_bytes() -> int:
    """This process's resident set now (0 where ``/proc`` does not say)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class IdleTrim:
    """When a server process gives its freed heap back: the rules ``run_idle_trim`` applies
    once a tick.

    ``served`` is the process's count of admitted requests (it only grows), ``resident`` its
    resident bytes. ``due`` answers whether to trim now:

    1. *Activity*: a change of ``served`` since the last tick, or ``resident`` more than
       ``regrowth_bytes`` above the mark (the mark then moves up to it). Activity restarts the
       quiet time and arms a trim. The process starts armed (start-up's own allocations).
    2. *One trim per quiet period*: an armed trim is due once ``idle_seconds`` have passed with no
       activity, and ``due`` disarms it: one trim per quiet period, none while requests flow.
    3. *The mark*: ``trimmed`` (after the trim) sets the mark to the resident size then.
    """

    def __init__(
        self,
        served: Callable[[], int],
        *,
        clock: Callable[[], float] = time.monotonic,
        resident: Callable[[], int] = resident_bytes,
        idle_seconds: float = IDLE_SECONDS,
        regrowth_bytes: int = REGROWTH_BYTES,
    ) -> None:
        self._served = served
        self._clock = clock
        self._resident = resident
        self.idle_seconds = idle_seconds
        self.regrowth_bytes = regrowth_bytes
        self._count = served()
        self._mark = resident()
        self._quiet_since = clock()
        self.armed = True

    def due(self) -> bool:
        """*Activity* and *one trim per quiet period*, at one tick."""
        now = self._clock()
        count = self._served()
        active = count != self._count
        self._count = count
        rss = self._resident()
        if rss > self._mark + self.regrowth_bytes:
            self._mark = rss
            active = True
        if active:
            self._quiet_since = now
            self.armed = True
            return False
        if self.armed and now - self._quiet_since >= self.idle_seconds:
            self.armed = False
            return True
        return False

    def trimmed(self) -> None:
        """*The mark*."""
        self._mark = self._resident()


async def run_idle_trim(
    served: Callable[[], int],
    *,
    trim: Callable[[], object] | None = None,
    resident: Callable[[], int] = resident_bytes,
    tick_seconds: float = TICK_SECONDS,
) -> None:
    """Trim the heap once per quiet period (``IdleTrim`` over ``served``) until cancelled.
    ``trim`` defaults to ``malloc_trim`` when ``tuning_enabled``; with none, this returns at
    once."""
    if trim is None:
        trim = malloc_trim() if tuning_enabled() else None
        if trim is None:
            return
    rules = IdleTrim(served, clock=anyio.current_time, resident=resident)
    while True:
        await anyio.sleep(tick_seconds)
        if rules.due():
            before = resident()
            await anyio.to_thread.run_sync(trim)
            rules.trimmed()
            _log.debug("heap_trimmed", resident_before=before, resident_after=resident())


__all__ = [
    "IDLE_SECONDS",
    "IdleTrim",
    "malloc_trim",
    "resident_bytes",
    "run_idle_trim",
    "tune_allocator",
    "tuning_enabled",
]

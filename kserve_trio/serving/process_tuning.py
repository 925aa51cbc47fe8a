"""Process-wide memory-allocator tuning for a server process (Linux/glibc).

XLA:CPU allocates a fresh buffer for every execution's outputs (and for unaligned inputs).
glibc serves allocations above 32 MiB with a new ``mmap`` and returns them with ``munmap`` on
free, so every large tensor pays a first-touch page fault per 4 KiB page, every time, and
those faults dominate a large execution (docs/benchmarks.md). Serving large blocks from the
heap instead (``M_MMAP_MAX=0``) and not trimming freed heap memory back to the kernel
(``M_TRIM_THRESHOLD``) lets them be reused warm. The cost is that freed memory stays with the process at its high-water mark,
the usual trade of a long-running server (jemalloc/tcmalloc behave alike).

Applied by the worker CLI at start-up; ``KSERVE_TRIO_MALLOC_TUNING=0`` turns it off. Embedding
programs call ``tune_allocator()`` themselves if they want it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_THRESHOLD_BYTES = 1 << 40  # effectively never trim


def tuning_enabled(env=os.environ) -> bool:
    value = env.get("KSERVE_TRIO_MALLOC_TUNING", "1").strip().lower()
    return value not in ("0", "false", "no", "off")


def tune_allocator() -> bool:
    """Apply the glibc settings above; returns whether they took effect (False off Linux/glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    path = ctypes.util.find_library("c")
    if not path:
        return False
    try:
        libc = ctypes.CDLL(path)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_MMAP_MAX, 0) == 1
    ok = mallopt(M_TRIM_THRESHOLD, min(TRIM_THRESHOLD_BYTES, 2**31 - 1)) == 1 and ok
    return ok


__all__ = ["tune_allocator", "tuning_enabled"]

"""The clean-run rule every A/B benchmark here applies: measure what else used the machine.

A figure counts only from a quiet machine. Per measured point a script samples, at the start and
the end of its window, the machine's busy CPU time (``/proc/stat``) and the CPU time of the
processes under test and of the load generator; what is left is what every *other* process used
(``others_cores``: cores' worth over the window). A point where others used more than
``NOISY_CORES`` is measured again, up to ``RETRIES`` times, and reported as noisy if it stays so
(``clean_point``). The load average is recorded with it.
"""

from __future__ import annotations

import os
import pathlib
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")

CLK_TCK = os.sysconf("SC_CLK_TCK")
NOISY_CORES = 0.10
RETRIES = 2


def machine_busy_seconds() -> float:
    """CPU seconds every core of the machine has spent busy so far."""
    head = pathlib.Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    fields = [int(x) for x in head]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / CLK_TCK


def load_average() -> float:
    return float(pathlib.Path("/proc/loadavg").read_text().split()[0])


def _descendants(pid: int) -> list[int]:
    out = [pid]
    for task in pathlib.Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            for child in task.read_text().split():
                out.extend(_descendants(int(child)))
        except OSError:
            pass
    return out


def cpu_seconds(pid: int) -> float:
    """utime+stime of ``pid`` and every live descendant."""
    total = 0
    for p in _descendants(pid):
        try:
            fields = pathlib.Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


class Window:
    """One measured window: ``start()`` and ``stop()`` around it; ``others_cores`` after.

    ``pids`` are the processes under test and the load generator (their CPU is not "others");
    ``own_seconds`` is how much of the machine's busy time the calling process used itself when
    it is the load generator (pass ``include_self=True``).
    """

    def __init__(self, pids: Iterable[int], *, include_self: bool = False) -> None:
        self.pids = list(pids)
        if include_self:
            self.pids.append(os.getpid())
        self._t0 = self._busy0 = 0.0
        self._cpu0: list[float] = []
        self.others_cores = 0.0
        self.load = 0.0

    def start(self) -> None:
        self._t0, self._busy0 = time.monotonic(), machine_busy_seconds()
        self._cpu0 = [cpu_seconds(p) for p in self.pids]

    def stop(self) -> None:
        cpu1 = [cpu_seconds(p) for p in self.pids]
        t1, busy1 = time.monotonic(), machine_busy_seconds()
        used = sum(b - a for a, b in zip(self._cpu0, cpu1, strict=True))
        others = (busy1 - self._busy0) - used
        self.others_cores = round(max(0.0, others) / max(t1 - self._t0, 1e-9), 3)
        self.load = load_average()

    def record(self, result: dict[str, Any]) -> dict[str, Any]:
        result["others_cores"] = self.others_cores
        result["load"] = self.load
        return result


def clean_point(measure: Callable[[], dict[str, Any]], label: str = "") -> dict[str, Any]:
    """``measure()`` (which returns a dict with ``others_cores``) again while it is noisy."""
    result: dict[str, Any] = {}
    for _ in range(RETRIES + 1):
        result = measure()
        if result.get("others_cores", 0.0) <= NOISY_CORES:
            return result
        print(
            f"  noisy{' ' + label if label else ''}: others used {result['others_cores']} cores "
            f"(load {result.get('load')}), measuring again",
            flush=True,
        )
    result["noisy"] = True
    return result


def read_window(lines: Iterable[str], sample: Callable[[], T]) -> tuple[dict | None, T, T]:
    """Read a load generator's output (``raw_load.py``: ``WINDOW_START``, ``WINDOW_END``, then
    its JSON result line), taking ``sample()`` at the two window marks; the result (None when
    the generator printed none) and the two samples. Raises when a mark never came."""
    import json

    s0 = s1 = None
    result = None
    for line in lines:
        if line.startswith("WINDOW_START"):
            s0 = sample()
        elif line.startswith("WINDOW_END"):
            s1 = sample()
        elif line.startswith("{"):
            result = json.loads(line)
    if s0 is None or s1 is None:
        raise RuntimeError("the load generator printed no measuring window")
    return result, s0, s1


__all__ = [
    "NOISY_CORES",
    "RETRIES",
    "Window",
    "clean_point",
    "cpu_seconds",
    "load_average",
    "machine_busy_seconds",
    "read_window",
]

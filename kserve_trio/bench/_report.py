"""The load generator's pure pieces: its configuration, latency statistics and the report.

Nothing here does I/O: a ``Window`` collects what one concurrency level measured, ``report``
turns windows into the JSON report and ``table`` into the plain-text table.
"""

from __future__ import annotations

import argparse
import os
import platform
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# --------------------------------------------------------------------------------------------
# Pure pieces: configuration, statistics, the report


@dataclass(frozen=True)
class BenchConfig:
    url: str
    model: str
    concurrency: tuple[int, ...] = (1, 8, 32)
    duration: float = 10.0
    warmup: float = 1.0
    rate: float | None = None
    transport: str = "inline"
    batch: int = 1
    deadline: float = 10.0
    client: str = "kserve_trio"
    progress: bool = True
    http2_engine: str | None = None
    """The kserve_trio client's HTTP/2 engine (None: its default)."""


def parse_concurrency(text: str) -> tuple[int, ...]:
    """``"1,8,32"`` -> ``(1, 8, 32)``; each level a positive integer."""
    try:
        levels = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--concurrency {text!r}: expected e.g. 1,8,32") from None
    if not levels or any(c < 1 for c in levels):
        raise argparse.ArgumentTypeError(f"--concurrency {text!r}: levels must be >= 1")
    return levels


def percentiles(samples_s: list[float]) -> dict[str, float]:
    """Latency summary in milliseconds (linear-interpolation percentiles); zeros when empty."""
    if not samples_s:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0, "max": 0.0}
    ms = np.asarray(samples_s) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {
        "p50": round(float(p50), 3),
        "p90": round(float(p90), 3),
        "p99": round(float(p99), 3),
        "mean": round(float(ms.mean()), 3),
        "max": round(float(ms.max()), 3),
    }


@dataclass
class Window:
    """What one concurrency level measured."""

    concurrency: int
    latencies: list[float] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    late: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0

    def summary(self, batch: int) -> dict[str, Any]:
        ok = len(self.latencies)
        total = ok + sum(self.errors.values())
        secs = self.seconds or float("nan")
        return {
            "concurrency": self.concurrency,
            "seconds": round(self.seconds, 3),
            "requests": total,
            "ok": ok,
            "items": ok * batch,
            "requests_per_s": round(ok / secs, 2) if self.seconds else 0.0,
            "items_per_s": round(ok * batch / secs, 2) if self.seconds else 0.0,
            "latency_ms": percentiles(self.latencies),
            "errors": dict(sorted(self.errors.items())),
            "late": self.late,
            "cpu_seconds": round(self.cpu_seconds, 4),
            "cpu_per_request_us": round(self.cpu_seconds / total * 1e6, 1) if total else 0.0,
        }


def status_name(exc: BaseException) -> str:
    """The bucket an error is counted in: its gRPC status name when it has one."""
    status = getattr(exc, "status", None)
    if status is not None and not callable(status):
        return getattr(status, "name", str(status))
    if callable(status):  # tritonclient's InferenceServerException.status()
        text = str(status() or "")
        return text.rsplit(".", 1)[-1] or type(exc).__name__
    if type(exc).__name__ == "PoolAcquireTimeout":
        return "POOL_ACQUIRE_TIMEOUT"
    return type(exc).__name__


def progress_line(cfg: BenchConfig, w: Window, elapsed: float) -> str:
    lat = percentiles(w.latencies[-2000:])
    rps = len(w.latencies) / elapsed if elapsed > 0 else 0.0
    errs = sum(w.errors.values())
    return (
        f"[c={w.concurrency} {cfg.transport} {cfg.client}] {elapsed:5.1f}/{cfg.duration:g}s "
        f"{len(w.latencies):7d} ok {rps:8.1f} req/s  p50 {lat['p50']:.2f} ms  "
        f"p99 {lat['p99']:.2f} ms  errors {errs}"
    )


def report(cfg: BenchConfig, windows: list[Window]) -> dict[str, Any]:
    return {
        "url": cfg.url,
        "model": cfg.model,
        "client": cfg.client,
        "transport": cfg.transport,
        "batch": cfg.batch,
        "mode": f"fixed rate {cfg.rate:g}/s" if cfg.rate else "closed loop",
        "duration_s": cfg.duration,
        "warmup_s": cfg.warmup,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "levels": [w.summary(cfg.batch) for w in windows],
    }


def table(rep: dict[str, Any]) -> str:
    """The report as a plain-text table."""
    head = (
        f"{rep['model']} via {rep['client']} ({rep['transport']}, batch {rep['batch']}, "
        f"{rep['mode']})"
    )
    lines = [
        head,
        f"{'conc':>5} {'req/s':>10} {'items/s':>10} {'p50 ms':>8} {'p90 ms':>8} "
        f"{'p99 ms':>8} {'cpu/req us':>10}  errors",
    ]
    for lv in rep["levels"]:
        lat = lv["latency_ms"]
        errs = ", ".join(f"{k}={v}" for k, v in lv["errors"].items()) or "-"
        lines.append(
            f"{lv['concurrency']:>5} {lv['requests_per_s']:>10.1f} {lv['items_per_s']:>10.1f} "
            f"{lat['p50']:>8.2f} {lat['p90']:>8.2f} {lat['p99']:>8.2f} "
            f"{lv['cpu_per_request_us']:>10.1f}  {errs}"
        )
    return "\n".join(lines)


__all__ = [
    "BenchConfig",
    "Window",
    "parse_concurrency",
    "percentiles",
    "progress_line",
    "report",
    "status_name",
    "table",
]

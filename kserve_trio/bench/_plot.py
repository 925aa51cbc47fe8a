"""The load generator's chart: latency percentiles against concurrency, drawn with matplotlib.

matplotlib comes from the ``plot`` extra (``pip install 'kserve_trio[plot]'``); it is imported
only when a chart is asked for, so the load generator itself runs without it. The figure is
rendered with the non-interactive Agg backend (no display needed) at 720 x 440 pixels.
"""

from __future__ import annotations

from typing import Any

WIDTH_PX, HEIGHT_PX, DPI = 720, 440, 100
SERIES = ("p50", "p90", "p99")


class PlotUnavailable(RuntimeError):
    """``--plot`` was asked for but matplotlib (the ``plot`` extra) is not installed."""


def latency_series(rep: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """Per percentile, the ``(concurrency, latency ms)`` points of a report (pure)."""
    return {
        name: [(lv["concurrency"], lv["latency_ms"][name]) for lv in rep["levels"]]
        for name in SERIES
    }


def plot_latency(rep: dict[str, Any], path: str) -> None:
    """Write the report's latency percentiles against concurrency to ``path`` as a PNG."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'kserve_trio[plot]'") from None
    # A bare Figure (no pyplot) renders with Agg and keeps no global figure state.
    fig = Figure(figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI)
    ax = fig.add_subplot()
    for name, points in latency_series(rep).items():
        xs = [x for x, _ in points]
        ys = [y for _, y in points]
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("latency (ms)")
    ax.set_title(f"{rep['model']} {rep['client']} {rep['transport']} batch {rep['batch']}")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.savefig(path, format="png", dpi=DPI)


__all__ = ["PlotUnavailable", "latency_series", "plot_latency"]

"""The load generator behind ``python -m kserve_trio bench``.

For each concurrency level it warms up, then measures for ``--duration`` seconds, either as a
closed loop (each of ``C`` tasks sends the next request as soon as the previous one returns) or
at a fixed rate (``--rate R`` starts requests on a schedule with at most ``C`` in flight; latency
counts from the scheduled start, so a server that falls behind shows in the tail). The load comes
from our client (``infer_async`` over a staging-pool slot, inline or through shared memory) or
from ``tritonclient.grpc.aio`` for comparison. The report holds requests/s, items/s, latency
percentiles, errors by status and the client's CPU time per request; ``--plot`` draws the
latency percentiles with matplotlib (the ``plot`` extra).

It lives outside ``kserve_trio.client`` so that a program that imports the client pulls in no
load generator.
"""

from __future__ import annotations

from kserve_trio.bench._cli import configure_parser, run
from kserve_trio.bench._drive import run_bench, synth_inputs
from kserve_trio.bench._plot import PlotUnavailable, latency_series, plot_latency
from kserve_trio.bench._report import (
    BenchConfig,
    Window,
    parse_concurrency,
    percentiles,
    report,
    status_name,
    table,
)

__all__ = [
    "BenchConfig",
    "PlotUnavailable",
    "Window",
    "configure_parser",
    "latency_series",
    "parse_concurrency",
    "percentiles",
    "plot_latency",
    "report",
    "run",
    "run_bench",
    "status_name",
    "synth_inputs",
    "table",
]

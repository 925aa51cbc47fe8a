"""``python -m kserve_trio bench``: the command line of the load generator."""

from __future__ import annotations

import argparse
import json
import sys

from kserve_trio.bench._drive import run_bench
from kserve_trio.bench._plot import PlotUnavailable, plot_latency
from kserve_trio.bench._report import BenchConfig, parse_concurrency, table
from kserve_trio.core.logging import configure_logging
from kserve_trio.http2 import ENGINES

# --------------------------------------------------------------------------------------------
# Command line


def configure_parser(parser: argparse.ArgumentParser):
    """Add the bench flags to ``parser``; returns the runner."""
    parser.add_argument(
        "--url", required=True, help="server address, host:port or grpc://host:port"
    )
    parser.add_argument("--model", required=True, help="model name")
    parser.add_argument(
        "--concurrency",
        type=parse_concurrency,
        default=(1, 8, 32),
        help="comma-separated in-flight levels (default 1,8,32)",
    )
    parser.add_argument(
        "--duration", type=float, default=10.0, help="seconds per level (default 10)"
    )
    parser.add_argument(
        "--warmup", type=float, default=1.0, help="warm-up seconds per level (default 1)"
    )
    parser.add_argument(
        "--rate", type=float, help="fixed rate in requests/s (default: closed loop)"
    )
    parser.add_argument(
        "--transport",
        choices=["inline", "shm"],
        default="inline",
        help="request path (default inline)",
    )
    parser.add_argument("--batch", type=int, default=1, help="items per request (default 1)")
    parser.add_argument("--deadline", type=float, default=10.0, help="per-request deadline in s")
    parser.add_argument(
        "--client",
        choices=["kserve_trio", "tritonclient"],
        default="kserve_trio",
        help="client library generating the load (default kserve_trio)",
    )
    parser.add_argument(
        "--http2-engine",
        choices=ENGINES,
        help="the kserve_trio client's HTTP/2 engine (default: KSERVE_TRIO_CLIENT_HTTP2_ENGINE "
        "or ngh2)",
    )
    parser.add_argument("--json", metavar="FILE", help="write the JSON report here")
    parser.add_argument(
        "--plot",
        metavar="FILE",
        help="write a PNG of latency vs concurrency (needs the plot extra: matplotlib)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no live progress line")
    parser.add_argument("--log-level", default="warning", help="client log level (default warning)")
    return run


def run(args: argparse.Namespace) -> int:
    configure_logging("auto", args.log_level)
    if args.batch < 1:
        print("error: --batch must be >= 1", file=sys.stderr)
        return 2
    if args.duration <= 0 or (args.rate is not None and args.rate <= 0):
        print("error: --duration and --rate must be > 0", file=sys.stderr)
        return 2
    cfg = BenchConfig(
        url=args.url,
        model=args.model,
        concurrency=tuple(args.concurrency),
        duration=args.duration,
        warmup=max(0.0, args.warmup),
        rate=args.rate,
        transport=args.transport,
        batch=args.batch,
        deadline=args.deadline,
        client=args.client,
        progress=not args.no_progress,
        http2_engine=args.http2_engine,
    )
    try:
        rep = run_bench(cfg)
    except Exception as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(table(rep))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rep, f, indent=2)
            f.write("\n")
    if args.plot:
        try:
            plot_latency(rep, args.plot)
        except PlotUnavailable as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    failed = sum(sum(lv["errors"].values()) for lv in rep["levels"])
    return 1 if failed else 0


__all__ = ["configure_parser", "run"]

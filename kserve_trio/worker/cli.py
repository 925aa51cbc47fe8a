"""``python -m kserve_trio worker``: serve a model repository from the command line.

With no arguments it serves ``./models`` on 127.0.0.1:8001. Precedence: defaults < node file <
``INFERENCE_SERVER_*`` environment < these flags.
"""

from __future__ import annotations

import argparse
import sys

from kserve_trio.core.process import ENV_PREFIX, add_tracing_flags, tracing_overrides
from kserve_trio.serving.background import (
    add_event_loop_flags,
    add_http2_engine_flag,
    event_loop_from_args,
)


def configure_parser(parser: argparse.ArgumentParser):
    """Add the worker's flags to ``parser``; returns the runner."""
    parser.add_argument(
        "--node", metavar="FILE", help="node file (node.yaml) to resolve the worker from"
    )
    parser.add_argument("--worker", metavar="NAME", help="worker entry of the node file to serve")
    parser.add_argument(
        "--model-repo",
        metavar="DIR",
        action="append",
        help="model repository (repeatable; default ./models)",
    )
    parser.add_argument("--host", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="gRPC port (default 8001; 0 = ephemeral)")
    parser.add_argument(
        "--metrics-port", type=int, help="Prometheus /metrics, /healthz, /readyz port (0 = off)"
    )
    parser.add_argument(
        "--http-port", type=int, help="KServe V2 HTTP/REST port (0 = off; docs/rest.md)"
    )
    parser.add_argument(
        "--model-control-mode",
        choices=["static", "dynamic", "explicit"],
        help="model lifecycle mode",
    )
    parser.add_argument(
        "--log-format",
        choices=["json", "console"],
        help="log rendering (default: console on a TTY)",
    )
    parser.add_argument(
        "--log-level", default="info", help="debug|info|warning|error (default info)"
    )
    parser.add_argument(
        "--restricted-protocol",
        metavar="GROUPS:KEY=VALUE",
        action="append",
        help="require header KEY=VALUE on the RPC groups GROUPS (comma-separated: health, "
        "metadata, inference, shared-memory, model-config, model-repository, statistics, "
        "trace, logging, control), gRPC and REST; repeatable (endpoints.restricted_protocols)",
    )
    parser.add_argument(
        "--frontend-processes",
        type=int,
        metavar="N",
        help="serve the gRPC and REST ports from N front-end processes in front of this one, "
        "which keeps the device (default 1: this process serves them; "
        "endpoints.frontend_processes)",
    )
    parser.add_argument(
        "--client-shared-memory",
        action=argparse.BooleanOptionalAction,
        help="serve the system shared-memory RPCs (default on); --no-client-shared-memory "
        "answers them UNAVAILABLE and clients send tensors inline "
        "(endpoints.client_shared_memory)",
    )
    parser.add_argument(
        "--client-shared-memory-prefix",
        metavar="PREFIX",
        action="append",
        help="allow only shared-memory keys starting with PREFIX; repeatable "
        "(endpoints.client_shared_memory_prefixes; default: any key but the server's own)",
    )
    add_event_loop_flags(parser, "endpoints.event_loop, env INFERENCE_SERVER_ENDPOINTS_EVENT_LOOP")
    add_http2_engine_flag(
        parser, "endpoints.http2_engine, env INFERENCE_SERVER_ENDPOINTS_HTTP2_ENGINE"
    )
    add_tracing_flags(parser, ENV_PREFIX)
    return run


def overrides_from_args(args: argparse.Namespace) -> dict:
    """CLI flags as a raw config dict in YAML shape (the last precedence layer)."""
    raw: dict = {}
    if args.model_repo:
        raw["model_dirs"] = list(args.model_repo)
    if args.model_control_mode:
        raw["model_control_mode"] = args.model_control_mode
    endpoints = {}
    if args.host is not None:
        endpoints["host"] = args.host
    if args.port is not None:
        endpoints["port"] = args.port
    if args.metrics_port is not None:
        endpoints["metrics_port"] = args.metrics_port
    if getattr(args, "http_port", None) is not None:
        endpoints["http_port"] = args.http_port
    event_loop = event_loop_from_args(args)
    if event_loop is not None:
        endpoints["event_loop"] = event_loop
    if getattr(args, "frontend_processes", None) is not None:
        endpoints["frontend_processes"] = args.frontend_processes
    if getattr(args, "http2_engine", None) is not None:
        endpoints["http2_engine"] = args.http2_engine
    if getattr(args, "restricted_protocol", None):
        endpoints["restricted_protocols"] = list(args.restricted_protocol)
    if getattr(args, "client_shared_memory", None) is not None:
        endpoints["client_shared_memory"] = args.client_shared_memory
    if getattr(args, "client_shared_memory_prefix", None):
        endpoints["client_shared_memory_prefixes"] = list(args.client_shared_memory_prefix)
    if endpoints:
        raw["endpoints"] = endpoints
    tracing = tracing_overrides(args)
    if tracing:
        raw["tracing"] = tracing
    return raw


def run(args: argparse.Namespace) -> int:
    from kserve_trio.core.errors import BundleError, ConfigError
    from kserve_trio.core.logging import configure_logging, get_logger

    configure_logging(args.log_format or "auto", args.log_level)
    from kserve_trio.serving.process_tuning import tune_allocator, tuning_enabled

    if tuning_enabled():
        tune_allocator()
    from kserve_trio.serving.fd_budget import raise_open_file_limit

    raise_open_file_limit()  # before the descriptor budget is split from it
    log = get_logger("kserve_trio.worker")
    from kserve_trio.worker.server import serve

    try:
        serve(args.node, args.worker, blocking=True, **overrides_from_args(args))
    except (ConfigError, BundleError) as exc:
        log.error("startup_failed", error=str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (OSError, BaseExceptionGroup) as exc:
        bind = listen_failure(exc)
        if bind is None:
            raise
        log.error("startup_failed", error=str(bind))  # a port that cannot be bound
        print(f"error: cannot serve: {bind}", file=sys.stderr)
        return 2
    return 0


def listen_failure(exc: BaseException) -> OSError | None:
    """The ``ListenError`` a failed start comes down to (a port taken, an address not local),
    also when the task tree wrapped it in exception groups; ``None`` when it was something
    else. Only a bind raises ``ListenError``, so an ``OSError`` of the running server (an
    accept, a connection) is never reported as "cannot serve": it is a fault, with its
    traceback."""
    from kserve_trio.serving.accept import ListenError

    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc if isinstance(exc, ListenError) else None


__all__ = ["configure_parser", "listen_failure", "overrides_from_args", "run"]

"""``python -m kserve_trio gateway``: one KServe V2 endpoint in front of many workers.

The configuration is ``--config FILE``, else the file ``KSERVE_TRIO_GATEWAY_FILE`` names, else
the environment alone (``KSERVE_TRIO_GATEWAY_*``); ``--log-level`` and ``--log-format`` override
its ``logging:`` block. Exit status: 0 after a drained shutdown (SIGTERM, SIGINT), 1 when the
gateway found itself wedged (its supervisor should restart it), 2 for a configuration error.

``--processes N`` (``processes:``, ``KSERVE_TRIO_GATEWAY_PROCESSES``) above 1 makes this process
the parent of N gateway processes sharing the public ports (``gateway.processes``). The
parent starts each child as this same command with ``--process-index I --runtime-dir DIR``
(flags for that use only).
"""

from __future__ import annotations

import argparse
import sys

from kserve_trio.core.process import add_tracing_flags, tracing_overrides
from kserve_trio.gateway.config import ENV_PREFIX
from kserve_trio.serving.background import (
    add_event_loop_flags,
    add_http2_engine_flag,
    event_loop_from_args,
)


def configure_parser(parser: argparse.ArgumentParser):
    """Add the gateway's flags to ``parser``; returns the runner."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="gateway.yml (default: $KSERVE_TRIO_GATEWAY_FILE, else the environment only)",
    )
    parser.add_argument(
        "--log-level", help="debug|info|warning|error|critical (default: logging.level, info)"
    )
    parser.add_argument(
        "--log-format",
        choices=["json", "console", "auto"],
        help="log rendering (default: logging.format; auto = console on a TTY, else JSON)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        metavar="N",
        help="gateway processes sharing the public ports (default: processes, 1)",
    )
    parser.add_argument("--process-index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--runtime-dir", help=argparse.SUPPRESS)
    add_event_loop_flags(parser, "event_loop, env KSERVE_TRIO_GATEWAY_EVENT_LOOP")
    add_http2_engine_flag(parser, "http2_engine, env KSERVE_TRIO_GATEWAY_HTTP2_ENGINE")
    add_tracing_flags(parser, ENV_PREFIX)
    return run


def run(args: argparse.Namespace) -> int:
    from kserve_trio.core.errors import ConfigError
    from kserve_trio.core.logging import configure_logging, get_logger
    from kserve_trio.gateway.config import (
        configure_gateway_logging,
        load_gateway_config,
        log_gateway_config,
    )

    log = get_logger("kserve_trio.gateway")
    overrides: dict[str, object] = {
        "logging": {"level": args.log_level, "format": args.log_format},
        "processes": args.processes,
        "tracing": tracing_overrides(args),
    }
    event_loop = event_loop_from_args(args)
    if event_loop is not None:
        overrides["event_loop"] = event_loop
    if getattr(args, "http2_engine", None) is not None:
        overrides["http2_engine"] = args.http2_engine
    try:
        loaded = load_gateway_config(args.config, overrides=overrides)
    except ConfigError as exc:
        configure_logging(args.log_format or "auto", args.log_level or "info")
        log.error("startup_failed", error=str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_gateway_logging(loaded.config.logging)
    log_gateway_config(loaded, log)
    from kserve_trio.serving.process_tuning import tune_allocator, tuning_enabled

    if tuning_enabled():  # large messages are copied several times: keep the heap warm
        tune_allocator()
    from kserve_trio.serving.fd_budget import raise_open_file_limit

    raise_open_file_limit()  # before the descriptor budget is split from it
    from kserve_trio.gateway.server import serve_gateway
    from kserve_trio.serving.accept import ListenError

    config = loaded.config
    try:
        if args.process_index is not None:  # one of several: the parent started us
            role = _role(args, config.processes)
            with role.holding():  # the last process of the gateway out removes its directory
                serve_gateway(config, blocking=True, process=role)
        elif config.processes > 1:
            return _run_parent(config, log)
        else:
            serve_gateway(config, blocking=True)
    except ConfigError as exc:  # e.g. a certificate that does not load
        log.error("startup_failed", error=str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ListenError as exc:  # a listen address that cannot be bound (never a later error)
        log.error("startup_failed", error=str(exc))
        print(f"error: cannot serve: {exc}", file=sys.stderr)
        return 2
    return 0


def _role(args: argparse.Namespace, count: int):
    import pathlib

    import structlog

    from kserve_trio.gateway.processes import ProcessRole

    structlog.contextvars.bind_contextvars(gateway_process=args.process_index)
    if not args.runtime_dir:
        raise SystemExit("--process-index needs --runtime-dir")
    return ProcessRole(args.process_index, count, pathlib.Path(args.runtime_dir))


def _run_parent(config, log) -> int:
    """The parent of ``config.processes`` gateway processes, until SIGTERM/SIGINT; a child that
    fails its first start ends it with the child's exit status."""
    import signal

    from kserve_trio.gateway.processes import serve_processes
    from kserve_trio.gateway.processes._children import ChildFailedToStart
    from kserve_trio.serving.background import run_loop, shutdown_signals

    async def until_signal() -> None:
        # The receiver opens before any child starts: a signal during the start-up stops
        # the children too (it is not the default action, which would orphan them).
        with shutdown_signals() as signals:
            async with serve_processes(config):
                async for signum in signals:
                    log.info("shutdown_signal", signal=signal.Signals(signum).name)
                    break

    # The children serve on config.event_loop; the parent runs on asyncio (uvloop when
    # installed) even for trio, which starts processes from a worker thread: the kernel ties a
    # child's parent-death signal to the thread that started it, and trio's threads come and go.
    loop = "asyncio" if config.event_loop == "trio" else config.event_loop or None
    try:
        run_loop(until_signal, event_loop=loop)
    except ChildFailedToStart as exc:
        log.error("startup_failed", error=str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return exc.returncode if exc.returncode in (1, 2) else 1
    return 0


__all__ = ["configure_parser", "run"]

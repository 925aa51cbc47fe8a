"""structlog configuration, done once per process.

JSON lines when stderr is not a TTY, console rendering on a TTY, overridable with
``--log-format`` / ``--log-level``. Events are snake_case verbs with bound context.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

LogFormat = Literal["json", "console", "auto"]
_LEVELS = {"debug": 10, "info": 20, "warning": 30, "warn": 30, "error": 40, "critical": 50}


def parse_level(level: str | int) -> int:
    """``"info"`` / ``"DEBUG"`` / ``20`` -> a numeric logging level; unknown names raise."""
    if isinstance(level, int):
        return level
    try:
        return _LEVELS[level.strip().lower()]
    except KeyError:
        raise ValueError(
            f"unknown log level '{level}'; expected one of {', '.join(_LEVELS)}"
        ) from None


def configure_logging(fmt: LogFormat = "auto", level: str | int = "info", stream=None) -> None:
    """Configure structlog (and stdlib logging) for this process.

    ``fmt="auto"`` renders for a console when ``stream`` (default stderr) is a TTY, else JSON.
    """
    stream = stream or sys.stderr
    numeric = parse_level(level)
    if fmt == "auto":
        fmt = "console" if getattr(stream, "isatty", lambda: False)() else "json"
    if fmt not in ("json", "console"):
        raise ValueError(f"unknown log format '{fmt}'; expected json or console")
    renderer = (
        structlog.dev.ConsoleRenderer(colors=False)
        if fmt == "console"
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=stream, force=True)


def _quiet_default() -> None:
    """A library imported by a program that never configured structlog must not print its
    debug and info events: until someone configures structlog (``configure_logging`` or the
    program's own ``structlog.configure``), only warnings and errors are shown."""
    if not structlog.is_configured():
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


_quiet_default()


def debug_enabled() -> bool:
    """Whether debug events are emitted under the current configuration (about 1 us).

    Hot paths check this before computing a debug event's fields, which a filtered
    ``log.debug(...)`` would otherwise still pay for.
    """
    wrapper = structlog.get_config().get("wrapper_class")
    check = getattr(wrapper, "is_enabled_for", None)
    if check is None:
        return True
    return bool(check(None, logging.DEBUG))


def get_logger(name: str | None = None, **context):
    """A structlog logger with optional bound context (``get_logger(__name__, model="mlp")``)."""
    log = structlog.get_logger(name) if name else structlog.get_logger()
    return log.bind(**context) if context else log


__all__ = ["configure_logging", "debug_enabled", "get_logger", "parse_level"]

"""structlog configuration: set once at start-up, adjustable at run time.

JSON lines when stderr is not a TTY, console rendering on a TTY, overridable with
``--log-format`` / ``--log-level``. Events are snake_case verbs with bound context.

At run time Triton's log-settings RPC adjusts the same configuration (``update_log_settings``):
``log_info``, ``log_warning`` and ``log_error`` switch those levels on and off independently,
``log_verbose_level`` > 0 turns on debug events, and ``log_format`` picks the renderer
(``json``, ``console``, Triton's ``ISO8601`` which is console lines with ISO-8601 timestamps,
or Triton's ``default``, the format the process started with). ``log_file`` is refused: logs go
to the process's stderr, where a supervisor or container runtime collects them.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import structlog
from structlog.typing import EventDict, WrappedLogger

from kserve_trio.core.errors import InvalidArgument

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


@dataclass(frozen=True)
class LogSettings:
    """What the process logs and how, in Triton's log-settings vocabulary."""

    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    log_verbose_level: int = 0
    log_format: str = "json"  # json | console | ISO8601
    log_file: str = ""

    @classmethod
    def from_level(cls, numeric: int, fmt: str) -> LogSettings:
        """The settings equivalent to a minimum level (``--log-level``) and a format."""
        return cls(
            log_info=numeric <= logging.INFO,
            log_warning=numeric <= logging.WARNING,
            log_error=numeric <= logging.ERROR,
            log_verbose_level=1 if numeric <= logging.DEBUG else 0,
            log_format=fmt,
        )

    @property
    def min_level(self) -> int:
        """The lowest level any switch lets through (structlog filters below it for free)."""
        if self.log_verbose_level > 0:
            return logging.DEBUG
        for enabled, level in (
            (self.log_info, logging.INFO),
            (self.log_warning, logging.WARNING),
            (self.log_error, logging.ERROR),
        ):
            if enabled:
                return level
        return logging.CRITICAL + 1

    def allows(self, level: int) -> bool:
        """Whether an event of ``level`` is emitted under these switches."""
        if level < logging.INFO:
            return self.log_verbose_level > 0
        if level < logging.WARNING:
            return self.log_info
        if level < logging.ERROR:
            return self.log_warning
        return self.log_error


_FORMATS = ("json", "console", "ISO8601")
_state: dict[str, Any] = {"settings": None, "start_format": "json", "stream": None}


def _gate(_logger: WrappedLogger, method: str, event: EventDict) -> EventDict:
    """Drop events whose level is switched off (levels are independent switches)."""
    settings: LogSettings | None = _state["settings"]
    if settings is not None and not settings.allows(_LEVELS.get(method, logging.INFO)):
        raise structlog.DropEvent
    return event


def _apply(settings: LogSettings, stream) -> None:
    if settings.log_format == "json":
        renderer: Any = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            _gate,
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(settings.min_level),
        # One write per line, newline included: the processes of a gateway (and a node's
        # children) share one output, and a line written in two pieces interleaves with theirs.
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    _state["settings"] = settings
    _state["stream"] = stream


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
    _state["start_format"] = fmt
    _apply(LogSettings.from_level(numeric, fmt), stream)
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=stream, force=True)


def current_log_settings() -> LogSettings:
    """The settings in force (those of ``--log-level`` / ``--log-format`` until changed)."""
    settings = _state["settings"]
    if settings is None:  # never configured: the library's quiet default
        return LogSettings(log_info=False, log_format=_state["start_format"])
    return settings


_SETTING_TYPES: dict[str, type] = {
    "log_info": bool,
    "log_warning": bool,
    "log_error": bool,
    "log_verbose_level": int,
    "log_format": str,
    "log_file": str,
}


def update_log_settings(changes: Mapping[str, bool | int | str]) -> LogSettings:
    """Apply Triton log-settings ``changes`` all or nothing and return the settings in force.

    Rules:
    1. Every key is one of ``log_info``, ``log_warning``, ``log_error`` (bool),
       ``log_verbose_level`` (non-negative int), ``log_format`` (``json``, ``console``,
       ``ISO8601`` or ``default``) and ``log_file`` (string); anything else, or a value of the
       wrong kind, is ``InvalidArgument`` naming the key, and nothing changes.
    2. ``log_file`` may only be ``""`` (stderr): redirecting logs to a file is refused.
    3. ``default`` means the format the process started with.
    """
    current = current_log_settings()
    updates: dict[str, Any] = {}
    for key, value in changes.items():
        kind = _SETTING_TYPES.get(key)
        if kind is None:
            raise InvalidArgument(
                f"unknown log setting '{key}'; expected one of {', '.join(_SETTING_TYPES)}"
            )
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        if not ok:
            raise InvalidArgument(f"log setting '{key}' must be a {kind.__name__}, got {value!r}")
        if key == "log_verbose_level" and int(value) < 0:
            raise InvalidArgument(f"log setting 'log_verbose_level' must be >= 0, got {value}")
        if key == "log_format":
            value = _state["start_format"] if value == "default" else value
            if value not in _FORMATS:
                raise InvalidArgument(
                    f"log setting 'log_format' must be one of json, console, ISO8601, default; "
                    f"got '{value}'"
                )
        if key == "log_file" and value:
            raise InvalidArgument(
                "log setting 'log_file' is not supported: the worker logs to its stderr "
                "(collect it with your supervisor or container runtime)"
            )
        updates[key] = value
    settings = dataclasses.replace(current, **updates)
    _apply(settings, _state["stream"] or sys.stderr)
    return settings


def _quiet_default() -> None:
    """A library imported by a program that never configured structlog must not print its
    debug and info events: until someone configures structlog (``configure_logging`` or the
    program's own ``structlog.configure``), only warnings and errors are shown."""
    if not structlog.is_configured():
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


_quiet_default()


def debug_enabled() -> bool:
    """Whether debug events are emitted under the current configuration (a cheap check).

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


__all__ = [
    "LogSettings",
    "configure_logging",
    "current_log_settings",
    "debug_enabled",
    "get_logger",
    "parse_level",
    "update_log_settings",
]

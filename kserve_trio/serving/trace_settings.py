"""Triton's TraceSetting RPC in our terms: the trace settings of one process (global, and per
model where a model has its own), the per-request sampling decision they make, and the RPC's
messages (what a request changes, what a reply says). ``trace_control.TraceControl`` serves the
RPC for the worker and the gateway with these, building the tracer when a change turns tracing on.

Triton's vocabulary, every value a list of strings:

- ``trace_level``: ``["OFF"]`` or ``["TIMESTAMPS"]`` (spans with their times); ``TENSORS`` is
  refused (no tensor contents are ever exported);
- ``trace_rate``: trace one request in N;
- ``trace_count``: requests still to be traced, ``-1`` for no end; it counts down as requests
  are traced and tracing stops at 0;
- ``log_frequency``: kept and answered as Triton keeps it in OpenTelemetry mode, where it has no
  effect (it flushes Triton's trace *file* every N traces; spans here leave through the batch
  processor), so a client that sets it along with the others is not refused;
- ``trace_mode``: ``["opentelemetry"]``, the only mode (read-only).

``trace_file`` is refused as Triton refuses it in every mode (UNIMPLEMENTED, "trace file location
can not be updated through network protocol") and, as in Triton's OpenTelemetry mode, is not
among the answered keys; ``trace_config`` is INVALID_ARGUMENT (the exporter is the
configuration's ``tracing`` block). A setting sent without a value is cleared: a model's falls
back to the global one, a global one to the configuration. A change is all or nothing. A
``trace_level`` other than ``OFF`` works whatever the configuration says, as in Triton: on a
server started with ``tracing.level: off`` it turns tracing on live (``turns_on``; the exporter
then posts to the configuration's ``tracing.endpoint``).

This module imports nothing of OpenTelemetry: it is used whether tracing is on or off.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kserve_trio.core.errors import InvalidArgument, Unimplemented
from kserve_trio.core.process import TracingConfig
from kserve_trio.proto import inference as pb

TRACEPARENT = "traceparent"
"""The W3C trace-context header: gRPC metadata and HTTP header alike (lower case, as both
carry header names)."""
TRACESTATE = "tracestate"


def caller_context(header: Callable[[str], str | None]) -> str | None:
    """The caller's W3C trace context as one string, the form it crosses a front end's channel
    in: its ``traceparent``, then its ``tracestate`` after a newline when it sent one (a header
    value holds no newline); None without a ``traceparent``. ``header`` looks a request header
    up by its lower-case name (gRPC metadata and HTTP headers alike)."""
    traceparent = header(TRACEPARENT)
    if not traceparent:
        return None
    tracestate = header(TRACESTATE)
    return f"{traceparent}\n{tracestate}" if tracestate else traceparent


LEVEL_OFF = "OFF"
LEVEL_TIMESTAMPS = "TIMESTAMPS"
TRACE_MODE = "opentelemetry"
TRACE_FILE_REFUSED = "trace file location can not be updated through network protocol"
"""Triton's answer to a ``trace_file`` update (its words, so a client matching them works)."""
_NUMBERS = {"trace_rate": 1, "trace_count": -1, "log_frequency": 0}
"""The integer settings, each with its smallest value."""

Changes = Mapping[str, Sequence[str] | None]
"""A request's settings: name -> its values, or None to clear it."""
Parsed = Mapping[str, str | int | None]
"""A request's settings checked and in our types (``parse_changes``): None clears one."""


@dataclass
class _Scope:
    """One scope's settings (global, or a model's overrides where ``None`` means inherit) and
    its sampling counter."""

    level: str | None = None
    rate: int | None = None
    count: int | None = None
    log_frequency: int | None = None
    seen: int = 0


@dataclass(frozen=True)
class TraceSetting:
    """The settings in force for one scope."""

    level: str
    rate: int
    count: int
    log_frequency: int = 0

    @property
    def on(self) -> bool:
        return self.level != LEVEL_OFF and self.count != 0


@dataclass
class TraceSettings:
    """One process's trace settings and sampling (module docstring). Used from the process's
    event loop only."""

    config: TracingConfig
    _global: _Scope = field(init=False)
    _models: dict[str, _Scope] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._global = self._configured()

    def _configured(self) -> _Scope:
        cfg = self.config
        level = LEVEL_TIMESTAMPS if cfg.on else LEVEL_OFF
        return _Scope(level, cfg.rate, cfg.count, 0)

    def effective(self, model: str = "") -> TraceSetting:
        """The settings in force for ``model`` (``""``: the global ones)."""
        g = self._global
        assert g.level is not None and g.rate is not None and g.count is not None
        assert g.log_frequency is not None
        m = self._models.get(model) if model else None
        if m is None:
            return TraceSetting(g.level, g.rate, g.count, g.log_frequency)
        return TraceSetting(
            m.level if m.level is not None else g.level,
            m.rate if m.rate is not None else g.rate,
            m.count if m.count is not None else g.count,
            m.log_frequency if m.log_frequency is not None else g.log_frequency,
        )

    def sample(self, model: str, parent_sampled: bool | None) -> bool:
        """Whether to trace this request, counting it. ``parent_sampled``: the caller's W3C
        context's sampled flag, None without a (valid) context. Rules, in order:

        1. the model's level ``OFF`` (its own or the global one), or its count at 0: no;
        2. a caller whose context is sampled out (flags ``00``): no, whatever the rate (its
           trace was decided upstream, as OpenTelemetry's parent-based sampler decides);
        3. a caller whose context says sampled: yes (the trace it started goes on);
        4. otherwise every ``trace_rate``-th request of the scope is traced;
        5. a traced request takes one from the scope's ``trace_count`` unless it is -1.
        """
        own = self._models.get(model)
        scope = own if own is not None and own.count is not None else self._global
        setting = self.effective(model)
        if not setting.on or parent_sampled is False:
            return False
        if parent_sampled is None:
            counter = own if own is not None and own.rate is not None else self._global
            counter.seen += 1
            if counter.seen % setting.rate:
                return False
        if scope.count is not None and scope.count > 0:
            scope.count -= 1
        return True

    def update(self, model: str, parsed: Parsed) -> TraceSetting:
        """Apply a request's changes (``parse_changes``: already checked, so nothing here can
        fail half-way) to ``model``'s scope (``""``: global) and return the settings now in
        force there."""
        if model:
            scope = self._models.setdefault(model, _Scope())
        else:
            scope = self._global
        configured = self._configured()
        for key, value in parsed.items():
            attr = _ATTRS.get(key)
            if attr is None:  # trace_mode: read-only, accepted when it names our mode
                continue
            if value is None and not model:
                value = getattr(configured, attr)
            setattr(scope, attr, value)
            if attr == "rate":
                scope.seen = 0
        if model and scope == _Scope(seen=scope.seen):
            del self._models[model]
        return self.effective(model)


_ATTRS = {
    "trace_level": "level",
    "trace_rate": "rate",
    "trace_count": "count",
    "log_frequency": "log_frequency",
}
"""The settable keys -> the ``_Scope`` field each sets."""


def _parse(key: str, values: Sequence[str] | None) -> str | int | None:
    """One setting's values as ours (None: clear it); INVALID_ARGUMENT naming the key."""
    if key == "trace_file":
        raise Unimplemented(TRACE_FILE_REFUSED)
    if key == "trace_config":
        raise InvalidArgument(
            "trace setting 'trace_config' is not supported: the exporter is configured by the "
            "tracing block of the configuration"
        )
    if key == "trace_mode":
        if values and list(values) != [TRACE_MODE]:
            raise InvalidArgument(f"trace setting 'trace_mode' can only be '{TRACE_MODE}'")
        return None
    if key not in _ATTRS:
        raise InvalidArgument(
            f"unknown trace setting '{key}' (known: {', '.join(_ATTRS)}, trace_mode)"
        )
    if not values:
        return None
    if len(values) != 1:
        raise InvalidArgument(f"trace setting '{key}' takes one value (got {len(values)})")
    text = values[0]
    if key == "trace_level":
        word = text.strip().upper()
        if word == "TENSORS":
            raise InvalidArgument("trace level 'TENSORS' is not supported: no tensor is exported")
        if word not in (LEVEL_OFF, LEVEL_TIMESTAMPS):
            raise InvalidArgument(f"trace_level must be OFF or TIMESTAMPS (got {text!r})")
        return word
    try:
        number = int(text)
    except ValueError:
        raise InvalidArgument(f"trace setting '{key}' must be an integer (got {text!r})") from None
    if number < _NUMBERS[key]:
        raise InvalidArgument(f"{key} must be >= {_NUMBERS[key]} (got {number})")
    return number


def parse_changes(changes: Changes) -> dict[str, str | int | None]:
    """Every setting of a request checked and parsed, before any is applied (a change is all
    or nothing); the first bad one is raised, naming its key."""
    return {key: _parse(key, values) for key, values in changes.items()}


def turns_on(parsed: Parsed) -> bool:
    """The change sets a ``trace_level`` that traces (only an explicit level can: a cleared
    one falls back to a level that was already in force somewhere)."""
    return parsed.get("trace_level") not in (None, LEVEL_OFF)


def requested_changes(request: pb.TraceSettingRequest) -> dict[str, list[str] | None]:
    """The request's settings as plain values; a setting with no values clears it."""
    return {key: (list(v.value) or None) for key, v in request.settings.items()}


def settings_reply(setting: TraceSetting) -> pb.TraceSettingResponse:
    """Every setting in force for the scope, each as Triton's list of strings."""
    value = pb.TraceSettingResponseSettingValue
    return pb.TraceSettingResponse(
        settings={
            "trace_level": value(value=[setting.level]),
            "trace_rate": value(value=[str(setting.rate)]),
            "trace_count": value(value=[str(setting.count)]),
            "log_frequency": value(value=[str(setting.log_frequency)]),
            "trace_mode": value(value=[TRACE_MODE]),
        }
    )


__all__ = [
    "LEVEL_OFF",
    "LEVEL_TIMESTAMPS",
    "TRACEPARENT",
    "TRACESTATE",
    "TRACE_FILE_REFUSED",
    "TRACE_MODE",
    "Changes",
    "Parsed",
    "TraceSetting",
    "TraceSettings",
    "caller_context",
    "parse_changes",
    "requested_changes",
    "settings_reply",
    "turns_on",
]

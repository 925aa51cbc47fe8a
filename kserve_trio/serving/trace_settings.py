"""Triton's TraceSetting RPC in our terms: the trace settings of one process (global, and per
model where a model has its own), the per-request sampling decision they make, and the RPC
itself (``answer``), which the worker and the gateway serve for their own process.

Triton's vocabulary, every value a list of strings:

- ``trace_level``: ``["OFF"]`` or ``["TIMESTAMPS"]`` (spans with their times); ``TENSORS`` is
  refused (no tensor contents are ever exported);
- ``trace_rate``: trace one request in N;
- ``trace_count``: requests still to be traced, ``-1`` for no end; it counts down as requests
  are traced and tracing stops at 0;
- ``trace_mode``: ``["opentelemetry"]``, the only mode (read-only).

Triton's ``trace_file``, ``log_frequency`` and ``trace_config`` have no meaning for an OTLP
exporter: a request naming them is INVALID_ARGUMENT (no inert setting). A setting sent without
a value is cleared: a model's falls back to the global one, a global one to the configuration.
A change is all or nothing. Settings other than ``OFF`` need ``tracing.enabled`` in the
configuration (the exporter is built at start-up): otherwise FAILED_PRECONDITION.

This module imports nothing of OpenTelemetry: it is used whether tracing is on or off.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kserve_trio.core.config import TracingConfig
from kserve_trio.core.errors import FailedPrecondition, InvalidArgument
from kserve_trio.core.logging import get_logger
from kserve_trio.proto import inference as pb

TRACEPARENT = "traceparent"
"""The W3C trace-context header: gRPC metadata and HTTP header alike (lower case, as both
carry header names)."""
TRACESTATE = "tracestate"

LEVEL_OFF = "OFF"
LEVEL_TIMESTAMPS = "TIMESTAMPS"
TRACE_MODE = "opentelemetry"
_UNSUPPORTED = {
    "trace_file": "spans are exported over OTLP/HTTP (tracing.endpoint), not to a file",
    "log_frequency": "spans are exported over OTLP/HTTP (tracing.endpoint), not to a file",
    "trace_config": "the exporter is configured by the tracing block of the configuration",
}

Changes = Mapping[str, Sequence[str] | None]
"""A request's settings: name -> its values, or None to clear it."""


@dataclass
class _Scope:
    """One scope's settings (global, or a model's overrides where ``None`` means inherit) and
    its sampling counter."""

    level: str | None = None
    rate: int | None = None
    count: int | None = None
    seen: int = 0


@dataclass(frozen=True)
class TraceSetting:
    """The settings in force for one scope."""

    level: str
    rate: int
    count: int

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
        level = LEVEL_TIMESTAMPS if cfg.enabled else LEVEL_OFF
        return _Scope(level, cfg.trace_rate, cfg.trace_count)

    def effective(self, model: str = "") -> TraceSetting:
        """The settings in force for ``model`` (``""``: the global ones)."""
        g = self._global
        assert g.level is not None and g.rate is not None and g.count is not None
        m = self._models.get(model) if model else None
        if m is None:
            return TraceSetting(g.level, g.rate, g.count)
        return TraceSetting(
            m.level if m.level is not None else g.level,
            m.rate if m.rate is not None else g.rate,
            m.count if m.count is not None else g.count,
        )

    def sample(self, model: str, parent_sampled: bool) -> bool:
        """Whether to trace this request, counting it. Rules, in order:

        1. the model's level ``OFF`` (its own or the global one), or its count at 0: no;
        2. a caller whose ``traceparent`` says sampled: yes (the trace it started goes on);
        3. otherwise every ``trace_rate``-th request of the scope is traced;
        4. a traced request takes one from the scope's ``trace_count`` unless it is -1.
        """
        own = self._models.get(model)
        scope = own if own is not None and own.count is not None else self._global
        setting = self.effective(model)
        if not setting.on:
            return False
        if not parent_sampled:
            counter = own if own is not None and own.rate is not None else self._global
            counter.seen += 1
            if counter.seen % setting.rate:
                return False
        if scope.count is not None and scope.count > 0:
            scope.count -= 1
        return True

    def update(self, model: str, changes: Changes) -> TraceSetting:
        """Apply a request's changes to ``model``'s scope (``""``: global), all or nothing, and
        return the settings now in force there."""
        parsed = {key: _parse(key, values) for key, values in changes.items()}
        level = parsed.get("trace_level")
        if level not in (None, LEVEL_OFF) and not self.config.enabled:
            raise FailedPrecondition(
                "tracing is not enabled in this server's configuration (tracing.enabled); "
                "trace_level can only be OFF"
            )
        if model:
            scope = self._models.setdefault(model, _Scope())
        else:
            scope = self._global
        configured = self._configured()
        for key, value in parsed.items():
            attr = key.removeprefix("trace_")
            if value is None and not model:
                value = getattr(configured, attr)
            setattr(scope, attr, value)
            if attr == "rate":
                scope.seen = 0
        if model and scope == _Scope(seen=scope.seen):
            del self._models[model]
        return self.effective(model)


def _parse(key: str, values: Sequence[str] | None) -> str | int | None:
    """One setting's values as ours (None: clear it); INVALID_ARGUMENT naming the key."""
    if key in _UNSUPPORTED:
        raise InvalidArgument(f"trace setting '{key}' is not supported: {_UNSUPPORTED[key]}")
    if key == "trace_mode":
        if values and list(values) != [TRACE_MODE]:
            raise InvalidArgument(f"trace setting 'trace_mode' can only be '{TRACE_MODE}'")
        return None
    if key not in ("trace_level", "trace_rate", "trace_count"):
        raise InvalidArgument(
            f"unknown trace setting '{key}' (known: trace_level, trace_rate, trace_count, "
            "trace_mode)"
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
    if key == "trace_rate" and number < 1:
        raise InvalidArgument(f"trace_rate must be >= 1 (got {number})")
    if key == "trace_count" and number < -1:
        raise InvalidArgument(f"trace_count must be >= -1 (got {number})")
    return number


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
            "trace_mode": value(value=[TRACE_MODE]),
        }
    )


def answer(settings: TraceSettings, request: pb.TraceSettingRequest) -> pb.TraceSettingResponse:
    """The RPC: change what the request names for its model (or globally), logged, and answer
    with every setting in force there; a request without settings only reads them."""
    changes = requested_changes(request)
    if not changes:
        return settings_reply(settings.effective(request.model_name))
    setting = settings.update(request.model_name, changes)
    get_logger("kserve_trio.tracing").info(
        "trace_settings_updated",
        model=request.model_name or None,
        **{k: ",".join(v) if v else "<cleared>" for k, v in changes.items()},
    )
    return settings_reply(setting)


__all__ = [
    "LEVEL_OFF",
    "LEVEL_TIMESTAMPS",
    "TRACEPARENT",
    "TRACESTATE",
    "TRACE_MODE",
    "Changes",
    "TraceSetting",
    "TraceSettings",
    "answer",
    "requested_changes",
    "settings_reply",
]

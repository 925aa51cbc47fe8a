"""Tracing: the ``tracing:`` block of both configurations (the worker's ``tracing.*`` /
``INFERENCE_SERVER_TRACING_*`` and the gateway's ``tracing.*`` / ``KSERVE_TRIO_GATEWAY_TRACING_*``)
and the ``--trace-*`` flags that set it from the command line.

One dataclass, ``TracingConfig``, whose field defaults are the one owner of each default. With
``level: off`` (the default) a server imports no OpenTelemetry module until a TraceSetting change
turns tracing on live, and a request pays one branch; with ``timestamps`` requests are traced as
``rate`` and ``count`` say (Triton's ``--trace-config`` vocabulary, changed live by the
TraceSetting RPC) and exported as OTLP/HTTP protobuf. The other keys (endpoint, resource, export
queue) hold for a tracer turned on live too. The standard OpenTelemetry variables fill what the block leaves empty:
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT`` the endpoint,
``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` the resource; a key set here wins.
docs/observability.md describes the spans.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from kserve_trio.core.errors import ConfigError
from kserve_trio.core.process.config._frozen import FrozenMap

LEVEL_OFF = "off"
LEVEL_TIMESTAMPS = "timestamps"
TRACE_LEVELS = (LEVEL_OFF, LEVEL_TIMESTAMPS)
"""``tracing.level``'s values, Triton's trace level names (``TENSORS`` is not offered: no
tensor contents are ever exported)."""


@dataclass(frozen=True)
class TracingConfig:
    """How one server process traces requests (module docstring)."""

    level: str = LEVEL_OFF
    """``off``: nothing is traced and nothing of OpenTelemetry is imported until a TraceSetting
    change turns tracing on live; ``timestamps``: requests are traced (each phase a span with
    its times)."""
    rate: int = 1
    """Trace one request in this many (Triton's ``trace_rate``), counted per process; a caller's
    context decides for itself (sampled: traced, sampled out: not)."""
    count: int = -1
    """How many requests to trace before tracing turns itself off (Triton's ``trace_count``);
    -1: no end."""
    endpoint: str = ""
    """The OTLP/HTTP traces URL the spans are posted to (protobuf); empty: the standard
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, else ``OTEL_EXPORTER_OTLP_ENDPOINT`` + ``/v1/traces``,
    else ``http://localhost:4318/v1/traces``."""
    service_name: str = ""
    """The ``service.name`` resource attribute; empty: ``OTEL_SERVICE_NAME``, else the process's
    role (``kserve_trio-worker``, ``kserve_trio-gateway``)."""
    resource: Mapping[str, str] = field(default_factory=FrozenMap)
    """More resource attributes (``deployment.environment``, ``k8s.pod.name``...), over those of
    ``OTEL_RESOURCE_ATTRIBUTES``; in the environment, that variable's ``key=value,...`` form."""
    max_queue_size: int = 2048
    """Finished spans waiting for export; one more is dropped and counted
    (``*_traces_dropped_total``), so a slow collector never grows a server's memory."""
    max_export_batch_size: int = 512
    """Spans per export request (at most ``max_queue_size``)."""
    schedule_delay_seconds: float = 1.0
    """The longest a finished span waits before an export is started."""
    export_timeout_seconds: float = 10.0
    """One export request's deadline; a collector that does not answer within it loses that
    batch (never retried past it)."""

    def __post_init__(self) -> None:
        if not isinstance(self.resource, FrozenMap):
            object.__setattr__(self, "resource", FrozenMap(self.resource))

    @property
    def on(self) -> bool:
        """Whether the process traces from start-up (builds its exporter then)."""
        return self.level == LEVEL_TIMESTAMPS


TRACING_FIELDS: tuple[dataclasses.Field, ...] = dataclasses.fields(TracingConfig)
"""The ``tracing:`` block's keys, in declaration order."""


def _level(value: Any, path: str) -> str:
    if value is False:  # YAML 1.1 reads a bare ``off`` as false
        return LEVEL_OFF
    word = value.strip().lower() if isinstance(value, str) else value
    if word not in TRACE_LEVELS:
        raise ConfigError(f"must be one of {', '.join(TRACE_LEVELS)} (got {value!r})", path)
    return word


def _resource(value: Any, path: str) -> FrozenMap[str]:
    """A mapping of strings, or ``OTEL_RESOURCE_ATTRIBUTES``'s text form (``k=v,k2=v2``,
    percent-encoded values) as the environment gives it."""
    if value is None:
        return FrozenMap()
    if isinstance(value, str):
        pairs: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in value.split(","))):
            key, eq, text = item.partition("=")
            if not eq or not key.strip():
                raise ConfigError(f"must be key=value pairs, comma-separated (got {item!r})", path)
            pairs[key.strip()] = unquote(text.strip())
        return FrozenMap(pairs)
    if not isinstance(value, Mapping):
        raise ConfigError(f"config '{path}' must be a mapping of strings (got {value!r})", path)
    out: dict[str, str] = {}
    for key, text in value.items():
        if not isinstance(text, str | int | float | bool):
            raise ConfigError(f"must be a string (got {text!r})", f"{path}.{key}")
        out[str(key)] = str(text)
    return FrozenMap(out)


TRACING_READERS: Mapping[str, Any] = {"level": _level, "resource": _resource}
"""The block's keys whose values need more than their annotation's reader (``read_block``)."""

_ENV_KINDS = {"Mapping[str, str]": "str"}


def tracing_env_rows(prefix: str) -> tuple[tuple[str, str, str], ...]:
    """The environment table rows of the ``tracing`` block: ``(prefix + TRACING_<FIELD>,
    tracing.<field>, kind)``, one per field, so the tables never miss a key."""
    return tuple(
        (
            f"{prefix}TRACING_{f.name.upper()}",
            f"tracing.{f.name}",
            _ENV_KINDS.get(str(f.type), str(f.type)),
        )
        for f in TRACING_FIELDS
    )


def tracing_to_raw(cfg: TracingConfig) -> dict[str, Any]:
    """The block in YAML shape, for the effective-configuration log line."""
    raw = {f.name: getattr(cfg, f.name) for f in TRACING_FIELDS}
    raw["resource"] = dict(cfg.resource)
    return raw


def validate_tracing(cfg: TracingConfig, prefix: str = "tracing") -> None:
    """Sizes and times are positive, ``count`` is -1 or more, and the endpoint is empty or an
    http(s) URL."""
    _level(cfg.level, f"{prefix}.level")
    for name in ("rate", "max_queue_size", "max_export_batch_size"):
        value = getattr(cfg, name)
        if value < 1:
            raise ConfigError(f"must be >= 1 (got {value})", f"{prefix}.{name}")
    for name in ("schedule_delay_seconds", "export_timeout_seconds"):
        value = getattr(cfg, name)
        if not value > 0:
            raise ConfigError(f"must be > 0 (got {value})", f"{prefix}.{name}")
    if cfg.count < -1:
        raise ConfigError(f"must be >= -1 (got {cfg.count})", f"{prefix}.count")
    if cfg.max_export_batch_size > cfg.max_queue_size:
        raise ConfigError(
            f"must be at most max_queue_size ({cfg.max_queue_size}; got "
            f"{cfg.max_export_batch_size})",
            f"{prefix}.max_export_batch_size",
        )
    if cfg.endpoint and not cfg.endpoint.startswith(("http://", "https://")):
        raise ConfigError(
            f"must be an http:// or https:// URL (got {cfg.endpoint!r})", f"{prefix}.endpoint"
        )


_FLAGS = (
    ("--trace-level", "level", str, "off|timestamps"),
    ("--trace-rate", "rate", int, "trace one request in N"),
    ("--trace-count", "count", int, "trace N requests, then stop (-1: no end)"),
    ("--trace-endpoint", "endpoint", str, "the collector's OTLP/HTTP traces URL"),
    ("--trace-service-name", "service_name", str, "the spans' service.name"),
)


def add_tracing_flags(parser: argparse.ArgumentParser, env_prefix: str) -> None:
    """The ``--trace-*`` flags, each naming the ``tracing.<key>`` it sets."""
    group = parser.add_argument_group(
        "tracing", "OpenTelemetry spans over OTLP/HTTP (docs/observability.md)"
    )
    for flag, key, kind, text in _FLAGS:
        group.add_argument(
            flag,
            type=kind,
            dest=f"trace_{key}",
            metavar=key.upper() if kind is int else None,
            help=f"{text} (tracing.{key}, env {env_prefix}TRACING_{key.upper()})",
        )


def tracing_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--trace-*`` flags given, as a raw ``tracing`` block (empty when none was)."""
    return {
        key: getattr(args, f"trace_{key}")
        for _, key, _, _ in _FLAGS
        if getattr(args, f"trace_{key}", None) is not None
    }


__all__ = [
    "LEVEL_OFF",
    "LEVEL_TIMESTAMPS",
    "TRACE_LEVELS",
    "TRACING_FIELDS",
    "TRACING_READERS",
    "TracingConfig",
    "add_tracing_flags",
    "tracing_env_rows",
    "tracing_overrides",
    "tracing_to_raw",
    "validate_tracing",
]

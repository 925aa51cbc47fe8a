"""Tracing: the ``tracing:`` block of both configurations (the worker's ``tracing.*`` /
``INFERENCE_SERVER_TRACING_*`` and the gateway's ``tracing.*`` / ``KSERVE_TRIO_GATEWAY_TRACING_*``).

One dataclass, ``TracingConfig``, whose field defaults are the one owner of each default. With
``enabled: false`` (the default) a server imports no OpenTelemetry module and a request pays one
branch; with it on, requests are traced as ``trace_rate`` and ``trace_count`` say (Triton's
trace-setting vocabulary, changed live by the TraceSetting RPC) and exported as OTLP/HTTP
protobuf to ``endpoint``. docs/observability.md describes the spans.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kserve_trio.core.errors import ConfigError


@dataclass(frozen=True)
class TracingConfig:
    """How one server process traces requests (module docstring)."""

    enabled: bool = False
    """Trace requests and export the spans; off, nothing of OpenTelemetry is imported."""
    endpoint: str = "http://127.0.0.1:4318/v1/traces"
    """The OTLP/HTTP traces URL the spans are posted to (protobuf)."""
    service_name: str = ""
    """The ``service.name`` resource attribute; empty: the process's role
    (``kserve_trio-worker``, ``kserve_trio-gateway``)."""
    trace_rate: int = 1
    """Trace one request in this many (Triton's ``trace_rate``), counted per process; a request
    whose caller sent a sampled ``traceparent`` is always traced."""
    trace_count: int = -1
    """How many requests to trace before tracing turns itself off (Triton's ``trace_count``);
    -1: no end."""
    max_queue_size: int = 2048
    """Finished spans waiting for export; one more is dropped and counted
    (``*_trace_spans_dropped_total``), so a slow collector never grows a server's memory."""
    max_export_batch_size: int = 512
    """Spans per export request (at most ``max_queue_size``)."""
    schedule_delay_seconds: float = 1.0
    """The longest a finished span waits before an export is started."""
    export_timeout_seconds: float = 10.0
    """One export request's deadline; a collector that does not answer within it loses that
    batch (counted as dropped by the exporter's log, never retried past it)."""


TRACING_FIELDS: tuple[dataclasses.Field, ...] = dataclasses.fields(TracingConfig)
"""The ``tracing:`` block's keys, in declaration order."""


def tracing_env_rows(prefix: str) -> tuple[tuple[str, str, str], ...]:
    """The environment table rows of the ``tracing`` block: ``(prefix + TRACING_<FIELD>,
    tracing.<field>, kind)``, one per field, so the tables never miss a key."""
    return tuple(
        (f"{prefix}TRACING_{f.name.upper()}", f"tracing.{f.name}", str(f.type))
        for f in TRACING_FIELDS
    )


def validate_tracing(cfg: TracingConfig, prefix: str = "tracing") -> None:
    """Sizes and times are positive, ``trace_count`` is -1 or more, and the endpoint is an
    http(s) URL."""
    for name in ("trace_rate", "max_queue_size", "max_export_batch_size"):
        value = getattr(cfg, name)
        if value < 1:
            raise ConfigError(f"must be >= 1 (got {value})", f"{prefix}.{name}")
    for name in ("schedule_delay_seconds", "export_timeout_seconds"):
        value = getattr(cfg, name)
        if not value > 0:
            raise ConfigError(f"must be > 0 (got {value})", f"{prefix}.{name}")
    if cfg.trace_count < -1:
        raise ConfigError(f"must be >= -1 (got {cfg.trace_count})", f"{prefix}.trace_count")
    if cfg.max_export_batch_size > cfg.max_queue_size:
        raise ConfigError(
            f"must be at most max_queue_size ({cfg.max_queue_size}; got "
            f"{cfg.max_export_batch_size})",
            f"{prefix}.max_export_batch_size",
        )
    if not cfg.endpoint.startswith(("http://", "https://")):
        raise ConfigError(
            f"must be an http:// or https:// URL (got {cfg.endpoint!r})", f"{prefix}.endpoint"
        )


__all__ = ["TRACING_FIELDS", "TracingConfig", "tracing_env_rows", "validate_tracing"]

"""OpenTelemetry tracing of one server process: the tracer provider, the OTLP/HTTP exporter
behind a bounded ``BatchSpanProcessor``, the W3C ``traceparent`` in and out, and the spans a
request makes.

Only a process whose configuration sets ``tracing.enabled`` imports this module (``open_tracing``
is called from the servers' start-up, behind that one test), so a server without tracing loads
nothing of OpenTelemetry and a request pays one ``is None`` branch.

Spans are made in two ways, each where it is cheapest:

- a request's server span (``Tracing.begin``) is live: started when the request arrives, ended
  with its status;
- the phases inside it (admission, preprocess, queue, execute, postprocess, encode) are written
  after the fact from the times the scheduler records anyway (``RequestSpan.child``), so a
  traced request takes no extra step on the device path and an untraced one none at all.

Times given to ``child`` are ``time.monotonic_ns()`` values (the scheduler's clock); a span
converts them with the offset to the wall clock taken when it began.

The processor's queue is bounded (``tracing.max_queue_size``): a span finished while it is full
is dropped by the SDK and counted in its meter, which ``dropped_spans`` reads (exported as
``<prefix>_trace_spans_dropped_total``), so a collector that is slow or gone costs a bounded
amount of memory and is visible.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from opentelemetry import trace as otel_trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from kserve_trio.core.config import TracingConfig
from kserve_trio.serving.trace_settings import TraceSettings

TRACEPARENT = "traceparent"
"""The W3C trace-context header (gRPC metadata and HTTP header alike)."""
TRACESTATE = "tracestate"

_PROPAGATOR = TraceContextTextMapPropagator()
_DROPPED_METRIC = "otel.sdk.processor.span.processed"
"""The SDK processor's counter; its points with ``error.type`` are the dropped spans."""


def parent_context(traceparent: str | None, tracestate: str | None = None) -> Context | None:
    """The caller's span as a parent context, or None when the header is absent or invalid
    (W3C: an invalid ``traceparent`` is ignored and a new trace starts)."""
    if not traceparent:
        return None
    carrier = {TRACEPARENT: traceparent}
    if tracestate:
        carrier[TRACESTATE] = tracestate
    ctx = _PROPAGATOR.extract(carrier)
    if not otel_trace.get_current_span(ctx).get_span_context().is_valid:
        return None
    return ctx


def _sampled(ctx: Context | None) -> bool:
    if ctx is None:
        return False
    return otel_trace.get_current_span(ctx).get_span_context().trace_flags.sampled


class RequestSpan:
    """One traced request's server (or client) span and the way to add its phases."""

    __slots__ = ("_offset", "_tracer", "span")

    def __init__(self, tracer: otel_trace.Tracer, span: otel_trace.Span, offset: int) -> None:
        self._tracer = tracer
        self.span = span
        self._offset = offset

    @property
    def context(self) -> SpanContext:
        return self.span.get_span_context()

    def wall(self, mono_ns: int) -> int:
        """A ``time.monotonic_ns()`` value on the wall clock the spans use."""
        return mono_ns + self._offset

    def child(
        self,
        name: str,
        start_mono_ns: int,
        end_mono_ns: int,
        attributes: Mapping[str, str | int | float | bool] | None = None,
        links: Sequence[SpanContext] = (),
    ) -> RequestSpan:
        """A finished child span between two ``time.monotonic_ns()`` marks."""
        ctx = otel_trace.set_span_in_context(self.span)
        span = self._tracer.start_span(
            name,
            ctx,
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            links=[Link(c) for c in links],
            start_time=self.wall(start_mono_ns),
        )
        span.end(end_time=self.wall(max(end_mono_ns, start_mono_ns)))
        return RequestSpan(self._tracer, span, self._offset)

    def start_child(
        self, name: str, kind: SpanKind = SpanKind.INTERNAL, **attributes: str | int
    ) -> RequestSpan:
        """A live child span (end it with ``end``): a gateway's forward attempt, a meta
        model's sub-call."""
        ctx = otel_trace.set_span_in_context(self.span)
        span = self._tracer.start_span(name, ctx, kind=kind, attributes=attributes)
        return RequestSpan(self._tracer, span, self._offset)

    def traceparent(self) -> str:
        """This span as the ``traceparent`` a callee continues."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=otel_trace.set_span_in_context(self.span))
        return carrier[TRACEPARENT]

    def set(self, key: str, value: str | int | float | bool) -> None:
        self.span.set_attribute(key, value)

    def end(self, status: str = "OK", message: str = "", end_mono_ns: int | None = None) -> None:
        """End the span with a gRPC status name (anything but OK marks it an error)."""
        self.span.set_attribute("rpc.grpc.status", status)
        if status != "OK":
            self.span.set_status(Status(StatusCode.ERROR, message or status))
        self.span.end(end_time=None if end_mono_ns is None else self.wall(end_mono_ns))

    def log_ids(self) -> dict[str, str]:
        """``trace_id`` and ``span_id`` as the log lines carry them (hex, W3C form)."""
        c = self.context
        return {"trace_id": f"{c.trace_id:032x}", "span_id": f"{c.span_id:016x}"}


class _DroppedSpans(Collector):
    """``<prefix>_trace_spans_dropped_total``: spans the processor's full queue dropped."""

    def __init__(self, tracing: Tracing, name: str) -> None:
        self._tracing = tracing
        self._name = name

    def collect(self) -> Iterable[CounterMetricFamily]:
        family = CounterMetricFamily(
            self._name,
            "Finished spans dropped because the export queue (tracing.max_queue_size) was full",
        )
        family.add_metric([], self._tracing.dropped_spans())
        yield family


@dataclass(frozen=True)
class _Names:
    role: str
    metric_prefix: str


class Tracing:
    """One process's tracer: settings, sampling, spans and their export (module docstring)."""

    def __init__(
        self,
        config: TracingConfig,
        *,
        role: str,
        metric_prefix: str,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.settings = TraceSettings(config)
        self._names = _Names(role, metric_prefix)
        self._reader = InMemoryMetricReader()
        self._meters = MeterProvider(metric_readers=[self._reader])
        resource = Resource.create({"service.name": config.service_name or f"kserve_trio-{role}"})
        self._provider = TracerProvider(resource=resource)
        exporter = OTLPSpanExporter(endpoint=config.endpoint, timeout=config.export_timeout_seconds)
        self._provider.add_span_processor(
            BatchSpanProcessor(
                exporter,
                max_queue_size=config.max_queue_size,
                schedule_delay_millis=config.schedule_delay_seconds * 1000,
                max_export_batch_size=config.max_export_batch_size,
                export_timeout_millis=config.export_timeout_seconds * 1000,
                meter_provider=self._meters,
            )
        )
        self._tracer = self._provider.get_tracer("kserve_trio")
        if registry is not None:
            registry.register(_DroppedSpans(self, f"{metric_prefix}_trace_spans_dropped_total"))

    def begin(
        self,
        name: str,
        model: str,
        traceparent: str | None,
        *,
        kind: SpanKind = SpanKind.SERVER,
        tracestate: str | None = None,
        start_mono_ns: int | None = None,
        attributes: Mapping[str, str | int | float | bool] | None = None,
    ) -> RequestSpan | None:
        """The request's span when the settings trace it (``TraceSettings.sample``), else None.
        A valid ``traceparent`` makes it the caller's child."""
        parent = parent_context(traceparent, tracestate)
        if not self.settings.sample(model, _sampled(parent)):
            return None
        offset = time.time_ns() - time.monotonic_ns()
        start = None if start_mono_ns is None else start_mono_ns + offset
        attrs = {"rpc.system": "grpc", "rpc.method": name}
        if model:
            attrs["kserve_trio.model"] = model
        if attributes:
            attrs.update(attributes)
        span = self._tracer.start_span(name, parent, kind=kind, attributes=attrs, start_time=start)
        return RequestSpan(self._tracer, span, offset)

    def batch(
        self,
        model: str,
        start_mono_ns: int,
        end_mono_ns: int,
        members: Sequence[SpanContext],
        attributes: Mapping[str, str | int | float | bool],
    ) -> None:
        """A coalesced batch: its own span, linked to every traced request it served (a batch
        has many parents, so it is a root with links, as OpenTelemetry's messaging
        conventions do for batch processing)."""
        offset = time.time_ns() - time.monotonic_ns()
        span = self._tracer.start_span(
            "batch",
            Context(),
            kind=SpanKind.INTERNAL,
            attributes={"kserve_trio.model": model, **attributes},
            links=[Link(c) for c in members],
            start_time=start_mono_ns + offset,
        )
        span.end(end_time=max(end_mono_ns, start_mono_ns) + offset)

    def dropped_spans(self) -> int:
        """Spans dropped so far because the export queue was full."""
        data = self._reader.get_metrics_data()
        total = 0
        for rm in data.resource_metrics if data is not None else ():
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name != _DROPPED_METRIC:
                        continue
                    for point in getattr(metric.data, "data_points", ()):
                        if point.attributes and point.attributes.get("error.type"):
                            total += int(getattr(point, "value", 0))
        return total

    def flush(self, timeout_seconds: float = 5.0) -> bool:
        """Export every finished span now (bounded); True when all went."""
        return self._provider.force_flush(int(timeout_seconds * 1000))

    def close(self) -> None:
        """Flush and stop the exporter thread (the process is ending)."""
        self._provider.shutdown()
        self._meters.shutdown()


def open_tracing(
    config: TracingConfig,
    *,
    role: str,
    metric_prefix: str,
    registry: CollectorRegistry | None = None,
) -> Tracing:
    """The process's ``Tracing`` (module docstring)."""
    return Tracing(config, role=role, metric_prefix=metric_prefix, registry=registry)


__all__ = [
    "TRACEPARENT",
    "TRACESTATE",
    "RequestSpan",
    "Tracing",
    "open_tracing",
    "parent_context",
]

"""OpenTelemetry tracing of one server process: the tracer provider, the OTLP/HTTP exporter
behind a bounded ``BatchSpanProcessor``, the W3C ``traceparent`` / ``tracestate`` in and out,
and the spans a request makes.

Only a process that traces imports this module: ``trace_control.TraceControl`` calls
``open_tracing`` at start-up when the configuration sets ``tracing.level: timestamps``, or
when a TraceSetting change first turns tracing on live. Until then a server loads nothing of
OpenTelemetry and a request pays one ``is None`` branch.

Spans are made in two ways, each where it is cheapest:

- a request's server span (``Tracing.begin``) is live: started when the request arrives, ended
  with its status;
- the phases inside it (admission, preprocess, queue, execute, postprocess, encode) are written
  after the fact from the times the scheduler records anyway (``RequestSpan.child``), so a
  traced request takes no extra step on the device path and an untraced one none at all;
- a device execution is one span (``Tracing.batch``), made by the dispatch loop when it served
  a traced request, and linked from each such request's ``execute`` span.

Times given to ``child`` are ``time.monotonic_ns()`` values (the scheduler's clock); a span
converts them with the offset to the wall clock taken when it began.

Export is bounded (``tracing.max_queue_size``): ``_BoundedExport`` counts the spans handed to the
SDK's ``BatchSpanProcessor`` until their export returns (queued or being sent), and drops and
counts a span finished while that many are pending (``<prefix>_traces_dropped_total``). So a
collector that is slow or gone costs a bounded amount of memory and is visible. (The SDK drops on
its own full queue too, but counts that only in OpenTelemetry's internal metrics, off unless an
environment variable turns them on.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager

import structlog
from opentelemetry import trace as otel_trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from kserve_trio.core.errors import StatusCode as GrpcStatus
from kserve_trio.core.process import TracingConfig
from kserve_trio.serving.http import http_status
from kserve_trio.serving.trace_settings import TRACEPARENT, TRACESTATE, TraceSettings

_PROPAGATOR = TraceContextTextMapPropagator()

Attributes = Mapping[str, str | int | float | bool]

RPC_SERVICE = "inference.GRPCInferenceService"
"""``rpc.service`` of every KServe V2 call (the gRPC service; REST calls name it too, so one
query finds a model's calls whichever protocol carried them)."""


def parent_context(context: str | None) -> Context | None:
    """The caller's span as a parent context, or None when there is none or its
    ``traceparent`` is invalid (W3C: an invalid ``traceparent`` is ignored and a new trace
    starts). ``context`` is ``trace_settings.caller_context``'s form: the ``traceparent``,
    then the ``tracestate`` after a newline."""
    if not context:
        return None
    traceparent, _, tracestate = context.partition("\n")
    carrier = {TRACEPARENT: traceparent}
    if tracestate:
        carrier[TRACESTATE] = tracestate
    ctx = _PROPAGATOR.extract(carrier)
    if not otel_trace.get_current_span(ctx).get_span_context().is_valid:
        return None
    return ctx


def _sampled(ctx: Context | None) -> bool | None:
    """The caller's sampled flag; None without a caller context."""
    if ctx is None:
        return None
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
        attributes: Attributes | None = None,
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
        self, name: str, *, client_rpc: str | None = None, **attributes: str | int
    ) -> RequestSpan:
        """A live child span (end it with ``end``): with ``client_rpc``, a client span calling
        that RPC of another server (a gateway's forward attempt), whose context the callee
        continues (``headers``)."""
        ctx = otel_trace.set_span_in_context(self.span)
        kind = SpanKind.INTERNAL
        attrs: dict[str, str | int] = dict(attributes)
        if client_rpc is not None:
            kind = SpanKind.CLIENT
            attrs.update(
                {"rpc.system": "grpc", "rpc.service": RPC_SERVICE, "rpc.method": client_rpc}
            )
        span = self._tracer.start_span(name, ctx, kind=kind, attributes=attrs)
        return RequestSpan(self._tracer, span, self._offset)

    def headers(self) -> dict[str, str]:
        """This span as the W3C headers a callee continues: ``traceparent``, and the
        ``tracestate`` the trace carries (the caller's, passed on unchanged)."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=otel_trace.set_span_in_context(self.span))
        return carrier

    def set(self, key: str, value: str | int | float | bool) -> None:
        self.span.set_attribute(key, value)

    def end(
        self,
        status: str = "OK",
        message: str = "",
        end_mono_ns: int | None = None,
        *,
        http: bool = False,
    ) -> None:
        """End the span with a gRPC status name (anything but OK marks it an error, with the
        message recorded): ``rpc.grpc.status_code`` is its number, as the semantic
        conventions have it; ``http``: a REST call, whose ``http.response.status_code`` is
        the status's HTTP answer."""
        code = GrpcStatus[status] if status in GrpcStatus.__members__ else GrpcStatus.UNKNOWN
        self.span.set_attribute("rpc.grpc.status_code", int(code))
        if http:
            answer = 200 if code is GrpcStatus.OK else http_status(code)
            self.span.set_attribute("http.response.status_code", answer)
        if status != "OK":
            self.span.set_status(Status(StatusCode.ERROR, message or status))
            self.span.add_event(
                "exception",
                {"exception.type": status, "exception.message": message or status},
            )
        self.span.end(end_time=None if end_mono_ns is None else self.wall(end_mono_ns))

    def in_logs(self) -> AbstractContextManager[None]:
        """Bind ``trace_id`` and ``span_id`` to every log line the block writes (structlog's
        context variables, which the tasks it starts inherit)."""
        return structlog.contextvars.bound_contextvars(**self.log_ids())

    def log_ids(self) -> dict[str, str]:
        """``trace_id`` and ``span_id`` as the log lines carry them (hex, W3C form)."""
        c = self.context
        return {"trace_id": f"{c.trace_id:032x}", "span_id": f"{c.span_id:016x}"}


class _DroppedSpans(Collector):
    """``<prefix>_traces_dropped_total``: spans the processor's full queue dropped."""

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


class _BoundedExport(SpanProcessor):
    """The ``BatchSpanProcessor`` behind a bound on pending spans (module docstring). Spans end
    on the event loop; exports return on the processor's thread: one lock guards the count."""

    def __init__(self, exporter: SpanExporter, config: TracingConfig) -> None:
        self._limit = config.max_queue_size
        self._pending = 0
        self.dropped = 0
        self._lock = threading.Lock()
        self._inner = BatchSpanProcessor(
            _Returning(exporter, self._exported),
            max_queue_size=config.max_queue_size,
            schedule_delay_millis=config.schedule_delay_seconds * 1000,
            max_export_batch_size=config.max_export_batch_size,
            export_timeout_millis=config.export_timeout_seconds * 1000,
        )

    def _exported(self, n: int) -> None:
        with self._lock:
            self._pending -= n

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        with self._lock:
            if self._pending >= self._limit:
                self.dropped += 1
                return
            self._pending += 1
        self._inner.on_end(span)

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class _Returning(SpanExporter):
    """The OTLP exporter, telling ``_BoundedExport`` how many spans each export gave back."""

    def __init__(self, exporter: SpanExporter, returned: Callable[[int], None]) -> None:
        self._exporter = exporter
        self._returned = returned

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            return self._exporter.export(spans)
        finally:
            self._returned(len(spans))

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporter.force_flush(timeout_millis)


class Tracing:
    """One process's tracer: settings, sampling, spans and their export (module docstring)."""

    def __init__(
        self,
        config: TracingConfig,
        *,
        role: str,
        metric_prefix: str,
        registry: CollectorRegistry | None = None,
        settings: TraceSettings | None = None,
    ) -> None:
        self.settings = settings if settings is not None else TraceSettings(config)
        self._export_timeout = config.export_timeout_seconds
        self._provider = TracerProvider(resource=process_resource(config, role))
        exporter = OTLPSpanExporter(
            endpoint=config.endpoint or None, timeout=config.export_timeout_seconds
        )
        self._export = _BoundedExport(exporter, config)
        self._provider.add_span_processor(self._export)
        self._tracer = self._provider.get_tracer("kserve_trio")
        self._ids = RandomIdGenerator()
        if registry is not None:
            registry.register(_DroppedSpans(self, f"{metric_prefix}_traces_dropped_total"))

    def begin(
        self,
        name: str,
        model: str,
        context: str | None,
        *,
        kind: SpanKind = SpanKind.SERVER,
        start_mono_ns: int | None = None,
        attributes: Attributes | Callable[[], Attributes] | None = None,
    ) -> RequestSpan | None:
        """The request's span when the settings trace it (``TraceSettings.sample``), else None.
        ``context`` (``trace_settings.caller_context``) with a valid ``traceparent`` makes it
        the caller's child, its ``tracestate`` carried on; a caller's sampled-out context is
        not traced. ``attributes`` may be a function, called only for a request that is
        traced (most are not: reading them costs the others nothing)."""
        parent = parent_context(context)
        if not self.settings.sample(model, _sampled(parent)):
            return None
        offset = time.time_ns() - time.monotonic_ns()
        start = None if start_mono_ns is None else start_mono_ns + offset
        attrs: dict[str, str | int | float | bool] = {
            "rpc.system": "grpc",
            "rpc.service": RPC_SERVICE,
            "rpc.method": name,
        }
        if model:
            attrs["kserve_trio.model"] = model
        if callable(attributes):
            attributes = attributes()
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
        served: int,
        attributes: Attributes,
    ) -> SpanContext:
        """One execution on the device (``execution``), for the traced requests among the
        ``served`` it ran; each request's ``execute`` span links to the context returned.
        Rules:

        1. it served one request: the span is that request's child, in its trace;
        2. it coalesced several: the span is a root linked to every traced one (a batch has
           many parents; OpenTelemetry's messaging conventions link a batch the same way),
           so it is exported once, not copied into every request's trace.
        """
        offset = time.time_ns() - time.monotonic_ns()
        parent = Context()
        if served == 1 and len(members) == 1:
            parent = otel_trace.set_span_in_context(otel_trace.NonRecordingSpan(members[0]))
        span = self._tracer.start_span(
            "execution",
            parent,
            kind=SpanKind.INTERNAL,
            attributes={"kserve_trio.model": model, "kserve_trio.requests": served, **attributes},
            links=[Link(c) for c in members] if served > 1 else (),
            start_time=start_mono_ns + offset,
        )
        span.end(end_time=max(end_mono_ns, start_mono_ns) + offset)
        return span.get_span_context()

    def sampled_out(self) -> dict[str, str]:
        """The ``traceparent`` of a request this process chose not to trace (a new trace id,
        flags ``00``): a callee that honours its caller's decision (a worker behind the
        gateway) does not trace it either, so one rate, the first hop's, decides."""
        ids = self._ids
        return {TRACEPARENT: f"00-{ids.generate_trace_id():032x}-{ids.generate_span_id():016x}-00"}

    def dropped_spans(self) -> int:
        """Spans dropped so far because ``max_queue_size`` spans were pending export."""
        return self._export.dropped

    def flush(self, timeout_seconds: float = 5.0) -> bool:
        """Export every finished span now (bounded); True when all went."""
        return self._provider.force_flush(int(timeout_seconds * 1000))

    def close(self) -> None:
        """Flush what is pending within one export timeout, then stop the exporter thread
        (the process is ending; a collector that does not answer delays it by that much)."""
        self._provider.force_flush(int(self._export_timeout * 1000))
        self._provider.shutdown()


def process_resource(config: TracingConfig, role: str) -> Resource:
    """The process's resource: ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME`` (read by
    ``Resource.create``), then ``tracing.resource`` and ``tracing.service_name`` over them;
    without any service name, ``kserve_trio-<role>``."""
    attributes: dict[str, str] = dict(config.resource)
    if config.service_name:
        attributes["service.name"] = config.service_name
    resource = Resource.create(attributes)
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        # The SDK's stand-in when nothing named the service: the process's role instead.
        resource = resource.merge(Resource({"service.name": f"kserve_trio-{role}"}))
    return resource


def open_tracing(
    config: TracingConfig,
    *,
    role: str,
    metric_prefix: str,
    registry: CollectorRegistry | None = None,
    settings: TraceSettings | None = None,
) -> Tracing:
    """The process's ``Tracing`` (module docstring); ``settings``: the ones the TraceSetting
    RPC changed before the tracer existed (a live turn-on), else new ones from ``config``."""
    return Tracing(
        config, role=role, metric_prefix=metric_prefix, registry=registry, settings=settings
    )


__all__ = [
    "RPC_SERVICE",
    "RequestSpan",
    "Tracing",
    "open_tracing",
    "parent_context",
    "process_resource",
]

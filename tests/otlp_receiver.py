"""A collector for the tracing tests: an OTLP/HTTP receiver on a loopback port that decodes each
``ExportTraceServiceRequest`` (protobuf) into plain ``ReceivedSpan`` records, so a test asserts on
what a real exporter really sent. ``hold()`` makes it keep the next export requests unanswered
until ``release()`` (a collector that has stalled), for the bounded-queue test."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.waiting import wait_until


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, its ids in W3C hex."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, object]
    links: tuple[tuple[str, str], ...]
    status_code: int
    service: str
    trace_state: str = ""
    resource: dict[str, object] = field(default_factory=dict)


def _value(v) -> object:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@dataclass
class OtlpReceiver:
    """The receiver's state; ``url`` is the traces endpoint to configure."""

    url: str = ""
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    waiting: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _gate: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._gate.set()

    def add(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        out = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            service = str(resource.get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.append(
                        ReceivedSpan(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            links=tuple((ln.trace_id.hex(), ln.span_id.hex()) for ln in s.links),
                            status_code=s.status.code,
                            service=service,
                            trace_state=s.trace_state,
                            resource=resource,
                        )
                    )
        with self._lock:
            self.spans.extend(out)
            self.requests += 1

    def named(self, name: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.name == name]

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, name: str, count: int = 1, timeout: float = 30.0) -> list[ReceivedSpan]:
        """The spans called ``name`` once at least ``count`` have arrived."""
        return wait_until(
            lambda: (found := self.named(name)) and len(found) >= count and found,
            timeout,
            f"{count} span(s) named {name!r} at the receiver",
        )

    def hold(self) -> None:
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()


@contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """A receiver serving on 127.0.0.1 (an ephemeral port) until the block ends."""
    receiver = OtlpReceiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            with receiver._lock:
                receiver.waiting += 1
            receiver._gate.wait()
            with receiver._lock:
                receiver.waiting -= 1
            receiver.add(body)
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver.release()
        server.shutdown()
        server.server_close()
        thread.join()


__all__ = ["OtlpReceiver", "ReceivedSpan", "otlp_receiver"]

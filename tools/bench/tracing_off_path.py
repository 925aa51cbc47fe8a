"""What tracing costs a request while it is off, in numbers: every step the request path takes
only because tracing exists, timed in this one process (``timeit``), in ns per request, per call
site and summed per path, and set against the worker's CPU per request (``--cpu-us``: measure it
with ``tools/bench/tracing.py`` or take docs/benchmarks.md's identity [1,16] figure).

The state measured is a server whose configuration has ``tracing.level: off`` with the
``tracing`` extra installed (so TraceSetting can turn tracing on live): no tracer exists yet.
A call site is timed as the request path makes the call (real ``TraceControl``, ``Call``,
``InferenceCore``, ``RequestTrace`` and ``QueuedRequest`` objects) against the same step without
the tracing part; its cost is the difference of the two minima (``timeit``'s rule: the minimum
is the figure least disturbed by the rest of the machine). Where the tracing part is an
argument or a closure (handler shapes, the gateway's attempt closure) the two shapes are
written here beside each other, each naming the code it mirrors.

Call sites (``SITES``), with the paths that take them (``PATHS``):

- ``worker.grpc.context_reader``: the worker's gRPC ModelInfer reads the caller's context
  through ``TraceControl.caller_context`` (None before a tracer exists) and hands it on as a
  third argument and a keyword (``serving/grpc/_methods.py`` ``_unary_with_header``,
  ``worker/service.py`` ``model_infer_traced``);
- ``worker.core.branch``: ``InferenceCore.infer``'s ``trace is None`` and ``_tracing is not
  None`` tests;
- ``worker.request_trace.fields`` / ``worker.queued_request.fields``: the span fields of
  ``RequestTrace`` and ``QueuedRequest``, set to None by their constructors;
- ``worker.scheduler.span_copies``: ``Scheduler.infer`` copies ``span`` in and ``batch_span``
  out;
- ``worker.dispatch.checks``: the dispatch loop's two ``tracing is not None`` tests per
  execution (one execution per request at c=1; fewer when requests coalesce);
- ``worker.rest.traced`` / ``worker.stream.traced``: ``core.traced`` before reading a REST
  request's or a stream message's context;
- ``frontend.grpc.header_scan`` / ``frontend.stream.header_scan``: a front end looks for a
  ``traceparent`` among the call's headers (absent: a scan of them all) and sends what it found;
- ``device.forwarded.kwarg``: the device process passes a forwarded request's context on;
- ``gateway.model_infer.branch``, ``gateway.forward.closure``, ``gateway.rest.branch``: the
  gateway's ``tracing is not None`` tests, and the per-request attempt closure of
  ``Forwarder.infer`` with its ``span`` test.

Usage: .venv/bin/python tools/bench/tracing_off_path.py [--cpu-us 400] [--gateway-cpu-us U]
           [--number 200000] [--repeat 7] [--json build/bench-tracing/off_path.json]
Smoke: .venv/bin/python tools/bench/tracing_off_path.py --number 2000 --repeat 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kserve_trio.core.process import TracingConfig  # noqa: E402
from kserve_trio.serving.grpc import Call, Limits  # noqa: E402
from kserve_trio.serving.trace_control import TraceControl, tracing_installed  # noqa: E402
from kserve_trio.serving.trace_settings import caller_context  # noqa: E402
from kserve_trio.worker.inference import InferenceCore  # noqa: E402
from kserve_trio.worker.model_state import QueuedRequest, RequestTrace  # noqa: E402

GRPC_HEADERS = [
    (":scheme", "http"),
    (":method", "POST"),
    (":authority", "127.0.0.1:8001"),
    (":path", "/inference.GRPCInferenceService/ModelInfer"),
    ("te", "trailers"),
    ("content-type", "application/grpc"),
    ("user-agent", "grpc-python/1.76.0 grpc-c/51.0.0 (linux; chttp2)"),
    ("grpc-accept-encoding", "identity, deflate, gzip"),
]
"""A tritonclient (grpcio) ModelInfer's request headers, as ``read_request`` keeps them: no
``traceparent``, so a front end's look for it scans them all."""

SPAN_FIELDS = ("span", "batch_span", "subcalls")
"""The fields ``RequestTrace`` and ``QueuedRequest`` carry for tracing only."""


def _without(cls: type, name: str) -> type:
    """``cls`` rebuilt without its tracing fields (the same slots dataclass otherwise)."""
    kept = []
    for f in dataclasses.fields(cls):
        if f.name in SPAN_FIELDS:
            continue
        if f.default_factory is not dataclasses.MISSING:
            kept.append((f.name, Any, dataclasses.field(default_factory=f.default_factory)))
        elif f.default is not dataclasses.MISSING:
            kept.append((f.name, Any, dataclasses.field(default=f.default)))
        else:
            kept.append((f.name, Any))
    params = cls.__dataclass_params__  # type: ignore[attr-defined]
    return dataclasses.make_dataclass(name, kept, slots=True, eq=params.eq)


@dataclass(frozen=True)
class Site:
    """One call site: ``traced`` runs one request's worth of the step as the path makes it,
    ``plain`` the same step without its tracing part."""

    name: str
    where: str
    traced: Callable[[], object]
    plain: Callable[[], object]


def _nothing() -> None:
    return None


def build_sites() -> list[Site]:
    control = TraceControl(TracingConfig(), role="worker", metric_prefix="worker")
    assert control.tracer is None
    call = Call(None, 1, GRPC_HEADERS[3][1], GRPC_HEADERS, "identity", Limits(1 << 20, 1 << 20), "ModelInfer")  # type: ignore[arg-type]  # fmt: skip
    core = InferenceCore(
        repository=SimpleNamespace(scheduler=None),  # type: ignore[arg-type]
        observer=None,  # type: ignore[arg-type]
        shm_registry=None,
        admission=None,  # type: ignore[arg-type]
        meta_pool=None,
    )
    request, deadline = object(), 0
    rest_headers = {"content-type": "application/json", "host": "127.0.0.1:8000"}

    # The handler shapes, as worker/service.py and worker/forwarded.py call the core.
    def infer(request: object, *, transport_deadline_ns: int = 0, trace_context: Any = None):
        return None

    def handler_traced(request: object, deadline_ns: int, context: str | None) -> None:
        return infer(request, transport_deadline_ns=deadline_ns, trace_context=context)

    def handler_plain(request: object, deadline_ns: int) -> None:
        return infer(request, transport_deadline_ns=deadline_ns)

    # The front end's forward, as frontend/forwarding.py's _forward_infer / _forward call it.
    def forward_traced(data: object, deadline_ns: int, context: str | None) -> None:
        return None

    def forward_plain(data: object, deadline_ns: int) -> None:
        return None

    # Forwarder.infer's attempt closure (gateway/request_path/forward.py), with and without
    # its span part.
    def gateway_infer_traced(span: object = None) -> object:
        def attempt(client: object, attempt_deadline: float) -> object:
            if span is not None:
                return _traced_attempt(span, client, attempt_deadline)
            return client

        async def _traced_attempt(span: object, client: object, attempt_deadline: float):
            return client

        return attempt(call, 0.0)

    def gateway_infer_plain() -> object:
        def attempt(client: object, attempt_deadline: float) -> object:
            return client

        return attempt(call, 0.0)

    untraced_trace = _without(RequestTrace, "UntracedRequestTrace")
    untraced_queued = _without(QueuedRequest, "UntracedQueuedRequest")
    arrays: list = []
    trace, queued = RequestTrace(), QueuedRequest(arrays, None, 1, 0, 0, "")
    dispatch = SimpleNamespace(cache=SimpleNamespace(loads=0), tracing=None)
    gateway = SimpleNamespace(tracing=None)
    trace_arg = None

    def span_copies() -> None:
        queued.span = trace.span
        trace.batch_span = queued.batch_span

    def dispatch_checks() -> None:
        d = dispatch
        _loads = d.cache.loads if d.cache is not None and d.tracing is not None else 0
        if d.tracing is not None:
            pass

    return [
        Site(
            "worker.grpc.context_reader",
            "serving/grpc/_methods.py _unary_with_header; worker/service.py model_infer_traced",
            lambda: handler_traced(request, deadline, control.caller_context(call.header)),
            lambda: handler_plain(request, deadline),
        ),
        Site(
            "worker.core.branch",
            "worker/inference.py InferenceCore.infer",
            lambda: trace_arg is None and core._tracing is not None,
            _nothing,
        ),
        Site(
            "worker.request_trace.fields",
            "worker/model_state.py RequestTrace",
            RequestTrace,
            untraced_trace,
        ),
        Site(
            "worker.queued_request.fields",
            "worker/model_state.py QueuedRequest",
            lambda: QueuedRequest(arrays, None, 1, 0, 0, ""),
            lambda: untraced_queued(arrays, None, 1, 0, 0, ""),
        ),
        Site(
            "worker.scheduler.span_copies",
            "worker/scheduler.py Scheduler.infer",
            span_copies,
            _nothing,
        ),
        Site("worker.dispatch.checks", "worker/dispatch.py _execute", dispatch_checks, _nothing),
        Site(
            "worker.rest.traced",
            "worker/rest.py (ModelInfer)",
            lambda: caller_context(rest_headers.get) if core.traced else None,
            _nothing,
        ),
        Site(
            "worker.stream.traced",
            "worker/stream.py (each message)",
            lambda: caller_context(call.header) if core.traced else None,
            _nothing,
        ),
        Site(
            "frontend.grpc.header_scan",
            "frontend/forwarding.py forwarded_methods (bytes_unary_with_header)",
            lambda: forward_traced(request, deadline, caller_context(call.header)),
            lambda: forward_plain(request, deadline),
        ),
        Site(
            "frontend.stream.header_scan",
            "frontend/forwarding.py ForwardedStream._one (each message)",
            lambda: caller_context(call.header) if True else None,
            _nothing,
        ),
        Site(
            "device.forwarded.kwarg",
            "worker/forwarded.py ForwardedRpcs.serve",
            lambda: infer(request, transport_deadline_ns=deadline, trace_context=None),
            lambda: infer(request, transport_deadline_ns=deadline),
        ),
        Site(
            "gateway.model_infer.branch",
            "gateway/request_path/service.py model_infer; gateway/request_path/stream.py _one",
            lambda: gateway.tracing is not None,
            _nothing,
        ),
        Site(
            "gateway.forward.closure",
            "gateway/request_path/forward.py Forwarder.infer (attempt closure)",
            gateway_infer_traced,
            gateway_infer_plain,
        ),
        Site(
            "gateway.rest.branch",
            "gateway/request_path/rest_forward.py ModelRequests._infer / attempt",
            lambda: gateway.tracing is None and trace_arg is None,
            _nothing,
        ),
    ]


_WORKER_CORE = (
    "worker.core.branch",
    "worker.request_trace.fields",
    "worker.queued_request.fields",
    "worker.scheduler.span_copies",
    "worker.dispatch.checks",
)
PATHS: dict[str, tuple[str, ...]] = {
    "worker gRPC ModelInfer (one process)": ("worker.grpc.context_reader", *_WORKER_CORE),
    "worker gRPC ModelInfer (front ends; both processes)": (
        "frontend.grpc.header_scan",
        "device.forwarded.kwarg",
        *_WORKER_CORE,
    ),
    "worker REST ModelInfer": ("worker.rest.traced", *_WORKER_CORE),
    "worker stream message (one process)": ("worker.stream.traced", *_WORKER_CORE),
    "worker stream message (front ends)": (
        "frontend.stream.header_scan",
        "device.forwarded.kwarg",
        *_WORKER_CORE,
    ),
    "gateway gRPC ModelInfer": ("gateway.model_infer.branch", "gateway.forward.closure"),
    "gateway REST ModelInfer": ("gateway.rest.branch",),
}
"""Each path's tracing call sites (a request takes each once)."""


def per_call_ns(fn: Callable[[], object], number: int, repeat: int) -> float:
    """The fastest of ``repeat`` runs of ``number`` calls, per call (timeit's rule)."""
    return min(timeit.Timer(fn).repeat(repeat=repeat, number=number)) / number * 1e9


def measure(sites: list[Site], number: int, repeat: int) -> dict[str, dict[str, float]]:
    """Per site: the traced and plain steps' ns per call and their difference (at least 0)."""
    out = {}
    for site in sites:
        traced = per_call_ns(site.traced, number, repeat)
        plain = per_call_ns(site.plain, number, repeat)
        out[site.name] = {
            "traced_ns": traced,
            "plain_ns": plain,
            "cost_ns": max(0.0, traced - plain),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cpu-us",
        type=float,
        default=400.0,
        help="the worker's CPU per request at identity [1,16], in us (measured)",
    )
    parser.add_argument(
        "--gateway-cpu-us",
        type=float,
        default=0.0,
        help="the gateway's CPU per request, in us (0: not compared)",
    )
    parser.add_argument("--number", type=int, default=200_000, help="calls per timing run")
    parser.add_argument("--repeat", type=int, default=7, help="timing runs per step (min taken)")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)  # fmt: skip

    sites = build_sites()
    figures = measure(sites, args.number, args.repeat)
    where = {s.name: s.where for s in sites}
    loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
    print(f"tracing off (extra installed: {tracing_installed()}; OpenTelemetry modules loaded: "
          f"{len(loaded)}), {args.number} calls x {args.repeat}")  # fmt: skip
    print(f"{'call site':32} {'cost ns':>8} {'with':>8} {'without':>8}  where")
    for name, f in figures.items():
        print(
            f"{name:32} {f['cost_ns']:8.1f} {f['traced_ns']:8.1f} {f['plain_ns']:8.1f}  {where[name]}"
        )
    print()
    totals = {}
    print(f"{'path':52} {'ns/request':>10} {'of CPU/request':>15}")
    for path, names in PATHS.items():
        total = sum(figures[n]["cost_ns"] for n in names)
        basis = args.gateway_cpu_us if path.startswith("gateway") else args.cpu_us
        share = f"{total / (basis * 1e3):.4%}" if basis else "-"
        totals[path] = {"ns": total, "share": total / (basis * 1e3) if basis else None}
        print(f"{path:52} {total:10.1f} {share:>15}")
    print(f"\nCPU per request compared with: worker {args.cpu_us} us"
          + (f", gateway {args.gateway_cpu_us} us" if args.gateway_cpu_us else ""))  # fmt: skip
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "number": args.number, "repeat": args.repeat, "cpu_us": args.cpu_us,
            "gateway_cpu_us": args.gateway_cpu_us, "opentelemetry_loaded": loaded,
            "sites": figures, "paths": totals,
        }, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

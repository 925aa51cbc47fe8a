"""Tracing through a CLI worker with two front-end processes (on uvloop, then on trio),
configured by its flags and the standard OpenTelemetry variables: the caller's W3C context
crosses a front end's channel to the device process (gRPC metadata and REST header,
``tracestate`` with it), a stream's messages are each a span, TraceSetting is answered through
either front end, and the worker's JSON log lines of a traced request carry its ``trace_id``
and ``span_id``; a worker started with tracing off turns it on live through a front end, after
which every front end carries the caller's context, and off again; ``worker --help`` names the
tracing flags."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.e2e.conftest import WorkerProcess
from tests.otlp_receiver import otlp_receiver
from tests.ports import free_port
from tests.waiting import wait_until

TRACE = "5bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "10f067aa0ba902b7"


@pytest.fixture(scope="module", params=["uvloop", "trio"])
def event_loop_name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def receiver(event_loop_name):
    with otlp_receiver() as rx:  # one per event loop: request ids repeat
        yield rx


@pytest.fixture(scope="module")
def worker(demo_repo, receiver, event_loop_name):
    http_port = free_port()
    w = WorkerProcess(
        demo_repo,
        "--frontend-processes",
        "2",
        "--http-port",
        str(http_port),
        "--log-level",
        "debug",
        "--event-loop",
        event_loop_name,
        "--trace-level",
        "timestamps",
        env={
            # The standard variables; ours win where both are set (the service name).
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url.removesuffix("/v1/traces"),
            "OTEL_SERVICE_NAME": "overridden",
            "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=e2e,team=ml%20infra",
            "INFERENCE_SERVER_TRACING_SCHEDULE_DELAY_SECONDS": "0.05",
            "INFERENCE_SERVER_TRACING_SERVICE_NAME": "traced-worker",
            "INFERENCE_SERVER_TRACING_RESOURCE": "team=serving",
        },
    )
    w.http_port = http_port
    try:
        w.wait_ready()
        yield w
    finally:
        w.terminate()


def _input(module):
    x = np.ones((1, 16), np.float32)
    inp = module.InferInput("input_0", [1, 16], "FP32")
    inp.set_data_from_numpy(x)
    return inp


def _span_of(receiver, request_id: str):
    return wait_until(
        lambda: [
            s
            for s in receiver.named("ModelInfer")
            if s.attributes.get("kserve_trio.request_id") == request_id
        ],
        60,
        f"the span of {request_id}",
    )[0]


def test_the_callers_context_crosses_the_front_ends_to_the_device_process(worker, receiver):
    for i in range(4):  # connections spread over both front ends
        with grpcclient.InferenceServerClient(worker.url) as c:
            c.infer(
                "mlp",
                [_input(grpcclient)],
                request_id=f"fe-{i}",
                headers={"traceparent": f"00-{TRACE}-{PARENT}-01"},
            )
    for i in range(4):
        span = _span_of(receiver, f"fe-{i}")
        assert (span.trace_id, span.parent_span_id) == (TRACE, PARENT)
        assert span.service == "traced-worker"
        assert span.resource["deployment.environment"] == "e2e"
        assert span.resource["team"] == "serving"
    rest = httpclient.InferenceServerClient(f"127.0.0.1:{worker.http_port}")
    rest.infer(
        "mlp",
        [_input(httpclient)],
        request_id="fe-rest",
        headers={"traceparent": f"00-{'a' * 32}-{'b' * 16}-01", "tracestate": "v=rest"},
    )
    span = _span_of(receiver, "fe-rest")
    assert (span.trace_id, span.parent_span_id) == ("a" * 32, "b" * 16)
    assert span.trace_state == "v=rest"
    assert span.attributes["http.route"] == "/v2/models/{model_name}/infer"


def test_a_streams_messages_are_spans_across_the_front_ends(worker, receiver):
    trace = "c" * 32
    answers: list = []
    with grpcclient.InferenceServerClient(worker.url) as c:
        c.start_stream(
            callback=lambda result, error: answers.append(error or result),
            headers={"traceparent": f"00-{trace}-{'d' * 16}-01", "tracestate": "v=stream"},
        )
        for i in range(2):
            c.async_stream_infer("mlp", [_input(grpcclient)], request_id=f"fe-stream-{i}")
        wait_until(lambda: len(answers) == 2, 60, "the stream's answers")
        c.stop_stream()
    spans = wait_until(
        lambda: (
            (found := [s for s in receiver.trace(trace) if s.name == "ModelStreamInfer"])
            and len(found) == 2
            and found
        ),
        60,
        "a span per stream message",
    )
    assert {(s.parent_span_id, s.trace_state) for s in spans} == {("d" * 16, "v=stream")}


def test_trace_settings_through_a_front_end_apply_in_the_device_process(worker):
    with grpcclient.InferenceServerClient(worker.url) as c:
        c.update_trace_settings(settings={"trace_rate": "3"})
    rest = httpclient.InferenceServerClient(f"127.0.0.1:{worker.http_port}")
    try:
        assert rest.get_trace_settings()["trace_rate"] == "3"
    finally:
        rest.update_trace_settings(settings={"trace_rate": None})
    assert rest.get_trace_settings()["trace_rate"] == "1"


def test_log_lines_of_a_traced_request_carry_its_trace_and_span_ids(worker, receiver):
    with grpcclient.InferenceServerClient(worker.url) as c:
        c.infer(
            "mlp",
            [_input(grpcclient)],
            request_id="logged-1",
            headers={"traceparent": f"00-{TRACE}-{PARENT}-01"},
        )
    span = _span_of(receiver, "logged-1")

    def done_line():
        for line in worker.log_path.read_text(errors="replace").splitlines():
            if '"logged-1"' in line and "request_done" in line:
                return json.loads(line)
        return None

    line = wait_until(done_line, 30, "the request_done line of logged-1")
    assert line["trace_id"] == TRACE
    assert line["span_id"] == span.span_id


def test_the_workers_help_names_its_tracing_flags():
    out = subprocess.run(
        [sys.executable, "-m", "kserve_trio", "worker", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    for flag in ("--trace-level", "--trace-rate", "--trace-count", "--trace-endpoint"):
        assert flag in out


@pytest.fixture(scope="module")
def untraced_worker(demo_repo, receiver, event_loop_name):
    """A worker with two front ends started with tracing off (its exporter's endpoint set)."""
    http_port = free_port()
    w = WorkerProcess(
        demo_repo,
        "--frontend-processes",
        "2",
        "--http-port",
        str(http_port),
        "--event-loop",
        event_loop_name,
        env={
            "INFERENCE_SERVER_TRACING_ENDPOINT": receiver.url,
            "INFERENCE_SERVER_TRACING_SCHEDULE_DELAY_SECONDS": "0.05",
            "INFERENCE_SERVER_TRACING_SERVICE_NAME": "live-worker",
        },
    )
    w.http_port = http_port
    try:
        w.wait_ready()
        yield w
    finally:
        w.terminate()


def test_tracing_turned_on_live_through_a_front_end_reaches_every_front_end(
    untraced_worker, receiver
):
    trace, parent = "e1" * 16, "f2" * 8

    def caller() -> dict[str, str]:  # a dict per call: tritonclient.http adds to the one given
        return {"traceparent": f"00-{trace}-{parent}-01"}

    def infer(request_id: str, model: str = "mlp") -> None:
        with grpcclient.InferenceServerClient(untraced_worker.url) as c:  # a new connection
            c.infer(model, [_input(grpcclient)], request_id=request_id, headers=caller())

    rest = httpclient.InferenceServerClient(f"127.0.0.1:{untraced_worker.http_port}")
    infer("live-cold-0")
    with grpcclient.InferenceServerClient(untraced_worker.url) as c:
        on = c.update_trace_settings("mlp", {"trace_level": ["TIMESTAMPS"]}, as_json=True)
        assert on["settings"]["trace_level"]["value"] == ["TIMESTAMPS"]
    # Connections spread over both front ends: each carries the caller's context now.
    for i in range(8):
        infer(f"live-fe-{i}")
    rest.infer("mlp", [_input(httpclient)], request_id="live-fe-rest", headers=caller())
    for request_id in [*(f"live-fe-{i}" for i in range(8)), "live-fe-rest"]:
        span = _span_of(receiver, request_id)
        assert (span.trace_id, span.parent_span_id) == (trace, parent)
        assert span.service == "live-worker"
    # Off again (the model's setting cleared: the global OFF), over REST.
    assert rest.update_trace_settings("mlp", {"trace_level": None})["trace_level"] == ["OFF"]
    for i in range(4):
        infer(f"live-off-{i}")
    rest.update_trace_settings("mlp_softmax", {"trace_level": ["TIMESTAMPS"]})
    try:
        infer("live-sentinel", "mlp_softmax")  # once its span is in, every earlier one is
        _span_of(receiver, "live-sentinel")
    finally:
        rest.update_trace_settings("mlp_softmax", {"trace_level": None})
    seen = {s.attributes.get("kserve_trio.request_id") for s in receiver.named("ModelInfer")}
    assert not {"live-cold-0", *(f"live-off-{i}" for i in range(4))} & seen

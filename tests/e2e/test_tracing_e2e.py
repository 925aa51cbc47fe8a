"""Tracing through a CLI worker with two front-end processes, configured by the environment: the
caller's W3C context crosses a front end's channel to the device process (gRPC metadata and REST
header), TraceSetting is answered through either front end, and the worker's JSON log lines of
a traced request carry its ``trace_id`` and ``span_id``."""

from __future__ import annotations

import json

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


@pytest.fixture(scope="module")
def receiver():
    with otlp_receiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def worker(demo_repo, receiver):
    http_port = free_port()
    w = WorkerProcess(
        demo_repo,
        "--frontend-processes",
        "2",
        "--http-port",
        str(http_port),
        "--log-level",
        "debug",
        env={
            "INFERENCE_SERVER_TRACING_LEVEL": "timestamps",
            "INFERENCE_SERVER_TRACING_ENDPOINT": receiver.url,
            "INFERENCE_SERVER_TRACING_SCHEDULE_DELAY_SECONDS": "0.05",
            "INFERENCE_SERVER_TRACING_SERVICE_NAME": "traced-worker",
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
    rest = httpclient.InferenceServerClient(f"127.0.0.1:{worker.http_port}")
    rest.infer(
        "mlp",
        [_input(httpclient)],
        request_id="fe-rest",
        headers={"traceparent": f"00-{'a' * 32}-{'b' * 16}-01"},
    )
    span = _span_of(receiver, "fe-rest")
    assert (span.trace_id, span.parent_span_id) == ("a" * 32, "b" * 16)


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

"""Tracing in the worker, against a real OTLP/HTTP receiver: a request's server span continues the
caller's W3C trace (gRPC metadata and HTTP header) with its phases as children, Triton's
TraceSetting RPC changes what is traced (globally and per model, gRPC and REST, stock
tritonclient), a stalled collector costs a bounded queue whose drops are counted, and a worker
without tracing imports nothing of OpenTelemetry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from tests.inprocess import in_process_worker
from tests.otlp_receiver import OtlpReceiver, otlp_receiver
from tests.ports import free_port
from tests.waiting import wait_until

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"


def tracing_block(receiver: OtlpReceiver, **extra) -> dict:
    return {
        "level": "timestamps",
        "endpoint": receiver.url,
        "schedule_delay_seconds": 0.05,
        **extra,
    }


def mlp_inputs(client_module) -> list:
    x = np.ones((2, 16), np.float32)
    inp = client_module.InferInput("input_0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return [inp]


@pytest.fixture(scope="module")
def receiver():
    with otlp_receiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def traced_worker(demo_repo, receiver):
    with in_process_worker(
        demo_repo,
        endpoints={"port": 0, "http_port": free_port(), "metrics_port": free_port()},
        tracing=tracing_block(receiver),
    ) as running:
        yield running


def _grpc(running) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(running.address)


def _http(running) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(f"127.0.0.1:{running.http_port}")


def _server_span(receiver: OtlpReceiver, request_id: str):
    found = wait_until(
        lambda: [
            s
            for s in receiver.named("ModelInfer")
            if s.attributes.get("kserve_trio.request_id") == request_id
        ],
        30,
        f"the server span of request {request_id}",
    )
    return found[0]


def test_a_grpc_request_continues_the_callers_trace_with_its_phases_as_children(
    traced_worker, receiver
):
    with _grpc(traced_worker) as c:
        c.infer(
            "mlp", mlp_inputs(grpcclient), request_id="g-1", headers={"traceparent": TRACEPARENT}
        )
    server = _server_span(receiver, "g-1")
    assert server.trace_id == CALLER_TRACE
    assert server.parent_span_id == CALLER_SPAN
    assert server.kind == 2  # SERVER
    assert server.service == "kserve_trio-worker"
    assert server.attributes["kserve_trio.model"] == "mlp"
    assert server.attributes["rpc.grpc.status_code"] == 0
    assert server.attributes["rpc.service"] == "inference.GRPCInferenceService"
    assert server.attributes["kserve_trio.model_version"] == "1"
    assert server.attributes["kserve_trio.rows"] == 2
    assert server.attributes["kserve_trio.bytes_in"] == 2 * 16 * 4
    assert server.attributes["kserve_trio.bytes_out"] > 0
    assert server.attributes["kserve_trio.shm_inputs"] == 0
    children = wait_until(
        lambda: (
            {
                s.name: s
                for s in receiver.trace(CALLER_TRACE)
                if s.parent_span_id == server.span_id
            }.keys()
            >= {"admission", "queue", "execute", "encode"}
            and {
                s.name: s
                for s in receiver.trace(CALLER_TRACE)
                if s.parent_span_id == server.span_id
            }
        ),
        30,
        "the request's phases",
    )
    assert children["execute"].attributes["kserve_trio.batch_size"] >= 2
    for child in children.values():
        assert server.start_ns <= child.start_ns <= child.end_ns <= server.end_ns
    assert children["admission"].end_ns <= children["queue"].start_ns
    assert children["queue"].end_ns <= children["execute"].start_ns


def test_a_rest_request_reads_the_traceparent_header(traced_worker, receiver):
    _http(traced_worker).infer(
        "mlp",
        mlp_inputs(httpclient),
        request_id="h-1",
        headers={"traceparent": f"00-{'1' * 32}-{'2' * 16}-01"},
    )
    server = _server_span(receiver, "h-1")
    assert server.trace_id == "1" * 32 and server.parent_span_id == "2" * 16


def test_without_a_traceparent_each_request_starts_a_trace_and_failures_are_errors(
    traced_worker, receiver
):
    with _grpc(traced_worker) as c:
        c.infer("mlp", mlp_inputs(grpcclient), request_id="root-1")
        bad = grpcclient.InferInput("input_0", [2, 15], "FP32")
        bad.set_data_from_numpy(np.ones((2, 15), np.float32))
        with pytest.raises(InferenceServerException):
            c.infer("mlp", [bad], request_id="bad-1")
    root = _server_span(receiver, "root-1")
    assert root.parent_span_id == "" and root.trace_id != CALLER_TRACE
    failed = _server_span(receiver, "bad-1")
    assert failed.attributes["rpc.grpc.status_code"] == 3  # INVALID_ARGUMENT
    assert failed.status_code == 2  # ERROR


def _settings(reply: dict) -> dict:
    return {k: v["value"] for k, v in reply["settings"].items()}


def test_trace_settings_are_read_and_changed_globally_and_per_model_over_grpc_and_rest(
    traced_worker, receiver
):
    with _grpc(traced_worker) as c:
        assert _settings(c.get_trace_settings(as_json=True)) == {
            "trace_level": ["TIMESTAMPS"],
            "trace_rate": ["1"],
            "trace_count": ["-1"],
            "log_frequency": ["0"],
            "trace_mode": ["opentelemetry"],
        }
        off = c.update_trace_settings("mlp", {"trace_level": "OFF"}, as_json=True)
        assert _settings(off)["trace_level"] == ["OFF"]
        assert _settings(c.get_trace_settings(as_json=True))["trace_level"] == ["TIMESTAMPS"]
        c.infer("mlp", mlp_inputs(grpcclient), request_id="untraced-1")
        c.infer("mlp_softmax", [_softmax_input()], request_id="traced-other")
        other = _server_span(receiver, "traced-other")
        wait_until(
            lambda: (
                "postprocess"
                in {
                    s.name
                    for s in receiver.trace(other.trace_id)
                    if s.parent_span_id == other.span_id
                }
            ),
            30,
            "the postprocess hook's span",
        )
        assert not [
            s
            for s in receiver.named("ModelInfer")
            if s.attributes.get("kserve_trio.request_id") == "untraced-1"
        ]
        # REST reads the model's settings and clears its override with null.
        rest = _http(traced_worker)
        assert rest.get_trace_settings("mlp")["trace_level"] == ["OFF"]
        cleared = rest.update_trace_settings("mlp", {"trace_level": None})
        assert cleared["trace_level"] == ["TIMESTAMPS"]
        # Triton's OpenTelemetry mode: log_frequency is kept and answered (it has no
        # effect there), the trace file is refused in Triton's words.
        freq = c.update_trace_settings("mlp", {"log_frequency": "5"}, as_json=True)
        assert _settings(freq)["log_frequency"] == ["5"]
        assert rest.update_trace_settings("mlp", {"log_frequency": None})["log_frequency"] == "0"
        with pytest.raises(InferenceServerException, match="trace file location") as refused:
            c.update_trace_settings(settings={"trace_file": "/tmp/t.json"})
        assert "UNIMPLEMENTED" in str(refused.value.status())
        with pytest.raises(InferenceServerException, match="trace file location"):
            rest.update_trace_settings(settings={"trace_file": "/tmp/t.json"})
        with pytest.raises(InferenceServerException, match="TENSORS"):
            c.update_trace_settings(settings={"trace_level": ["TENSORS"]})
        with pytest.raises(InferenceServerException, match="no_such_model"):
            c.get_trace_settings("no_such_model")
        assert "trace" in c.get_server_metadata(as_json=True)["extensions"]


def test_trace_count_turns_tracing_off_once_spent(traced_worker, receiver):
    with _grpc(traced_worker) as c:
        c.update_trace_settings("mlp_softmax", {"trace_count": "1"})
        try:
            c.infer("mlp_softmax", [_softmax_input()], request_id="count-1")
            c.infer("mlp_softmax", [_softmax_input()], request_id="count-2")
            assert _settings(c.get_trace_settings("mlp_softmax", as_json=True))["trace_count"] == [
                "0"
            ]
            _server_span(receiver, "count-1")
            assert not [
                s
                for s in receiver.named("ModelInfer")
                if s.attributes.get("kserve_trio.request_id") == "count-2"
            ]
        finally:
            c.update_trace_settings("mlp_softmax", {"trace_count": None})


def _softmax_input():
    x = np.ones((1, 16), np.float32)
    inp = grpcclient.InferInput("input_0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def _metric(running, name: str) -> float:
    url = f"http://127.0.0.1:{running.metrics_port}/metrics"
    with urllib.request.urlopen(url) as r:
        text = r.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    )


def test_a_stalled_collector_costs_a_bounded_queue_and_the_drops_are_counted(demo_repo):
    with otlp_receiver() as rx:
        rx.hold()
        block = tracing_block(rx, max_queue_size=2, max_export_batch_size=1)
        with in_process_worker(
            demo_repo, endpoints={"port": 0, "metrics_port": free_port()}, tracing=block
        ) as running:
            try:
                with _grpc(running) as c:
                    assert _metric(running, "worker_traces_dropped_total") == 0
                    c.infer("mlp_softmax", [_softmax_input()])
                    wait_until(lambda: rx.waiting >= 1, 30, "an export held by the collector")
                    # One export is held, at most two spans wait: the rest are dropped.
                    c.infer("mlp_softmax", [_softmax_input()])
                    assert _metric(running, "worker_traces_dropped_total") > 0
            finally:
                rx.release()
            wait_until(lambda: rx.requests >= 1, 30, "the held export answered")


def test_tracing_off_changes_only_to_off_and_imports_no_opentelemetry(demo_repo, tmp_path):
    script = tmp_path / "off.py"
    script.write_text(
        "import sys, json\n"
        "import numpy as np, tritonclient.grpc as g\n"
        "from tritonclient.utils import InferenceServerException\n"
        "from tests.inprocess import in_process_worker\n"
        f"with in_process_worker({str(demo_repo)!r}) as running:\n"
        "    c = g.InferenceServerClient(running.address)\n"
        "    x = g.InferInput('input_0', [1, 16], 'FP32')\n"
        "    x.set_data_from_numpy(np.ones((1, 16), np.float32))\n"
        "    c.infer('mlp_softmax', [x], headers={'traceparent': '" + TRACEPARENT + "'})\n"
        "    level = c.get_trace_settings(as_json=True)['settings']['trace_level']['value']\n"
        "    try:\n"
        "        c.update_trace_settings(settings={'trace_level': 'TIMESTAMPS'})\n"
        "        refused = ''\n"
        "    except InferenceServerException as e:\n"
        "        refused = str(e)\n"
        "    c.close()\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
        "print(json.dumps({'level': level, 'refused': refused, 'loaded': loaded}))\n"
    )
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["level"] == ["OFF"]
    assert "tracing.level" in result["refused"]
    assert result["loaded"] == []

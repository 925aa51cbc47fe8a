"""Tracing in the worker, against a real OTLP/HTTP receiver, on uvloop and on trio: a request's
server span continues the caller's W3C trace (gRPC metadata and HTTP header, ``tracestate``
passed on; a sampled-out caller is not traced) with its phases as children, a coalesced
execution is one span linked from each request it served, a meta model's sub-calls are child
spans, Triton's TraceSetting RPC changes what is traced (globally and per model, gRPC and REST,
stock tritonclient; rate 1 in N traces 10 of 10N), a stalled or absent collector costs a bounded
queue whose drops are counted, and a worker without tracing imports nothing of
OpenTelemetry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from tests.device_hold import hold_device
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


CHAIN_MANIFEST = """\
format_version: "2.0"
kind: meta
meta:
  calls: [mlp, mlp_softmax]
client_inputs:
  - {name: x, dtype: f32, shape: cn, dims: {c: 16}}
client_outputs:
  - {name: y, dtype: f32, shape: cn, dims: {c: 16}}
"""

CHAIN_MODEL_PY = """
import numpy as np
from kserve_trio.core.tensors.tensor import NamedTensor

def run(inputs, call):
    (x,) = inputs
    h = call("mlp", [NamedTensor.from_array("input_0", np.asarray(x.data))])[0].data
    call("mlp_softmax", [NamedTensor.from_array("input_0", np.asarray(x.data))])
    return [NamedTensor.from_array("y", np.asarray(x.data))]

register_meta_model("traced_chain", run=run)
"""


@pytest.fixture(scope="module")
def meta_repo(tmp_path_factory):
    """A meta model calling two of the demo repository's models."""
    repo = tmp_path_factory.mktemp("meta") / "models"
    (repo / "traced_chain").mkdir(parents=True)
    (repo / "traced_chain" / "manifest.yaml").write_text(CHAIN_MANIFEST)
    (repo / "traced_chain" / "model.py").write_text(textwrap.dedent(CHAIN_MODEL_PY))
    return repo


@pytest.fixture(scope="module", params=["uvloop", "trio"])
def event_loop_name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def receiver(event_loop_name):
    with otlp_receiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def traced_worker(demo_repo, meta_repo, receiver, event_loop_name):
    with in_process_worker(
        demo_repo,
        meta_repo,
        endpoints={
            "port": 0,
            "http_port": free_port(),
            "metrics_port": free_port(),
            "event_loop": event_loop_name,
        },
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


_OFF_WORKER_SCRIPT = """
import importlib.abc, json, sys
if {blocked!r}:
    class _NoOpenTelemetry(importlib.abc.MetaPathFinder):
        # The tracing extra as if it were not installed: every import of it fails.
        def find_spec(self, name, path, target=None):
            if name.split('.')[0] == 'opentelemetry':
                raise ModuleNotFoundError(f'No module named {{name!r}}', name=name)
            return None
    sys.meta_path.insert(0, _NoOpenTelemetry())
import numpy as np, tritonclient.grpc as g
from tritonclient.utils import InferenceServerException
from tests.inprocess import in_process_worker
def loaded():
    return sorted(m for m in sys.modules if m.startswith('opentelemetry'))
tracing = {{'endpoint': {endpoint!r}, 'schedule_delay_seconds': 0.05}}
with in_process_worker({repo!r}, tracing=tracing) as running:
    c = g.InferenceServerClient(running.address)
    x = g.InferInput('input_0', [1, 16], 'FP32')
    x.set_data_from_numpy(np.ones((1, 16), np.float32))
    c.infer('mlp_softmax', [x], request_id='off-1', headers={{'traceparent': {traceparent!r}}})
    out = {{'level': c.get_trace_settings(as_json=True)['settings']['trace_level']['value']}}
    out['loaded_while_off'] = loaded()
    try:
        c.update_trace_settings(settings={{'trace_level': 'TIMESTAMPS'}})
        out['refused'] = ''
    except InferenceServerException as e:
        out['refused'] = str(e)
    out['level_after'] = c.get_trace_settings(as_json=True)['settings']['trace_level']['value']
    c.infer('mlp_softmax', [x], request_id='on-1', headers={{'traceparent': {traceparent!r}}})
    out['loaded_after'] = loaded()
    c.close()
print(json.dumps(out))
"""


def _off_worker(demo_repo, tmp_path, receiver: OtlpReceiver, *, blocked: bool) -> dict:
    """A fresh process serving a worker started with tracing off: a request with a caller's
    context, then a live turn-on, then another request; what it saw and imported, as JSON.
    ``blocked``: the process cannot import OpenTelemetry (the extra not installed)."""
    script = tmp_path / "off.py"
    script.write_text(
        _OFF_WORKER_SCRIPT.format(
            blocked=blocked, endpoint=receiver.url, repo=str(demo_repo), traceparent=TRACEPARENT
        )
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
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tracing_off_imports_no_opentelemetry_until_turned_on_live(demo_repo, tmp_path):
    with otlp_receiver() as rx:
        result = _off_worker(demo_repo, tmp_path, rx, blocked=False)
        on = _server_span(rx, "on-1")
    assert result["level"] == ["OFF"]
    assert result["loaded_while_off"] == []  # a request with a context was served meanwhile
    assert result["refused"] == ""
    assert result["level_after"] == ["TIMESTAMPS"]
    assert "opentelemetry.sdk.trace" in result["loaded_after"]
    assert on.trace_id == CALLER_TRACE and on.parent_span_id == CALLER_SPAN
    assert not [
        s for s in rx.named("ModelInfer") if s.attributes.get("kserve_trio.request_id") == "off-1"
    ]


def test_without_the_tracing_extra_a_turn_on_is_refused_naming_it(demo_repo, tmp_path):
    with otlp_receiver() as rx:
        result = _off_worker(demo_repo, tmp_path, rx, blocked=True)
    assert "FAILED_PRECONDITION" in result["refused"]
    assert "'tracing' extra" in result["refused"]
    assert result["level_after"] == ["OFF"]  # nothing of the change was applied
    assert result["loaded_after"] == []


@pytest.fixture(scope="module")
def untraced_worker(demo_repo, receiver, event_loop_name):
    """A worker started with tracing off; its exporter's endpoint is set for a live turn-on."""
    with in_process_worker(
        demo_repo,
        endpoints={"port": 0, "http_port": free_port(), "event_loop": event_loop_name},
        tracing={"level": "off", "endpoint": receiver.url, "schedule_delay_seconds": 0.05},
    ) as running:
        yield running


def _request_ids(receiver: OtlpReceiver) -> set[object]:
    return {s.attributes.get("kserve_trio.request_id") for s in receiver.named("ModelInfer")}


def test_a_worker_started_with_tracing_off_turns_it_on_live_per_model_and_globally(
    untraced_worker, receiver
):

    def caller() -> dict[str, str]:  # a dict per call: tritonclient.http adds to the one given
        return {"traceparent": f"00-{'a' * 32}-{'b' * 16}-01"}

    rest = _http(untraced_worker)
    with _grpc(untraced_worker) as c:
        c.infer("mlp", mlp_inputs(grpcclient), request_id="cold-1", headers=caller())
        assert _settings(c.get_trace_settings(as_json=True))["trace_level"] == ["OFF"]
        # One model on, over gRPC: only its requests are traced.
        on = c.update_trace_settings("mlp_softmax", {"trace_level": ["TIMESTAMPS"]}, as_json=True)
        assert _settings(on)["trace_level"] == ["TIMESTAMPS"]
        assert _settings(c.get_trace_settings(as_json=True))["trace_level"] == ["OFF"]
        c.infer("mlp", mlp_inputs(grpcclient), request_id="cold-2", headers=caller())
        c.infer("mlp_softmax", [_softmax_input()], request_id="warm-1", headers=caller())
        warm = _server_span(receiver, "warm-1")
        assert warm.trace_id == "a" * 32 and warm.parent_span_id == "b" * 16
        # Globally on, over REST: every model's requests, REST's too.
        assert rest.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]})[
            "trace_level"
        ] == ["TIMESTAMPS"]
        rest.infer("mlp", mlp_inputs(httpclient), request_id="warm-rest", headers=caller())
        assert _server_span(receiver, "warm-rest").trace_id == "a" * 32
        # Off again, globally and for the model: nothing is traced.
        c.update_trace_settings("mlp_softmax", {"trace_level": None})
        rest.update_trace_settings(settings={"trace_level": ["OFF"]})
        c.infer("mlp", mlp_inputs(grpcclient), request_id="cold-3", headers=caller())
        c.infer("mlp_softmax", [_softmax_input()], request_id="cold-4", headers=caller())
        rest.infer("mlp", mlp_inputs(httpclient), request_id="cold-5", headers=caller())
        c.update_trace_settings("mlp", {"trace_level": ["TIMESTAMPS"]})
        try:
            _sentinel(c, receiver, "cold-sentinel")  # every span ended before it is in
        finally:
            c.update_trace_settings("mlp", {"trace_level": None})
    assert not {f"cold-{i}" for i in range(1, 6)} & _request_ids(receiver)


def _ids(receiver: OtlpReceiver, prefix: str) -> dict[str, object]:
    return {
        s.attributes["kserve_trio.request_id"]: s
        for s in receiver.named("ModelInfer")
        if str(s.attributes.get("kserve_trio.request_id", "")).startswith(prefix)
    }


def _sentinel(client, receiver: OtlpReceiver, request_id: str) -> None:
    """A traced request after the others, waited for at the receiver: the exporter sends in
    the order spans end, one export at a time, so every span ended before it has arrived."""
    client.infer(
        "mlp",
        mlp_inputs(grpcclient),
        request_id=request_id,
        headers={"traceparent": f"00-{'e' * 32}-{'f' * 16}-01"},
    )
    _server_span(receiver, request_id)


def test_four_coalesced_requests_are_four_traces_linking_one_execution_span(
    traced_worker, receiver
):
    hold = hold_device(traced_worker)
    results: list = []

    def one(i: int) -> None:  # 2 rows each: 8 rows, mlp's compiled batch of 8
        x = np.full((2, 16), i, np.float32)
        inp = grpcclient.InferInput("input_0", [2, 16], "FP32")
        inp.set_data_from_numpy(x)
        with _grpc(traced_worker) as c:
            results.append(c.infer("mlp", [inp], request_id=f"co-{i}"))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        wait_until(
            lambda: traced_worker.scheduler.scheduler_metrics()["mlp"].queue_depth == 4,
            30,
            "four requests queued behind the held device",
        )
    finally:
        hold.release()
    for t in threads:
        t.join(60)
    assert len(results) == 4
    servers = wait_until(
        lambda: (found := _ids(receiver, "co-")) and len(found) == 4 and found,
        30,
        "the four server spans",
    )
    assert len({s.trace_id for s in servers.values()}) == 4  # four traces

    def executes():
        out = [
            x
            for s in servers.values()
            for x in receiver.trace(s.trace_id)
            if x.name == "execute" and x.parent_span_id == s.span_id
        ]
        return len(out) == 4 and out

    linked = {x.links for x in wait_until(executes, 30, "each request's execute span")}
    assert len(linked) == 1  # every request links the same execution
    ((trace_id, span_id),) = linked.pop()
    execution = wait_until(
        lambda: [x for x in receiver.named("execution") if x.span_id == span_id],
        30,
        "the execution span",
    )[0]
    assert execution.trace_id == trace_id and execution.parent_span_id == ""
    assert set(execution.links) == {(s.trace_id, s.span_id) for s in servers.values()}
    attrs = execution.attributes
    assert (attrs["kserve_trio.requests"], attrs["kserve_trio.rows"]) == (4, 8)
    assert (attrs["kserve_trio.batch_size"], attrs["kserve_trio.padding"]) == (8, 0)
    assert attrs["kserve_trio.thread"] in ("device", "inline")
    # Exported once: no request's trace holds a copy of it.
    assert all(x.name != "execution" for s in servers.values() for x in receiver.trace(s.trace_id))


def test_a_meta_models_sub_calls_are_children_of_its_execution(traced_worker, receiver):
    x = np.ones((1, 16), np.float32)
    inp = grpcclient.InferInput("x", [1, 16], "FP32")
    inp.set_data_from_numpy(x)
    with _grpc(traced_worker) as c:
        c.infer("traced_chain", [inp], request_id="meta-1")
    server = _server_span(receiver, "meta-1")

    def subcalls():
        spans = receiver.trace(server.trace_id)
        execute = [s for s in spans if s.name == "execute" and s.parent_span_id == server.span_id]
        if not execute:
            return None
        children = sorted(
            (s for s in spans if s.parent_span_id == execute[0].span_id), key=lambda s: s.start_ns
        )
        return len(children) == 2 and (execute[0], children)

    execute, children = wait_until(subcalls, 30, "the meta model's sub-call spans")
    assert [c.name for c in children] == ["mlp", "mlp_softmax"]
    assert children[0].end_ns <= children[1].start_ns
    for child in children:
        assert execute.start_ns <= child.start_ns <= child.end_ns <= execute.end_ns
        assert child.attributes["kserve_trio.meta_call"] is True


def test_rate_one_in_n_on_ten_n_requests_traces_ten(traced_worker, receiver):
    n = 4
    with _grpc(traced_worker) as c:
        c.update_trace_settings("mlp_softmax", {"trace_rate": str(n)})
        try:
            for i in range(10 * n):
                c.infer("mlp_softmax", [_softmax_input()], request_id=f"rate-{i}")
        finally:
            c.update_trace_settings("mlp_softmax", {"trace_rate": None})
        _sentinel(c, receiver, "rate-sentinel")
    traced = _ids(receiver, "rate-")
    traced.pop("rate-sentinel")
    assert len(traced) == 10
    assert len({s.trace_id for s in traced.values()}) == 10
    assert {int(k.split("-")[1]) % n for k in traced} == {n - 1}  # every n-th


def test_a_sampled_out_caller_is_not_traced_and_tracestate_is_carried(traced_worker, receiver):
    trace = "7" * 32
    with _grpc(traced_worker) as c:
        c.infer(
            "mlp",
            mlp_inputs(grpcclient),
            request_id="out-1",
            headers={"traceparent": f"00-{trace}-{'8' * 16}-00"},
        )
        c.infer(
            "mlp",
            mlp_inputs(grpcclient),
            request_id="state-1",
            headers={"traceparent": f"00-{'9' * 32}-{'8' * 16}-01", "tracestate": "vendor=v1"},
        )
    state = _server_span(receiver, "state-1")
    assert state.trace_state == "vendor=v1"
    _http(traced_worker).infer(
        "mlp",
        mlp_inputs(httpclient),
        request_id="out-rest",
        headers={"traceparent": f"00-{trace}-{'8' * 16}-00"},
    )
    with _grpc(traced_worker) as c:
        _sentinel(c, receiver, "out-sentinel")
    assert not receiver.trace(trace)
    assert not _ids(receiver, "out-1") and not _ids(receiver, "out-rest")


def test_a_rest_request_has_the_http_attributes(traced_worker, receiver):
    _http(traced_worker).infer("mlp", mlp_inputs(httpclient), request_id="http-attrs")
    span = _server_span(receiver, "http-attrs")
    assert span.attributes["http.request.method"] == "POST"
    assert span.attributes["http.route"] == "/v2/models/{model_name}/infer"
    assert span.attributes["http.response.status_code"] == 200


def test_each_message_of_a_stream_is_a_span_continuing_the_streams_context(traced_worker, receiver):
    trace = "3" * 32
    answers: list = []
    with _grpc(traced_worker) as c:
        c.start_stream(
            callback=lambda result, error: answers.append(error or result),
            headers={"traceparent": f"00-{trace}-{'4' * 16}-01"},
        )
        for i in range(3):
            c.async_stream_infer("mlp", mlp_inputs(grpcclient), request_id=f"stream-{i}")
        wait_until(lambda: len(answers) == 3, 30, "the three stream answers")
        c.stop_stream()
    spans = wait_until(
        lambda: (
            (found := [s for s in receiver.trace(trace) if s.name == "ModelStreamInfer"])
            and len(found) == 3
            and found
        ),
        30,
        "one span per stream message",
    )
    assert {s.attributes["kserve_trio.request_id"] for s in spans} == {
        f"stream-{i}" for i in range(3)
    }
    assert {s.parent_span_id for s in spans} == {"4" * 16}


def _rss_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_a_collector_that_is_down_serves_every_request_counts_drops_and_bounds_memory(
    demo_repo,
):
    down = f"http://127.0.0.1:{free_port()}/v1/traces"  # nothing listens there
    block = {
        "level": "timestamps",
        "endpoint": down,
        "schedule_delay_seconds": 0.05,
        "max_queue_size": 64,
        "max_export_batch_size": 16,
        "export_timeout_seconds": 1.0,
    }
    with in_process_worker(
        demo_repo, endpoints={"port": 0, "metrics_port": free_port()}, tracing=block
    ) as running:
        with _grpc(running) as c:
            for i in range(50):  # the allocator's and the exporter's first growth
                c.infer("mlp_softmax", [_softmax_input()], request_id=f"warm-{i}")
            before = _rss_bytes()
            for i in range(1000):
                reply = c.infer("mlp_softmax", [_softmax_input()], request_id=f"down-{i}")
                assert reply.get_response().id == f"down-{i}"
            grown = _rss_bytes() - before
        wait_until(
            lambda: _metric(running, "worker_traces_dropped_total") > 0,
            30,
            "spans dropped while the collector is down",
        )
    # Some 6000 spans were made while at most 64 may wait: the drops show the bound held; the
    # RSS bound is generous (a loaded machine, an allocator that keeps what it took).
    assert grown < 128 * 1024 * 1024, f"RSS grew by {grown / 2**20:.1f} MiB"


def test_an_execution_that_loaded_its_weights_says_so(demo_repo):
    from tests.worker.test_residency import ARENA, FRACTION, cnn_x

    with otlp_receiver() as rx:
        with in_process_worker(
            demo_repo,
            models_include=["mlp", "cnn"],
            runtime={"cpu_device_memory_bytes": ARENA, "weight_cache_fraction": FRACTION},
            tracing=tracing_block(rx),
        ) as running:
            with _grpc(running) as c:
                cnn = grpcclient.InferInput("input_0", [1, 3, 32, 32], "FP32")
                cnn.set_data_from_numpy(cnn_x())
                c.infer("cnn", [cnn])  # the budget holds one of the two: mlp is evicted
                c.infer("mlp", mlp_inputs(grpcclient), request_id="load-1")
                c.infer("mlp", mlp_inputs(grpcclient), request_id="load-2")

            def execution_of(request_id: str):
                server = _server_span(rx, request_id)
                execute = [
                    s
                    for s in rx.trace(server.trace_id)
                    if s.name == "execute" and s.parent_span_id == server.span_id
                ]
                if not execute or not execute[0].links:
                    return None
                ((_, span_id),) = execute[0].links
                found = [s for s in rx.named("execution") if s.span_id == span_id]
                return found[0] if found else None

            first = wait_until(lambda: execution_of("load-1"), 30, "load-1's execution")
            second = wait_until(lambda: execution_of("load-2"), 30, "load-2's execution")
    assert first.attributes["kserve_trio.weight_load"] is True
    assert first.parent_span_id  # it served one request: that request's child
    assert second.attributes["kserve_trio.weight_load"] is False


def test_update_trace_settings_turns_tracing_off_globally_and_on_for_one_model_live(
    traced_worker, receiver
):
    with _grpc(traced_worker) as c:
        c.update_trace_settings(settings={"trace_level": ["OFF"]})
        try:
            c.update_trace_settings("mlp_softmax", {"trace_level": ["TIMESTAMPS"]})
            c.infer("mlp", mlp_inputs(grpcclient), request_id="live-off")
            c.infer("mlp_softmax", [_softmax_input()], request_id="live-on")
        finally:
            c.update_trace_settings("mlp_softmax", {"trace_level": None})
            c.update_trace_settings(settings={"trace_level": None})  # the configuration's
        assert _settings(c.get_trace_settings(as_json=True))["trace_level"] == ["TIMESTAMPS"]
        _sentinel(c, receiver, "live-sentinel")
    assert _ids(receiver, "live-on") and not _ids(receiver, "live-off")

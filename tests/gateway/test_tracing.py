"""Tracing through the gateway, with a real worker and gateway as subprocesses (both on uvloop,
then both on trio) and a real OTLP/HTTP receiver: the gateway's server span continues the
caller's trace, each forward attempt is a client span, and the worker's span is that attempt's
child, the caller's ``tracestate`` carried through; a TraceSetting change through the gateway
reaches the worker; the gateway's ``--help`` names its tracing flags. A fleet started with
tracing off everywhere (a gateway and two workers) turns it on live through the gateway, per
model and globally, over gRPC and REST, and off again; and a request that fails over shows as
two forward attempts under the gateway's server span, the first an error, in the caller's
trace."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.gateway.procs import Gateway, Worker
from tests.gateway.test_rest_e2e import routed_to
from tests.otlp_receiver import otlp_receiver
from tests.ports import free_port
from tests.waiting import wait_until

TRACE = "6bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "20f067aa0ba902b7"


def _tracing_env(prefix: str, url: str, service: str) -> dict[str, str]:
    return {
        prefix + "TRACING_LEVEL": "timestamps",
        prefix + "TRACING_ENDPOINT": url,
        prefix + "TRACING_SCHEDULE_DELAY_SECONDS": "0.05",
        prefix + "TRACING_SERVICE_NAME": service,
    }


@pytest.fixture(scope="module", params=["uvloop", "trio"])
def fleet(demo_repo, tmp_path_factory, request):
    loop = request.param
    with otlp_receiver() as rx:
        worker = Worker(
            demo_repo,
            "127.0.0.1",
            free_port(),
            env={
                **_tracing_env("INFERENCE_SERVER_", rx.url, "w"),
                "INFERENCE_SERVER_ENDPOINTS_EVENT_LOOP": loop,
            },
        )
        gateway = None
        try:
            worker.wait_ready()
            http_port = free_port()
            gateway = Gateway(
                tmp_path_factory.mktemp("gw"),
                {
                    "KSERVE_TRIO_GATEWAY_WORKERS": worker.url,
                    "KSERVE_TRIO_GATEWAY_LISTEN_HTTP": f"127.0.0.1:{http_port}",
                    **_tracing_env("KSERVE_TRIO_GATEWAY_", rx.url, "gw"),
                    "KSERVE_TRIO_GATEWAY_EVENT_LOOP": loop,
                },
            )
            gateway.wait_ready()
            gateway.http_port = http_port
            yield rx, worker, gateway
        finally:
            if gateway is not None:
                gateway.stop()
            worker.stop()


def test_the_trace_goes_caller_gateway_forward_worker(fleet):
    rx, _, gateway = fleet
    x = np.ones((1, 16), np.float32)
    inp = grpcclient.InferInput("input_0", [1, 16], "FP32")
    inp.set_data_from_numpy(x)
    with gateway.client() as c:
        c.infer(
            "mlp",
            [inp],
            request_id="gw-1",
            headers={"traceparent": f"00-{TRACE}-{PARENT}-01", "tracestate": "caller=c1"},
        )

    def spans():
        found = {(s.service, s.name): s for s in rx.trace(TRACE)}
        need = {("gw", "ModelInfer"), ("gw", "forward"), ("w", "ModelInfer")}
        return need <= found.keys() and found

    found = wait_until(spans, 60, "the gateway's and the worker's spans")
    server, forward, worker = (
        found["gw", "ModelInfer"],
        found["gw", "forward"],
        found["w", "ModelInfer"],
    )
    assert server.parent_span_id == PARENT and server.kind == 2
    assert forward.parent_span_id == server.span_id and forward.kind == 3  # CLIENT
    assert worker.parent_span_id == forward.span_id
    assert forward.attributes["worker"]
    assert forward.attributes["rpc.service"] == "inference.GRPCInferenceService"
    assert forward.attributes["rpc.method"] == "ModelInfer"
    assert server.attributes["rpc.grpc.status_code"] == 0
    assert {server.trace_state, forward.trace_state, worker.trace_state} == {"caller=c1"}


def test_a_trace_setting_change_through_the_gateway_reaches_the_worker(fleet):
    _, worker, gateway = fleet
    with gateway.client() as g, worker.client() as w:
        try:
            g.update_trace_settings(settings={"trace_rate": "7"})
            assert g.get_trace_settings(as_json=True)["settings"]["trace_rate"]["value"] == ["7"]
            assert w.get_trace_settings(as_json=True)["settings"]["trace_rate"]["value"] == ["7"]
            assert "trace" in g.get_server_metadata(as_json=True)["extensions"]
        finally:
            g.update_trace_settings(settings={"trace_rate": None})
        assert w.get_trace_settings(as_json=True)["settings"]["trace_rate"]["value"] == ["1"]


def test_the_gateways_help_names_its_tracing_flags():
    out = subprocess.run(
        [sys.executable, "-m", "kserve_trio", "gateway", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    for flag in ("--trace-level", "--trace-rate", "--trace-count", "--trace-endpoint"):
        assert flag in out
    assert "KSERVE_TRIO_GATEWAY_TRACING_LEVEL" in out


def test_the_gateways_rate_decides_for_the_workers_behind_it(fleet):
    rx, _, gateway = fleet
    x = np.ones((1, 16), np.float32)
    inp = grpcclient.InferInput("input_0", [1, 16], "FP32")
    inp.set_data_from_numpy(x)
    with gateway.client() as c:
        c.update_trace_settings("mlp", {"trace_rate": "3"})  # gateway and worker
        try:
            for i in range(9):
                c.infer("mlp", [inp], request_id=f"gw-rate-{i}")
        finally:
            c.update_trace_settings("mlp", {"trace_rate": None})
        c.infer(  # after the others: once its spans are in, theirs are
            "mlp",
            [inp],
            request_id="gw-rate-sentinel",
            headers={"traceparent": f"00-{'5' * 32}-{'6' * 16}-01"},
        )
    wait_until(
        lambda: (
            {("gw", "ModelInfer"), ("w", "ModelInfer")}
            <= {(s.service, s.name) for s in rx.trace("5" * 32)}
        ),
        60,
        "the sentinel's spans from both",
    )

    def traced(service: str) -> dict[str, object]:
        return {
            s.attributes["kserve_trio.request_id"]: s
            for s in rx.named("ModelInfer")
            if s.service == service
            and str(s.attributes.get("kserve_trio.request_id", "")).startswith("gw-rate-")
            and s.attributes["kserve_trio.request_id"] != "gw-rate-sentinel"
        }

    at_gateway = traced("gw")
    at_worker = traced("w")
    assert len(at_gateway) == 3  # one in three
    # The worker traced exactly the gateway's picks, each under the gateway's forward span.
    assert at_worker.keys() == at_gateway.keys()
    forwards = {s.span_id for s in rx.named("forward")}
    assert all(s.parent_span_id in forwards for s in at_worker.values())


def test_a_rest_request_through_the_gateway_is_traced_to_the_worker(fleet):
    rx, _, gateway = fleet
    trace, parent = "8" * 32, "9" * 16
    x = np.ones((1, 16), np.float32)
    inp = httpclient.InferInput("input_0", [1, 16], "FP32")
    inp.set_data_from_numpy(x)
    rest = httpclient.InferenceServerClient(f"127.0.0.1:{gateway.http_port}")
    rest.infer(
        "mlp",
        [inp],
        request_id="gw-rest",
        headers={"traceparent": f"00-{trace}-{parent}-01", "tracestate": "caller=rest"},
    )

    def spans():
        found = {(s.service, s.name): s for s in rx.trace(trace)}
        need = {("gw", "ModelInfer"), ("gw", "forward"), ("w", "ModelInfer")}
        return need <= found.keys() and found

    found = wait_until(spans, 60, "the gateway's and the worker's spans of a REST call")
    server, forward, worker = (
        found["gw", "ModelInfer"],
        found["gw", "forward"],
        found["w", "ModelInfer"],
    )
    assert server.parent_span_id == parent
    assert server.attributes["http.route"] == "/v2/models/{model_name}/infer"
    assert server.attributes["http.response.status_code"] == 200
    assert forward.parent_span_id == server.span_id
    assert worker.parent_span_id == forward.span_id
    assert worker.trace_state == "caller=rest"


def test_each_message_of_a_stream_through_the_gateway_is_traced_to_the_worker(fleet):
    rx, _, gateway = fleet
    trace, parent = "a1" * 16, "b2" * 8
    x = np.ones((1, 16), np.float32)
    answers: list = []
    with gateway.client() as c:
        c.start_stream(
            callback=lambda result, error: answers.append(error or result),
            headers={"traceparent": f"00-{trace}-{parent}-01"},
        )
        for i in range(2):
            inp = grpcclient.InferInput("input_0", [1, 16], "FP32")
            inp.set_data_from_numpy(x)
            c.async_stream_infer("mlp", [inp], request_id=f"gw-stream-{i}")
        wait_until(lambda: len(answers) == 2, 60, "the stream's answers")
        c.stop_stream()

    def spans():
        found = rx.trace(trace)
        servers = [s for s in found if s.service == "gw" and s.name == "ModelStreamInfer"]
        workers = [s for s in found if s.service == "w" and s.name == "ModelInfer"]
        forwards = {s.span_id: s for s in found if s.name == "forward"}
        done = len(servers) == 2 and len(workers) == 2 and len(forwards) == 2
        return done and (servers, workers, forwards)

    servers, workers, forwards = wait_until(
        spans, 60, "two messages' spans at the gateway and the worker"
    )
    assert {s.parent_span_id for s in servers} == {parent}
    assert {forwards[w.parent_span_id].parent_span_id for w in workers} == {
        s.span_id for s in servers
    }


class DynamicWorker(Worker):
    """A worker in dynamic model control: a model whose directory is removed is unloaded."""

    def _argv(self) -> list[str]:
        return [*super()._argv(), "--model-control-mode", "dynamic"]


def _off_env(prefix: str, url: str, service: str) -> dict[str, str]:
    """Tracing off, with the exporter's endpoint set for a live turn-on."""
    return {
        prefix + "TRACING_ENDPOINT": url,
        prefix + "TRACING_SCHEDULE_DELAY_SECONDS": "0.05",
        prefix + "TRACING_SERVICE_NAME": service,
    }


@pytest.fixture(scope="module", params=["uvloop", "trio"])
def cold_fleet(demo_repo, tmp_path_factory, request):
    """A gateway and two workers, all started with tracing off. ``a`` serves its own copy of
    the models in dynamic mode (a test removes one); the gateway probes once an hour, so its
    routing table stays what its first round saw (a worker that lost a model stays listed
    until a request finds out)."""
    loop = request.param
    repo_a = tmp_path_factory.mktemp("worker_a") / "models"
    for model in ("mlp", "mlp_softmax"):
        shutil.copytree(demo_repo / model, repo_a / model)
    models = "mlp:mlp_softmax"
    with otlp_receiver() as rx:
        a = DynamicWorker(
            repo_a,
            "127.0.0.1",
            free_port(),
            models=models,
            env={
                **_off_env("INFERENCE_SERVER_", rx.url, "wa"),
                "INFERENCE_SERVER_ENDPOINTS_EVENT_LOOP": loop,
                "INFERENCE_SERVER_MODEL_POLL_SECONDS": "0.2",
            },
        )
        b = Worker(
            demo_repo,
            "127.0.0.1",
            free_port(),
            models=models,
            env={
                **_off_env("INFERENCE_SERVER_", rx.url, "wb"),
                "INFERENCE_SERVER_ENDPOINTS_EVENT_LOOP": loop,
            },
        )
        gateway = None
        try:
            a.wait_ready()
            b.wait_ready()
            http_port = free_port()
            gateway = Gateway(
                tmp_path_factory.mktemp("gw_cold"),
                {
                    "KSERVE_TRIO_GATEWAY_WORKERS": f"{a.url},{b.url}",
                    "KSERVE_TRIO_GATEWAY_LISTEN_HTTP": f"127.0.0.1:{http_port}",
                    "KSERVE_TRIO_GATEWAY_HEALTH_INTERVAL_SECONDS": "3600",
                    "KSERVE_TRIO_GATEWAY_SCHEDULING_MODE": "round_robin",
                    **_off_env("KSERVE_TRIO_GATEWAY_", rx.url, "gw"),
                    "KSERVE_TRIO_GATEWAY_EVENT_LOOP": loop,
                },
            )
            gateway.wait_ready()
            gateway.http_port = http_port
            for model in ("mlp", "mlp_softmax"):
                wait_until(lambda m=model: len(routed_to(gateway, m)) == 2, 60, f"{model} on both")
            yield rx, a, b, gateway
        finally:
            if gateway is not None:
                gateway.stop()
            a.stop()
            b.stop()


def _grpc_input() -> grpcclient.InferInput:
    inp = grpcclient.InferInput("input_0", [1, 16], "FP32")
    inp.set_data_from_numpy(np.ones((1, 16), np.float32))
    return inp


def _caller(trace: str) -> dict[str, str]:
    return {"traceparent": f"00-{trace}-{PARENT}-01"}


def _level(client, model: str = "") -> list[str]:
    return client.get_trace_settings(model, as_json=True)["settings"]["trace_level"]["value"]


def _hops(rx, trace: str, timeout: float = 60.0) -> tuple:
    """The gateway's server span, its forward span and a worker's server span of one trace."""

    def found():
        spans = {(s.service if s.service == "gw" else "w", s.name): s for s in rx.trace(trace)}
        need = {("gw", "ModelInfer"), ("gw", "forward"), ("w", "ModelInfer")}
        return need <= spans.keys() and spans

    spans = wait_until(found, timeout, f"the gateway's and a worker's spans of {trace}")
    return spans["gw", "ModelInfer"], spans["gw", "forward"], spans["w", "ModelInfer"]


def test_tracing_turned_on_live_through_the_gateway_reaches_it_and_the_workers(cold_fleet):
    rx, a, b, gateway = cold_fleet
    cold, per_model, rest_trace, off = "c0" * 16, "c1" * 16, "c2" * 16, "c3" * 16
    rest = httpclient.InferenceServerClient(f"127.0.0.1:{gateway.http_port}")
    with gateway.client() as g, a.client() as wa, b.client() as wb:
        g.infer("mlp", [_grpc_input()], request_id="gw-cold-0", headers=_caller(cold))
        assert _level(g) == ["OFF"]
        # One model on, over gRPC: the gateway's and every worker's.
        on = g.update_trace_settings("mlp", {"trace_level": ["TIMESTAMPS"]}, as_json=True)
        assert on["settings"]["trace_level"]["value"] == ["TIMESTAMPS"]
        assert _level(wa, "mlp") == _level(wb, "mlp") == ["TIMESTAMPS"]
        assert _level(g) == _level(wa) == ["OFF"]
        g.infer("mlp", [_grpc_input()], request_id="gw-live-1", headers=_caller(per_model))
        server, forward, worker = _hops(rx, per_model)
        assert server.parent_span_id == PARENT and forward.parent_span_id == server.span_id
        assert worker.parent_span_id == forward.span_id
        # Globally on, over REST: the gateway's REST forwarding traces too.
        assert rest.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]})[
            "trace_level"
        ] == ["TIMESTAMPS"]
        assert _level(wa) == _level(wb) == ["TIMESTAMPS"]
        inp = httpclient.InferInput("input_0", [1, 16], "FP32")
        inp.set_data_from_numpy(np.ones((1, 16), np.float32))
        rest.infer("mlp_softmax", [inp], request_id="gw-live-rest", headers=_caller(rest_trace))
        server, forward, worker = _hops(rx, rest_trace)
        assert server.attributes["http.route"] == "/v2/models/{model_name}/infer"
        assert worker.parent_span_id == forward.span_id
        # Off again everywhere: nothing is traced.
        g.update_trace_settings("mlp", {"trace_level": None})
        g.update_trace_settings(settings={"trace_level": ["OFF"]})
        assert _level(g, "mlp") == _level(wa, "mlp") == _level(wb, "mlp") == ["OFF"]
        for i in range(4):
            g.infer("mlp_softmax", [_grpc_input()], request_id=f"gw-off-{i}", headers=_caller(off))
        # Two sentinels, one through each worker (round robin): once their spans are in,
        # every span the gateway and either worker ended before them is.
        g.update_trace_settings("mlp_softmax", {"trace_level": ["TIMESTAMPS"]})
        try:
            sentinels = ["d0" * 16, "d1" * 16]
            for i, trace in enumerate(sentinels):
                g.infer("mlp_softmax", [_grpc_input()], request_id=f"gw-sentinel-{i}",
                        headers=_caller(trace))  # fmt: skip
            wait_until(
                lambda: (
                    {"gw", "wa", "wb"}
                    <= {s.service for t in sentinels for s in rx.trace(t) if s.name == "ModelInfer"}
                ),
                60,
                "the sentinels' spans at the gateway and at both workers",
            )
        finally:
            g.update_trace_settings("mlp_softmax", {"trace_level": None})
    assert rx.trace(cold) == [] and rx.trace(off) == []


def test_a_failover_is_two_forward_attempts_in_the_callers_trace(cold_fleet):
    rx, a, _, gateway = cold_fleet
    traces = ["f0" * 16, "f1" * 16]
    with gateway.client() as g, a.client() as wa:
        g.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]})
        try:
            shutil.rmtree(a.repo / "mlp")  # a answers NOT_FOUND for mlp: the gateway fails over
            wait_until(lambda: not wa.is_model_ready("mlp"), 60, "mlp unloaded from worker a")
            assert len(routed_to(gateway, "mlp")) == 2  # the gateway still routes to both
            for i, trace in enumerate(traces):  # round robin: one of the two starts at a
                g.infer("mlp", [_grpc_input()], request_id=f"fo-{i}", headers=_caller(trace))
        finally:
            g.update_trace_settings(settings={"trace_level": None})  # the configuration's: OFF
    forwards = {}
    for trace in traces:
        server, _, _ = _hops(rx, trace)  # its forwards ended before it: they are in
        forwards[trace] = sorted(
            (s for s in rx.trace(trace) if s.name == "forward"), key=lambda s: s.start_ns
        )
    failed_over = [t for t in traces if len(forwards[t]) == 2]
    assert len(failed_over) == 1, {t: len(f) for t, f in forwards.items()}
    trace = failed_over[0]
    server = next(s for s in rx.trace(trace) if s.service == "gw" and s.name == "ModelInfer")
    first, second = forwards[trace]
    assert server.trace_id == trace and server.parent_span_id == PARENT
    assert server.attributes["rpc.grpc.status_code"] == 0
    for attempt in (first, second):
        assert attempt.parent_span_id == server.span_id and attempt.kind == 3  # CLIENT
    assert first.status_code == 2  # ERROR
    assert first.attributes["rpc.grpc.status_code"] == 5  # NOT_FOUND
    assert second.status_code != 2 and second.attributes["rpc.grpc.status_code"] == 0
    assert first.attributes["worker"] != second.attributes["worker"]
    assert first.end_ns <= second.start_ns
    # Each worker's own span hangs under the attempt that reached it: a's is the failure.
    at = wait_until(
        lambda: (
            (found := {s.service: s for s in rx.trace(trace) if s.name == "ModelInfer"}).keys()
            >= {"wa", "wb"}
            and found
        ),
        60,
        "both workers' spans of the failed-over request",
    )
    assert at["wa"].parent_span_id == first.span_id and at["wa"].status_code == 2
    assert at["wb"].parent_span_id == second.span_id

"""The gateway's REST endpoint end to end: two CLI workers (explicit mode, a CPU arena, each with
its own REST port) behind the gateway CLI with ``KSERVE_TRIO_GATEWAY_LISTEN_HTTP`` and
``KSERVE_TRIO_GATEWAY_WORKER_HTTP_ENDPOINTS``, driven by the stock ``tritonclient.http``.

Each worker's REST port is reached through a relay (``rest_relay``) that keeps what it was sent,
so the tests see the requests that reached each worker's REST port; each worker's own
statistics show where requests were served."""

from __future__ import annotations

import gzip
import json
import time
import types
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.e2e import reference as ref
from tests.gateway.procs import Gateway, Worker
from tests.gateway.rest_relay import Relay
from tests.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
G = "KSERVE_TRIO_GATEWAY_"
EXPLICIT = {"INFERENCE_SERVER_RUNTIME_CPU_DEVICE_MEMORY_BYTES": "10000000"}


INFER = b"POST /v2/models/mlp/infer HTTP/1.1\r\n"


class ExplicitWorker(Worker):
    """A worker in explicit mode (a model serves only once loaded), with a REST port."""

    def __init__(self, *args, **kw) -> None:
        self.http_port = free_port()
        super().__init__(*args, **kw)

    def _argv(self) -> list[str]:
        argv = super()._argv()
        argv[argv.index("--model-control-mode") + 1] = "explicit"
        return [*argv, "--http-port", str(self.http_port)]


@pytest.fixture(scope="module")
def fleet(demo_repo, tmp_path_factory):
    work = tmp_path_factory.mktemp("gateway_rest")
    models = {"models": "mlp:cnn", "env": EXPLICIT}
    a = ExplicitWorker(demo_repo, "127.0.0.1", free_port(), **models)
    b = ExplicitWorker(demo_repo, "127.0.0.1", free_port(), **models)
    gw = None
    relays: list[Relay] = []
    try:
        a.wait_ready()
        b.wait_ready()
        relays = [Relay(a.http_port), Relay(b.http_port)]
        http_port = free_port()
        env = {
            G + "WORKERS": f"{a.url},{b.url}",
            G + "WORKER_HTTP_ENDPOINTS": ",".join(r.address for r in relays),
            G + "LISTEN_HTTP": f"127.0.0.1:{http_port}",
        }
        gw = Gateway(work, env)
        gw.http_url = f"127.0.0.1:{http_port}"
        httpclient.InferenceServerClient(gw.http_url)  # the URL is well formed
        for w in (a, b):  # explicit mode: make mlp resident so the gateway routes it
            w.client().load_model("mlp")
        gw.wait_ready()
        yield types.SimpleNamespace(
            a=a, b=b, gw=gw, repo=demo_repo, rest_a=relays[0], rest_b=relays[1], work=work
        )
    finally:
        if gw is not None:
            assert gw.stop() == 0, gw.logs()
        for relay in relays:
            relay.close()
        a.stop()
        b.stop()


def client(fleet) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(fleet.gw.http_url)


def mlp_input(x: np.ndarray, binary: bool = True) -> httpclient.InferInput:
    inp = httpclient.InferInput("input_0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    return inp


def successes(worker: Worker) -> int:
    stats = worker.client().get_inference_statistics("mlp", as_json=True)["model_stats"][0]
    return int(stats["inference_stats"].get("success", {}).get("count", 0))


def status_of(call) -> tuple[str | None, str]:
    with pytest.raises(InferenceServerException) as err:
        call()
    return err.value.status(), err.value.message()


def raw(fleet, method: str, path: str, body: bytes | None = None):
    req = urllib.request.Request(f"http://{fleet.gw.http_url}{path}", data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_one_server_over_rest_and_traffic_spreads_over_both_workers(fleet):
    c = client(fleet)
    assert c.is_server_live() and c.is_server_ready()
    assert c.get_server_metadata()["name"] == "kserve_trio"
    assert c.is_model_ready("mlp") and not c.is_model_ready("cnn")
    assert c.is_model_ready("mlp", "1") and not c.is_model_ready("mlp", "7")
    assert c.get_model_metadata("mlp")["inputs"] == [
        {"name": "input_0", "datatype": "FP32", "shape": [-1, 16]}
    ]
    assert c.get_model_config("mlp")["max_batch_size"] == 64
    index = {m["name"]: m["state"] for m in c.get_model_repository_index()}
    assert index["mlp"] == "READY"
    before = (successes(fleet.a), successes(fleet.b))
    sent = (fleet.rest_a.requests(INFER), fleet.rest_b.requests(INFER))
    connections = (fleet.rest_a.connections, fleet.rest_b.connections)
    w = ref.weights(fleet.repo, "mlp")
    rng = np.random.default_rng(0)
    for i in range(20):
        x = rng.standard_normal((1 + i % 4, 16), dtype=np.float32)
        binary = i % 2 == 0
        out = httpclient.InferRequestedOutput("output", binary_data=binary)
        r = c.infer("mlp", [mlp_input(x, binary)], outputs=[out], request_id=f"u{i}")
        np.testing.assert_allclose(r.as_numpy("output"), ref.mlp(x, w), rtol=1e-5, atol=1e-5)
        assert r.get_response()["id"] == f"u{i}"
        assert ("data" in r.get_output("output")) is not binary
    after = (successes(fleet.a), successes(fleet.b))
    assert (after[0] - before[0], after[1] - before[1]) == (10, 10)  # round robin
    # Every request reached its worker's REST port, as the client sent it (the binary ones with
    # their Inference-Header-Content-Length), over one kept-alive connection per worker.
    reached = (fleet.rest_a.requests(INFER) - sent[0], fleet.rest_b.requests(INFER) - sent[1])
    assert reached == (10, 10)
    assert fleet.rest_a.connections - connections[0] <= 1
    assert fleet.rest_b.connections - connections[1] <= 1
    sent_bytes = bytes(fleet.rest_a.sent + fleet.rest_b.sent).lower()
    assert sent_bytes.count(b"\r\ninference-header-content-length: ") >= 10  # the binary ones
    stats = c.get_inference_statistics("mlp")["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] == sum(after)  # summed over workers


def test_shared_memory_through_the_gateway(fleet):
    c = client(fleet)
    x = np.random.default_rng(1).standard_normal((2, 16), dtype=np.float32)
    key = f"/kserve_trio_gw_rest_{fleet.gw.port}"
    in_h = shm.create_shared_memory_region("gw_in", key + "_in", x.nbytes)
    out_h = shm.create_shared_memory_region("gw_out", key + "_out", 2 * 8 * 4)
    try:
        shm.set_shared_memory_region(in_h, [x])
        c.register_system_shared_memory("gw_in", key + "_in", x.nbytes)
        c.register_system_shared_memory("gw_out", key + "_out", 2 * 8 * 4)
        assert sorted(r["name"] for r in c.get_system_shared_memory_status()) == [
            "gw_in",
            "gw_out",
        ]
        for w in (fleet.a, fleet.b):  # registered on every worker
            assert len(w.client().get_system_shared_memory_status().regions) == 2
        want = ref.mlp(x, ref.weights(fleet.repo, "mlp"))
        for _ in range(2):  # one request to each worker
            inp = httpclient.InferInput("input_0", list(x.shape), "FP32")
            inp.set_shared_memory("gw_in", x.nbytes)
            out = httpclient.InferRequestedOutput("output")
            out.set_shared_memory("gw_out", 2 * 8 * 4)
            r = c.infer("mlp", [inp], outputs=[out])
            assert r.get_output("output")["parameters"]["shared_memory_region"] == "gw_out"
            got = shm.get_contents_as_numpy(out_h, np.float32, [2, 8])
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
            shm.set_shared_memory_region(out_h, [np.zeros((2, 8), np.float32)])
        c.unregister_system_shared_memory()
        assert c.get_system_shared_memory_status() == []
        for w in (fleet.a, fleet.b):
            assert len(w.client().get_system_shared_memory_status().regions) == 0
    finally:
        shm.destroy_shared_memory_region(in_h)
        shm.destroy_shared_memory_region(out_h)


def test_explicit_load_and_unload_fan_out(fleet):
    c = client(fleet)
    c.load_model("cnn")
    for w in (fleet.a, fleet.b):
        assert w.client().is_model_ready("cnn")
    x = np.random.default_rng(2).standard_normal((1, 3, 32, 32), dtype=np.float32)
    inp = httpclient.InferInput("input_0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    np.testing.assert_allclose(
        c.infer("cnn", [inp]).as_numpy("output"),
        ref.cnn(x, ref.weights(fleet.repo, "cnn")),
        rtol=1e-4,
        atol=1e-4,
    )
    c.unload_model("cnn")
    for w in (fleet.a, fleet.b):
        assert not w.client().is_model_ready("cnn")
    assert not c.is_model_ready("cnn")


def test_errors_read_as_the_gateway_grpc_ones_and_it_serves_on(fleet):
    c = client(fleet)
    g = grpcclient.InferenceServerClient(fleet.gw.url)
    x = np.ones((1, 16), dtype=np.float32)
    status, message = status_of(lambda: c.infer("nope", [mlp_input(x)]))
    ginp = grpcclient.InferInput("input_0", [1, 16], "FP32")
    ginp.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException) as err:
        g.infer("nope", [ginp])
    assert (status, message) == ("404", err.value.message())
    bad = np.ones((1, 15), dtype=np.float32)
    status, message = status_of(lambda: c.infer("mlp", [mlp_input(bad)]))
    assert status == "400" and "input_0" in message
    assert raw(fleet, "POST", "/v2/models/mlp/infer", b"[")[0] == 400
    assert raw(fleet, "POST", "/v2/repository/models//load")[0] == 400  # no model name
    assert c.infer("mlp", [mlp_input(x)]).as_numpy("output").shape == (1, 8)


def test_log_settings_are_the_gateways_own_over_rest_and_grpc(fleet):
    g = grpcclient.InferenceServerClient(fleet.gw.url)
    status, settings = raw(fleet, "GET", "/v2/logging")
    assert status == 200 and settings["log_info"] is True
    assert set(settings) == set(g.get_log_settings(as_json=True)["settings"])
    changed = g.update_log_settings({"log_verbose_level": 1}, as_json=True)["settings"]
    try:
        assert changed["log_verbose_level"]["uint32_param"] == 1
        assert raw(fleet, "GET", "/v2/logging")[1]["log_verbose_level"] == 1
    finally:
        raw(fleet, "POST", "/v2/logging", json.dumps({"log_verbose_level": 0}).encode())
    assert raw(fleet, "GET", "/v2/logging")[1]["log_verbose_level"] == 0
    status, body = raw(fleet, "POST", "/v2/logging", b'{"log_info": [1]}')
    assert status == 400 and "log setting 'log_info' must be" in body["error"]
    with pytest.raises(InferenceServerException, match="log_format"):
        g.update_log_settings({"log_format": "xml"})
    assert g.is_server_ready()  # and it serves on


def routed_to(gw: Gateway, model: str) -> list[str]:
    return json.loads(gw.admin("/routing")[1])["models"].get(model, [])


def wait_routed(gw: Gateway, model: str, replicas: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while len(routed_to(gw, model)) != replicas:
        assert time.monotonic() < deadline, gw.admin("/routing")
        time.sleep(0.1)


def test_a_404_tries_every_replica_then_passes_the_workers_answer_back(fleet):
    # No worker has version 7 of mlp: each replica's REST port is tried once (NOT_FOUND fails
    # over, as over gRPC), and the last worker's 404 reaches the client as it answered.
    line = b"POST /v2/models/mlp/versions/7/infer HTTP/1.1\r\n"
    before = (fleet.rest_a.requests(line), fleet.rest_b.requests(line))
    x = np.ones((1, 16), dtype=np.float32)
    status, message = status_of(lambda: client(fleet).infer("mlp", [mlp_input(x)], "7"))
    assert (fleet.rest_a.requests(line) - before[0], fleet.rest_b.requests(line) - before[1]) == (
        1,
        1,
    )
    g = grpcclient.InferenceServerClient(fleet.gw.url)
    ginp = grpcclient.InferInput("input_0", [1, 16], "FP32")
    ginp.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException) as err:
        g.infer("mlp", [ginp], model_version="7")
    assert (status, message) == ("404", err.value.message())
    assert "has no version '7'" in message
    wait_routed(fleet.gw, "mlp", 2)  # the refresh the 404 asked for keeps both replicas


def test_a_compressed_request_and_reply_pass_through_byte_for_byte(fleet):
    doc = {
        "inputs": [{"name": "input_0", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]
    }
    packed = gzip.compress(json.dumps(doc).encode())
    headers = {
        "Content-Type": "application/json",
        "Content-Encoding": "gzip",
        "Accept-Encoding": "gzip",
    }
    url = f"http://{fleet.gw.http_url}/v2/models/mlp/infer"
    req = urllib.request.Request(url, data=packed, headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200 and r.headers["Content-Encoding"] == "gzip"  # the worker's
        reply = json.loads(gzip.decompress(r.read()))
    assert reply["outputs"][0]["shape"] == [1, 8]
    assert packed in bytes(fleet.rest_a.sent + fleet.rest_b.sent)  # forwarded as it came


def test_a_head_is_the_gets_headers_without_the_body(fleet):
    url = f"http://{fleet.gw.http_url}/v2/models/mlp"
    with urllib.request.urlopen(url, timeout=30) as r:
        body = r.read()
        assert r.status == 200 and json.loads(body)["name"] == "mlp"
    relays = (fleet.rest_a, fleet.rest_b)
    before = [len(relay.sent) for relay in relays]
    req = urllib.request.Request(url, method="HEAD")
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200 and r.read() == b""
        assert int(r.headers["Content-Length"]) == len(body)
        assert r.headers["Content-Type"].startswith("application/json")
    sent = [bytes(relay.sent[n:]) for relay, n in zip(relays, before, strict=True)]
    assert sorted(sent)[-1].startswith(b"GET /v2/models/mlp ")  # a worker's REST port got a GET
    assert b"" in sent  # and only one of them


def test_a_rest_port_down_fails_over_to_the_other_workers_rest_port(fleet):
    wait_routed(fleet.gw, "mlp", 2)
    fleet.rest_b.close()  # b's REST port is gone; its gRPC port still serves
    c = client(fleet)
    before = (successes(fleet.a), successes(fleet.b))
    x = np.ones((2, 16), dtype=np.float32)
    for _ in range(6):
        assert c.infer("mlp", [mlp_input(x)]).as_numpy("output").shape == (2, 8)
    assert (successes(fleet.a) - before[0], successes(fleet.b) - before[1]) == (6, 0)
    g = grpcclient.InferenceServerClient(fleet.gw.url)
    ginp = grpcclient.InferInput("input_0", [2, 16], "FP32")
    ginp.set_data_from_numpy(x)
    for _ in range(2):  # gRPC through the gateway still reaches b (round robin: one each)
        g.infer("mlp", [ginp])
    assert successes(fleet.b) - before[1] == 1


def test_a_worker_lost_fails_over_to_the_other(fleet):
    c = client(fleet)
    fleet.b.stop()
    w = ref.weights(fleet.repo, "mlp")
    x = np.random.default_rng(3).standard_normal((2, 16), dtype=np.float32)
    for _ in range(6):  # the first of these may reach the stopped worker and fail over
        r = c.infer("mlp", [mlp_input(x)])
        np.testing.assert_allclose(r.as_numpy("output"), ref.mlp(x, w), rtol=1e-5, atol=1e-5)

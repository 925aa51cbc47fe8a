"""The REST endpoint of a worker started from the CLI, driven by the stock ``tritonclient.http``.

One module-scoped worker in explicit mode (``--http-port``, a CPU arena so load/unload drive
residency, a 1 MiB message cap) serves ``mlp`` and ``cnn``. gRPC (``tritonclient.grpc``) talks
to the same worker where a test pins that both transports share a rule: statistics, error
messages, the cap.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.e2e import reference as ref
from tests.e2e.conftest import WorkerProcess
from tests.ports import free_port

pytestmark = pytest.mark.slow

CAP = 1 << 20


@pytest.fixture(scope="module")
def worker(demo_repo):
    http_port = free_port()
    w = WorkerProcess(
        demo_repo,
        "--model-control-mode",
        "explicit",
        "--http-port",
        str(http_port),
        env={
            "INFERENCE_SERVER_MODELS_INCLUDE": "mlp:cnn",
            "INFERENCE_SERVER_RUNTIME_CPU_DEVICE_MEMORY_BYTES": "10000000",
            "INFERENCE_SERVER_GRPC_MAX_RECV_MSG_BYTES": str(CAP),
        },
    )
    w.http_url = f"127.0.0.1:{http_port}"
    try:
        w.wait_ready()
        c = httpclient.InferenceServerClient(w.http_url)
        c.load_model("mlp")
        c.load_model("cnn")
        yield w
    finally:
        w.terminate()


def client(worker) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(worker.http_url)


def mlp_input(x: np.ndarray, binary: bool) -> httpclient.InferInput:
    inp = httpclient.InferInput("input_0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    return inp


def status_of(call) -> tuple[str | None, str]:
    with pytest.raises(InferenceServerException) as err:
        call()
    return err.value.status(), err.value.message()


def raw(worker, method: str, path: str, body: bytes | None = None, headers=None):
    """(status, parsed JSON body or raw bytes) of one plain HTTP request."""
    req = urllib.request.Request(
        f"http://{worker.http_url}{path}", data=body, method=method, headers=headers or {}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, data = r.status, r.read()
    except urllib.error.HTTPError as exc:
        status, data = exc.code, exc.read()
    try:
        return status, json.loads(data)
    except ValueError:
        return status, data


def test_health_and_metadata(worker):
    c = client(worker)
    assert c.is_server_live() and c.is_server_ready()
    assert c.is_model_ready("mlp") and not c.is_model_ready("nope")
    meta = c.get_server_metadata()
    assert meta["name"] == "kserve_trio" and "model_repository" in meta["extensions"]
    assert meta == grpcclient.InferenceServerClient(worker.url).get_server_metadata(as_json=True)
    md = c.get_model_metadata("cnn")
    assert md == {
        "name": "cnn",
        "versions": ["1"],
        "platform": "jax",
        "inputs": [{"name": "input_0", "datatype": "FP32", "shape": [-1, 3, 32, 32]}],
        "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, 10]}],
    }
    assert c.get_model_metadata("mlp", "1")["name"] == "mlp"
    assert raw(worker, "GET", "/v2/health/live") == (200, {"live": True})
    assert raw(worker, "GET", "/v2/models/mlp/ready") == (200, {"name": "mlp", "ready": True})
    assert raw(worker, "GET", "/v2/models/nope/ready") == (503, {"name": "nope", "ready": False})


def test_an_unknown_version_is_not_ready_and_not_found_elsewhere(worker):
    c = client(worker)
    assert c.is_model_ready("mlp", "1") and not c.is_model_ready("mlp", "7")
    assert raw(worker, "GET", "/v2/models/mlp/versions/7/ready") == (
        503,
        {"name": "mlp", "ready": False},
    )
    status, body = raw(worker, "GET", "/v2/models/mlp/versions/7")
    assert status == 404 and "has no version '7'" in body["error"]


def test_config_matches_grpc(worker):
    c = client(worker)
    cfg = c.get_model_config("mlp")
    assert cfg["name"] == "mlp" and cfg["platform"] == "jax" and cfg["max_batch_size"] == 64
    assert cfg["input"][0]["data_type"] == "TYPE_FP32" and cfg["input"][0]["dims"] == [16]
    grpc_cfg = grpcclient.InferenceServerClient(worker.url).get_model_config("mlp", as_json=True)
    assert grpc_cfg["config"]["input"][0]["dims"] == ["16"]  # protobuf JSON: int64 as strings
    assert cfg["dynamic_batching"]["preferred_batch_size"] == [
        int(s) for s in grpc_cfg["config"]["dynamic_batching"]["preferred_batch_size"]
    ]


@pytest.mark.parametrize("binary_in", [True, False])
@pytest.mark.parametrize("binary_out", [True, False, None])
def test_infer_json_and_binary(worker, demo_repo, binary_in, binary_out):
    c = client(worker)
    x = np.random.default_rng(3).standard_normal((3, 16), dtype=np.float32)
    outputs = None
    if binary_out is not None:
        outputs = [httpclient.InferRequestedOutput("output", binary_data=binary_out)]
    r = c.infer("mlp", [mlp_input(x, binary_in)], outputs=outputs, request_id="rq-1")
    np.testing.assert_allclose(
        r.as_numpy("output"), ref.mlp(x, ref.weights(demo_repo, "mlp")), rtol=1e-5, atol=1e-5
    )
    out = r.get_output("output")
    assert ("data" in out) is (binary_out is False)  # no outputs named: binary by default
    assert r.get_response()["id"] == "rq-1"


def test_a_large_binary_tensor(worker, demo_repo):
    x = np.random.default_rng(4).standard_normal((8, 3, 32, 32), dtype=np.float32)
    inp = httpclient.InferInput("input_0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    r = client(worker).infer("cnn", [inp])
    np.testing.assert_allclose(
        r.as_numpy("output"), ref.cnn(x, ref.weights(demo_repo, "cnn")), rtol=1e-4, atol=1e-4
    )


def test_statistics_are_shared_with_grpc(worker):
    c = client(worker)
    g = grpcclient.InferenceServerClient(worker.url)

    def successes() -> int:
        stats = c.get_inference_statistics("mlp")["model_stats"][0]
        return stats["inference_stats"]["success"]["count"]

    before = successes()
    x = np.ones((2, 16), dtype=np.float32)
    c.infer("mlp", [mlp_input(x, True)])
    ginp = grpcclient.InferInput("input_0", [2, 16], "FP32")
    ginp.set_data_from_numpy(x)
    g.infer("mlp", [ginp])
    assert successes() == before + 2
    every = c.get_inference_statistics()["model_stats"]
    assert sorted(s["name"] for s in every) == ["cnn", "mlp"]
    stats = c.get_inference_statistics("mlp", "1")["model_stats"][0]
    grpc_stats = g.get_inference_statistics("mlp", as_json=True)["model_stats"][0]
    assert stats["inference_count"] == int(grpc_stats["inference_count"])
    assert stats["inference_stats"]["success"]["count"] == int(
        grpc_stats["inference_stats"]["success"]["count"]
    )


def test_shared_memory_inputs_and_outputs(worker, demo_repo):
    c = client(worker)
    x = np.random.default_rng(5).standard_normal((4, 16), dtype=np.float32)
    key = f"/kserve_trio_rest_{worker.port}"
    in_h = shm.create_shared_memory_region("rest_in", key + "_in", x.nbytes)
    out_h = shm.create_shared_memory_region("rest_out", key + "_out", 4 * 8 * 4)
    try:
        shm.set_shared_memory_region(in_h, [x])
        c.register_system_shared_memory("rest_in", key + "_in", x.nbytes)
        c.register_system_shared_memory("rest_out", key + "_out", 4 * 8 * 4)
        status = c.get_system_shared_memory_status()
        assert sorted(r["name"] for r in status) == ["rest_in", "rest_out"]
        assert c.get_system_shared_memory_status("rest_in") == [
            {"name": "rest_in", "key": key + "_in", "offset": 0, "byte_size": x.nbytes}
        ]
        inp = httpclient.InferInput("input_0", list(x.shape), "FP32")
        inp.set_shared_memory("rest_in", x.nbytes)
        out = httpclient.InferRequestedOutput("output", binary_data=True)
        out.set_shared_memory("rest_out", 4 * 8 * 4)
        r = c.infer("mlp", [inp], outputs=[out])
        params = r.get_output("output")["parameters"]
        assert params["shared_memory_region"] == "rest_out"
        assert params["shared_memory_byte_size"] == 4 * 8 * 4
        got = shm.get_contents_as_numpy(out_h, np.float32, [4, 8])
        np.testing.assert_allclose(
            got, ref.mlp(x, ref.weights(demo_repo, "mlp")), rtol=1e-5, atol=1e-5
        )
        c.unregister_system_shared_memory("rest_in")
        assert [r["name"] for r in c.get_system_shared_memory_status()] == ["rest_out"]
        assert status_of(lambda: c.infer("mlp", [inp])) == (
            "400",
            "unregistered shared memory region: rest_in",
        )
        c.unregister_system_shared_memory()
        assert c.get_system_shared_memory_status() == []
    finally:
        shm.destroy_shared_memory_region(in_h)
        shm.destroy_shared_memory_region(out_h)


def test_explicit_load_and_unload(worker):
    c = client(worker)
    x = np.ones((1, 16), dtype=np.float32)
    c.unload_model("mlp")
    assert not c.is_model_ready("mlp")
    index = {m["name"]: m["state"] for m in c.get_model_repository_index()}
    assert index == {"cnn": "READY", "mlp": "UNAVAILABLE"}
    assert status_of(lambda: c.infer("mlp", [mlp_input(x, True)])) == (
        "400",
        "model 'mlp' is not resident",
    )
    c.load_model("mlp")
    assert c.is_model_ready("mlp")
    assert c.infer("mlp", [mlp_input(x, True)]).as_numpy("output").shape == (1, 8)
    status, body = raw(worker, "POST", "/v2/repository/index", json.dumps({"ready": True}).encode())
    assert status == 200 and sorted(m["name"] for m in body) == ["cnn", "mlp"]


def grpc_message(worker, call) -> str:
    with pytest.raises(InferenceServerException) as err:
        call(grpcclient.InferenceServerClient(worker.url))
    return err.value.message()


def test_errors_map_to_http_statuses_with_the_grpc_messages(worker):
    c = client(worker)
    x = np.ones((2, 15), dtype=np.float32)  # mlp wants [-1, 16]
    status, message = status_of(lambda: c.infer("mlp", [mlp_input(x, True)]))
    ginp = grpcclient.InferInput("input_0", [2, 15], "FP32")
    ginp.set_data_from_numpy(x)
    assert status == "400"
    assert message == grpc_message(worker, lambda g: g.infer("mlp", [ginp]))
    status, message = status_of(lambda: c.infer("nope", [mlp_input(x, True)]))
    assert status == "404"
    assert message == grpc_message(worker, lambda g: g.infer("nope", [ginp]))
    assert status_of(lambda: c.get_model_metadata("nope"))[0] == "404"
    assert status_of(lambda: c.get_model_config("mlp", "7"))[0] == "404"
    status, body = raw(worker, "POST", "/v2/models/mlp/infer", b"{not json")
    assert status == 400 and body["error"].startswith("malformed JSON in the inference request")
    status, body = raw(worker, "GET", "/v2/models/mlp/infer")
    assert status == 405 and "ModelInfer is served on POST" in body["error"]
    status, body = raw(worker, "GET", "/v2/nowhere")
    assert (status, body) == (404, {"error": "no such endpoint: GET /v2/nowhere"})
    status, body = raw(worker, "GET", "/v2/cudasharedmemory/status")
    assert status == 501
    assert body == {
        "error": "CudaSharedMemoryStatus is not implemented: CUDA shared memory is not supported"
    }
    status, body = raw(worker, "POST", "/v2/repository/models/mlp/load", b'{"parameters": [1]}')
    assert status == 400 and "'parameters' must be a JSON object" in body["error"]
    # the cap is grpc.max_recv_msg_bytes, with gRPC's message, as 413 Payload Too Large
    status, body = raw(worker, "POST", "/v2/models/mlp/infer", b" " * (CAP + 1))
    assert (status, body) == (
        413,
        {"error": f"received message larger than max ({CAP + 1} vs. {CAP})"},
    )
    # after all of it the worker serves on
    assert (
        c.infer("mlp", [mlp_input(np.ones((1, 16), np.float32), False)]).as_numpy("output")
        is not None
    )


def test_compressed_request_bodies(worker, demo_repo):
    x = np.random.default_rng(6).standard_normal((2, 16), dtype=np.float32)
    for algorithm in ("gzip", "deflate"):
        r = client(worker).infer(
            "mlp",
            [mlp_input(x, True)],
            request_compression_algorithm=algorithm,
            response_compression_algorithm=algorithm,
        )
        np.testing.assert_allclose(
            r.as_numpy("output"), ref.mlp(x, ref.weights(demo_repo, "mlp")), rtol=1e-5, atol=1e-5
        )


def test_replies_are_compressed_when_the_client_accepts_it(worker):
    import gzip

    body = json.dumps(
        {"inputs": [{"name": "input_0", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]}
    ).encode()
    req = urllib.request.Request(
        f"http://{worker.http_url}/v2/models/mlp/infer",
        data=body,
        headers={"Accept-Encoding": "br, gzip;q=0.9"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["Content-Encoding"] == "gzip"
        doc = json.loads(gzip.decompress(r.read()))
    assert doc["outputs"][0]["shape"] == [1, 8]


def test_log_settings_over_rest_are_the_grpc_ones(worker):
    status, settings = raw(worker, "GET", "/v2/logging")
    assert status == 200 and settings["log_info"] is True
    g = grpcclient.InferenceServerClient(worker.url).get_log_settings(as_json=True)["settings"]
    assert set(settings) == set(g)
    status, changed = raw(
        worker, "POST", "/v2/logging", json.dumps({"log_verbose_level": 1}).encode()
    )
    try:
        assert status == 200 and changed["log_verbose_level"] == 1
        assert raw(worker, "GET", "/v2/logging")[1]["log_verbose_level"] == 1
    finally:
        raw(worker, "POST", "/v2/logging", json.dumps({"log_verbose_level": 0}).encode())
    status, body = raw(worker, "POST", "/v2/logging", b'{"log_info": [1]}')
    assert status == 400 and "log setting 'log_info' must be" in body["error"]

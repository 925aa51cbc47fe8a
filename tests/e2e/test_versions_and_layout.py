"""A CLI worker serving a three-output model, driven by stock tritonclient and by our client:
mixed shared-memory and inline outputs read by position, the one served version ``1``,
ServerMetadata's extensions and the platform string, and malformed frames answered
INVALID_ARGUMENT without an unexpected-failure log.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from kserve_trio.client import InferInput, InferOutput, KServeModel
from kserve_trio.core.protocol.codec import (
    RequestedOutput,
    ShmRef,
    decode_infer_response,
    encode_infer_request,
)
from tests.e2e.conftest import WorkerProcess
from tests.worker.raw_h2 import grpc_frame, raw_grpc_call

MODEL = "three"
W = np.array([0.5, -1.0, 2.0, 3.0], np.float32)
OUTPUTS = ["output_0", "output_1", "output_2"]


def three_fn(x, w):
    import jax.numpy as jnp

    return x * w, jnp.sum(x, axis=1).astype(jnp.int32), x[:, :2] - 1.0


def expected(x: np.ndarray) -> dict[str, np.ndarray]:
    return {
        "output_0": x * W,
        "output_1": x.sum(axis=1).astype(np.int32),
        "output_2": x[:, :2] - 1.0,
    }


@pytest.fixture(scope="session")
def three_output_repo(tmp_path_factory):
    """A repository with one bundle of three outputs of different shapes and dtypes."""
    from kserve_trio.export import export_bundle

    repo = tmp_path_factory.mktemp("three") / "models"
    export_bundle(
        "jax", three_fn, np.zeros((1, 4), np.float32), {"w": W}, dir=repo / MODEL, batch_sizes=[4]
    )
    return repo


@pytest.fixture(scope="module")
def worker(three_output_repo):
    w = WorkerProcess(three_output_repo)
    try:
        w.wait_ready()
        yield w
    finally:
        w.terminate()


@pytest.fixture
def region():
    """A tritonclient-created system shared-memory region of 256 bytes, destroyed after."""
    tag = f"{os.getpid()}_{uuid.uuid4().hex[:8]}"
    name, key = f"r_{tag}", f"/k_{tag}"
    handle = shm.create_shared_memory_region(name, key, 256)
    yield name, key, handle
    shm.destroy_shared_memory_region(handle)


def x_rows(rows: int = 3) -> np.ndarray:
    return np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) / 4


def triton_input(x: np.ndarray) -> grpcclient.InferInput:
    inp = grpcclient.InferInput("input_0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def not_found(call) -> str:
    with pytest.raises(InferenceServerException) as err:
        call()
    assert err.value.status() == "StatusCode.NOT_FOUND", err.value.message()
    return err.value.message()


# --------------------------------------------------------------------------------------------
# mixed shared-memory and inline outputs


@pytest.mark.parametrize("in_shm", OUTPUTS)
def test_tritonclient_reads_every_inline_output_of_a_mixed_response(worker, region, in_shm):
    name, key, handle = region
    c = grpcclient.InferenceServerClient(worker.url)
    c.register_system_shared_memory(name, key, 256)
    try:
        x = x_rows()
        want = expected(x)
        outs = []
        for out_name in OUTPUTS:
            out = grpcclient.InferRequestedOutput(out_name)
            if out_name == in_shm:
                out.set_shared_memory(name, want[out_name].nbytes)
            outs.append(out)
        result = c.infer(MODEL, [triton_input(x)], outputs=outs)
        raw = result.get_response().raw_output_contents
        assert len(raw) == 3 and raw[OUTPUTS.index(in_shm)] == b""
        for out_name in OUTPUTS:
            arr = want[out_name]
            if out_name == in_shm:
                got = shm.get_contents_as_numpy(handle, arr.dtype, list(arr.shape))
            else:
                got = result.as_numpy(out_name)
            assert got.dtype == arr.dtype and got.shape == arr.shape, out_name
            np.testing.assert_allclose(got, arr, rtol=1e-6, err_msg=out_name)
    finally:
        c.unregister_system_shared_memory(name)


def test_our_client_reads_a_mixed_response(worker, region):
    name, key, handle = region
    c = grpcclient.InferenceServerClient(worker.url)
    c.register_system_shared_memory(name, key, 256)
    x = x_rows(2)
    want = expected(x)
    request = encode_infer_request(
        MODEL,
        [InferInput("input_0", x).to_tensor()],
        requested_outputs=[
            RequestedOutput("output_0", ShmRef(name, 16, want["output_0"].nbytes)),
            "output_1",
            "output_2",
        ],
    )

    async def main():
        async with KServeModel(worker.url, MODEL, shared_memory="off") as model:
            return await model.infer_request(request)

    try:
        response = asyncio.run(main())
    finally:
        c.unregister_system_shared_memory(name)
    np.testing.assert_array_equal(InferOutput("output_1", response), want["output_1"])
    np.testing.assert_allclose(InferOutput("output_2", response), want["output_2"])
    with pytest.raises(ValueError, match=f"written to shared memory region '{name}'"):
        InferOutput("output_0", response)
    decoded = {t.name: t.data for t in decode_infer_response(response, skip_shm=True)}
    assert list(decoded) == ["output_1", "output_2"]
    np.testing.assert_allclose(decoded["output_2"], want["output_2"])
    got0 = shm.get_contents_as_numpy(handle, np.float32, [2 * 4 + 4])[4:].reshape(2, 4)
    np.testing.assert_allclose(got0, want["output_0"])


# --------------------------------------------------------------------------------------------
# versions


def test_a_bundle_is_version_1_everywhere(worker):
    c = grpcclient.InferenceServerClient(worker.url)
    x = x_rows(1)
    for version in ("", "1"):
        r = c.infer(MODEL, [triton_input(x)], model_version=version)
        assert r.get_response().model_version == "1"
        np.testing.assert_allclose(r.as_numpy("output_2"), expected(x)["output_2"])
        assert c.is_model_ready(MODEL, version)
        assert c.get_model_metadata(MODEL, version, as_json=True)["versions"] == ["1"]
        assert c.get_model_config(MODEL, version, as_json=True)["config"]["name"] == MODEL
        stats = c.get_inference_statistics(MODEL, version, as_json=True)["model_stats"]
        assert [(s["name"], s["version"]) for s in stats] == [(MODEL, "1")]
    message = not_found(lambda: c.infer(MODEL, [triton_input(x)], model_version="7"))
    assert message == "model 'three' has no version '7' (a bundle is served as version 1 only)"
    assert not c.is_model_ready(MODEL, "7")  # readiness answers, as for an unknown model
    not_found(lambda: c.get_model_metadata(MODEL, "7"))
    not_found(lambda: c.get_model_config(MODEL, "7"))
    not_found(lambda: c.get_inference_statistics(MODEL, "7"))
    not_found(lambda: c.get_inference_statistics("", "2"))
    assert not c.is_model_ready("nope")
    index = c.get_model_repository_index(as_json=True)["models"]
    assert [(m["name"], m["version"], m["state"]) for m in index] == [(MODEL, "1", "READY")]


def test_server_metadata_extensions_and_one_platform_string(worker):
    c = grpcclient.InferenceServerClient(worker.url)
    assert c.get_server_metadata(as_json=True)["extensions"] == [
        "model_repository",
        "model_configuration",
        "system_shared_memory",
        "parameters",
        "statistics",
        "trace",
        "logging",
    ]
    meta = c.get_model_metadata(MODEL, as_json=True)
    config = c.get_model_config(MODEL, as_json=True)["config"]
    assert meta["platform"] == config["platform"] == config["backend"] == "jax"


# --------------------------------------------------------------------------------------------
# malformed frames


def test_malformed_frames_are_invalid_argument_and_not_unexpected(worker):
    path = "/inference.GRPCInferenceService/ModelInfer"
    req = service_pb2.ModelInferRequest(model_name=MODEL)
    req.inputs.add(name="input_0", datatype="FP32", shape=[1, 4])
    req.raw_input_contents.append(x_rows(1).tobytes())
    body = grpc_frame(req.SerializeToString())
    for crafted in (body[:3], body[:-5]):
        reply = raw_grpc_call(worker.url, path, crafted)
        assert reply.status == grpc.StatusCode.INVALID_ARGUMENT.value[0], reply
        assert "truncated request: the stream ended inside the" in reply.message
    deep = service_pb2.ModelInferRequest(model_name=MODEL)
    deep.inputs.add(name="input_0", datatype="FP32", shape=[1] * 65)
    deep.raw_input_contents.append(b"\0" * 4)
    with grpc.insecure_channel(worker.url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(deep, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "rank 65" in err.value.details()
        good = stub.ModelInfer(req, timeout=10)  # still serving
    assert np.frombuffer(good.raw_output_contents[1], np.int32).tolist() == [1]
    assert "request_failed_unexpectedly" not in worker.logs()

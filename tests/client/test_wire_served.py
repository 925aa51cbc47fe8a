"""ModelInfer end to end through a real ``serving.grpc`` server with the typed ``unary`` shape
and the codec (an echo model: outputs = inputs), read by stock tritonclient and by our client
on asyncio and trio.

Replies cover both send paths of ``Call``: one joined frame for a small reply, and framed from
the arrays' own buffers for a large one, through small 4 MiB windows (so the sender waits for
WINDOW_UPDATEs) and 16 KiB frames, with small pieces between large payloads, and compressed
when the request was."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as tc

from kserve_trio.client import InferInput, InferOutput, KServeModel, RetryPolicy
from kserve_trio.client.errors import RpcError
from kserve_trio.core.errors import StatusCode
from kserve_trio.core.process.config import EdgeLimits
from kserve_trio.core.protocol import codec
from kserve_trio.core.protocol.infer_wire import (
    InferInputTensor,
    InferRequestMessage,
    infer_response_pieces,
)
from kserve_trio.proto import inference as pb
from kserve_trio.serving.grpc import Limits, Method, ServerSettings, unary
from kserve_trio.serving.grpc._call import JOIN_BYTES
from kserve_trio.serving.rpc_codec import reply_pieces
from tests.threaded_grpc import ThreadedGrpcServer

PREFIX = "/inference.GRPCInferenceService/"
SEND_CAP = 64 << 20


async def model_infer(request):
    """ModelInfer answering with its inputs (views of the received request: zero copy)."""
    decoded = codec.decode_infer_request(request)
    with decoded:
        return codec.encode_infer_response(
            request.model_name,
            decoded.id,
            decoded.inputs,
            decoded.requested_outputs,
            zero_copy=True,
        )


class Echo(ThreadedGrpcServer):
    """The echo model on small windows and frames, on its own thread."""

    settings = ServerSettings(
        limits=EdgeLimits(
            stream_window_bytes=4 << 20, connection_window_bytes=4 << 20, max_frame_bytes=16 << 10
        )
    )

    def methods(self) -> dict[str, Method]:
        limits = Limits(256 << 20, SEND_CAP)
        return {
            PREFIX + "ModelInfer": unary(model_infer, pb.ModelInferRequest, limits, "ModelInfer")
        }


@pytest.fixture(scope="module")
def echo_address():
    with Echo() as server:
        yield f"127.0.0.1:{server.port}"


RNG = np.random.default_rng(7)
CASES = {
    "small": {"x": RNG.standard_normal((1, 16)).astype(np.float32)},
    "one_large": {"x": RNG.standard_normal((300 << 10) // 4).astype(np.float32)},
    "large_small_large": {
        "a": RNG.integers(0, 255, 10 << 20, dtype=np.uint8),
        "b": np.array([1, -2, 3], np.int8),
        "c": RNG.standard_normal((5 << 20) // 8).astype(np.float64),
    },
}


def triton_inputs(arrays: dict[str, np.ndarray]) -> list[tc.InferInput]:
    inputs = []
    for name, arr in arrays.items():
        inp = tc.InferInput(name, list(arr.shape), tc.np_to_triton_dtype(arr.dtype))
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return inputs


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("compression", [None, "gzip"])
def test_tritonclient_reads_every_reply_exactly(echo_address, case, compression):
    arrays = CASES[case]
    client = tc.InferenceServerClient(echo_address)
    result = client.infer(
        "echo", triton_inputs(arrays), request_id="r", compression_algorithm=compression
    )
    assert result.get_response().id == "r"
    for name, arr in arrays.items():
        got = result.as_numpy(name)
        assert got.dtype == arr.dtype and got.shape == arr.shape
        np.testing.assert_array_equal(got, arr)
    client.close()


@pytest.mark.anyio
@pytest.mark.parametrize("case", list(CASES))
async def test_our_client_reads_every_reply_exactly(echo_address, case):
    arrays = CASES[case]
    async with KServeModel(echo_address, "echo", shared_memory="off") as model:
        response = await model.infer([InferInput(n, a) for n, a in arrays.items()], id="q")
        assert response.id == "q"
        for name, arr in arrays.items():
            np.testing.assert_array_equal(InferOutput(name, response), arr)
        last = list(arrays)[-1]
        subset = await model.infer([InferInput(n, a) for n, a in arrays.items()], outputs=[last])
        assert [o.name for o in subset.outputs] == [last]
        np.testing.assert_array_equal(InferOutput(last, subset), arrays[last])


@pytest.mark.anyio
async def test_a_reply_over_the_send_cap_is_resource_exhausted_and_the_server_serves_on(
    echo_address,
):
    big = np.zeros(SEND_CAP // 4 + 16, np.float32)
    async with KServeModel(
        echo_address, "echo", shared_memory="off", retry=RetryPolicy(enabled=False)
    ) as model:
        with pytest.raises(RpcError) as info:
            await model.infer([InferInput("x", big)])
        assert info.value.status is StatusCode.RESOURCE_EXHAUSTED
        assert "response larger than max" in info.value.message
        small = CASES["small"]["x"]
        response = await model.infer([InferInput("x", small)])
        np.testing.assert_array_equal(InferOutput("x", response), small)


@pytest.mark.anyio
async def test_a_malformed_request_is_invalid_argument(echo_address):
    request = InferRequestMessage(
        "echo",
        inputs=[InferInputTensor("x", "FP32", [2])],
        raw_input_contents=[bytes(12)],  # 12 bytes for 2 elements
    )
    async with KServeModel(echo_address, "echo", shared_memory="off") as model:
        with pytest.raises(RpcError) as info:
            await model.infer_request(request)
        assert info.value.status is StatusCode.INVALID_ARGUMENT
        assert (
            "input 'x' of model 'echo' has 12 bytes of raw data, expected 8" in info.value.message
        )


def test_a_large_reply_is_framed_from_the_arrays_own_buffers():
    big = np.ones(JOIN_BYTES, np.uint8)
    tiny = np.arange(3, dtype=np.uint8)
    wire = infer_response_pieces(
        "m", "", "", None, [], [memoryview(big), memoryview(tiny), memoryview(big)]
    )
    pieces, length = reply_pieces(wire)
    assert length > JOIN_BYTES  # so Call frames it from the pieces instead of joining them
    assert length == sum(len(p) for p in pieces)
    shared = [p for p in pieces if np.shares_memory(np.frombuffer(p, np.uint8), big)]
    assert len(shared) == 2 and all(len(p) == big.nbytes for p in shared)

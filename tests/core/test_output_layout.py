"""Where each output's bytes sit in ``raw_output_contents``, and the shape limits of decode.

The worker writes Triton's positional layout (one entry per output without typed contents, an
empty one for an output written to shared memory); readers also accept the older inline-only
layout. Both are checked here without a server: through our codec, our client's ``InferOutput``
and ``rehydrate``, and stock tritonclient's ``InferResult`` on the serialized bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.grpc import service_pb2 as sp

from kserve_trio.client.io import InferOutput
from kserve_trio.core.errors import InvalidArgument
from kserve_trio.core.protocol import codec
from kserve_trio.core.protocol.codec import (
    MAX_RANK,
    RequestedOutput,
    ShmRef,
    decode_infer_request,
    decode_infer_response,
    encode_infer_response,
    raw_output_indices,
)
from kserve_trio.core.tensors.tensor import NamedTensor
from kserve_trio.proto import inference as pb

X0 = np.arange(4, dtype=np.float32)
X1 = np.array([[7, -8], [9, 10]], dtype=np.int32)
X2 = np.linspace(-1, 1, 3).astype(np.float64)
OUTS = [
    NamedTensor.from_array("output_0", X0),
    NamedTensor.from_array("output_1", X1),
    NamedTensor.from_array("output_2", X2),
]


class Registry:
    """One real bytearray region named ``out``."""

    def __init__(self) -> None:
        self.buf = bytearray(64)

    def write(self, region: str, offset: int, data) -> None:
        assert region == "out"
        raw = np.asarray(data).tobytes()
        self.buf[offset : offset + len(raw)] = raw


def mixed_response(registry: Registry) -> pb.ModelInferResponse:
    requested = [
        RequestedOutput("output_0", ShmRef("out", 8, 16)),
        RequestedOutput("output_1"),
        RequestedOutput("output_2"),
    ]
    return pb.ModelInferResponse.parse(
        bytes(encode_infer_response("m", "", OUTS, requested, registry))
    )


def shm_out(name: str, datatype: str, shape: list[int]) -> pb.ModelInferResponseInferOutputTensor:
    return pb.ModelInferResponseInferOutputTensor(
        name=name,
        datatype=datatype,
        shape=shape,
        parameters={
            codec.SHM_REGION_PARAM: pb.InferParameter(string_param="out"),
            codec.SHM_OFFSET_PARAM: pb.InferParameter(int64_param=0),
            codec.SHM_BYTE_SIZE_PARAM: pb.InferParameter(int64_param=16),
        },
    )


def old_layout_response() -> pb.ModelInferResponse:
    """What a server before the positional layout sent: no entry for the shm output."""
    return pb.ModelInferResponse(
        model_name="m",
        outputs=[
            shm_out("output_0", "FP32", [4]),
            pb.ModelInferResponseInferOutputTensor(name="output_1", datatype="INT32", shape=[2, 2]),
            pb.ModelInferResponseInferOutputTensor(name="output_2", datatype="FP64", shape=[3]),
        ],
        raw_output_contents=[X1.tobytes(), X2.tobytes()],
    )


def test_the_worker_writes_one_entry_per_output_and_an_empty_one_for_shared_memory():
    reg = Registry()
    resp = mixed_response(reg)
    assert resp.raw_output_contents == [b"", X1.tobytes(), X2.tobytes()]
    assert bytes(reg.buf[8:24]) == X0.tobytes()
    assert resp.outputs[0].parameters[codec.SHM_REGION_PARAM].string_param == "out"
    assert resp.outputs[0].parameters[codec.SHM_BYTE_SIZE_PARAM].int64_param == 16


def test_tritonclient_as_numpy_finds_every_inline_output_of_a_mixed_response():
    result = tc.InferResult(sp.ModelInferResponse.FromString(bytes(mixed_response(Registry()))))
    np.testing.assert_array_equal(result.as_numpy("output_1"), X1)
    np.testing.assert_array_equal(result.as_numpy("output_2"), X2)
    assert result.as_numpy("output_2").dtype == np.float64


@pytest.mark.parametrize("layout", ["positional", "old"])
def test_our_readers_accept_both_layouts(layout):
    resp = mixed_response(Registry()) if layout == "positional" else old_layout_response()
    got = {t.name: t.data for t in decode_infer_response(resp, skip_shm=True)}
    assert list(got) == ["output_1", "output_2"]
    np.testing.assert_array_equal(got["output_1"], X1)
    np.testing.assert_array_equal(got["output_2"], X2)
    np.testing.assert_array_equal(InferOutput("output_1", resp), X1)
    np.testing.assert_array_equal(InferOutput("output_2", resp), X2)
    with pytest.raises(ValueError, match="output 'output_0' of model 'm' was written to shared"):
        InferOutput("output_0", resp)
    with pytest.raises(InvalidArgument, match="output 'output_0' of model 'm' was written"):
        decode_infer_response(resp)


def test_raw_output_indices_by_layout():
    typed = pb.ModelInferResponseInferOutputTensor(
        name="t", datatype="INT32", shape=[1], contents=pb.InferTensorContents(int_contents=[5])
    )
    inline = pb.ModelInferResponseInferOutputTensor(name="i", datatype="INT32", shape=[1])
    shm = shm_out("s", "FP32", [4])
    outs = [shm, typed, inline, shm, inline]
    assert raw_output_indices(outs, 4) == [0, None, 1, 2, 3]  # positional: shm -> placeholder
    assert raw_output_indices(outs, 2) == [None, None, 0, None, 1]  # inline-only
    assert raw_output_indices(outs, 0) == [None] * 5
    assert raw_output_indices(outs, 3) is None
    assert raw_output_indices([inline, inline], 2) == [0, 1]  # both layouts agree


def test_a_count_matching_neither_layout_is_refused_by_every_reader():
    resp = old_layout_response()
    resp.raw_output_contents += [b"", b""]  # 4 entries for 3 outputs: neither layout
    with pytest.raises(InvalidArgument) as info:
        decode_infer_response(resp, skip_shm=True)
    assert str(info.value) == (
        "response from model 'm' has 4 raw_output_contents entries but 3 output(s) without "
        "typed contents (1 of them in shared memory)"
    )
    with pytest.raises(ValueError, match="matching neither one per output"):
        InferOutput("output_1", resp)


def request(shape: list[int], raw: bytes = b"") -> pb.ModelInferRequest:
    return pb.ModelInferRequest(
        model_name="m",
        inputs=[pb.ModelInferRequestInferInputTensor(name="x", datatype="FP32", shape=shape)],
        raw_input_contents=[raw],
    )


def test_rank_above_the_limit_is_invalid_argument():
    with pytest.raises(InvalidArgument) as info:
        decode_infer_request(request([1] * (MAX_RANK + 1), b"\0" * 4))
    assert str(info.value) == (
        "input 'x' of model 'm' has rank 65, more than the limit of 64 dimensions"
    )
    decoded = decode_infer_request(request([1] * MAX_RANK, b"\0" * 4))
    assert decoded.inputs[0].data.ndim == MAX_RANK


def test_an_empty_tensor_with_huge_dimensions_is_invalid_argument():
    with pytest.raises(InvalidArgument) as info:
        decode_infer_request(request([0, 2**61]))
    assert str(info.value) == (
        "input 'x' of model 'm' shape [0, 2305843009213693952] spans 9223372036854775808 bytes "
        "(zero dimensions aside), more than the limit of 4611686018427387904 bytes"
    )
    assert decode_infer_request(request([0, 2**40])).inputs[0].data.shape == (0, 2**40)


def test_a_response_output_of_rank_above_the_limit_is_invalid_argument():
    out = pb.ModelInferResponseInferOutputTensor(name="y", datatype="FP32", shape=[1] * 70)
    resp = pb.ModelInferResponse(model_name="m", outputs=[out], raw_output_contents=[b"\0" * 4])
    with pytest.raises(InvalidArgument, match="output 'y' of model 'm' has rank 70"):
        decode_infer_response(resp)

"""The KServe V2 codec and input validation: round trips, zero copy, every error message,
deadlines, requested outputs, shared memory through a fake registry, metadata and index."""

from __future__ import annotations

import time
from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kserve_trio.core.bundles.manifest import parse_manifest
from kserve_trio.core.errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    UnregisteredRegionError,
)
from kserve_trio.core.protocol import codec
from kserve_trio.core.protocol.codec import (
    INT64_MAX,
    TIMEOUT_NS_PARAM,
    InferRequest,
    RequestedOutput,
    ShmRef,
    combine_deadlines,
    deadline_from_parameters,
    deadline_params,
    decode_infer_request,
    decode_infer_response,
    encode_infer_request,
    encode_infer_request_shm,
    encode_infer_response,
    encode_model_metadata,
    encode_repository_index,
)
from kserve_trio.core.protocol.infer_wire import (
    InferRequestMessage,
    WirePieces,
    parse_infer_request,
    parse_infer_response,
)
from kserve_trio.core.tensors.dtypes import DType
from kserve_trio.core.tensors.tensor import NamedTensor
from kserve_trio.proto import inference as pb

WIRE_DTYPES = [d for d in DType if d.has_wire]
TYPED_DTYPES = [d for d in WIRE_DTYPES if d.contents_field is not None]


# --------------------------------------------------------------------------------------------
# helpers


class FakeRegistry:
    """Real memory per region; records active leases and writes."""

    def __init__(self) -> None:
        self.regions: dict[str, bytearray] = {}
        self.active = 0
        self.released = 0
        self.writes: list[tuple[str, int, int]] = []

    def add(self, name: str, size: int) -> bytearray:
        buf = bytearray(size)
        self.regions[name] = buf
        return buf

    def _region(self, name: str) -> bytearray:
        try:
            return self.regions[name]
        except KeyError:
            raise UnregisteredRegionError(name) from None

    def read_view(
        self, region: str, offset: int, byte_size: int
    ) -> tuple[memoryview, Callable[[], None]]:
        buf = self._region(region)
        if offset > len(buf) or byte_size > len(buf) - offset:
            raise InvalidArgument(f"read out of bounds of region '{region}'")
        self.active += 1

        def release() -> None:
            self.active -= 1
            self.released += 1

        return memoryview(buf)[offset : offset + byte_size], release

    def write(self, region: str, offset: int, data: memoryview | bytes | np.ndarray) -> None:
        buf = self._region(region)
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        buf[offset : offset + raw.nbytes] = raw.tobytes()
        self.writes.append((region, offset, raw.nbytes))


def wire(msg):
    """Serialize and parse back, as the transports do: a request as the server reads it, a
    response as the client does."""
    data = bytes(msg)
    if isinstance(msg, InferRequestMessage | pb.ModelInferRequest):
        return parse_infer_request(data)
    if isinstance(msg, WirePieces):
        return parse_infer_response(data)
    return type(msg).parse(data)


def raw_request(
    *tensors: tuple[str, str, list[int]], raw: list[bytes], **kw
) -> pb.ModelInferRequest:
    return pb.ModelInferRequest(
        model_name=kw.pop("model_name", "m"),
        inputs=[
            pb.ModelInferRequestInferInputTensor(name=n, datatype=dt, shape=s, **kw)
            for n, dt, s in tensors
        ],
        raw_input_contents=raw,
    )


def input_tensor(name: str, datatype: str, shape: list[int], **kw):
    return pb.ModelInferRequestInferInputTensor(name=name, datatype=datatype, shape=shape, **kw)


def shm_params(region: str, offset: int | None, byte_size: int | None) -> dict:
    params = {"shared_memory_region": pb.InferParameter(string_param=region)}
    if offset is not None:
        params["shared_memory_offset"] = pb.InferParameter(int64_param=offset)
    if byte_size is not None:
        params["shared_memory_byte_size"] = pb.InferParameter(int64_param=byte_size)
    return params


def decode_error(msg: pb.ModelInferRequest, registry=None) -> str:
    with pytest.raises(InvalidArgument) as info:
        decode_infer_request(msg, registry)
    return str(info.value)


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype == object or b.dtype == object:  # BYTES: the elements, not the pointers
        return a.dtype == b.dtype and a.shape == b.shape and a.tolist() == b.tolist()
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


F32 = np.arange(6, dtype=np.float32).reshape(2, 3)


# --------------------------------------------------------------------------------------------
# round trips


@st.composite
def tensors(draw) -> list[NamedTensor]:
    n = draw(st.integers(1, 3))
    out = []
    for i in range(n):
        dtype = draw(st.sampled_from(WIRE_DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 3), min_size=0, max_size=4)))
        count = int(np.prod(shape, dtype=np.int64))
        if dtype.is_bytes:  # variable-length elements, the empty one included
            data = np.empty(count, dtype=object)
            elements = draw(st.lists(st.binary(max_size=6), min_size=count, max_size=count))
            for k, value in enumerate(elements):
                data[k] = value
        else:
            nbytes = count * dtype.itemsize
            data = np.frombuffer(draw(st.binary(min_size=nbytes, max_size=nbytes)), dtype.numpy)
        out.append(NamedTensor(f"t{i}", dtype, shape, data.reshape(shape)))
    return out


@settings(max_examples=150, deadline=None)
@given(inputs=tensors(), data=st.data())
def test_client_server_round_trip_is_exact_for_every_wire_dtype_and_shape(inputs, data):
    names = [t.name for t in inputs]
    requested = data.draw(st.sampled_from([[], names[::-1], names[:1]]))
    req = encode_infer_request("echo", inputs, id="r-1", requested_outputs=requested)
    decoded = decode_infer_request(wire(req))
    assert decoded.model_name == "echo" and decoded.id == "r-1"
    assert [r.name for r in decoded.requested_outputs] == requested
    for sent, got in zip(inputs, decoded.inputs, strict=True):
        assert (got.name, got.dtype, got.shape) == (sent.name, sent.dtype, sent.shape)
        assert same_bytes(got.data, sent.data)

    resp = encode_infer_response("echo", decoded.id, decoded.inputs, decoded.requested_outputs)
    outputs = decode_infer_response(wire(resp))
    expected = [next(t for t in inputs if t.name == n) for n in requested] if requested else inputs
    assert [o.name for o in outputs] == [t.name for t in expected]
    for sent, got in zip(expected, outputs, strict=True):
        assert (got.dtype, got.shape) == (sent.dtype, sent.shape)
        assert same_bytes(got.data, sent.data)


def test_shapes_are_row_major_on_the_wire_never_reversed():
    t = NamedTensor.from_array("x", np.zeros((2, 3, 5), np.float32))
    req = encode_infer_request("m", [t])
    assert list(req.inputs[0].shape) == [2, 3, 5]
    assert decode_infer_request(wire(req)).inputs[0].shape == (2, 3, 5)
    resp = wire(encode_infer_response("m", "", [t]))
    assert list(resp.outputs[0].shape) == [2, 3, 5]


def test_rank0_and_empty_tensors_round_trip():
    scalar = NamedTensor.from_array("s", np.array(3.5, np.float64))
    empty = NamedTensor.from_array("e", np.zeros((0, 4), np.int16))
    decoded = decode_infer_request(wire(encode_infer_request("m", [scalar, empty])))
    assert decoded.inputs[0].shape == () and decoded.inputs[0].data.item() == 3.5
    assert decoded.inputs[1].shape == (0, 4) and decoded.inputs[1].data.dtype == np.int16


# --------------------------------------------------------------------------------------------
# zero copy


def test_raw_inputs_are_views_of_the_received_bytes():
    msg = wire(encode_infer_request("m", [NamedTensor.from_array("x", F32)]))
    arr = decode_infer_request(msg).inputs[0].data
    assert np.shares_memory(arr, np.frombuffer(msg.raw_input_contents[0], np.uint8))
    assert not arr.flags.writeable


def test_echoed_input_is_sent_back_without_a_copy():
    data = bytes(encode_infer_request("m", [NamedTensor.from_array("x", F32)]))
    decoded = decode_infer_request(parse_infer_request(data))
    resp = encode_infer_response("m", "", decoded.inputs, zero_copy=True)
    payload = resp.pieces[1]  # header, payload
    assert bytes(payload) == F32.tobytes()
    assert np.shares_memory(np.frombuffer(payload, np.uint8), np.frombuffer(data, np.uint8))
    copied = encode_infer_response("m", "", decoded.inputs)  # zero_copy=False: bytes of its own
    assert type(copied.pieces[1]) is bytes and copied.pieces[1] == F32.tobytes()


def test_partial_views_and_strided_arrays_are_copied_in_c_order():
    base = wire(encode_infer_request("m", [NamedTensor.from_array("x", F32)]))
    arr = decode_infer_request(base).inputs[0].data
    part = NamedTensor.from_array("p", arr[1:])
    strided = NamedTensor.from_array("t", F32.T)
    resp = wire(encode_infer_response("m", "", [part, strided], zero_copy=True))
    assert resp.raw_output_contents[0] == F32[1:].tobytes()
    assert resp.raw_output_contents[1] == np.ascontiguousarray(F32.T).tobytes()
    assert list(resp.outputs[1].shape) == [3, 2]


# --------------------------------------------------------------------------------------------
# typed contents


TYPED_VALUES = {
    DType.BOOL: [True, False, True, True],
    DType.U8: [0, 1, 200, 255],
    DType.U16: [0, 1, 60000, 7],
    DType.U32: [0, 1, 2**32 - 1, 9],
    DType.U64: [0, 1, 2**64 - 1, 2**40],
    DType.I8: [-128, 0, 5, 127],
    DType.I16: [-32768, 0, 5, 32767],
    DType.I32: [-(2**31), 0, 5, 2**31 - 1],
    DType.I64: [-(2**63), 0, 5, 2**63 - 1],
    DType.F32: [0.5, -1.25, 3.0, 1e30],
    DType.F64: [0.5, -1.25, 3.0, 1e300],
    DType.BYTES: [b"ab", b"", b"\x00\xff", "caf\u00e9".encode()],
}


@pytest.mark.parametrize("dtype", TYPED_DTYPES, ids=lambda d: d.token)
def test_typed_contents_decode_to_the_exact_dtype(dtype):
    values = TYPED_VALUES[dtype]
    contents = pb.InferTensorContents(**{dtype.contents_field: values})
    msg = pb.ModelInferRequest(
        model_name="m", inputs=[input_tensor("x", dtype.wire, [2, 2], contents=contents)]
    )
    x = decode_infer_request(wire(msg)).inputs[0]
    assert x.dtype is dtype and x.shape == (2, 2) and x.data.dtype == dtype.numpy
    np.testing.assert_array_equal(x.data, np.array(values, dtype.numpy).reshape(2, 2))

    resp = pb.ModelInferResponse(
        model_name="m",
        outputs=[
            pb.ModelInferResponseInferOutputTensor(
                name="y", datatype=dtype.wire, shape=[4], contents=contents
            )
        ],
    )
    (y,) = decode_infer_response(wire(resp))
    assert y.dtype is dtype
    np.testing.assert_array_equal(y.data, np.array(values, dtype.numpy))


def test_typed_and_raw_inputs_mix_raw_goes_to_inputs_without_contents():
    msg = pb.ModelInferRequest(
        model_name="m",
        inputs=[
            input_tensor("a", "INT32", [2], contents=pb.InferTensorContents(int_contents=[7, 8])),
            input_tensor("b", "FP32", [2, 3]),
        ],
        raw_input_contents=[F32.tobytes()],
    )
    a, b = decode_infer_request(wire(msg)).inputs
    np.testing.assert_array_equal(a.data, [7, 8])
    np.testing.assert_array_equal(b.data, F32)


# --------------------------------------------------------------------------------------------
# malformed requests: every error with its message


def test_empty_model_name():
    msg = raw_request(("x", "FP32", [2, 3]), raw=[F32.tobytes()], model_name="")
    assert decode_error(msg) == "model_name is empty"


def test_raw_byte_length_mismatch_names_both_numbers():
    msg = raw_request(("x", "FP32", [2, 3]), raw=[b"\0" * 20])
    assert decode_error(msg) == (
        "input 'x' of model 'm' has 20 bytes of raw data, expected 24 (shape [2, 3] x FP32)"
    )


def test_raw_and_typed_contents_both_given():
    msg = pb.ModelInferRequest(
        model_name="m",
        inputs=[
            input_tensor("x", "FP32", [2, 3]),
            input_tensor("y", "INT32", [1], contents=pb.InferTensorContents(int_contents=[1])),
        ],
        raw_input_contents=[F32.tobytes(), b"\1\0\0\0"],
    )
    assert decode_error(msg) == (
        "input 'y' of model 'm' has both typed contents and a raw_input_contents entry"
    )


def test_input_without_any_data():
    msg = pb.ModelInferRequest(model_name="m", inputs=[input_tensor("x", "FP32", [2, 3])])
    assert decode_error(msg) == (
        "input 'x' of model 'm' has no data: no shared memory region, raw_input_contents entry "
        "or typed contents"
    )


def test_negative_dimension():
    msg = raw_request(("x", "FP32", [2, -3]), raw=[b""])
    assert decode_error(msg) == "input 'x' of model 'm' has a negative dimension in shape [2, -3]"


def test_oversized_shape_is_rejected_before_allocating():
    msg = raw_request(("x", "FP64", [2**31, 2**31]), raw=[b""])
    assert decode_error(msg) == (
        "input 'x' of model 'm' shape [2147483648, 2147483648] needs 36893488147419103232 bytes, "
        "more than the limit of 4611686018427387904 bytes"
    )
    typed = pb.ModelInferRequest(
        model_name="m",
        inputs=[
            input_tensor(
                "x", "INT64", [2**40, 2**40], contents=pb.InferTensorContents(int64_contents=[1])
            )
        ],
    )
    assert "more than the limit of 4611686018427387904 bytes" in decode_error(typed)


def test_duplicate_input_names():
    msg = raw_request(("x", "FP32", [2, 3]), ("x", "FP32", [2, 3]), raw=[F32.tobytes()] * 2)
    assert decode_error(msg) == "duplicate input 'x' in request for model 'm'"


def test_raw_entry_count_must_match_the_inputs_that_need_raw():
    msg = raw_request(("x", "FP32", [2, 3]), raw=[F32.tobytes(), F32.tobytes()])
    assert decode_error(msg) == (
        "request for model 'm' has 2 raw_input_contents entries but 1 input(s) take their data "
        "from raw_input_contents"
    )
    msg = raw_request(("x", "FP32", [2, 3]), ("y", "FP32", [2, 3]), raw=[F32.tobytes()])
    assert "has 1 raw_input_contents entries but 2 input(s)" in decode_error(msg)


@pytest.mark.parametrize(
    ("datatype", "message"),
    [
        ("STRING", "input 'x' of model 'm': unknown KServe datatype 'STRING'; expected one of"),
        ("FLOAT", "input 'x' of model 'm': unknown KServe datatype 'FLOAT'; expected one of BOOL"),
    ],
)
def test_unknown_datatype(datatype, message):
    msg = raw_request(("x", datatype, [1]), raw=[b"\0"])
    assert decode_error(msg).startswith(message)


def test_typed_element_count_mismatch():
    contents = pb.InferTensorContents(fp32_contents=[1.0] * 5)
    msg = pb.ModelInferRequest(
        model_name="m", inputs=[input_tensor("x", "FP32", [2, 3], contents=contents)]
    )
    assert decode_error(msg) == (
        "input 'x' of model 'm' has 5 elements in fp32_contents, expected 6 (shape [2, 3])"
    )


def test_typed_data_in_the_wrong_field():
    contents = pb.InferTensorContents(int_contents=[1, 2])
    msg = pb.ModelInferRequest(
        model_name="m", inputs=[input_tensor("x", "FP32", [2], contents=contents)]
    )
    assert decode_error(msg) == (
        "input 'x' of model 'm' has datatype FP32 but carries data in int_contents; "
        "expected fp32_contents"
    )


@pytest.mark.parametrize("datatype", ["FP16", "BF16"])
def test_half_precision_has_no_typed_field(datatype):
    contents = pb.InferTensorContents(fp32_contents=[1.0])
    msg = pb.ModelInferRequest(
        model_name="m", inputs=[input_tensor("x", datatype, [1], contents=contents)]
    )
    assert decode_error(msg) == (
        f"input 'x' of model 'm' has datatype {datatype}, which has no typed contents field; "
        "send it in raw_input_contents or shared memory"
    )


def test_typed_value_out_of_range():
    contents = pb.InferTensorContents(int_contents=[300])
    msg = pb.ModelInferRequest(
        model_name="m", inputs=[input_tensor("x", "INT8", [1], contents=contents)]
    )
    assert (
        decode_error(msg)
        == "input 'x' of model 'm' has a value in int_contents out of range for INT8"
    )


def test_requested_output_errors():
    base = raw_request(("x", "FP32", [2, 3]), raw=[F32.tobytes()])
    dup = pb.ModelInferRequestInferRequestedOutputTensor(name="y")
    base.outputs = [dup, pb.ModelInferRequestInferRequestedOutputTensor(name="y")]
    assert decode_error(base) == "output 'y' of model 'm' is requested more than once"
    base.outputs = [pb.ModelInferRequestInferRequestedOutputTensor(name="")]
    assert decode_error(base) == "request for model 'm' requests an unnamed output"
    base.outputs = [
        pb.ModelInferRequestInferRequestedOutputTensor(
            name="y", parameters=shm_params("r", 0, None)
        )
    ]
    assert decode_error(base) == (
        "requested output 'y' of model 'm' names shared memory region 'r' but has no "
        "shared_memory_byte_size"
    )


def test_requested_outputs_decode_with_shm_refs():
    msg = raw_request(("x", "FP32", [2, 3]), raw=[F32.tobytes()])
    msg.outputs = [
        pb.ModelInferRequestInferRequestedOutputTensor(
            name="b", parameters=shm_params("r", 16, 64)
        ),
        pb.ModelInferRequestInferRequestedOutputTensor(name="a"),
    ]
    decoded = decode_infer_request(wire(msg))
    assert decoded.requested_outputs == [
        RequestedOutput("b", ShmRef("r", 16, 64)),
        RequestedOutput("a", None),
    ]


# --------------------------------------------------------------------------------------------
# deadlines


def int_param(v: int) -> pb.InferParameter:
    return pb.InferParameter(int64_param=v)


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({}, 0),
        ({TIMEOUT_NS_PARAM: int_param(500)}, 1500),
        ({"timeout": int_param(2)}, 3000),
        ({TIMEOUT_NS_PARAM: int_param(5000), "timeout": int_param(2)}, 3000),
        ({TIMEOUT_NS_PARAM: int_param(500), "timeout": int_param(2)}, 1500),
        ({TIMEOUT_NS_PARAM: pb.InferParameter(string_param="500")}, 0),
        ({TIMEOUT_NS_PARAM: pb.InferParameter(double_param=500.0)}, 0),
        ({TIMEOUT_NS_PARAM: pb.InferParameter(uint64_param=500)}, 0),
        ({"timeout": pb.InferParameter(uint64_param=2)}, 0),
        ({TIMEOUT_NS_PARAM: int_param(0)}, 0),
        ({TIMEOUT_NS_PARAM: int_param(-5), "timeout": int_param(-1)}, 0),
        ({TIMEOUT_NS_PARAM: int_param(-5), "timeout": int_param(1)}, 2000),
        ({TIMEOUT_NS_PARAM: int_param(INT64_MAX)}, INT64_MAX),
        ({"timeout": int_param(INT64_MAX)}, INT64_MAX),
    ],
)
def test_deadline_from_parameters(params, expected):
    assert deadline_from_parameters(params, now_ns=1000) == expected
    msg = raw_request(("x", "FP32", [2, 3]), raw=[F32.tobytes()])
    msg.parameters = params
    assert decode_infer_request(wire(msg), now_ns=1000).deadline_ns == expected


def test_decode_uses_the_monotonic_clock_by_default():
    msg = wire(raw_request(("x", "FP32", [2, 3]), raw=[F32.tobytes()]))
    msg.parameters = deadline_params(10**9)
    before = time.monotonic_ns()
    deadline = decode_infer_request(wire(msg)).deadline_ns
    after = time.monotonic_ns()
    assert before + 10**9 <= deadline <= after + 10**9


def test_deadline_params_round_trip_and_non_positive_budget():
    assert deadline_params(0) == {}
    assert deadline_params(-7) == {}
    params = deadline_params(123)
    assert params == {TIMEOUT_NS_PARAM: 123} and type(params[TIMEOUT_NS_PARAM]) is int
    req = wire(encode_infer_request("m", [NamedTensor.from_array("x", F32)], budget_ns=123))
    assert deadline_from_parameters(req.parameters, now_ns=10) == 133
    assert deadline_params(2**70)[TIMEOUT_NS_PARAM] == INT64_MAX


def test_combine_deadlines_smallest_non_zero_wins():
    assert combine_deadlines() == 0
    assert combine_deadlines(0, 0) == 0
    assert combine_deadlines(5, 0, 3) == 3
    assert combine_deadlines(0, 9) == 9


def test_encode_request_merges_parameters_with_the_budget():
    extra = {"priority": pb.InferParameter(int64_param=2)}
    req = encode_infer_request(
        "m", [NamedTensor.from_array("x", F32)], parameters=extra, budget_ns=50, id="q"
    )
    assert req.id == "q"
    assert set(req.parameters) == {"priority", TIMEOUT_NS_PARAM}
    decoded = decode_infer_request(wire(req), now_ns=0)
    assert decoded.parameters["priority"] == 2 and decoded.deadline_ns == 50
    assert type(decoded.parameters["priority"]) is int  # an int64_param


# --------------------------------------------------------------------------------------------
# response encode: requested outputs


OUTS = [
    NamedTensor.from_array("a", np.arange(3, dtype=np.int32)),
    NamedTensor.from_array("b", np.ones((2, 2), np.float64)),
    NamedTensor.from_array("c", np.zeros((1,), ml_dtypes.bfloat16)),
]


def test_no_requested_outputs_returns_all_in_model_order():
    resp = wire(encode_infer_response("m", "id-1", OUTS, None, model_version="3"))
    assert (resp.model_name, resp.id, resp.model_version) == ("m", "id-1", "3")
    assert [o.name for o in resp.outputs] == ["a", "b", "c"]
    assert [o.datatype for o in resp.outputs] == ["INT32", "FP64", "BF16"]
    assert resp.raw_output_contents == [t.data.tobytes() for t in OUTS]
    assert [o.name for o in wire(encode_infer_response("m", "", OUTS, [])).outputs] == [
        "a",
        "b",
        "c",
    ]


def test_requested_outputs_subset_in_request_order():
    resp = wire(encode_infer_response("m", "", OUTS, [RequestedOutput("c"), RequestedOutput("a")]))
    assert [o.name for o in resp.outputs] == ["c", "a"]
    assert resp.raw_output_contents == [OUTS[2].data.tobytes(), OUTS[0].data.tobytes()]


def test_unknown_requested_output():
    with pytest.raises(InvalidArgument) as info:
        encode_infer_response("m", "", OUTS, [RequestedOutput("a"), RequestedOutput("x")])
    assert str(info.value) == "model 'm' has no output 'x' (outputs: a, b, c)"


def test_outputs_inconsistent_with_their_data_are_internal_errors():
    bad = NamedTensor("y", DType.F32, (2,), np.zeros(2, np.float64))
    with pytest.raises(Internal) as info:
        encode_infer_response("m", "", [bad])
    assert str(info.value) == "output 'y' of model 'm' declares f32[2] but its data is float64[2]"
    fp8 = NamedTensor.from_array("z", np.zeros(2, ml_dtypes.float8_e4m3fn))
    with pytest.raises(Internal) as info:
        encode_infer_response("m", "", [fp8])
    assert str(info.value) == (
        "output 'z' of model 'm' has dtype f8_e4m3, which has no KServe wire datatype"
    )


# --------------------------------------------------------------------------------------------
# shared memory


def stage_shm(registry: FakeRegistry, tensors: list[NamedTensor], region="in", pad=8):
    offsets, off = [], pad
    for t in tensors:
        offsets.append(off)
        off += t.nbytes + pad
    buf = registry.add(region, off)
    for t, o in zip(tensors, offsets, strict=True):
        buf[o : o + t.nbytes] = t.data.tobytes()
    return offsets


def test_shm_inputs_are_zero_copy_and_leases_released_once():
    reg = FakeRegistry()
    a = NamedTensor.from_array("a", F32)
    b = NamedTensor.from_array("b", np.arange(4, dtype=np.uint16))
    offsets = stage_shm(reg, [a, b])
    req = encode_infer_request_shm("m", [a, b], "in", offsets, budget_ns=5)
    assert req.raw_input_contents == []
    assert req.inputs[0].parameters["shared_memory_byte_size"] == 24
    decoded = decode_infer_request(wire(req), reg, now_ns=0)
    assert decoded.deadline_ns == 5
    assert reg.active == 2 and len(decoded.leases) == 2
    for sent, got in zip([a, b], decoded.inputs, strict=True):
        assert same_bytes(got.data, sent.data)
        assert np.shares_memory(got.data, np.frombuffer(reg.regions["in"], np.uint8))
        assert not got.data.flags.writeable
    decoded.release()
    decoded.release()
    assert reg.active == 0 and reg.released == 2


def test_request_is_a_context_manager_that_releases():
    reg = FakeRegistry()
    a = NamedTensor.from_array("a", F32)
    req = encode_infer_request_shm("m", [a], "in", stage_shm(reg, [a]))
    with decode_infer_request(wire(req), reg) as decoded:
        assert reg.active == 1 and isinstance(decoded, InferRequest)
    assert reg.active == 0


def test_release_runs_every_lease_even_if_one_fails():
    calls = []

    def boom():
        calls.append("boom")
        raise RuntimeError("lease failed")

    request = InferRequest("m", leases=[boom, lambda: calls.append("ok")])
    with pytest.raises(RuntimeError, match="lease failed"):
        request.release()
    assert calls == ["boom", "ok"]
    request.release()
    assert calls == ["boom", "ok"]


def test_shm_priority_over_raw_and_mixed_with_raw():
    reg = FakeRegistry()
    a = NamedTensor.from_array("a", F32)
    offsets = stage_shm(reg, [a])
    msg = pb.ModelInferRequest(
        model_name="m",
        inputs=[
            input_tensor("a", "FP32", [2, 3], parameters=shm_params("in", offsets[0], 24)),
            input_tensor("b", "INT8", [2]),
        ],
        raw_input_contents=[b"\x01\x02"],
    )
    got_a, got_b = decode_infer_request(wire(msg), reg).inputs
    assert same_bytes(got_a.data, F32)
    np.testing.assert_array_equal(got_b.data, [1, 2])


def test_unregistered_region_is_failed_precondition_and_releases_earlier_leases():
    reg = FakeRegistry()
    a = NamedTensor.from_array("a", F32)
    offsets = stage_shm(reg, [a])
    msg = pb.ModelInferRequest(
        model_name="m",
        inputs=[
            input_tensor("a", "FP32", [2, 3], parameters=shm_params("in", offsets[0], 24)),
            input_tensor("b", "FP32", [2, 3], parameters=shm_params("gone", 0, 24)),
        ],
    )
    with pytest.raises(FailedPrecondition) as info:
        decode_infer_request(wire(msg), reg)
    assert str(info.value) == "unregistered shared memory region: gone"
    assert reg.active == 0 and reg.released == 1


def test_shm_param_errors():
    reg = FakeRegistry()
    reg.add("in", 64)

    def with_params(params):
        return pb.ModelInferRequest(
            model_name="m", inputs=[input_tensor("x", "FP32", [2, 3], parameters=params)]
        )

    assert decode_error(with_params(shm_params("in", 0, None)), reg) == (
        "input 'x' of model 'm' names shared memory region 'in' but has no shared_memory_byte_size"
    )
    assert decode_error(with_params(shm_params("in", 0, 20)), reg) == (
        "input 'x' of model 'm' has shared_memory_byte_size 20, expected 24 (shape [2, 3] x FP32)"
    )
    assert decode_error(with_params(shm_params("in", -4, 24)), reg) == (
        "input 'x' of model 'm' has a negative shared_memory_offset -4"
    )
    assert decode_error(with_params(shm_params("in", 0, -1)), reg) == (
        "input 'x' of model 'm' has a negative shared_memory_byte_size -1"
    )
    assert decode_error(with_params(shm_params("in", 0, 24)), None) == (
        "input 'x' of model 'm' names shared memory region 'in' but this endpoint has no shared "
        "memory registry"
    )
    assert reg.active == 0


def test_registry_view_of_the_wrong_size_is_rejected_and_released():
    class ShortRegistry(FakeRegistry):
        def read_view(self, region, offset, byte_size):
            view, release = super().read_view(region, offset, byte_size)
            return view[:-1], release

    reg = ShortRegistry()
    reg.add("in", 64)
    msg = pb.ModelInferRequest(
        model_name="m",
        inputs=[input_tensor("x", "FP32", [2, 3], parameters=shm_params("in", 0, 24))],
    )
    assert decode_error(msg, reg) == (
        "input 'x' of model 'm': shared memory region 'in' returned 23 bytes, expected 24"
    )
    assert reg.active == 0


def test_shm_params_with_wrong_oneof_are_absent():
    reg = FakeRegistry()
    buf = reg.add("in", 24)
    buf[:] = F32.tobytes()
    params = shm_params("in", None, 24)
    params["shared_memory_offset"] = pb.InferParameter(string_param="8")
    msg = pb.ModelInferRequest(
        model_name="m", inputs=[input_tensor("x", "FP32", [2, 3], parameters=params)]
    )
    assert same_bytes(decode_infer_request(wire(msg), reg).inputs[0].data, F32)

    params = {"shared_memory_region": pb.InferParameter(int64_param=1)}
    msg = pb.ModelInferRequest(
        model_name="m",
        inputs=[input_tensor("x", "FP32", [2, 3], parameters=params)],
        raw_input_contents=[F32.tobytes()],
    )
    decoded = decode_infer_request(wire(msg), reg)
    assert not decoded.leases and same_bytes(decoded.inputs[0].data, F32)


def test_shm_output_is_written_with_params_and_an_empty_raw_entry():
    reg = FakeRegistry()
    buf = reg.add("out", 128)
    requested = [RequestedOutput("b", ShmRef("out", 16, 64)), RequestedOutput("a")]
    resp = wire(encode_infer_response("m", "", OUTS, requested, reg))
    assert [o.name for o in resp.outputs] == ["b", "a"]
    assert resp.raw_output_contents == [b"", OUTS[0].data.tobytes()]  # positional
    params = resp.outputs[0].parameters
    assert params == {
        "shared_memory_region": "out",
        "shared_memory_offset": 16,
        "shared_memory_byte_size": 32,
    }
    assert not resp.outputs[1].parameters
    assert bytes(buf[16:48]) == OUTS[1].data.tobytes()
    assert reg.writes == [("out", 16, 32)]

    (a,) = decode_infer_response(resp, skip_shm=True)
    np.testing.assert_array_equal(a.data, OUTS[0].data)
    with pytest.raises(InvalidArgument) as info:
        decode_infer_response(resp)
    assert str(info.value) == (
        "output 'b' of model 'm' was written to shared memory region 'out'; read it from there"
    )


def test_shm_output_larger_than_the_requested_slice():
    reg = FakeRegistry()
    reg.add("out", 128)
    requested = [RequestedOutput("a"), RequestedOutput("b", ShmRef("out", 0, 31))]
    with pytest.raises(InvalidArgument) as info:
        encode_infer_response("m", "", OUTS, requested, reg)
    assert str(info.value) == (
        "output 'b' of model 'm' is 32 bytes, larger than the requested shared_memory_byte_size 31"
    )
    assert reg.writes == []
    with pytest.raises(InvalidArgument) as info:
        encode_infer_response("m", "", OUTS, [RequestedOutput("b", ShmRef("out", 0, 32))], None)
    assert str(info.value) == (
        "output 'b' of model 'm' was requested into shared memory region 'out' but this endpoint "
        "has no shared memory registry"
    )


def test_shm_output_into_unregistered_region_propagates():
    with pytest.raises(UnregisteredRegionError):
        encode_infer_response(
            "m", "", OUTS, [RequestedOutput("a", ShmRef("nope", 0, 64))], FakeRegistry()
        )


def test_encode_request_shm_requires_one_offset_per_input():
    with pytest.raises(ValueError, match="1 offsets given for 2 inputs"):
        encode_infer_request_shm("m", OUTS[:2], "r", [0])


def test_client_requests_shm_outputs():
    req = wire(
        encode_infer_request(
            "m", OUTS[:1], requested_outputs=["a", RequestedOutput("b", ShmRef("r", 8, 32))]
        )
    )
    assert decode_infer_request(req).requested_outputs == [
        RequestedOutput("a"),
        RequestedOutput("b", ShmRef("r", 8, 32)),
    ]


# --------------------------------------------------------------------------------------------
# response decode errors


def test_decode_response_errors():
    out = pb.ModelInferResponseInferOutputTensor(name="y", datatype="FP32", shape=[2])
    resp = pb.ModelInferResponse(model_name="m", outputs=[out], raw_output_contents=[b"", b""])
    with pytest.raises(InvalidArgument) as info:
        decode_infer_response(resp)
    assert str(info.value) == (
        "response from model 'm' has 2 raw_output_contents entries but 1 output(s) without "
        "typed contents (0 of them in shared memory)"
    )
    resp.raw_output_contents = [b"\0" * 7]
    with pytest.raises(InvalidArgument) as info:
        decode_infer_response(resp)
    assert str(info.value) == (
        "output 'y' of model 'm' has 7 bytes of raw data, expected 8 (shape [2] x FP32)"
    )
    resp.raw_output_contents = []
    with pytest.raises(InvalidArgument) as info:
        decode_infer_response(resp)
    assert str(info.value) == (
        "output 'y' of model 'm' has no data: no raw_output_contents entry or contents"
    )


# --------------------------------------------------------------------------------------------
# metadata and repository index

MANIFEST = {
    "format_version": "2.0",
    "executable_inputs": [
        {"name": "image", "dtype": "f32", "shape": "whcn", "dims": {"w": 224, "h": 224, "c": 3}},
        {"name": "tokens", "dtype": "i64", "shape": "tn", "dims": {"t": -1}},
    ],
    "executable_outputs": [{"name": "logits", "dtype": "bf16", "shape": "kn", "dims": {"k": 10}}],
    "input_shapes": [{"t": 8}, {"t": 16}],
}


def test_model_metadata_has_row_major_wire_shapes_with_wildcards():
    manifest = parse_manifest(MANIFEST, "resnet")
    meta = wire(encode_model_metadata("resnet", manifest, "cpu"))
    assert (meta.name, meta.platform, meta.versions) == ("resnet", "cpu", ["1"])
    assert [(t.name, t.datatype, t.shape) for t in meta.inputs] == [
        ("image", "FP32", [-1, 3, 224, 224]),
        ("tokens", "INT64", [-1, -1]),
    ]
    assert [(t.name, t.datatype, t.shape) for t in meta.outputs] == [("logits", "BF16", [-1, 10])]


def test_model_metadata_prefers_client_specs():
    raw = dict(MANIFEST)
    raw["client_inputs"] = [{"name": "jpeg", "dtype": "u8", "shape": "l", "dims": {"l": -1}}]
    meta = encode_model_metadata("r", parse_manifest(raw, "r"), "cuda")
    assert [(t.name, t.datatype, t.shape) for t in meta.inputs] == [("jpeg", "UINT8", [-1])]
    assert [t.name for t in meta.outputs] == ["logits"]


def test_repository_index_names_and_pairs_keep_the_given_order():
    index = wire(encode_repository_index(["b", "a"]))
    assert [(m.name, m.state, m.version, m.reason) for m in index.models] == [
        ("b", "READY", "1", ""),
        ("a", "READY", "1", ""),
    ]
    index = encode_repository_index([("z", False), ("y", True)])
    assert [(m.name, m.state) for m in index.models] == [("z", "UNAVAILABLE"), ("y", "READY")]
    assert encode_repository_index([]).models == []


def test_public_surface():
    assert codec.TIMEOUT_NS_PARAM == "reactant_timeout_ns"
    for name in codec.__all__:
        assert hasattr(codec, name), name

"""The ModelInfer wire module against Google protobuf (tritonclient's ``service_pb2``), both
directions, every field: protobuf's bytes parse to exactly the message a field-by-field
conversion gives, and our bytes parse in protobuf to exactly the original. Payloads are views
(zero copy) on parse and on encode; malformed bytes are ``ValueError``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as sp

from kserve_trio.core.protocol.infer_wire import (
    InferInputTensor,
    InferOutputTensor,
    InferRequestedOutput,
    InferRequestMessage,
    InferResponseMessage,
    WirePieces,
    infer_request_pieces,
    infer_response_pieces,
    parse_infer_request,
    parse_infer_response,
)
from kserve_trio.core.protocol.wire import (
    TensorContents,
    Uint64,
    encode_varint,
    len_field,
    param_bytes,
    plain_param,
)
from kserve_trio.proto import inference as pb

# --------------------------------------------------------------------------------------------
# strategies: protobuf messages with every field

texts = st.text(max_size=6)
INT64 = st.integers(-(2**63), 2**63 - 1)
param_values = st.one_of(
    st.tuples(st.just("bool_param"), st.booleans()),
    st.tuples(st.just("int64_param"), INT64),
    st.tuples(st.just("string_param"), texts),
    st.tuples(st.just("double_param"), st.floats(allow_nan=False)),
    st.tuples(st.just("uint64_param"), st.integers(0, 2**64 - 1)),
    st.tuples(st.just(""), st.none()),  # a parameter with no member set
)
param_maps = st.dictionaries(texts, param_values, max_size=3)
contents = st.fixed_dictionaries(
    {},
    optional={
        "bool_contents": st.lists(st.booleans(), max_size=4),
        "int_contents": st.lists(st.integers(-(2**31), 2**31 - 1), max_size=4),
        "int64_contents": st.lists(INT64, max_size=4),
        "uint_contents": st.lists(st.integers(0, 2**32 - 1), max_size=4),
        "uint64_contents": st.lists(st.integers(0, 2**64 - 1), max_size=4),
        "fp32_contents": st.lists(st.floats(width=32, allow_nan=False), max_size=4),
        "fp64_contents": st.lists(st.floats(allow_nan=False), max_size=4),
        "bytes_contents": st.lists(st.binary(max_size=5), max_size=3),
    },
)
tensors = st.fixed_dictionaries(
    {
        "name": texts,
        "datatype": st.sampled_from(["", "FP32", "BF16", "INT64", "BYTES"]),
        "shape": st.lists(INT64, max_size=4),
        "parameters": param_maps,
        "contents": st.none() | contents,
    }
)


def fill_params(target, params: dict) -> None:
    for key, (kind, value) in params.items():
        if kind:
            setattr(target[key], kind, value)
        else:
            target[key].CopyFrom(sp.InferParameter())


def fill_tensor(t, spec: dict) -> None:
    t.name, t.datatype = spec["name"], spec["datatype"]
    t.shape.extend(spec["shape"])
    fill_params(t.parameters, spec["parameters"])
    if spec["contents"] is not None:
        t.contents.SetInParent()
        for field, values in spec["contents"].items():
            getattr(t.contents, field).extend(values)


@st.composite
def pb_requests(draw) -> sp.ModelInferRequest:
    m = sp.ModelInferRequest(model_name=draw(texts), model_version=draw(texts), id=draw(texts))
    fill_params(m.parameters, draw(param_maps))
    for spec in draw(st.lists(tensors, max_size=3)):
        fill_tensor(m.inputs.add(), spec)
    for name, params in draw(st.lists(st.tuples(texts, param_maps), max_size=3)):
        out = m.outputs.add(name=name)
        fill_params(out.parameters, params)
    m.raw_input_contents.extend(draw(st.lists(st.binary(max_size=300), max_size=3)))
    return m


@st.composite
def pb_responses(draw) -> sp.ModelInferResponse:
    m = sp.ModelInferResponse(model_name=draw(texts), model_version=draw(texts), id=draw(texts))
    fill_params(m.parameters, draw(param_maps))
    for spec in draw(st.lists(tensors, max_size=3)):
        fill_tensor(m.outputs.add(), spec)
    m.raw_output_contents.extend(draw(st.lists(st.binary(max_size=300), max_size=3)))
    return m


# --------------------------------------------------------------------------------------------
# an independent field-by-field conversion of a protobuf message into our types


def expected_value(p: sp.InferParameter):
    kind = p.WhichOneof("parameter_choice")
    if kind is None:
        return None
    value = getattr(p, kind)
    return Uint64(value) if kind == "uint64_param" else value


def expected_params(params) -> dict:
    return {k: expected_value(v) for k, v in params.items()}


def expected_contents(t) -> TensorContents | None:
    if not t.HasField("contents"):
        return None
    c = t.contents
    return TensorContents(**{f.name: list(v) for f, v in c.ListFields()})


def expected_tensor(t, cls):
    return cls(
        t.name, t.datatype, list(t.shape), expected_params(t.parameters), expected_contents(t)
    )


def expected_request(m: sp.ModelInferRequest) -> InferRequestMessage:
    return InferRequestMessage(
        model_name=m.model_name,
        model_version=m.model_version,
        id=m.id,
        parameters=expected_params(m.parameters),
        inputs=[expected_tensor(t, InferInputTensor) for t in m.inputs],
        outputs=[InferRequestedOutput(o.name, expected_params(o.parameters)) for o in m.outputs],
        raw_input_contents=[bytes(r) for r in m.raw_input_contents],
    )


def expected_response(m: sp.ModelInferResponse) -> InferResponseMessage:
    return InferResponseMessage(
        model_name=m.model_name,
        model_version=m.model_version,
        id=m.id,
        parameters=expected_params(m.parameters),
        outputs=[expected_tensor(t, InferOutputTensor) for t in m.outputs],
        raw_output_contents=[bytes(r) for r in m.raw_output_contents],
    )


def kinds(params: dict) -> dict:
    """Each parameter's Python type too: ``Uint64(5) == 5`` but they travel differently."""
    return {k: (type(v), v) for k, v in params.items()}


def assert_same_kinds(ours, want) -> None:
    assert kinds(ours.parameters) == kinds(want.parameters)
    tensors = ours.inputs if hasattr(ours, "inputs") else ours.outputs
    want_tensors = want.inputs if hasattr(want, "inputs") else want.outputs
    for a, b in zip(tensors, want_tensors, strict=True):
        assert kinds(a.parameters) == kinds(b.parameters)


# --------------------------------------------------------------------------------------------
# round trips


@settings(max_examples=250, deadline=None)
@given(pb_requests())
def test_request_protobuf_bytes_parse_to_every_field(m):
    ours = parse_infer_request(m.SerializeToString())
    want = expected_request(m)
    assert ours == want
    assert_same_kinds(ours, want)


@settings(max_examples=250, deadline=None)
@given(pb_requests())
def test_request_our_bytes_parse_in_protobuf_to_the_same_message(m):
    data = bytes(expected_request(m))
    assert sp.ModelInferRequest.FromString(data) == m
    assert pb.ModelInferRequest.parse(data) == pb.ModelInferRequest.parse(m.SerializeToString())


@settings(max_examples=250, deadline=None)
@given(pb_responses())
def test_response_protobuf_bytes_parse_to_every_field(m):
    ours = parse_infer_response(m.SerializeToString())
    want = expected_response(m)
    assert ours == want
    assert_same_kinds(ours, want)


@settings(max_examples=250, deadline=None)
@given(pb_responses())
def test_response_our_pieces_parse_in_protobuf_to_the_same_message(m):
    pieces = expected_response(m).pieces()
    data = b"".join(pieces.pieces)
    assert pieces.nbytes == len(data) and bytes(pieces) == data
    assert sp.ModelInferResponse.FromString(data) == m


@pytest.mark.parametrize("value", [0, 0.0, False, "", None, Uint64(0)])
def test_oneof_defaults_are_still_written(value):
    msg = InferRequestMessage(parameters={"k": value})
    back = sp.ModelInferRequest.FromString(bytes(msg))
    kind = {int: "int64_param", float: "double_param", bool: "bool_param", str: "string_param"}
    want = None if value is None else "uint64_param" if type(value) is Uint64 else kind[type(value)]
    assert back.parameters["k"].WhichOneof("parameter_choice") == want
    assert "k" in back.parameters


def test_parameter_values_travel_as_their_kind():
    assert param_bytes(2**63) == b"\x28" + encode_varint(2**63)  # past int64: uint64_param
    assert param_bytes(-1) == b"\x10" + b"\xff" * 9 + b"\x01"
    assert param_bytes(np.int32(7)) == param_bytes(7)
    for bad in (2**64, -(2**63) - 1, b"bytes", [1]):
        with pytest.raises(ValueError):
            param_bytes(bad)
    assert plain_param(pb.InferParameter(uint64_param=3)) == Uint64(3)
    assert type(plain_param(pb.InferParameter(int64_param=3))) is int
    assert plain_param(pb.InferParameter()) is None
    msg = InferRequestMessage(parameters={"p": pb.InferParameter(double_param=1.5)})
    assert sp.ModelInferRequest.FromString(bytes(msg)).parameters["p"].double_param == 1.5


# --------------------------------------------------------------------------------------------
# zero copy


def test_request_payloads_are_views_of_the_received_buffer():
    payload = np.arange(1 << 18, dtype=np.float32)
    m = sp.ModelInferRequest(model_name="m")
    m.inputs.add(name="x", datatype="FP32", shape=[1 << 18])
    m.raw_input_contents.append(payload.tobytes())
    data = m.SerializeToString()
    view = parse_infer_request(data).raw_input_contents[0]
    assert isinstance(view, memoryview)
    arr = np.frombuffer(view, np.float32)
    assert np.shares_memory(arr, np.frombuffer(data, np.uint8))
    np.testing.assert_array_equal(arr, payload)


def test_response_payloads_are_views_on_parse_and_on_encode():
    out = np.arange(1 << 16, dtype=np.float32)
    pieces = infer_response_pieces(
        "m", "", "x", None, [InferOutputTensor("o", "FP32", [1 << 16])], [memoryview(out), b""]
    )
    assert isinstance(pieces, WirePieces)
    assert np.shares_memory(np.frombuffer(pieces.pieces[1], np.uint8), out)  # the array itself
    assert all(type(p) is bytes for i, p in enumerate(pieces.pieces) if i != 1)
    data = bytes(pieces)
    theirs = sp.ModelInferResponse.FromString(data)
    assert theirs.raw_output_contents[0] == out.tobytes() and theirs.raw_output_contents[1] == b""
    parsed = parse_infer_response(data)
    view = parsed.raw_output_contents[0]
    assert np.shares_memory(np.frombuffer(view, np.uint8), np.frombuffer(data, np.uint8))


def test_request_encode_keeps_payloads_as_the_callers_buffers():
    x = np.ones((4, 4), np.float16)
    msg = InferRequestMessage("m", raw_input_contents=[memoryview(x), x.tobytes()])
    pieces = infer_request_pieces(msg)
    assert np.shares_memory(np.frombuffer(pieces.pieces[1], np.uint8), x)
    assert sp.ModelInferRequest.FromString(bytes(msg)).raw_input_contents == [x.tobytes()] * 2


# --------------------------------------------------------------------------------------------
# what protobuf allows and what it does not


def test_unpacked_repeated_fields_and_unknown_fields_are_read():
    tensor = b"\x0a\x01y" + b"\x18\x02\x18\x7f" + b"\x78\x05"  # shape [2, 127] unpacked, field 15
    contents = b"\x35" + np.float32(2.5).tobytes() + b"\x10\x05" + b"\x08\x01"
    tensor += len_field(5, contents)
    data = len_field(5, tensor) + b"\x7a\x01z"  # + unknown field 15 (length-delimited)
    resp = parse_infer_response(data)
    assert resp.outputs[0].shape == [2, 127]
    c = resp.outputs[0].contents
    assert (c.fp32_contents, c.int_contents, c.bool_contents) == ([2.5], [5], [True])
    theirs = sp.ModelInferResponse.FromString(data)
    assert list(theirs.outputs[0].shape) == [2, 127]
    assert expected_response(theirs) == resp


def test_a_known_field_of_another_wire_type_is_skipped():
    data = b"\x08\x05" + len_field(1, b"m")  # model_name first as a varint: skipped
    assert parse_infer_request(data).model_name == "m"
    assert sp.ModelInferRequest.FromString(data).model_name == "m"


@pytest.mark.parametrize(
    "data",
    [
        b"\x3a\x10abc",  # raw entry announcing 16 bytes, 3 there
        b"\x80",  # truncated varint
        b"\x0b",  # wire type 3 (groups)
        b"\x00\x00",  # field number 0
        len_field(1, b"\xff\xfe"),  # model_name not UTF-8
        len_field(5, b"\x1a\x02\x80"),  # truncated packed shape
        len_field(5, len_field(5, b"\x32\x03\x00\x00\x00")),  # packed fp32 of 3 bytes
    ],
)
def test_malformed_bytes_raise_value_error(data):
    with pytest.raises(ValueError):
        parse_infer_request(data)
    with pytest.raises(ValueError):
        parse_infer_response(data.replace(b"\x3a", b"\x32", 1))


def test_varint():
    assert encode_varint(0) == b"\x00"
    assert encode_varint(300) == b"\xac\x02"
    assert encode_varint(-1) == b"\xff" * 9 + b"\x01"  # int64 -1: ten bytes, two's complement

"""The direct ``ModelInferRequest`` encoder means exactly what betterproto2 and protobuf read."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from kserve_trio.client._wire import (
    EncodedInferRequest,
    decode_infer_response,
    encode_infer_request,
    varint,
)
from kserve_trio.proto import inference as pb

names = st.text(min_size=0, max_size=8)
params = st.dictionaries(
    st.text(min_size=0, max_size=6),
    st.one_of(
        st.builds(lambda v: pb.InferParameter(bool_param=v), st.booleans()),
        st.builds(lambda v: pb.InferParameter(int64_param=v), st.integers(-(2**63), 2**63 - 1)),
        st.builds(lambda v: pb.InferParameter(string_param=v), names),
        st.builds(
            lambda v: pb.InferParameter(double_param=v), st.floats(allow_nan=False, width=64)
        ),
        st.builds(lambda v: pb.InferParameter(uint64_param=v), st.integers(0, 2**64 - 1)),
    ),
    max_size=3,
)
inputs = st.builds(
    lambda n, d, s, p: pb.ModelInferRequestInferInputTensor(
        name=n, datatype=d, shape=s, parameters=p
    ),
    names,
    st.sampled_from(["", "FP32", "BF16", "INT64"]),
    st.lists(st.integers(-1, 2**40), max_size=4),
    params,
)
outputs = st.builds(
    lambda n, p: pb.ModelInferRequestInferRequestedOutputTensor(name=n, parameters=p), names, params
)
requests = st.builds(
    lambda m, v, i, p, ins, outs, raw: pb.ModelInferRequest(
        model_name=m,
        model_version=v,
        id=i,
        parameters=p,
        inputs=ins,
        outputs=outs,
        raw_input_contents=raw,
    ),
    names,
    names,
    names,
    params,
    st.lists(inputs, max_size=3),
    st.lists(outputs, max_size=3),
    st.lists(st.binary(max_size=300), max_size=3),
)


@settings(max_examples=300, deadline=None)
@given(requests)
def test_betterproto_reads_back_exactly_the_message(msg):
    assert pb.ModelInferRequest.FromString(encode_infer_request(msg)) == msg


@settings(max_examples=100, deadline=None)
@given(requests)
def test_protobuf_reads_the_same_message_as_from_betterproto(msg):
    ours = service_pb2.ModelInferRequest.FromString(encode_infer_request(msg))
    theirs = service_pb2.ModelInferRequest.FromString(bytes(msg))
    assert ours == theirs


def test_typed_contents_fall_back_to_betterproto():
    msg = pb.ModelInferRequest(
        model_name="m",
        inputs=[
            pb.ModelInferRequestInferInputTensor(
                name="x",
                datatype="INT32",
                shape=[2],
                contents=pb.InferTensorContents(int_contents=[1, -2]),
            )
        ],
    )
    assert encode_infer_request(msg) == bytes(msg)


def test_varints():
    assert varint(0) == b"\x00" and varint(127) == b"\x7f"
    assert varint(300) == b"\xac\x02"
    assert varint(-1) == b"\xff" * 9 + b"\x01"  # int64 -1: ten bytes, two's complement


def test_encoded_request_serializes_on_demand():
    msg = pb.ModelInferRequest(
        model_name="m", raw_input_contents=[np.ones(4, np.float32).tobytes()]
    )
    wire = EncodedInferRequest(msg)
    first = bytes(wire)
    msg.id = "changed"
    assert pb.ModelInferRequest.FromString(bytes(wire)).id == "changed"
    assert pb.ModelInferRequest.FromString(first).id == ""
    assert wire.message is msg


@pytest.mark.parametrize("value", [0, 0.0, False, ""])
def test_oneof_defaults_are_still_written(value):
    key = {int: "int64_param", float: "double_param", bool: "bool_param", str: "string_param"}[
        type(value)
    ]
    msg = pb.ModelInferRequest(parameters={"k": pb.InferParameter(**{key: value})})
    back = service_pb2.ModelInferRequest.FromString(encode_infer_request(msg))
    assert back.parameters["k"].WhichOneof("parameter_choice") == key


out_tensors = st.builds(
    lambda n, d, s, p: pb.ModelInferResponseInferOutputTensor(
        name=n, datatype=d, shape=s, parameters=p
    ),
    names,
    st.sampled_from(["", "FP32", "INT8"]),
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4),
    params,
)
responses = st.builds(
    lambda m, v, i, p, outs, raw: pb.ModelInferResponse(
        model_name=m, model_version=v, id=i, parameters=p, outputs=outs, raw_output_contents=raw
    ),
    names,
    names,
    names,
    params,
    st.lists(out_tensors, max_size=3),
    st.lists(st.binary(max_size=300), max_size=3),
)


@settings(max_examples=300, deadline=None)
@given(responses)
def test_fast_response_decoding_equals_betterproto(msg):
    data = bytes(msg)
    assert decode_infer_response(data) == pb.ModelInferResponse.FromString(data) == msg


@settings(max_examples=100, deadline=None)
@given(responses)
def test_fast_response_decoding_of_protobuf_bytes(msg):
    data = service_pb2.ModelInferResponse.FromString(bytes(msg)).SerializeToString()
    assert decode_infer_response(data) == pb.ModelInferResponse.FromString(data)


def test_unpacked_shapes_are_read_too():
    # field 5 (output) holding field 3 as two unpacked varints: shape [2, 3]
    tensor = b"\x0a\x01y" + b"\x18\x02\x18\x03"
    data = b"\x2a" + bytes([len(tensor)]) + tensor
    assert list(decode_infer_response(data).outputs[0].shape) == [2, 3]


def test_decoding_falls_back_for_contents_and_unknown_fields():
    typed = pb.ModelInferResponse(
        outputs=[
            pb.ModelInferResponseInferOutputTensor(
                name="y",
                datatype="INT32",
                shape=[1],
                contents=pb.InferTensorContents(int_contents=[7]),
            )
        ]
    )
    assert decode_infer_response(bytes(typed)) == typed
    unknown = bytes(pb.ModelInferResponse(model_name="m")) + b"\x78\x01"  # field 15, varint
    assert decode_infer_response(unknown).model_name == "m"

"""Peeking at a ModelInferRequest's routing fields: agreement with full protobuf decoders
(Google protobuf and our betterproto2 classes) on well-formed messages, hand-built encodings
(unpacked shapes, repeated fields), and a fuzz test that malformed input is only ever
InvalidArgument."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as sp

from kserve_trio.core.errors import InvalidArgument
from kserve_trio.core.protocol.wire import encode_varint, len_field
from kserve_trio.gateway.request_path.peek import (
    PeekedRequest,
    peek_infer_request,
    peek_region_name,
)
from kserve_trio.proto import inference as pb

INT64 = st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1)
NAMES = st.sampled_from(["x", "y", "input_ids", "", "é"])


def first_shape(msg: sp.ModelInferRequest, name: str | None):
    if name is None:
        return None
    for t in msg.inputs:
        if t.name == name:
            return tuple(t.shape)
    return None


@st.composite
def requests(draw) -> sp.ModelInferRequest:
    msg = sp.ModelInferRequest(
        model_name=draw(st.text(min_size=1, max_size=12)),
        model_version=draw(st.sampled_from(["", "1"])),
        id=draw(st.text(max_size=12)),
    )
    for _ in range(draw(st.integers(0, 4))):
        t = msg.inputs.add()
        t.name = draw(NAMES)
        t.datatype = draw(st.sampled_from(["FP32", "INT64", "BYTES"]))
        t.shape.extend(draw(st.lists(INT64, max_size=5)))
        if draw(st.booleans()):
            t.parameters["k"].int64_param = draw(INT64)
        if draw(st.booleans()):
            t.contents.int_contents.extend(draw(st.lists(st.integers(-5, 5), max_size=3)))
    for _ in range(draw(st.integers(0, 2))):
        msg.outputs.add().name = draw(NAMES)
    if draw(st.booleans()):
        msg.parameters["reactant_timeout_ns"].int64_param = draw(INT64)
    for _ in range(draw(st.integers(0, 3))):
        msg.raw_input_contents.append(draw(st.binary(max_size=64)))
    return msg


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(msg=requests(), name=st.one_of(st.none(), NAMES))
def test_peek_agrees_with_protobuf_on_well_formed_requests(msg, name):
    data = msg.SerializeToString()
    got = peek_infer_request(data, name)
    assert got == PeekedRequest(msg.model_name, msg.id, first_shape(msg, name))
    ours = pb.ModelInferRequest.parse(data)  # and with betterproto2's decode
    assert (ours.model_name, ours.id) == (got.model_name, got.id)


@st.composite
def mutated(draw) -> bytes:
    data = bytearray(draw(requests()).SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "cut":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif data:
            del data[at]
    return bytes(data)


@FUZZ
@given(data=st.one_of(mutated(), st.binary(max_size=64)), name=st.one_of(st.none(), NAMES))
def test_malformed_bytes_are_only_ever_invalid_argument(data, name):
    try:
        got = peek_infer_request(data, name)
    except InvalidArgument as exc:
        assert exc.message.startswith(("malformed ModelInferRequest", "model_name is empty"))
        return
    # When it reads something, a full decoder that accepts the bytes reads the same.
    msg = sp.ModelInferRequest()
    try:
        msg.ParseFromString(data)
    except DecodeError:
        return
    assert got == PeekedRequest(msg.model_name, msg.id, first_shape(msg, name))


# --------------------------------------------------------------------------------------------
# hand-built encodings


def tensor(name: bytes | None, *parts: bytes) -> bytes:
    body = (len_field(1, name) if name is not None else b"") + b"".join(parts)
    return len_field(5, body)


def packed(*dims: int) -> bytes:
    return len_field(3, b"".join(encode_varint(d) for d in dims))


def unpacked(*dims: int) -> bytes:
    return b"".join(b"\x18" + encode_varint(d) for d in dims)


def test_unpacked_and_mixed_shapes_are_read_as_protobuf_does():
    data = (
        len_field(1, b"m")
        + tensor(b"a", packed(9))
        + tensor(b"x", unpacked(2, -3), packed(4), unpacked(5))
        + len_field(7, b"\x00" * 100)
    )
    reference = sp.ModelInferRequest.FromString(data)
    assert tuple(reference.inputs[1].shape) == (2, -3, 4, 5)
    assert peek_infer_request(data, "x").shape == (2, -3, 4, 5)
    assert peek_infer_request(data, "a").shape == (9,)
    assert peek_infer_request(data, "missing").shape is None
    assert peek_infer_request(data).shape is None


def test_the_last_model_name_wins_and_the_first_named_input_is_used():
    data = (
        len_field(1, b"first")
        + len_field(3, b"id-1")
        + tensor(b"x", packed(1, 2))
        + tensor(b"x", packed(3))
        + len_field(1, b"second")
    )
    assert peek_infer_request(data, "x") == PeekedRequest("second", "id-1", (1, 2))
    assert sp.ModelInferRequest.FromString(data).model_name == "second"


def test_a_tensor_whose_name_repeats_uses_its_last_name():
    data = len_field(1, b"m") + tensor(b"y", packed(7), len_field(1, b"x"))
    assert peek_infer_request(data, "x").shape == (7,)
    assert peek_infer_request(data, "y").shape is None


def test_fields_of_an_unexpected_wire_type_are_skipped_like_unknown_fields():
    data = (
        b"\x08\x05"  # field 1 as a varint: not the model_name
        + len_field(1, b"m")
        + b"\x19" + b"\x00" * 8  # field 3 as fixed64
        + len_field(99, b"future field")
        + tensor(b"x", b"\x1d\x01\x02\x03\x04", packed(6))  # shape as fixed32: unknown
    )  # fmt: skip
    assert peek_infer_request(data, "x") == PeekedRequest("m", "", (6,))
    reference = sp.ModelInferRequest.FromString(data)
    assert (reference.model_name, tuple(reference.inputs[0].shape)) == ("m", (6,))


def test_payload_fields_are_skipped_by_length_not_read():
    payload = b"\xff" * (10 << 20)  # not a valid message inside: it must never be parsed
    data = len_field(7, payload) + len_field(1, b"big") + tensor(b"x", packed(1, 3, 224, 224))
    assert peek_infer_request(data, "x") == PeekedRequest("big", "", (1, 3, 224, 224))


def test_a_memoryview_and_a_bytearray_are_accepted():
    data = len_field(1, b"m") + len_field(3, b"r")
    assert peek_infer_request(memoryview(data)) == peek_infer_request(bytearray(data))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "model_name is empty"),
        (len_field(3, b"id"), "model_name is empty"),
        (len_field(1, b""), "model_name is empty"),
        (b"\x0a\x05ab", "malformed ModelInferRequest: truncated field 1"),
        (b"\x0a", "malformed ModelInferRequest: truncated message"),
        (b"\x0b\x00", "malformed ModelInferRequest: unsupported wire type 3"),
        (b"\x0a\x02\xff\xfe", "model_name is not valid UTF-8"),
        (b"\x08" + b"\xff" * 11, "malformed ModelInferRequest: varint too long"),
        (len_field(1, b"m") + len_field(5, b"\x0a\x09x"), "truncated field 1"),
        (
            len_field(1, b"m") + len_field(5, b"\x0a\x01x\x1a\x02\x80"),
            "malformed ModelInferRequest",
        ),
    ],
)
def test_malformed_requests_are_invalid_argument_with_a_reason(data, message):
    with pytest.raises(InvalidArgument) as info:
        peek_infer_request(data, "x")
    assert message in info.value.message
    assert info.value.status.name == "INVALID_ARGUMENT"


def test_a_nested_tensor_cannot_read_past_its_own_length():
    # The tensor claims 2 bytes; a varint that continues past them must not borrow the bytes
    # that follow the tensor in the outer message.
    data = len_field(1, b"m") + len_field(5, b"\x1a\x80") + len_field(3, b"r")
    with pytest.raises(InvalidArgument):
        peek_infer_request(data, "")


def test_region_names_of_shared_memory_requests():
    register = sp.SystemSharedMemoryRegisterRequest(name="r0", key="/k", offset=0, byte_size=64)
    assert peek_region_name(register.SerializeToString(), "SystemSharedMemoryRegister") == "r0"
    assert peek_region_name(b"", "SystemSharedMemoryUnregister") == ""  # "every region"
    with pytest.raises(InvalidArgument, match="malformed SystemSharedMemoryRegister request"):
        peek_region_name(b"\x0a\x05r", "SystemSharedMemoryRegister")
    with pytest.raises(InvalidArgument, match="malformed SystemSharedMemoryUnregister request"):
        peek_region_name(b"\x0a\x01\xff", "SystemSharedMemoryUnregister")

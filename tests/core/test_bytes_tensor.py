"""core.protocol.bytes_tensor and the BYTES rules of the codec and the manifest: Triton's length-prefixed
encoding against tritonclient's own serializer, each malformation's message, typed and shared
memory inputs, outputs inline and to shared memory, and ``bytes`` refused on executable tensors.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from kserve_trio.core.bundles.manifest import parse_manifest_text
from kserve_trio.core.errors import Internal, InvalidArgument, ManifestError
from kserve_trio.core.protocol.bytes_tensor import (
    bytes_tensor_from_values,
    decode_bytes_tensor,
    encode_bytes_tensor,
)
from kserve_trio.core.protocol.codec import (
    RequestedOutput,
    ShmRef,
    decode_infer_request,
    encode_infer_response,
)
from kserve_trio.core.protocol.infer_wire import parse_infer_request, parse_infer_response
from kserve_trio.core.tensors.dtypes import DType
from kserve_trio.core.tensors.tensor import NamedTensor
from kserve_trio.proto import inference as pb


def strings(values) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=40), min_size=1, max_size=12))
def test_the_encoding_is_tritonclients_both_ways(values):
    arr = strings(values)
    ours = encode_bytes_tensor(arr)
    assert ours == serialize_byte_tensor(arr).item()
    back = decode_bytes_tensor(ours, (len(values),))
    assert back.dtype == object and list(back) == values
    assert list(deserialize_bytes_tensor(ours)) == values


def test_shapes_str_elements_and_an_empty_tensor():
    arr = strings([b"a", "\u00e9", b"", bytearray(b"xy")]).reshape(2, 2)
    data = encode_bytes_tensor(arr)
    assert data == b"\x01\x00\x00\x00a\x02\x00\x00\x00\xc3\xa9\x00\x00\x00\x00\x02\x00\x00\x00xy"
    back = decode_bytes_tensor(memoryview(data), (2, 2))
    assert back.shape == (2, 2) and back.tolist() == [[b"a", "\u00e9".encode()], [b"", b"xy"]]
    assert not back.flags.writeable
    assert decode_bytes_tensor(b"", (0, 3)).shape == (0, 3)
    assert encode_bytes_tensor(np.empty((0,), object)) == b""


@pytest.mark.parametrize(
    ("data", "shape", "message"),
    [
        (
            b"\x05\x00",
            (1,),
            "input 'x': BYTES data ends at byte 2 inside the length prefix of element 0 "
            "(the shape holds 1 elements)",
        ),
        (
            b"\x05\x00\x00\x00abc",
            (1,),
            "input 'x': BYTES element 0 announces 5 bytes at byte 0 but only 3 remain",
        ),
        (
            b"\x01\x00\x00\x00ab",
            (1,),
            "input 'x': 1 bytes of BYTES data left after the 1 elements of its shape",
        ),
        (
            b"\x01\x00\x00\x00a",
            (2,),
            "input 'x': BYTES data ends at byte 5 inside the length prefix of element 1 "
            "(the shape holds 2 elements)",
        ),
    ],
)
def test_every_malformation_is_invalid_argument_naming_the_tensor(data, shape, message):
    with pytest.raises(InvalidArgument) as info:
        decode_bytes_tensor(data, shape, "input 'x'")
    assert info.value.message == message


def test_elements_must_be_bytes_or_str():
    with pytest.raises(TypeError, match="a BYTES element must be bytes or str, got int"):
        encode_bytes_tensor(strings([b"a", 7]))
    with pytest.raises(InvalidArgument, match="has 1 elements in bytes_contents, expected 2"):
        bytes_tensor_from_values([b"a"], (2,), "input 'x'")


# --------------------------------------------------------------------------------------------
# the codec: requests in (raw, typed, shared memory) and responses out


class FakeRegistry:
    """A shared-memory registry over one bytearray (region 'r')."""

    def __init__(self, size: int = 256) -> None:
        self.buf = bytearray(size)
        self.released = 0

    def read_view(self, region, offset, byte_size):
        assert region == "r"

        def release():
            self.released += 1

        return memoryview(self.buf)[offset : offset + byte_size], release

    def write(self, region, offset, data):
        raw = bytes(memoryview(np.ascontiguousarray(data)).cast("B"))
        self.buf[offset : offset + len(raw)] = raw


def text_input(name="text", shape=(3,), **kw):
    return pb.ModelInferRequestInferInputTensor(
        name=name, datatype="BYTES", shape=list(shape), **kw
    )


TEXTS = [b"one two", b"", b"\x00\xff"]


def test_raw_bytes_inputs_decode_to_an_object_array():
    msg = pb.ModelInferRequest(
        model_name="m",
        inputs=[text_input()],
        raw_input_contents=[encode_bytes_tensor(strings(TEXTS))],
    )
    (x,) = decode_infer_request(parse_infer_request(bytes(msg))).inputs
    assert x.dtype is DType.BYTES and x.shape == (3,) and x.data.dtype == object
    assert list(x.data) == TEXTS


def test_typed_bytes_contents_decode_to_the_same_array():
    msg = pb.ModelInferRequest(
        model_name="m",
        inputs=[text_input(contents=pb.InferTensorContents(bytes_contents=TEXTS))],
    )
    (x,) = decode_infer_request(parse_infer_request(bytes(msg))).inputs
    assert list(x.data) == TEXTS
    bad = pb.ModelInferRequest(
        model_name="m",
        inputs=[text_input(contents=pb.InferTensorContents(bytes_contents=TEXTS[:2]))],
    )
    with pytest.raises(InvalidArgument, match="has 2 elements in bytes_contents, expected 3"):
        decode_infer_request(parse_infer_request(bytes(bad)))


def test_shared_memory_bytes_inputs_read_the_whole_range():
    data = encode_bytes_tensor(strings(TEXTS))
    registry = FakeRegistry()
    registry.buf[16 : 16 + len(data)] = data
    params = {
        "shared_memory_region": pb.InferParameter(string_param="r"),
        "shared_memory_offset": pb.InferParameter(int64_param=16),
        "shared_memory_byte_size": pb.InferParameter(int64_param=len(data)),
    }
    msg = pb.ModelInferRequest(model_name="m", inputs=[text_input(parameters=params)])
    request = decode_infer_request(parse_infer_request(bytes(msg)), registry)
    assert list(request.inputs[0].data) == TEXTS
    request.release()
    assert registry.released == 1
    params["shared_memory_byte_size"] = pb.InferParameter(int64_param=len(data) - 1)
    short = pb.ModelInferRequest(model_name="m", inputs=[text_input(parameters=params)])
    with pytest.raises(InvalidArgument, match="BYTES element 2 announces 2 bytes"):
        decode_infer_request(parse_infer_request(bytes(short)), registry)
    assert registry.released == 2  # released on the error path too


def test_a_malformed_raw_bytes_input_names_the_input_and_model():
    msg = pb.ModelInferRequest(
        model_name="m", inputs=[text_input(shape=(1,))], raw_input_contents=[b"\x09\x00\x00\x00ab"]
    )
    with pytest.raises(InvalidArgument) as info:
        decode_infer_request(parse_infer_request(bytes(msg)))
    assert info.value.message == (
        "input 'text' of model 'm': BYTES element 0 announces 9 bytes at byte 0 but only 2 remain"
    )


def test_bytes_outputs_are_encoded_inline_and_into_shared_memory():
    label = NamedTensor.from_array("label", strings([b"ok", "caf\u00e9"]))
    count = NamedTensor.from_array("n", np.array([1, 2], np.int32))
    reply = parse_infer_response(bytes(encode_infer_response("m", "r1", [count, label])))
    assert [o.datatype for o in reply.outputs] == ["INT32", "BYTES"]
    assert list(deserialize_bytes_tensor(bytes(reply.raw_output_contents[1]))) == [
        b"ok",
        "caf\u00e9".encode(),
    ]
    registry = FakeRegistry()
    pieces = encode_infer_response(
        "m", "r2", [label], [RequestedOutput("label", ShmRef("r", 8, 64))], registry
    )
    reply = parse_infer_response(bytes(pieces))
    written = encode_bytes_tensor(label.data)
    assert reply.outputs[0].parameters["shared_memory_byte_size"] == len(written)
    assert bytes(registry.buf[8 : 8 + len(written)]) == written
    with pytest.raises(InvalidArgument, match=r"is 15 bytes, larger than the requested"):
        encode_infer_response(
            "m", "", [label], [RequestedOutput("label", ShmRef("r", 0, 14))], registry
        )


def test_a_bytes_output_with_a_bad_element_is_the_models_bug():
    bad = NamedTensor.from_array("label", strings([b"ok", 3.5]))
    with pytest.raises(Internal) as info:
        encode_infer_response("m", "", [bad])
    assert info.value.message.startswith(
        "output 'label' of model 'm': a BYTES element must be bytes or str, got float"
    )


# --------------------------------------------------------------------------------------------
# manifests


MANIFEST = """\
format_version: "2.0"
executable_inputs:
  - {{name: ids, dtype: {exec_in}, shape: an, dims: {{a: 4}}}}
executable_outputs:
  - {{name: y, dtype: i32, shape: n}}
client_inputs:
  - {{name: text, dtype: bytes, shape: n}}
client_outputs:
  - {{name: label, dtype: bytes, shape: n}}
"""


def test_bytes_is_allowed_on_client_tensors():
    m = parse_manifest_text(MANIFEST.format(exec_in="i32"), "tok")
    assert [t.dtype for t in m.wire_inputs] == [DType.BYTES]
    assert [t.dtype for t in m.wire_outputs] == [DType.BYTES]


def test_bytes_on_an_executable_tensor_is_refused():
    with pytest.raises(ManifestError) as info:
        parse_manifest_text(MANIFEST.format(exec_in="bytes"), "tok", source="tok/manifest.yaml")
    assert str(info.value) == (
        "manifest 'tok' (tok/manifest.yaml): executable_inputs tensor 'ids' has dtype bytes, "
        "which no executable takes or returns; declare string tensors in "
        "client_inputs/client_outputs and turn them into tensors in model.py"
    )
    out = MANIFEST.format(exec_in="i32").replace("{name: y, dtype: i32", "{name: y, dtype: bytes")
    with pytest.raises(ManifestError, match="executable_outputs tensor 'y' has dtype bytes"):
        parse_manifest_text(out, "tok")


def test_the_length_prefix_is_little_endian():
    assert struct.unpack_from("<I", encode_bytes_tensor(strings([b"x" * 258])))[0] == 258

"""core.protocol.rest_codec: REST inference bodies as tritonclient.http writes and reads them.

Requests are built by tritonclient.http itself (``generate_request_body``) and parsed here; our
responses are read back by tritonclient.http (``parse_response_body``). A parsed request is
decoded by the same ``codec.decode_infer_request`` a gRPC request goes through.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import tritonclient.http as httpclient

from kserve_trio.core.errors import InvalidArgument
from kserve_trio.core.protocol import codec, rest_codec
from kserve_trio.core.protocol.infer_wire import InferOutputTensor
from kserve_trio.core.tensors.dtypes import DType
from kserve_trio.core.tensors.tensor import NamedTensor


def triton_body(inputs, outputs=None, **kw):
    body, json_size = httpclient.InferenceServerClient.generate_request_body(inputs, outputs, **kw)
    return (body.encode() if isinstance(body, str) else body), json_size


def tensor(name, x, datatype, binary):
    t = httpclient.InferInput(name, list(x.shape), datatype)
    t.set_data_from_numpy(x, binary_data=binary)
    return t


@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize(
    ("dtype", "datatype"),
    [
        (np.float32, "FP32"),
        (np.float64, "FP64"),
        (np.int8, "INT8"),
        (np.int32, "INT32"),
        (np.int64, "INT64"),
        (np.uint16, "UINT16"),
        (np.uint64, "UINT64"),
        (np.bool_, "BOOL"),
        (np.float16, "FP16"),
    ],
)
def test_tritonclient_requests_decode_to_the_same_arrays(dtype, datatype, binary):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2, 3)) * 10).astype(dtype)
    y = np.arange(4, dtype=np.float32)
    body, json_size = triton_body(
        [tensor("x", x, datatype, binary), tensor("y", y, "FP32", not binary)],
        [httpclient.InferRequestedOutput("out", binary_data=binary)],
        request_id="r-7",
        timeout=5_000_000,
    )
    parsed = rest_codec.parse_infer_request(body, json_size, "m", "1")
    msg = parsed.message
    assert (msg.model_name, msg.model_version, msg.id) == ("m", "1", "r-7")
    assert [o.name for o in msg.outputs] == ["out"] and parsed.wants_binary("out") is binary
    assert msg.parameters == {"timeout": 5_000_000}
    decoded = codec.decode_infer_request(msg)
    assert decoded.deadline_ns > 0  # Triton's timeout parameter reached the codec
    got = {t.name: np.asarray(t.data) for t in decoded.inputs}
    np.testing.assert_array_equal(got["x"], x)
    assert got["x"].dtype == x.dtype and got["x"].shape == x.shape
    np.testing.assert_array_equal(got["y"], y)


def test_bf16_travels_binary_only_and_binary_data_output_asks_for_every_output():
    x = np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 3)
    body, json_size = triton_body([tensor("x", x, "BF16", True)])
    parsed = rest_codec.parse_infer_request(body, json_size, "m")
    assert parsed.binary_all and parsed.wants_binary("anything")
    assert "binary_data_output" not in parsed.message.parameters
    decoded = codec.decode_infer_request(parsed.message)
    np.testing.assert_array_equal(decoded.inputs[0].data, x)


def test_nested_json_data_is_row_major():
    doc = {
        "inputs": [{"name": "x", "shape": [2, 2], "datatype": "INT32", "data": [[1, 2], [3, 4]]}]
    }
    parsed = rest_codec.parse_infer_request(json.dumps(doc).encode(), None, "m")
    decoded = codec.decode_infer_request(parsed.message)
    np.testing.assert_array_equal(decoded.inputs[0].data, [[1, 2], [3, 4]])


def bad(doc_or_body, header_length=None) -> str:
    body = doc_or_body if isinstance(doc_or_body, bytes) else json.dumps(doc_or_body).encode()
    with pytest.raises(InvalidArgument) as err:
        parsed = rest_codec.parse_infer_request(body, header_length, "m")
        codec.decode_infer_request(parsed.message)
    return err.value.message


def inp(**kw):
    base = {"name": "x", "shape": [2], "datatype": "FP32", "data": [1.0, 2.0]}
    base.update(kw)
    return {"inputs": [base]}


def test_malformed_requests_name_the_fault():
    assert bad(b"{nope").startswith("malformed JSON in the inference request")
    assert bad([1, 2]) == "the request must be a JSON object"
    assert bad({"inputs": {}}) == "request for model 'm' 'inputs' must be a list"
    assert bad(inp(shape="2")) == "input 'x' of model 'm' 'shape' must be a list of integers"
    assert bad(inp(datatype=3)) == "input 'x' of model 'm' needs a string 'datatype'"
    assert bad(inp(data=["a", "b"])) == (
        "input 'x' of model 'm' has datatype FP32: its 'data' must hold JSON numbers"
    )
    assert bad(inp(datatype="INT32", data=[1.5, 2])) == (
        "input 'x' of model 'm' has datatype INT32: its 'data' must hold JSON integers"
    )
    assert bad(inp(datatype="BOOL", data=[1, 0])) == (
        "input 'x' of model 'm' has datatype BOOL: its 'data' must hold JSON booleans"
    )
    assert bad(inp(data=[1.0, [2.0]])) == "input 'x' of model 'm' 'data' mixes lists and values"
    no_data = inp()
    del no_data["inputs"][0]["data"]
    assert bad(no_data) == (
        "input 'x' of model 'm' has no data: no shared memory region, binary data or JSON 'data'"
    )
    # the faults the gRPC codec also sees read exactly as they do over gRPC
    assert bad(inp(data=[1.0, 2.0, 3.0])) == (
        "input 'x' of model 'm' has 3 elements in fp32_contents, expected 2 (shape [2])"
    )
    assert "unknown KServe datatype 'FP99'" in bad(inp(datatype="FP99"))
    # the binary section must match the sizes the inputs announce
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": [2],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 8},
                }
            ]
        }
    ).encode()
    assert bad(head + b"\0" * 4, len(head)) == (
        "input 'x' of model 'm' has binary_data_size 8 but only 4 bytes of binary data are "
        "left in the request"
    )
    assert bad(head + b"\0" * 12, len(head)) == (
        "request for model 'm' has 12 bytes of binary data but its inputs' binary_data_size "
        "add up to 8"
    )
    assert bad(head, len(head) + 1) == (
        f"Inference-Header-Content-Length {len(head) + 1} is outside the {len(head)}-byte "
        "request body"
    )


def response(outputs, payloads, wants=None, request_id="r"):
    reply = rest_codec.encode_infer_response("m", "1", request_id, outputs, payloads, wants)
    body = b"".join(bytes(p) for p in reply.pieces)
    return reply, httpclient.InferenceServerClient.parse_response_body(
        body, header_length=reply.header_length
    )


def test_responses_read_back_by_tritonclient_json_and_binary():
    a = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    b = np.array([[True, False]])
    c = np.arange(4, dtype=np.int64) - 2
    named = [
        NamedTensor("a", DType.F32, a.shape, a),
        NamedTensor("b", DType.BOOL, b.shape, b),
        NamedTensor("c", DType.I64, c.shape, c),
    ]
    tensors, payloads = codec.response_outputs("m", named, zero_copy=True)
    for wants in (None, lambda n: n != "b", lambda n: True):
        reply, result = response(tensors, payloads, wants)
        for name, want in (("a", a), ("b", b), ("c", c)):
            got = result.as_numpy(name)
            np.testing.assert_array_equal(got, want)
            assert got.dtype == want.dtype and got.shape == want.shape
        binary = wants is not None
        assert (reply.header_length is not None) is binary
        assert reply.content_type == ("application/octet-stream" if binary else "application/json")
        doc = result.get_response()
        assert doc["model_name"] == "m" and doc["model_version"] == "1" and doc["id"] == "r"
    _, result = response(tensors, payloads, None, request_id="")
    assert "id" not in result.get_response()


def test_an_output_in_shared_memory_carries_its_parameters_and_no_data():
    params = {"shared_memory_region": "r", "shared_memory_byte_size": 8}
    tensors = [InferOutputTensor("a", "FP32", [2], params)]
    reply, result = response(tensors, [b""], lambda n: True)
    out = result.get_response()["outputs"][0]
    assert out == {"name": "a", "datatype": "FP32", "shape": [2], "parameters": params}
    assert reply.header_length is None


def test_bytes_tensors_travel_as_json_strings_and_as_binary():
    x = np.array([b"ab", "h\u00e9llo".encode()], dtype=object)
    for binary in (True, False):
        body, json_size = triton_body([tensor("s", x, "BYTES", binary)])
        decoded = codec.decode_infer_request(
            rest_codec.parse_infer_request(body, json_size, "m").message
        )
        assert list(decoded.inputs[0].data) == [b"ab", "h\u00e9llo".encode()]
    named = [NamedTensor("s", DType.BYTES, x.shape, x)]
    tensors, payloads = codec.response_outputs("m", named)
    for wants in (None, lambda n: True):
        _, result = response(tensors, payloads, wants)
        got = [v if isinstance(v, bytes) else v.encode() for v in result.as_numpy("s")]
        assert got == [b"ab", "h\u00e9llo".encode()]  # tritonclient gives JSON ones as str
    raw = np.array([b"\xff"], dtype=object)
    tensors, payloads = codec.response_outputs("m", [NamedTensor("s", DType.BYTES, (1,), raw)])
    with pytest.raises(InvalidArgument, match="not UTF-8"):
        response(tensors, payloads)

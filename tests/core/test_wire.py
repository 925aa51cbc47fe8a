"""Wire-level fast paths: same messages as betterproto2, payloads as zero-copy views."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from kserve_trio.core.wire import encode_varint, infer_response_pieces, parse_infer_request
from kserve_trio.proto import inference as pb


def triton_request(raws: list[bytes]) -> bytes:
    m = service_pb2.ModelInferRequest(model_name="m", model_version="1", id="req-7")
    m.parameters["timeout"].int64_param = 500
    for i, raw in enumerate(raws):
        t = m.inputs.add(name=f"in{i}", datatype="UINT8", shape=[len(raw)])
        t.parameters["p"].string_param = "v"
        m.raw_input_contents.append(raw)
    out = m.outputs.add(name="o")
    out.parameters["shared_memory_region"].string_param = "r"
    return m.SerializeToString()


def as_message(view) -> pb.ModelInferRequest:
    """Rebuild a betterproto2 message from the view, field by field."""
    return pb.ModelInferRequest(
        model_name=view.model_name,
        model_version=view.model_version,
        id=view.id,
        parameters=dict(view.parameters),
        inputs=[
            pb.ModelInferRequestInferInputTensor(
                name=t.name,
                datatype=t.datatype,
                shape=list(t.shape),
                parameters=dict(t.parameters),
                contents=t.contents,
            )
            for t in view.inputs
        ],
        outputs=[
            pb.ModelInferRequestInferRequestedOutputTensor(
                name=o.name, parameters=dict(o.parameters)
            )
            for o in view.outputs
        ],
        raw_input_contents=[bytes(r) for r in view.raw_input_contents],
    )


@given(
    st.lists(st.binary(max_size=300), max_size=4),
    st.lists(st.integers(-(2**40), 2**40), max_size=4),
    st.text(max_size=8),
    st.floats(allow_nan=False),
)
def test_fast_parse_equals_betterproto2(raws, shape, text, number):
    m = service_pb2.ModelInferRequest.FromString(triton_request(raws))
    t = m.inputs.add(name="typed", datatype="FP32", shape=shape)
    t.contents.fp32_contents.extend([1.0, 2.5])
    m.parameters["b"].bool_param = True
    m.parameters["s"].string_param = text
    m.parameters["d"].double_param = number
    m.parameters["u"].uint64_param = 2**63 + 5
    m.parameters["neg"].int64_param = -7
    data = m.SerializeToString()
    assert as_message(parse_infer_request(data)) == pb.ModelInferRequest.parse(data)


def test_payloads_are_views_of_the_received_buffer():
    payload = np.arange(1 << 18, dtype=np.float32).tobytes()
    data = triton_request([payload])
    msg = parse_infer_request(data)
    view = msg.raw_input_contents[0]
    assert isinstance(view, memoryview)
    arr = np.frombuffer(view, np.float32)
    assert np.shares_memory(arr, np.frombuffer(data, np.uint8))
    assert arr[-1] == (1 << 18) - 1


@pytest.mark.parametrize("data", [b"\x3a\x10abc", b"\x80", b"\x0b"])
def test_truncated_or_unsupported_input_raises(data):
    with pytest.raises(ValueError):
        parse_infer_request(data)


def test_response_pieces_concatenate_to_the_betterproto2_encoding():
    out = np.arange(10, dtype=np.float32)
    resp = pb.ModelInferResponse(
        model_name="m",
        id="x",
        outputs=[pb.ModelInferResponseInferOutputTensor(name="o", datatype="FP32", shape=[10])],
        raw_output_contents=[out.tobytes(), b""],
    )
    pieces = infer_response_pieces(resp)
    assert b"".join(pieces) == bytes(resp)
    parsed = service_pb2.ModelInferResponse.FromString(b"".join(pieces))
    assert parsed.raw_output_contents[0] == out.tobytes()
    view_resp = pb.ModelInferResponse(raw_output_contents=[memoryview(out.view(np.uint8))])
    pieces = infer_response_pieces(view_resp)
    assert any(
        isinstance(p, memoryview) and np.shares_memory(np.frombuffer(p, np.uint8), out)
        for p in pieces
    )
    assert resp.raw_output_contents[0] == out.tobytes()  # the message is left as it was


def test_varint():
    assert encode_varint(0) == b"\x00"
    assert encode_varint(300) == b"\xac\x02"

"""The client's side of the ModelInfer wire: the requests it builds mean exactly what
betterproto2 and protobuf read, each attempt is encoded with its own budget, and the replies it
parses (``InferResponseMessage``, its transports' reply type) read like protobuf's."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2
from tritonclient.utils import serialize_byte_tensor

from kserve_trio.client import BufferPool, InferInput, InferOutput, RetryPolicy, scratch
from kserve_trio.client.driver import build_chunk_request
from kserve_trio.client.errors import RpcError
from kserve_trio.client.model import send_infer
from kserve_trio.core.errors import StatusCode
from kserve_trio.core.protocol.codec import (
    TIMEOUT_NS_PARAM,
    RequestedOutput,
    ShmRef,
    encode_infer_request,
)
from kserve_trio.core.protocol.infer_wire import InferResponseMessage
from kserve_trio.core.protocol.wire import Uint64
from kserve_trio.core.tensors.dtypes import DType
from kserve_trio.core.tensors.tensor import NamedTensor
from kserve_trio.proto import inference as pb

names = st.text(max_size=8)
plain_values = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.builds(Uint64, st.integers(0, 2**64 - 1)),
    st.floats(allow_nan=False),
    names,
)
params = st.dictionaries(names, plain_values, max_size=3)
WIRE = [d for d in DType if d.has_wire]


@st.composite
def named_tensors(draw) -> list[NamedTensor]:
    out = []
    for i in range(draw(st.integers(0, 3))):
        dtype = draw(st.sampled_from(WIRE))
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
        count = int(np.prod(shape, dtype=np.int64))
        if dtype.is_bytes:  # variable-length elements
            data = np.empty(count, dtype=object)
            for k, value in enumerate(
                draw(st.lists(st.binary(max_size=6), min_size=count, max_size=count))
            ):
                data[k] = value
        else:
            n = count * dtype.itemsize
            data = np.frombuffer(draw(st.binary(min_size=n, max_size=n)), dtype.numpy)
        out.append(NamedTensor(f"in{i}", dtype, shape, data.reshape(shape)))
    return out


def wire_payload(t: NamedTensor) -> bytes:
    """What tritonclient itself would send for ``t`` (its own BYTES serializer)."""
    if t.dtype.is_bytes:
        return serialize_byte_tensor(t.data).item() if t.data.size else b""
    return t.data.tobytes()


def kind_of(value) -> str:
    if isinstance(value, bool):
        return "bool_param"
    if isinstance(value, Uint64):
        return "uint64_param"
    if isinstance(value, int):
        return "int64_param"
    return "double_param" if isinstance(value, float) else "string_param"


@settings(max_examples=200, deadline=None)
@given(named_tensors(), params, names, st.lists(names, max_size=3), st.integers(-5, 10**12))
def test_encoded_requests_read_back_exactly_in_betterproto_and_protobuf(
    tensors, extra, rid, outs, budget
):
    msg = encode_infer_request(
        "m", tensors, requested_outputs=outs, id=rid, budget_ns=budget, parameters=extra
    )
    data = bytes(msg)
    theirs = service_pb2.ModelInferRequest.FromString(data)
    assert pb.ModelInferRequest.parse(data) == pb.ModelInferRequest.parse(
        theirs.SerializeToString()
    )
    want = dict(extra)
    if budget > 0:
        want[TIMEOUT_NS_PARAM] = budget
    assert set(theirs.parameters) == set(want)
    for key, value in want.items():
        param = theirs.parameters[key]
        assert param.WhichOneof("parameter_choice") == kind_of(value)
        assert getattr(param, kind_of(value)) == value
    assert (theirs.model_name, theirs.id) == ("m", rid)
    assert [o.name for o in theirs.outputs] == outs
    assert [(t.name, t.datatype, tuple(t.shape)) for t in theirs.inputs] == [
        (t.name, t.dtype.wire, t.shape) for t in tensors
    ]
    assert list(theirs.raw_input_contents) == [wire_payload(t) for t in tensors]


def test_betterproto_parameters_are_still_accepted():
    msg = encode_infer_request(
        "m",
        [],
        parameters={"p": pb.InferParameter(uint64_param=7), "q": pb.InferParameter()},
        requested_outputs=[RequestedOutput("y", ShmRef("r", 8, 16))],
    )
    theirs = service_pb2.ModelInferRequest.FromString(bytes(msg))
    assert theirs.parameters["p"].uint64_param == 7
    assert theirs.parameters["q"].WhichOneof("parameter_choice") is None
    shm = theirs.outputs[0].parameters
    assert shm["shared_memory_region"].string_param == "r"
    assert shm["shared_memory_offset"].int64_param == 8
    assert shm["shared_memory_byte_size"].int64_param == 16


def test_inline_inputs_are_sent_from_the_callers_memory():
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    msg = encode_infer_request("m", [NamedTensor.from_array("x", x)])
    assert np.shares_memory(np.frombuffer(msg.raw_input_contents[0], np.uint8), x)
    strided = NamedTensor.from_array("t", x.T)  # not C-contiguous: copied once, in C order
    msg = encode_infer_request("m", [strided])
    assert bytes(msg.raw_input_contents[0]) == np.ascontiguousarray(x.T).tobytes()

    with BufferPool(4096, 2) as pool:
        slot = pool.acquire_nowait(1)
        (d,) = scratch(slot, [("d", (4,), np.int32)])
        req = build_chunk_request("m", [d, InferInput("x", x)], pool, shm=False)
        assert np.shares_memory(np.frombuffer(req.raw_input_contents[1], np.uint8), x)
        theirs = service_pb2.ModelInferRequest.FromString(bytes(req))
        assert theirs.raw_input_contents[1] == x.tobytes()
        slot.release()


class Recorder:
    """A transport that records each attempt's bytes and answers from a script."""

    def __init__(self, answers) -> None:
        self.sent: list[bytes] = []
        self.answers = list(answers)

    async def unary(self, method, request, reply_type, *, timeout=None, metadata=None):
        self.sent.append(bytes(request))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return reply_type.FromString(answer)


@pytest.mark.anyio
async def test_each_attempt_is_encoded_with_its_own_remaining_budget():
    reply = service_pb2.ModelInferResponse(model_name="m", id="r")
    out = reply.outputs.add(name="y", datatype="INT32", shape=[2])
    out.parameters["note"].string_param = "n"
    reply.raw_output_contents.append(np.array([3, 4], np.int32).tobytes())
    shed = RpcError(StatusCode.RESOURCE_EXHAUSTED, "busy", method="ModelInfer")
    transport = Recorder([shed, reply.SerializeToString()])
    request = encode_infer_request("m", [NamedTensor.from_array("x", np.ones(2, np.float32))])
    policy = RetryPolicy(initial_backoff=0.001, jitter=False)
    response = await send_infer(transport, request, policy, 5.0)

    budgets = [
        service_pb2.ModelInferRequest.FromString(d).parameters[TIMEOUT_NS_PARAM].int64_param
        for d in transport.sent
    ]
    assert len(budgets) == 2 and 0 < budgets[1] < budgets[0] <= 5 * 10**9
    assert isinstance(response, InferResponseMessage)
    assert response.outputs[0].parameters == {"note": "n"}
    np.testing.assert_array_equal(InferOutput("y", response), [3, 4])

    no_deadline = Recorder([reply.SerializeToString()])
    await send_infer(no_deadline, request, policy, 0.0)
    assert (
        TIMEOUT_NS_PARAM
        not in service_pb2.ModelInferRequest.FromString(no_deadline.sent[0]).parameters
    )


@pytest.mark.anyio
async def test_a_betterproto_request_is_sent_as_the_same_message():
    msg = pb.ModelInferRequest(
        model_name="m",
        id="b",
        inputs=[pb.ModelInferRequestInferInputTensor(name="x", datatype="INT8", shape=[1])],
        raw_input_contents=[b"\x05"],
    )
    transport = Recorder([b""])
    await send_infer(transport, msg, RetryPolicy(), 2.0)
    theirs = service_pb2.ModelInferRequest.FromString(transport.sent[0])
    assert (theirs.model_name, theirs.id, theirs.raw_input_contents[0]) == ("m", "b", b"\x05")
    assert theirs.parameters[TIMEOUT_NS_PARAM].int64_param > 0


def test_typed_response_contents_are_read_directly():
    reply = service_pb2.ModelInferResponse(model_name="m")
    out = reply.outputs.add(name="y", datatype="INT32", shape=[2])
    out.contents.int_contents.extend([7, -8])
    reply.outputs.add(name="f", datatype="FP32", shape=[1])
    reply.raw_output_contents.append(np.float32(0.5).tobytes())
    response = InferResponseMessage.FromString(reply.SerializeToString())
    assert response.outputs[0].contents.int_contents == [7, -8]
    np.testing.assert_array_equal(InferOutput("y", response), [7, -8])
    np.testing.assert_array_equal(InferOutput("f", response), [0.5])

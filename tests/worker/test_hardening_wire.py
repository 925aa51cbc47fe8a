"""Malformed input never answers INTERNAL or UNKNOWN, is never logged as an unexpected failure,
and leaves the worker serving: raw HTTP/2 frames with broken gRPC framing, a rank above 64,
and hypothesis fuzzing of ModelInfer (arbitrary bytes, arbitrary well-formed messages) through
the real in-process server.
"""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest
import structlog
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.e2e import reference as ref
from tests.worker.raw_h2 import grpc_frame, raw_grpc_call

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
INFER = "/inference.GRPCInferenceService/ModelInfer"
RPCS = [
    "ModelInfer",
    "ModelMetadata",
    "ModelReady",
    "ModelConfig",
    "ModelStatistics",
    "ServerMetadata",
    "RepositoryIndex",
]
FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def server(demo_worker):
    """The suite's shared demo worker (this module only sends it requests)."""
    return demo_worker


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address) as ch:
        yield ch


@pytest.fixture
def unexpected_failures():
    """The ``request_failed_unexpectedly`` events logged while the test runs."""
    with structlog.testing.capture_logs() as logs:
        yield lambda: [e for e in logs if e.get("event") == "request_failed_unexpectedly"]


def good_request() -> service_pb2.ModelInferRequest:
    req = service_pb2.ModelInferRequest(model_name="mlp")
    req.inputs.add(name="input_0", datatype="FP32", shape=[2, 16])
    req.raw_input_contents.append(np.ones((2, 16), np.float32).tobytes())
    return req


def assert_still_serving(channel, demo_repo) -> None:
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    reply = stub.ModelInfer(good_request(), timeout=10)
    out = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(2, 8)
    x = np.ones((2, 16), np.float32)
    np.testing.assert_allclose(out, ref.mlp(x, ref.weights(demo_repo, "mlp")), rtol=1e-5, atol=1e-5)


def status_of(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


# --------------------------------------------------------------------------------------------
# broken framing, sent as raw HTTP/2


GOOD = good_request().SerializeToString()


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"\x00\x00\x00", "the stream ended inside the 5-byte gRPC message prefix"),
        (grpc_frame(GOOD)[:-7], f"inside the {len(GOOD)}-byte message its prefix announced"),
        (b"\x00\x00\x00\x00\x10", "inside the 16-byte message its prefix announced"),
        (grpc_frame(GOOD, flag=7), "malformed gRPC message prefix: compressed flag 7"),
        (b"", "empty request: no message was sent"),
        (grpc_frame(b"\xff\xff\xff"), "malformed request message"),
    ],
    ids=["3-byte-prefix", "short-body", "prefix-only", "bad-flag", "empty", "garbage"],
)
def test_broken_grpc_framing_is_invalid_argument(
    server, channel, demo_repo, unexpected_failures, body, needle
):
    reply = raw_grpc_call(server.address, INFER, body)
    assert reply.status == INVALID_ARGUMENT, reply
    assert needle in reply.message
    assert unexpected_failures() == []
    assert_still_serving(channel, demo_repo)


def test_rank_above_64_is_invalid_argument(channel, demo_repo, unexpected_failures):
    req = service_pb2.ModelInferRequest(model_name="mlp")
    req.inputs.add(name="input_0", datatype="FP32", shape=[1] * 65)
    req.raw_input_contents.append(b"\0" * 4)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(req, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "has rank 65, more than the limit of 64 dimensions" in err.value.details()
    assert unexpected_failures() == []
    assert_still_serving(channel, demo_repo)


# --------------------------------------------------------------------------------------------
# fuzzing


@FUZZ
@given(rpc=st.sampled_from(RPCS), payload=st.binary(max_size=512))
def test_arbitrary_bytes_never_answer_internal(channel, unexpected_failures, rpc, payload):
    call = channel.unary_unary(f"/inference.GRPCInferenceService/{rpc}")
    code = status_of(lambda: call(payload, timeout=10))
    event(code.name)
    assert code not in NEVER, (rpc, payload)
    assert unexpected_failures() == []


ITEMSIZE = {"FP32": 4, "FP16": 2, "BF16": 2, "FP64": 8, "INT8": 1, "INT32": 4, "INT64": 8}
ITEMSIZE |= {"UINT64": 8, "BOOL": 1}
DATATYPES = list(ITEMSIZE)
dims = st.one_of(
    st.integers(0, 20),
    st.integers(-(2**63), -1),
    st.integers(2**20, 2**63 - 1),
    st.sampled_from([16, 2**31, 2**62]),
)
shapes = st.one_of(
    st.lists(dims, max_size=4),
    st.lists(st.integers(0, 2), min_size=60, max_size=70),  # around the rank limit
    st.lists(st.sampled_from([0, 2**61, 2**62]), min_size=2, max_size=3),  # empty yet huge
)
PARAM_KEYS = [
    "timeout",
    "reactant_timeout_ns",
    "shared_memory_region",
    "shared_memory_offset",
    "shared_memory_byte_size",
    "priority",
    "x",
]


@st.composite
def parameters(draw) -> dict[str, service_pb2.InferParameter]:
    out = {}
    for key in draw(st.lists(st.sampled_from(PARAM_KEYS), max_size=3, unique=True)):
        kind = draw(st.sampled_from(["bool", "int64", "string", "double", "uint64"]))
        if kind == "bool":
            value = service_pb2.InferParameter(bool_param=draw(st.booleans()))
        elif kind == "int64":
            value = service_pb2.InferParameter(int64_param=draw(st.integers(-(2**63), 2**63 - 1)))
        elif kind == "string":
            value = service_pb2.InferParameter(string_param=draw(st.text(max_size=8)))
        elif kind == "double":
            value = service_pb2.InferParameter(double_param=draw(st.floats()))
        else:
            value = service_pb2.InferParameter(uint64_param=draw(st.integers(0, 2**64 - 1)))
        out[key] = value
    return out


@st.composite
def near_valid_requests(draw) -> service_pb2.ModelInferRequest:
    """A valid mlp request (0 to 70 rows) with random parameters and requested outputs."""
    rows = draw(st.integers(0, 70))
    req = service_pb2.ModelInferRequest(
        model_name="mlp", model_version=draw(st.sampled_from(["", "1"]))
    )
    for k, v in draw(parameters()).items():
        req.parameters[k].CopyFrom(v)
    t = req.inputs.add(name="input_0", datatype="FP32", shape=[rows, 16])
    if draw(st.booleans()):
        for k, v in draw(parameters()).items():
            t.parameters[k].CopyFrom(v)
    req.raw_input_contents.append(np.ones((rows, 16), np.float32).tobytes())
    for name in draw(st.lists(st.sampled_from(["output", "probs", ""]), max_size=2)):
        o = req.outputs.add(name=name)
        if draw(st.booleans()):
            for k, v in draw(parameters()).items():
                o.parameters[k].CopyFrom(v)
    return req


@st.composite
def shape_probes(draw) -> service_pb2.ModelInferRequest:
    """One mlp input of any datatype and shape (ranks around 64, huge, negative and empty dims)
    carrying exactly the bytes its shape calls for, so only the shape itself can be wrong."""
    datatype = draw(st.sampled_from(DATATYPES))
    shape = draw(shapes)
    req = service_pb2.ModelInferRequest(model_name="mlp")
    req.inputs.add(name="input_0", datatype=datatype, shape=shape)
    nbytes = math.prod(shape) * ITEMSIZE[datatype]
    req.raw_input_contents.append(b"\0" * (nbytes if 0 <= nbytes < 1 << 16 else 3))
    return req


@st.composite
def random_requests(draw) -> service_pb2.ModelInferRequest:
    req = service_pb2.ModelInferRequest(
        model_name=draw(st.sampled_from(["mlp", "mlp", "mlp", "scale4", "", "nope"])),
        model_version=draw(st.sampled_from(["", "", "1", "2"])),
        id=draw(st.text(max_size=4)),
    )
    for k, v in draw(parameters()).items():
        req.parameters[k].CopyFrom(v)
    for _ in range(draw(st.integers(1, 2))):
        t = req.inputs.add(
            name=draw(st.sampled_from(["input_0", "x", "", "input_1"])),
            datatype=draw(st.sampled_from([*DATATYPES, "BYTES", "", "fp32"])),
        )
        if draw(st.integers(0, 2)) == 0:  # an mlp-shaped input, so decode gets far
            t.shape.extend([draw(st.integers(0, 70)), 16])
        else:
            t.shape.extend(draw(shapes))
        for k, v in draw(parameters()).items():
            t.parameters[k].CopyFrom(v)
        if draw(st.integers(0, 5)) == 0:
            t.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32), max_size=8)))
            t.contents.int_contents.extend(draw(st.lists(st.integers(-5, 5), max_size=4)))
    for _ in range(draw(st.integers(0, 2))):
        o = req.outputs.add(name=draw(st.sampled_from(["output", "probs", "y", ""])))
        for k, v in draw(parameters()).items():
            o.parameters[k].CopyFrom(v)
    for t in req.inputs:
        if draw(st.integers(0, 3)):  # the byte count the shape and datatype call for
            nbytes = math.prod(t.shape) * ITEMSIZE.get(t.datatype, 1)
            req.raw_input_contents.append(b"\0" * (nbytes if 0 <= nbytes < 1 << 16 else 3))
        else:
            req.raw_input_contents.append(draw(st.binary(max_size=64)))
    if draw(st.integers(0, 3)) == 0 and req.raw_input_contents:  # a count mismatch
        req.raw_input_contents.pop() if draw(st.booleans()) else req.raw_input_contents.append(b"")
    return req


@FUZZ
@given(req=st.one_of(near_valid_requests(), random_requests()))
def test_well_formed_messages_never_answer_internal(channel, unexpected_failures, req):
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    code = status_of(lambda: stub.ModelInfer(req, timeout=10))
    event(code.name)
    assert code not in NEVER, req
    assert unexpected_failures() == []


@FUZZ
@given(req=shape_probes())
def test_any_shape_never_answers_internal(channel, unexpected_failures, req):
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    code = status_of(lambda: stub.ModelInfer(req, timeout=10))
    event(code.name)
    assert code not in NEVER, list(req.inputs[0].shape)
    assert unexpected_failures() == []


def test_the_worker_serves_after_the_fuzzing(channel, demo_repo):
    assert_still_serving(channel, demo_repo)

"""Fields sent with the wrong wire type are named, so the adapter answers INVALID_ARGUMENT."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kserve_trio.proto import inference as pb
from kserve_trio.proto import reactant_control as rc
from kserve_trio.serving.message_check import wrong_field


def test_well_typed_messages_pass():
    assert (
        wrong_field(pb.SystemSharedMemoryRegisterRequest(name="r", key="/k", byte_size=8)) is None
    )
    assert wrong_field(pb.ModelConfigResponse(config=pb.ModelConfig(name="m"))) is None
    load = pb.RepositoryModelLoadRequest(
        model_name="m", parameters={"p": pb.ModelRepositoryParameter(bool_param=True)}
    )
    assert wrong_field(load) is None
    assert wrong_field(rc.SetModelPolicyRequest(name="m", weight=2.0)) is None


def test_a_string_sent_as_a_varint_is_named():
    msg = pb.SystemSharedMemoryRegisterRequest.parse(bytes([0x08, 0x05]))  # name = varint 5
    assert wrong_field(msg) == "name"


def test_a_map_value_sent_as_a_varint_is_named():
    # parameters {"a": <varint 1>} instead of a ModelRepositoryParameter message
    msg = pb.RepositoryModelLoadRequest.parse(bytes([0x1A, 0x05, 0x0A, 0x01, 0x61, 0x10, 0x01]))
    assert wrong_field(msg) == "parameters['a']"


@pytest.fixture(scope="module")
def channel(demo_worker):
    """A channel to the suite's shared demo worker (this module only sends it requests)."""
    with grpc.insecure_channel(demo_worker.address) as ch:
        yield ch


RPCS = [
    "ServerMetadata",
    "ModelMetadata",
    "ModelReady",
    "ModelConfig",
    "ModelStatistics",
    "RepositoryIndex",
    "RepositoryModelLoad",
    "RepositoryModelUnload",
    "SystemSharedMemoryStatus",
    "SystemSharedMemoryRegister",
    "SystemSharedMemoryUnregister",
]

WIRE_TYPES = st.sampled_from([0, 1, 2, 5])


@st.composite
def mistyped_fields(draw) -> bytes:
    """A message of 1-4 fields numbered 1-6, each with an arbitrary wire type and value."""
    out = bytearray()
    for _ in range(draw(st.integers(1, 4))):
        number, wt = draw(st.integers(1, 6)), draw(WIRE_TYPES)
        out.append(number << 3 | wt)
        if wt == 0:
            out.append(draw(st.integers(0, 127)))
        elif wt == 1:
            out += draw(st.binary(min_size=8, max_size=8))
        elif wt == 5:
            out += draw(st.binary(min_size=4, max_size=4))
        else:
            body = draw(st.binary(max_size=12))
            out.append(len(body))
            out += body
    return bytes(out)


@given(rpc=st.sampled_from(RPCS), body=mistyped_fields())
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_mistyped_fields_never_answer_internal(channel, rpc, body):
    call = channel.unary_unary(
        f"/inference.GRPCInferenceService/{rpc}",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    try:
        call(body, timeout=10)
    except grpc.RpcError as exc:
        assert exc.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (
            rpc,
            body,
            exc.details(),
        )


def test_the_worker_names_the_mistyped_field(channel):
    call = channel.unary_unary(
        "/inference.GRPCInferenceService/ModelMetadata",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    with pytest.raises(grpc.RpcError) as info:
        call(bytes([0x08, 0x07]), timeout=10)  # name = varint 7
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "field 'name' has the wrong wire type" in info.value.details()

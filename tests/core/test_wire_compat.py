"""Cross-implementation wire compatibility: Google protobuf (tritonclient's ``service_pb2`` /
``model_config_pb2``) against our betterproto2 classes, in both directions, field by field;
tritonclient's own request builder and result reader against our codec; and exact byte
encodings of the control proto (which has no protobuf twin to compare with)."""

from __future__ import annotations

import dataclasses
import struct

import betterproto2
import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as tc
from google.protobuf.descriptor import FieldDescriptor
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as sp

from kserve_trio.core.protocol.codec import (
    RequestedOutput,
    ShmRef,
    decode_infer_request,
    decode_infer_response,
    encode_infer_request,
    encode_infer_request_shm,
    encode_infer_response,
    encode_repository_index,
)
from kserve_trio.core.protocol.wire import Uint64
from kserve_trio.core.tensors.tensor import NamedTensor
from kserve_trio.proto import inference as pb
from kserve_trio.proto import reactant_control as rc

# --------------------------------------------------------------------------------------------
# the field-by-field comparer


def _same_value(field: FieldDescriptor, theirs, ours, path: str) -> None:
    if field.message_type is not None:
        assert_same(theirs, ours, path)
    elif field.enum_type is not None:
        assert int(ours) == theirs, path
    else:
        assert type(ours) is type(theirs) or isinstance(ours, type(theirs)), (
            f"{path}: {type(ours).__name__} vs {type(theirs).__name__}"
        )
        assert ours == theirs, f"{path}: ours {ours!r} != protobuf {theirs!r}"


def assert_same(theirs, ours, path: str = "") -> None:
    """Recursively compare a protobuf message with a betterproto2 message.

    Our schema may be a subset of Triton's (model_config.proto is large); a field missing on our
    side must then be unset on theirs, so nothing is silently skipped.
    """
    path = path or type(theirs).__name__
    desc = theirs.DESCRIPTOR
    ours_names = {f.name for f in dataclasses.fields(ours)}
    theirs_names = {f.name for f in desc.fields}
    assert ours_names <= theirs_names, (
        f"{path}: fields unknown to protobuf {ours_names - theirs_names}"
    )
    set_names = {f.name for f, _ in theirs.ListFields()}
    for field in desc.fields:
        p = f"{path}.{field.name}"
        if field.name not in ours_names:
            assert field.name not in set_names, f"{p} is set but our schema lacks it"
            continue
        a, b = getattr(theirs, field.name), getattr(ours, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            assert set(a.keys()) == set(b.keys()), f"{p}: keys {set(a)} != {set(b)}"
            for k in a:
                _same_value(value_field, a[k], b[k], f"{p}[{k!r}]")
        elif field.is_repeated:
            assert len(a) == len(b), f"{p}: length {len(a)} != {len(b)}"
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                _same_value(field, x, y, f"{p}[{i}]")
        elif field.containing_oneof is not None or field.message_type is not None:
            if theirs.HasField(field.name):
                assert b is not None, f"{p} is set in protobuf only"
                _same_value(field, a, b, p)
            else:
                assert b is None, f"{p} is set in ours only"
        else:
            _same_value(field, a, b, p)
    for oneof in desc.oneofs:
        which = theirs.WhichOneof(oneof.name)
        ours_which = betterproto2.which_one_of(ours, oneof.name)[0] or None
        assert which == ours_which, f"{path}.{oneof.name}: {which} != {ours_which}"


def check_both_ways(theirs) -> None:
    """protobuf bytes -> ours equal field by field; our bytes -> protobuf equal (``==``)."""
    cls = getattr(pb, type(theirs).__name__)
    ours = cls.parse(theirs.SerializeToString())
    assert_same(theirs, ours)
    again = type(theirs)()
    again.ParseFromString(bytes(ours))
    assert again == theirs


# --------------------------------------------------------------------------------------------
# messages built on the protobuf side


def params_every_kind(target) -> None:
    target["b"].bool_param = True
    target["i"].int64_param = -(2**40)
    target["s"].string_param = "héllo"
    target["d"].double_param = 0.1
    target["u"].uint64_param = 2**63 + 5


def infer_request() -> sp.ModelInferRequest:
    req = sp.ModelInferRequest(model_name="m", model_version="2", id="req-7")
    params_every_kind(req.parameters)
    req.parameters["reactant_timeout_ns"].int64_param = 10**9
    req.parameters["timeout"].int64_param = 5000

    raw = req.inputs.add(name="raw", datatype="FP32", shape=[2, 3])
    raw.parameters["note"].string_param = "x"
    typed = [
        ("bool", "BOOL", "bool_contents", [True, False]),
        ("int", "INT32", "int_contents", [-(2**31), 7]),
        ("int64", "INT64", "int64_contents", [-(2**63), 2**63 - 1]),
        ("uint", "UINT32", "uint_contents", [0, 2**32 - 1]),
        ("uint64", "UINT64", "uint64_contents", [0, 2**64 - 1]),
        ("fp32", "FP32", "fp32_contents", [0.5, -3.25]),
        ("fp64", "FP64", "fp64_contents", [0.1, -1e300]),
        ("bytes", "BYTES", "bytes_contents", [b"ab", b"\0\xff"]),
    ]
    for name, dt, field, values in typed:
        t = req.inputs.add(name=name, datatype=dt, shape=[2])
        getattr(t.contents, field).extend(values)
    shm = req.inputs.add(name="shm", datatype="INT8", shape=[4])
    shm.parameters["shared_memory_region"].string_param = "region0"
    shm.parameters["shared_memory_offset"].int64_param = 64
    shm.parameters["shared_memory_byte_size"].int64_param = 4
    req.raw_input_contents.append(np.arange(6, dtype=np.float32).tobytes())

    req.outputs.add(name="plain")
    out = req.outputs.add(name="to_shm")
    out.parameters["shared_memory_region"].string_param = "out0"
    out.parameters["shared_memory_offset"].int64_param = 0
    out.parameters["shared_memory_byte_size"].int64_param = 1024
    out.parameters["flag"].bool_param = False
    return req


def infer_response() -> sp.ModelInferResponse:
    resp = sp.ModelInferResponse(model_name="m", model_version="1", id="req-7")
    params_every_kind(resp.parameters)
    resp.outputs.add(name="raw", datatype="BF16", shape=[1, 2])
    typed = resp.outputs.add(name="typed", datatype="INT64", shape=[3])
    typed.contents.int64_contents.extend([1, -2, 3])
    both = resp.outputs.add(name="f", datatype="FP32", shape=[1])
    both.contents.fp32_contents.append(1.5)
    shm = resp.outputs.add(name="shm", datatype="UINT8", shape=[8])
    shm.parameters["shared_memory_region"].string_param = "out0"
    shm.parameters["shared_memory_offset"].int64_param = 16
    shm.parameters["shared_memory_byte_size"].int64_param = 8
    shm.parameters["u"].uint64_param = 1
    shm.parameters["d"].double_param = -2.5
    resp.raw_output_contents.append(np.ones(2, ml_dtypes.bfloat16).tobytes())
    return resp


def model_metadata() -> sp.ModelMetadataResponse:
    meta = sp.ModelMetadataResponse(name="resnet", versions=["1", "2"], platform="cpu")
    meta.inputs.add(name="image", datatype="FP32", shape=[-1, 3, 224, 224])
    meta.outputs.add(name="logits", datatype="BF16", shape=[-1, 1000])
    return meta


def model_config() -> sp.ModelConfigResponse:
    cfg = mc.ModelConfig(name="resnet", platform="reactant_stablehlo", max_batch_size=8)
    cfg.backend = "reactant"
    cfg.input.add(
        name="image",
        data_type=mc.TYPE_FP32,
        format=mc.ModelInput.FORMAT_NCHW,
        dims=[3, 224, 224],
        allow_ragged_batch=True,
        optional=True,
    )
    cfg.input.add(name="shape", data_type=mc.TYPE_INT64, dims=[-1], is_shape_tensor=True)
    cfg.output.add(name="logits", data_type=mc.TYPE_BF16, dims=[1000], label_filename="labels.txt")
    cfg.output.add(name="mask", data_type=mc.TYPE_BOOL, dims=[-1, 4], is_shape_tensor=True)
    cfg.dynamic_batching.preferred_batch_size.extend([1, 4, 8])
    cfg.dynamic_batching.max_queue_delay_microseconds = 2**40
    cfg.dynamic_batching.preserve_ordering = True
    return sp.ModelConfigResponse(config=cfg)


def duration(count: int, ns: int) -> sp.StatisticDuration:
    return sp.StatisticDuration(count=count, ns=ns)


def model_statistics() -> sp.ModelStatisticsResponse:
    resp = sp.ModelStatisticsResponse()
    stats = resp.model_stats.add(
        name="resnet", version="1", last_inference=1_700_000_000_000, inference_count=42
    )
    stats.execution_count = 17
    inf = stats.inference_stats
    for i, name in enumerate(
        ["success", "fail", "queue", "compute_input", "compute_infer", "compute_output"]
    ):
        getattr(inf, name).CopyFrom(duration(i + 1, (i + 1) * 10**9 + 2**33))
    inf.cache_hit.CopyFrom(duration(0, 0))
    for size in (1, 8):
        batch = stats.batch_stats.add(batch_size=size)
        batch.compute_input.CopyFrom(duration(size, 100 * size))
        batch.compute_infer.CopyFrom(duration(size, 2**50))
        batch.compute_output.CopyFrom(duration(size, 7))
    stats.memory_usage.add(type="GPU", id=0, byte_size=2**34)
    stats.response_stats["0"].success.CopyFrom(duration(3, 30))
    stats.response_stats["0"].cancel.CopyFrom(duration(1, 1))
    resp.model_stats.add(name="empty")
    return resp


def repository_index() -> sp.RepositoryIndexResponse:
    resp = sp.RepositoryIndexResponse()
    resp.models.add(name="a", version="", state="READY", reason="")
    resp.models.add(name="b", version="3", state="UNAVAILABLE", reason="not resident")
    return resp


def repository_load() -> sp.RepositoryModelLoadRequest:
    req = sp.RepositoryModelLoadRequest(repository_name="", model_name="resnet")
    req.parameters["config"].string_param = '{"max_batch_size": 8}'
    req.parameters["b"].bool_param = True
    req.parameters["i"].int64_param = -3
    req.parameters["file:1/model.hlo"].bytes_param = b"\x00\x01"
    return req


def repository_unload() -> sp.RepositoryModelUnloadRequest:
    req = sp.RepositoryModelUnloadRequest(repository_name="repo", model_name="resnet")
    req.parameters["unload_dependents"].bool_param = True
    return req


def shm_status() -> sp.SystemSharedMemoryStatusResponse:
    resp = sp.SystemSharedMemoryStatusResponse()
    for name, key, off, size in [("in0", "/pool_in", 0, 1 << 20), ("out0", "/pool_out", 64, 2**40)]:
        resp.regions[name].CopyFrom(
            sp.SystemSharedMemoryStatusResponse.RegionStatus(
                name=name, key=key, offset=off, byte_size=size
            )
        )
    return resp


CASES = {
    "ModelInferRequest": infer_request,
    "ModelInferResponse": infer_response,
    "ModelMetadataRequest": lambda: sp.ModelMetadataRequest(name="m", version="1"),
    "ModelMetadataResponse": model_metadata,
    "ModelConfigRequest": lambda: sp.ModelConfigRequest(name="m", version="1"),
    "ModelConfigResponse": model_config,
    "ModelStatisticsRequest": lambda: sp.ModelStatisticsRequest(name="m", version=""),
    "ModelStatisticsResponse": model_statistics,
    "RepositoryIndexRequest": lambda: sp.RepositoryIndexRequest(repository_name="r", ready=True),
    "RepositoryIndexResponse": repository_index,
    "RepositoryModelLoadRequest": repository_load,
    "RepositoryModelLoadResponse": sp.RepositoryModelLoadResponse,
    "RepositoryModelUnloadRequest": repository_unload,
    "RepositoryModelUnloadResponse": sp.RepositoryModelUnloadResponse,
    "SystemSharedMemoryStatusRequest": lambda: sp.SystemSharedMemoryStatusRequest(name="in0"),
    "SystemSharedMemoryStatusResponse": shm_status,
    "SystemSharedMemoryRegisterRequest": lambda: sp.SystemSharedMemoryRegisterRequest(
        name="in0", key="/pool_in", offset=4096, byte_size=2**33
    ),
    "SystemSharedMemoryRegisterResponse": sp.SystemSharedMemoryRegisterResponse,
    "SystemSharedMemoryUnregisterRequest": lambda: sp.SystemSharedMemoryUnregisterRequest(
        name="in0"
    ),
    "SystemSharedMemoryUnregisterResponse": sp.SystemSharedMemoryUnregisterResponse,
    "ServerLiveResponse": lambda: sp.ServerLiveResponse(live=True),
    "ServerReadyResponse": lambda: sp.ServerReadyResponse(ready=True),
    "ModelReadyRequest": lambda: sp.ModelReadyRequest(name="m", version="1"),
    "ModelReadyResponse": lambda: sp.ModelReadyResponse(ready=True),
    "ServerMetadataResponse": lambda: sp.ServerMetadataResponse(
        name="kserve_trio", version="0.1.0", extensions=["system_shared_memory"]
    ),
}


@pytest.mark.parametrize("build", CASES.values(), ids=CASES.keys())
def test_protobuf_bytes_decode_equal_and_our_bytes_parse_back_equal(build):
    check_both_ways(build())


def test_the_comparer_catches_differences():
    theirs = infer_request()
    ours = pb.ModelInferRequest.parse(theirs.SerializeToString())
    ours.inputs[1].contents.bool_contents[0] = False
    with pytest.raises(AssertionError, match=r"inputs\[1\]\.contents\.bool_contents\[0\]"):
        assert_same(theirs, ours)
    ours = pb.ModelInferRequest.parse(theirs.SerializeToString())
    ours.parameters["u"] = pb.InferParameter(int64_param=5)
    with pytest.raises(AssertionError, match=r"parameters\['u'\]\.int64_param is set in ours only"):
        assert_same(theirs, ours)
    cfg = model_config()
    cfg.config.instance_group.add(count=2)
    with pytest.raises(AssertionError, match="instance_group is set but our schema lacks it"):
        assert_same(cfg, pb.ModelConfigResponse.parse(cfg.SerializeToString()))


def test_unset_oneof_and_optional_message_stay_unset():
    theirs = sp.ModelInferResponse(model_name="m")
    theirs.outputs.add(name="x", datatype="FP32", shape=[0])
    theirs.parameters["empty"].CopyFrom(sp.InferParameter())
    ours = pb.ModelInferResponse.parse(theirs.SerializeToString())
    assert ours.outputs[0].contents is None
    assert betterproto2.which_one_of(ours.parameters["empty"], "parameter_choice") == ("", None)
    check_both_ways(theirs)


# --------------------------------------------------------------------------------------------
# our codec against tritonclient


class Region:
    """A one-region registry over real memory, enough for the codec's shm path."""

    def __init__(self, name: str, size: int) -> None:
        self.name, self.buf, self.active = name, bytearray(size), 0

    def read_view(self, region, offset, byte_size):
        assert region == self.name
        self.active += 1

        def release():
            self.active -= 1

        return memoryview(self.buf)[offset : offset + byte_size], release

    def write(self, region, offset, data):
        assert region == self.name
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8).tobytes()
        self.buf[offset : offset + len(raw)] = raw


ARRAYS = {
    "f32": np.arange(12, dtype=np.float32).reshape(3, 4),
    "i64": np.array([[-(2**62), 5]], dtype=np.int64),
    "b": np.array([True, False, True]),
    "f16": np.array([0.5, -2.0], dtype=np.float16),
    "u8": np.arange(5, dtype=np.uint8),
    "bf16": np.array([1.0, -0.5], dtype=ml_dtypes.bfloat16),
}


def triton_request_bytes(inputs, outputs, timeout=None) -> bytes:
    msg = tc._utils._get_inference_request(
        model_name="echo",
        inputs=inputs,
        model_version="",
        request_id="t-1",
        outputs=outputs,
        sequence_id=0,
        sequence_start=False,
        sequence_end=False,
        priority=3,
        timeout=timeout,
        parameters={"tag": "x"},
    )
    return msg.SerializeToString()


def test_tritonclient_request_decodes_and_our_response_reads_back_in_tritonclient():
    inputs = []
    for name, arr in ARRAYS.items():
        inp = tc.InferInput(name, list(arr.shape), tc.np_to_triton_dtype(arr.dtype))
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    outputs = [tc.InferRequestedOutput("bf16"), tc.InferRequestedOutput("f32")]
    decoded = decode_infer_request(
        pb.ModelInferRequest.parse(triton_request_bytes(inputs, outputs, timeout=2000)), now_ns=0
    )
    assert decoded.id == "t-1" and decoded.deadline_ns == 2_000_000
    assert decoded.parameters["priority"] == Uint64(3)
    assert isinstance(decoded.parameters["priority"], Uint64)  # a uint64_param
    assert decoded.parameters["tag"] == "x"
    assert [r.name for r in decoded.requested_outputs] == ["bf16", "f32"]
    for t in decoded.inputs:
        np.testing.assert_array_equal(t.data, ARRAYS[t.name])
        assert t.data.dtype == ARRAYS[t.name].dtype

    resp = encode_infer_response("echo", decoded.id, decoded.inputs)
    result = tc.InferResult(sp.ModelInferResponse.FromString(bytes(resp)))
    assert result.get_response().id == "t-1"
    for name, arr in ARRAYS.items():
        if name == "bf16":
            # tritonclient reads BF16 back as float32 values
            np.testing.assert_array_equal(result.as_numpy(name), arr.astype(np.float32))
        else:
            np.testing.assert_array_equal(result.as_numpy(name), arr)
            assert result.as_numpy(name).dtype == arr.dtype


def test_tritonclient_shm_inputs_and_outputs_through_our_codec():
    region = Region("pool", 256)
    arr = ARRAYS["f32"]
    region.buf[32 : 32 + arr.nbytes] = arr.tobytes()
    inp = tc.InferInput("f32", list(arr.shape), "FP32")
    inp.set_shared_memory("pool", arr.nbytes, offset=32)
    out = tc.InferRequestedOutput("f32")
    out.set_shared_memory("pool", 100, offset=128)
    decoded = decode_infer_request(
        pb.ModelInferRequest.parse(triton_request_bytes([inp], [out])), region
    )
    assert region.active == 1
    np.testing.assert_array_equal(decoded.inputs[0].data, arr)
    assert decoded.requested_outputs == [RequestedOutput("f32", ShmRef("pool", 128, 100))]

    resp = encode_infer_response(
        "echo", decoded.id, decoded.inputs, decoded.requested_outputs, region
    )
    decoded.release()
    assert region.active == 0
    theirs = sp.ModelInferResponse.FromString(bytes(resp))
    assert list(theirs.raw_output_contents) == [b""]  # Triton's placeholder for a shm output
    params = tc.InferResult(theirs).get_output("f32").parameters
    assert params["shared_memory_region"].string_param == "pool"
    assert params["shared_memory_offset"].int64_param == 128
    assert params["shared_memory_byte_size"].int64_param == arr.nbytes
    assert bytes(region.buf[128 : 128 + arr.nbytes]) == arr.tobytes()


def test_our_client_requests_parse_in_protobuf():
    tensors = [NamedTensor.from_array(n, a) for n, a in ARRAYS.items()]
    ours = encode_infer_request(
        "m", tensors, requested_outputs=["f32"], id="c-1", budget_ns=7 * 10**6
    )
    theirs = sp.ModelInferRequest.FromString(bytes(ours))
    assert_same(theirs, pb.ModelInferRequest.parse(bytes(ours)))
    assert [i.datatype for i in theirs.inputs] == ["FP32", "INT64", "BOOL", "FP16", "UINT8", "BF16"]
    assert list(theirs.inputs[0].shape) == [3, 4]
    assert theirs.raw_input_contents[0] == ARRAYS["f32"].tobytes()
    assert theirs.parameters["reactant_timeout_ns"].int64_param == 7 * 10**6

    shm = encode_infer_request_shm("m", tensors[:2], "pool", [0, 64])
    theirs = sp.ModelInferRequest.FromString(bytes(shm))
    assert_same(theirs, pb.ModelInferRequest.parse(bytes(shm)))
    assert theirs.inputs[1].parameters["shared_memory_offset"].int64_param == 64
    assert theirs.inputs[1].parameters["shared_memory_byte_size"].int64_param == 16


def test_protobuf_typed_response_decodes_in_our_client():
    decoded = decode_infer_response(
        pb.ModelInferResponse.parse(infer_response().SerializeToString()), skip_shm=True
    )
    assert [t.name for t in decoded] == ["raw", "typed", "f"]
    np.testing.assert_array_equal(decoded[1].data, [1, -2, 3])
    assert decoded[0].data.dtype == ml_dtypes.bfloat16 and decoded[0].shape == (1, 2)


def test_repository_index_parses_in_protobuf():
    theirs = sp.RepositoryIndexResponse.FromString(
        bytes(encode_repository_index([("a", True), ("b", False)]))
    )
    assert [(m.name, m.state) for m in theirs.models] == [("a", "READY"), ("b", "UNAVAILABLE")]


# --------------------------------------------------------------------------------------------
# control proto: exact encodings pin the field numbers


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (rc.ModelStatus(batch_axis=1), b"\x68\x01"),
        (rc.ModelStatus(name="m", residency=rc.Residency.PINNED_DEVICE), b"\x0a\x01m\x10\x03"),
        (rc.ModelStatus(rows_served=300), b"\x70\xac\x02"),
        (rc.ModelStatus(weight=0.5), b"\x31" + struct.pack("<d", 0.5)),
        (rc.ModelControlStatusResponse(weight_cache_max_bytes=5), b"\x20\x05"),
        (rc.ModelControlStatusResponse(discipline="fair"), b"\x12\x04fair"),
        (
            rc.ModelControlStatusResponse(models=[rc.ModelStatus(queue_depth=2)]),
            b"\x1a\x02\x38\x02",
        ),
        (
            rc.SetModelResidencyRequest(name="a", target=rc.Residency.UNPINNED),
            b"\x0a\x01a\x10\x01",
        ),
        (
            rc.SetModelPolicyRequest(name="m", has_weight=True, weight=2.0),
            b"\x0a\x01m\x10\x01\x19" + struct.pack("<d", 2.0),
        ),
        (rc.CompactMemoryRequest(reload_models=["x", "y"]), b"\x0a\x01x\x0a\x01y"),
        (rc.CompactMemoryResponse(reloaded_models=2, resident_bytes_after=7), b"\x08\x02\x10\x07"),
        (
            rc.SetModelPlacementRequest(name="m", replicas=-1),
            b"\x0a\x01m" + b"\x10" + b"\xff" * 9 + b"\x01",
        ),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, betterproto2.Message) else None,
)
def test_control_proto_exact_bytes(message, expected):
    assert bytes(message) == expected
    assert type(message).parse(expected) == message

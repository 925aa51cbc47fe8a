"""BYTES tensors through a hook bundle (the demo ``tokenize_sum``) on a worker served in-process,
driven by tritonclient: raw inline, typed ``bytes_contents``, shared memory in and out, a
malformed payload, the model's metadata and configuration, and a bundle that puts ``bytes`` on
an executable tensor refused at load time."""

from __future__ import annotations

import os
import shutil
import uuid

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from kserve_trio.export.demo import tokenize_sum_reference, write_demo_repository
from kserve_trio.worker.registry import load_repository
from tests.inprocess import in_process_worker

TEXTS = np.array(
    [
        b"the quick brown fox",
        b"",
        "gr\u00fc\u00dfe aus k\u00f6ln".encode(),
        b"a " * 20,
        b"\xff\x00",
    ],
    dtype=object,
)


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("bytes") / "models"
    write_demo_repository(root, only=["tokenize_sum"])
    return root


@pytest.fixture(scope="module")
def server(repo):
    with in_process_worker(repo) as running:
        yield running


def text_input(texts: np.ndarray) -> grpcclient.InferInput:
    inp = grpcclient.InferInput("text", list(texts.shape), "BYTES")
    inp.set_data_from_numpy(texts)
    return inp


def check(result, texts) -> None:
    tokens, labels = tokenize_sum_reference(texts)
    np.testing.assert_array_equal(result.as_numpy("tokens"), tokens)
    got = result.as_numpy("label")
    assert got.dtype == np.object_ and list(got) == list(labels)


def test_metadata_and_config_name_the_string_tensors(server):
    c = grpcclient.InferenceServerClient(server.address)
    meta = c.get_model_metadata("tokenize_sum", as_json=True)
    assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": ["-1"]}]
    assert meta["outputs"] == [
        {"name": "tokens", "datatype": "INT32", "shape": ["-1"]},
        {"name": "label", "datatype": "BYTES", "shape": ["-1"]},
    ]
    config = c.get_model_config("tokenize_sum", as_json=True)["config"]
    assert [i["data_type"] for i in config["input"]] == ["TYPE_STRING"]
    assert [o["data_type"] for o in config["output"]] == ["TYPE_INT32", "TYPE_STRING"]


def test_a_raw_bytes_round_trip_through_the_hooks(server):
    c = grpcclient.InferenceServerClient(server.address)
    check(c.infer("tokenize_sum", [text_input(TEXTS)]), TEXTS)
    one = TEXTS[:1]
    check(c.infer("tokenize_sum", [text_input(one)]), one)


def test_typed_bytes_contents_are_served_the_same(server):
    req = service_pb2.ModelInferRequest(model_name="tokenize_sum", id="typed")
    t = req.inputs.add(name="text", datatype="BYTES", shape=[len(TEXTS)])
    t.contents.bytes_contents.extend(list(TEXTS))
    with grpc.insecure_channel(server.address) as channel:
        reply = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=30)
    result = grpcclient.InferResult(reply)
    assert reply.id == "typed"
    check(result, TEXTS)


def unique(prefix: str) -> str:
    return f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"


def test_bytes_in_and_out_through_shared_memory(server):
    c = grpcclient.InferenceServerClient(server.address)
    payload = serialize_byte_tensor(TEXTS)
    size = len(payload.item())
    names = (unique("in"), unique("out"))
    regions = [shm.create_shared_memory_region(n, "/" + n, 4096) for n in names]
    try:
        shm.set_shared_memory_region(regions[0], [payload])
        for n in names:
            c.register_system_shared_memory(n, "/" + n, 4096)
        inp = grpcclient.InferInput("text", [len(TEXTS)], "BYTES")
        inp.set_shared_memory(names[0], size)
        label = grpcclient.InferRequestedOutput("label")
        label.set_shared_memory(names[1], 4096)
        tokens = grpcclient.InferRequestedOutput("tokens")
        result = c.infer("tokenize_sum", [inp], outputs=[tokens, label])
        want_tokens, want_labels = tokenize_sum_reference(TEXTS)
        np.testing.assert_array_equal(result.as_numpy("tokens"), want_tokens)
        out = result.get_output("label")
        written = out.parameters["shared_memory_byte_size"].int64_param
        assert written == len(serialize_byte_tensor(want_labels).item())
        got = shm.get_contents_as_numpy(regions[1], np.object_, [len(TEXTS)])
        assert list(got) == list(want_labels)
    finally:
        for n in names:
            c.unregister_system_shared_memory(n)
        for r in regions:
            shm.destroy_shared_memory_region(r)


def test_a_malformed_bytes_payload_is_invalid_argument_and_the_worker_serves_on(server):
    req = service_pb2.ModelInferRequest(model_name="tokenize_sum")
    req.inputs.add(name="text", datatype="BYTES", shape=[2])
    req.raw_input_contents.append(b"\x03\x00\x00\x00abc\x10\x00\x00\x00xy")
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == (
        "input 'text' of model 'tokenize_sum': BYTES element 1 announces 16 bytes at byte 7 "
        "but only 2 remain"
    )
    c = grpcclient.InferenceServerClient(server.address)
    with pytest.raises(InferenceServerException) as wrong:
        c.infer("tokenize_sum", [grpcclient.InferInput("text", [1], "FP32")])
    assert wrong.value.status() == "StatusCode.INVALID_ARGUMENT"
    check(c.infer("tokenize_sum", [text_input(TEXTS)]), TEXTS)


def test_bytes_on_an_executable_tensor_is_refused_at_load_time(repo, tmp_path):
    bad = tmp_path / "models" / "bad_bytes"
    shutil.copytree(repo / "tokenize_sum", bad)
    manifest = (bad / "manifest.yaml").read_text()
    (bad / "manifest.yaml").write_text(manifest.replace("dtype: i32", "dtype: bytes", 1))
    bundles, failures = load_repository([tmp_path / "models"], backend=None)
    assert bundles == {}
    assert "executable_inputs tensor 'ids' has dtype bytes" in failures["bad_bytes"].reason
    assert str(bad) in failures["bad_bytes"].reason

"""gRPC compression against the CLI worker with stock tritonclient and raw HTTP/2.

tritonclient compresses requests with ``compression_algorithm``; the worker decompresses them
(caps on the decompressed size), answers compressed when the request was, and refuses a
decompression bomb with RESOURCE_EXHAUSTED while it keeps serving.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2

from kserve_trio.core.protocol import compression
from tests.e2e import reference
from tests.serving.bomb import zero_bomb
from tests.worker.raw_h2 import grpc_frame, raw_grpc_call

INFER = "/inference.GRPCInferenceService/ModelInfer"


def mlp_inputs(rows: int = 3) -> list[grpcclient.InferInput]:
    x = np.random.default_rng(rows).standard_normal((rows, 16), dtype=np.float32)
    inp = grpcclient.InferInput("input_0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return [inp]


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests_give_the_same_outputs(demo_worker, algorithm):
    c = grpcclient.InferenceServerClient(demo_worker.url)
    inputs = mlp_inputs()
    plain = c.infer("mlp", inputs).as_numpy("output")
    packed = c.infer("mlp", inputs, compression_algorithm=algorithm).as_numpy("output")
    np.testing.assert_array_equal(plain, packed)
    assert plain.shape == (3, 8)


def test_compressed_outputs_match_the_reference(demo_worker, demo_repo):
    c = grpcclient.InferenceServerClient(demo_worker.url)
    x = np.random.default_rng(7).standard_normal((5, 16), dtype=np.float32)
    inp = grpcclient.InferInput("input_0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    got = c.infer("mlp", [inp], compression_algorithm="gzip").as_numpy("output")
    expected = reference.mlp(x, reference.weights(demo_repo, "mlp"))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def _request_bytes() -> bytes:
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    req = service_pb2.ModelInferRequest(model_name="mlp", id="z1")
    req.inputs.add(name="input_0", datatype="FP32", shape=[1, 16])
    req.raw_input_contents.append(x.tobytes())
    return req.SerializeToString()


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_a_compressed_request_gets_a_compressed_reply(demo_worker, algorithm):
    body = compression.compress(_request_bytes(), algorithm)
    reply = raw_grpc_call(
        demo_worker.url,
        INFER,
        grpc_frame(body, flag=1),
        headers=(("grpc-encoding", algorithm), ("grpc-accept-encoding", "identity,deflate,gzip")),
    )
    assert reply.status == 0, reply.message
    assert reply.headers.get("grpc-encoding") == algorithm
    flag, length = struct.unpack(">BI", reply.body[:5])
    assert flag == 1
    message = compression.decompress(reply.body[5 : 5 + length], algorithm, 1 << 20)
    parsed = service_pb2.ModelInferResponse.FromString(bytes(message))
    assert (parsed.model_name, parsed.id) == ("mlp", "z1")
    assert np.frombuffer(parsed.raw_output_contents[0], np.float32).shape == (8,)


def test_an_uncompressed_request_gets_an_uncompressed_reply(demo_worker):
    reply = raw_grpc_call(
        demo_worker.url,
        INFER,
        grpc_frame(_request_bytes()),
        headers=(("grpc-accept-encoding", "identity,deflate,gzip"),),
    )
    assert reply.status == 0, reply.message
    assert "grpc-encoding" not in reply.headers
    assert reply.body[0] == 0


def test_a_reply_is_not_compressed_with_what_the_client_does_not_accept(demo_worker):
    body = compression.compress(_request_bytes(), "gzip")
    reply = raw_grpc_call(
        demo_worker.url,
        INFER,
        grpc_frame(body, flag=1),
        headers=(("grpc-encoding", "gzip"), ("grpc-accept-encoding", "identity")),
    )
    assert reply.status == 0, reply.message
    assert reply.body[0] == 0


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_a_4_gb_decompression_bomb_is_resource_exhausted_and_the_worker_serves_on(
    demo_worker, algorithm
):
    bomb = zero_bomb(4 << 30, algorithm)
    reply = raw_grpc_call(
        demo_worker.url,
        INFER,
        grpc_frame(bomb, flag=1),
        headers=(("grpc-encoding", algorithm),),
        timeout=60,
    )
    assert reply.status == 8, reply.message  # RESOURCE_EXHAUSTED
    assert "received message larger than max" in reply.message
    assert demo_worker.proc.poll() is None
    c = grpcclient.InferenceServerClient(demo_worker.url)
    assert c.infer("mlp", mlp_inputs()).as_numpy("output").shape == (3, 8)


def test_a_corrupt_compressed_message_is_invalid_argument(demo_worker):
    reply = raw_grpc_call(
        demo_worker.url,
        INFER,
        grpc_frame(b"\x1f\x8b definitely not gzip", flag=1),
        headers=(("grpc-encoding", "gzip"),),
    )
    assert reply.status == 3, reply.message
    assert "cannot decompress the gzip message" in reply.message

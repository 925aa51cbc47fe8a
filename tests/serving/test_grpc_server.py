"""The request-header checks of our gRPC servers (``serving.grpc.header_problem``): malformed
headers get a clear status, not UNKNOWN, from the pure check and from a live worker."""

from __future__ import annotations

import pytest

from kserve_trio.core.errors import StatusCode
from kserve_trio.serving.grpc import header_problem
from tests.worker.raw_h2 import grpc_frame, raw_grpc_call

BASE = [(":method", "POST"), (":path", "/x"), ("content-type", "application/grpc")]


@pytest.mark.parametrize("value", ["1S", "99999999m", "5n", "0u", "3H", "10M"])
def test_well_formed_timeouts_pass(value):
    assert header_problem([*BASE, ("grpc-timeout", value)]) is None


@pytest.mark.parametrize("value", ["", "1", "S", "1s", "123456789S", "-1S", "1.5S", "1 S"])
def test_malformed_timeouts_are_invalid_argument(value):
    status, message, _ = header_problem([*BASE, ("grpc-timeout", value)])
    assert status is StatusCode.INVALID_ARGUMENT
    assert "malformed grpc-timeout header" in message


def test_binary_metadata_must_be_base64():
    assert header_problem([*BASE, ("trace-bin", "AAEC")]) is None
    assert header_problem([*BASE, ("trace-bin", "AAE")]) is None  # unpadded is allowed
    status, message, _ = header_problem([*BASE, ("trace-bin", "not base64!")])
    assert (status, message) == (StatusCode.INVALID_ARGUMENT, "metadata trace-bin is not base64")


def test_unknown_encodings_are_unimplemented_with_what_we_accept():
    assert header_problem([*BASE, ("grpc-encoding", "gzip")]) is None
    assert header_problem([*BASE, ("grpc-encoding", "identity")]) is None
    status, message, extra = header_problem([*BASE, ("grpc-encoding", "snappy")])
    assert status is StatusCode.UNIMPLEMENTED
    assert "grpc-encoding 'snappy' is not supported" in message
    assert extra == (("grpc-accept-encoding", "identity,deflate,gzip"),)


@pytest.fixture(scope="module")
def worker(demo_worker):
    """The suite's shared demo worker (this module only sends it requests)."""
    return demo_worker


PATH = "/inference.GRPCInferenceService/ServerLive"


@pytest.mark.parametrize(
    ("headers", "status", "text"),
    [
        ((("grpc-timeout", "soon"),), StatusCode.INVALID_ARGUMENT, "malformed grpc-timeout"),
        ((("x-trace-bin", "%%%"),), StatusCode.INVALID_ARGUMENT, "x-trace-bin is not base64"),
        ((("grpc-encoding", "br"),), StatusCode.UNIMPLEMENTED, "grpc-encoding 'br'"),
    ],
)
def test_a_live_worker_answers_malformed_headers_with_a_clear_status(worker, headers, status, text):
    reply = raw_grpc_call(worker.address, PATH, grpc_frame(b""), headers=headers)
    assert reply.status == int(status)
    assert text in reply.message
    # and it keeps serving
    ok = raw_grpc_call(worker.address, PATH, grpc_frame(b""))
    assert ok.status == 0
    assert ok.body[5:] == b"\x08\x01"  # ServerLiveResponse(live=True)


def test_an_unimplemented_encoding_reply_advertises_what_we_accept(worker):
    reply = raw_grpc_call(
        worker.address, PATH, grpc_frame(b""), headers=(("grpc-encoding", "zstd"),)
    )
    assert reply.headers.get("grpc-accept-encoding") == "identity,deflate,gzip"

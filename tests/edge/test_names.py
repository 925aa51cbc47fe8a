"""Names and repeated fields: refusing a message costs little, whatever it holds.

Against a CLI worker and a CLI gateway in front of it (gRPC and REST): a 1 MB model, input,
output or parameter-key name, a 1 MB load or shared-memory region name, and 1.9 MiB of empty
``raw_input_contents`` entries are each INVALID_ARGUMENT (REST 400) at once, with a bounded
message that tritonclient receives as it was sent (not RESOURCE_EXHAUSTED); the server's memory
stays flat from round to round, and the next client is served promptly.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from kserve_trio.core.protocol.infer_wire import InferInputTensor, InferRequestMessage
from tests.edge.edge_procs import Pair, raw_call, rest, worker_and_gateway
from tests.edge.memory_probe import status_kib

pytestmark = pytest.mark.slow

HUGE = "n" * (1 << 20)
QUICK_SECONDS = (
    5.0  # loopback answers in milliseconds (a 1 MB name once took ~55 s); slack for load
)
MESSAGE_CHARS = 512
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"


@pytest.fixture(scope="module")
def pair(demo_repo):
    with worker_and_gateway(demo_repo) as p:
        yield p


def _url(pair: Pair, side: str) -> str:
    return pair.worker.url if side == "worker" else pair.gateway.url


def _inputs(name: str = "input_0") -> list[grpcclient.InferInput]:
    x = grpcclient.InferInput(name, [1, 16], "FP32")
    x.set_data_from_numpy(np.ones((1, 16), np.float32))
    return [x]


def _served_promptly(url: str) -> None:
    """A new client on a new connection is answered within the bound."""
    started = time.monotonic()
    assert grpcclient.InferenceServerClient(url).is_server_ready(client_timeout=10)
    assert time.monotonic() - started < QUICK_SECONDS


def _refused(call) -> InferenceServerException:
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as info:
        call()
    elapsed = time.monotonic() - started
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value
    assert elapsed < QUICK_SECONDS, elapsed
    message = info.value.message() or ""
    assert len(message) < MESSAGE_CHARS
    return info.value


INFER_CASES = {
    "model": lambda c: c.infer(HUGE, _inputs(), client_timeout=30),
    "input": lambda c: c.infer("mlp", _inputs(HUGE), client_timeout=30),
    "output": lambda c: c.infer(
        "mlp", _inputs(), outputs=[grpcclient.InferRequestedOutput(HUGE)], client_timeout=30
    ),
    "parameter_key": lambda c: c.infer("mlp", _inputs(), parameters={HUGE: 1}, client_timeout=30),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("side", ["worker", "gateway"])
@pytest.mark.parametrize("kind", sorted(INFER_CASES))
def test_a_megabyte_name_is_refused_at_once(pair, side, kind):
    url = _url(pair, side)
    client = grpcclient.InferenceServerClient(url)
    err = _refused(lambda: INFER_CASES[kind](client))
    assert "limits.max_name_bytes" in (err.message() or "")
    _served_promptly(url)
    result = client.infer("mlp", _inputs(), client_timeout=30)  # a good request still works
    assert result is not None
    out = result.as_numpy("output")
    assert out is not None and out.shape == (1, 8)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("side", ["worker", "gateway"])
def test_megabyte_load_and_region_names_are_refused(pair, side):
    url = _url(pair, side)
    client = grpcclient.InferenceServerClient(url)
    for call in (
        lambda: client.load_model(HUGE, client_timeout=30),
        lambda: client.unload_model(HUGE, client_timeout=30),
        lambda: client.register_system_shared_memory(HUGE, "/k", 64, client_timeout=30),
        lambda: client.get_model_metadata(HUGE, client_timeout=30),
    ):
        err = _refused(call)
        assert "limits.max_name_bytes" in (err.message() or "")
    _served_promptly(url)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("side", ["worker", "gateway"])
def test_empty_raw_contents_are_refused_with_flat_memory(pair, side):
    """1.9 MiB of two-byte entries (a million of them): refused after the first
    ``limits.max_tensors``, so neither the worker nor the gateway holds an object per entry."""
    head = InferRequestMessage(
        model_name="mlp", inputs=[InferInputTensor("input_0", "FP32", [1, 16])]
    )
    body = bytes(head) + b"\x3a\x00" * (950 << 10)
    pids = [pair.worker.proc.pid, pair.gateway.proc.pid]
    before = [status_kib(pid, "VmHWM") for pid in pids]
    peaks = []
    for _ in range(3):
        code, message, elapsed = raw_call(_url(pair, side), MODEL_INFER, body)
        assert code.name == "INVALID_ARGUMENT", message
        assert "raw_input_contents" in message and "limits.max_tensors" in message
        assert elapsed < QUICK_SECONDS
        peaks.append([status_kib(pid, "VmHWM") for pid in pids])
    # Before the bound the worker's peak grew by ~180 MB on the first such request; now a
    # round holds little more than the message itself (a few MiB), and later rounds add
    # nothing.
    for i in range(len(pids)):
        assert peaks[0][i] - before[i] < 32 << 10, (before, peaks)
        assert peaks[2][i] - peaks[0][i] < 8 << 10, (before, peaks)
    _served_promptly(_url(pair, side))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("side", ["worker", "gateway"])
def test_rest_names_over_the_limit_are_400(pair, side):
    port = pair.worker_http if side == "worker" else pair.gateway_http
    long = "r" * 4096  # the request head caps a path; 4 KiB is well over max_name_bytes
    status, body = rest(port, "GET", f"/v2/models/{long}")
    assert status == 400, body
    assert len(body) < MESSAGE_CHARS and b"limits.max_name_bytes" in body
    doc = {"inputs": [{"name": HUGE, "shape": [1, 16], "datatype": "FP32", "data": [0.0] * 16}]}
    started = time.monotonic()
    status, body = rest(port, "POST", "/v2/models/mlp/infer", json.dumps(doc).encode())
    assert status == 400, body
    assert time.monotonic() - started < QUICK_SECONDS
    assert len(body) < MESSAGE_CHARS and b"limits.max_name_bytes" in body
    status, _ = rest(port, "GET", "/v2/health/ready")
    assert status == 200

"""The ModelInfer fast path inside grpclib, against stock tritonclient, with the switch on and off.

Every behaviour test runs twice on one in-process worker: ``fast`` (the default) and ``grpclib``
(``KSERVE_TRIO_GRPC_FAST_UNARY=0``, read when a connection is made), and checks which path
served it (``FastUnary.calls``). Covered: results, request ids, Triton statistics, shared
memory both ways, deadlines, client cancellation (RST_STREAM), the receive and send caps,
error statuses and messages, malformed framing, compressed requests (grpclib's path either
way), and ModelStreamInfer next to it.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid

import anyio.from_thread
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from kserve_trio.serving.fast_unary import FAST_ENV, FastUnary, fast_path_enabled, plain_call
from kserve_trio.worker.server import serve, stop
from tests.e2e import reference as ref
from tests.worker.raw_h2 import raw_grpc_call

INFER = "/inference.GRPCInferenceService/ModelInfer"


def start(repo, **overrides):
    overrides.setdefault("endpoints", {})
    overrides["endpoints"].setdefault("port", 0)
    return serve(
        None, blocking=False, model_dirs=[str(repo)], model_control_mode="static", **overrides
    )


@pytest.fixture(scope="module")
def server(demo_repo):
    running = start(demo_repo)
    yield running
    stop(running)


@pytest.fixture(params=["fast", "grpclib"])
def path(request, monkeypatch):
    """The serving path under test; after the test, checks that path served its calls."""
    monkeypatch.setenv(FAST_ENV, "1" if request.param == "fast" else "0")
    before = FastUnary.calls
    yield request.param
    if request.param == "fast":
        assert FastUnary.calls > before, "no call took the fast path"
    else:
        assert FastUnary.calls == before, "a call took the fast path with the switch off"


OWN_CONNECTION = [
    # grpc C-core shares one connection between channels to the same address; the switch is
    # read when a connection is accepted, so each client opens its own.
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
]


def own_client(address: str) -> grpcclient.InferenceServerClient:
    """A tritonclient on a connection of its own (opened under the test's switch)."""
    return grpcclient.InferenceServerClient(address, channel_args=OWN_CONNECTION)


def mlp_input(x, name="input_0"):
    inp = grpcclient.InferInput(name, list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def status_of(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as err:
        call()
    return err.value.status(), err.value.message()


def block_device(running, seconds: float) -> threading.Thread:
    def target():
        anyio.from_thread.run(
            running.scheduler.run_on_device, time.sleep, seconds, token=running._portal
        )

    t = threading.Thread(target=target, daemon=True)
    t.start()
    time.sleep(0.1)
    return t


def assert_serves(address, demo_repo):
    c = own_client(address)
    x = np.arange(32, dtype=np.float32).reshape(2, 16) / 32
    out = c.infer("mlp", [mlp_input(x)]).as_numpy("output")
    np.testing.assert_allclose(out, ref.mlp(x, ref.weights(demo_repo, "mlp")), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------ pure


def test_plain_call_takes_only_standard_headers():
    base = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", INFER),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    assert plain_call(base) == (INFER, "")
    assert plain_call([*base, ("grpc-timeout", "5S")]) == (INFER, "5S")
    assert plain_call([*base, ("grpc-encoding", "identity")]) == (INFER, "")
    assert plain_call(
        [(k, "application/grpc+proto" if k == "content-type" else v) for k, v in base]
    )
    refused = [
        [*base, ("grpc-encoding", "gzip")],
        [*base, ("grpc-timeout", "5S"), ("grpc-timeout", "1S")],
        [(k, "GET" if k == ":method" else v) for k, v in base],
        [(k, "application/grpc+json" if k == "content-type" else v) for k, v in base],
        [h for h in base if h[0] != "te"],
        [h for h in base if h[0] != ":path"],
    ]
    for headers in refused:
        assert plain_call(headers) is None, headers


def test_the_switch_reads_the_environment():
    assert fast_path_enabled({})
    assert fast_path_enabled({FAST_ENV: "1"})
    for off in ("0", "false", "No", " off "):
        assert not fast_path_enabled({FAST_ENV: off})


# ------------------------------------------------------------------------- against a worker


def test_results_request_ids_and_statistics(server, demo_repo, path):
    c = own_client(server.address)
    before = c.get_inference_statistics("mlp", as_json=True)["model_stats"][0]
    ok_before = int(before["inference_stats"]["success"].get("count", 0))
    for i in range(5):
        x = np.full((1, 16), i / 10, np.float32)
        r = c.infer("mlp", [mlp_input(x)], request_id=f"req-{i}")
        assert r.get_response().id == f"req-{i}"
        np.testing.assert_allclose(
            r.as_numpy("output"), ref.mlp(x, ref.weights(demo_repo, "mlp")), rtol=1e-5, atol=1e-5
        )
    after = c.get_inference_statistics("mlp", as_json=True)["model_stats"][0]
    assert int(after["inference_stats"]["success"]["count"]) == ok_before + 5


def test_shared_memory_inputs_and_outputs(server, demo_repo, path):
    c = own_client(server.address)
    tag = f"{os.getpid()}_{uuid.uuid4().hex[:8]}"
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(4, 16)
    hin = shm.create_shared_memory_region(f"in_{tag}", f"/in_{tag}", x.nbytes)
    hout = shm.create_shared_memory_region(f"out_{tag}", f"/out_{tag}", 4 * 8 * 4)
    try:
        shm.set_shared_memory_region(hin, [x])
        c.register_system_shared_memory(f"in_{tag}", f"/in_{tag}", x.nbytes)
        c.register_system_shared_memory(f"out_{tag}", f"/out_{tag}", 4 * 8 * 4)
        inp = grpcclient.InferInput("input_0", [4, 16], "FP32")
        inp.set_shared_memory(f"in_{tag}", x.nbytes)
        out = grpcclient.InferRequestedOutput("output")
        out.set_shared_memory(f"out_{tag}", 4 * 8 * 4)
        c.infer("mlp", [inp], outputs=[out])
        y = shm.get_contents_as_numpy(hout, np.float32, [4, 8])
        np.testing.assert_allclose(
            y, ref.mlp(x, ref.weights(demo_repo, "mlp")), rtol=1e-5, atol=1e-5
        )
    finally:
        c.unregister_system_shared_memory(f"in_{tag}")
        c.unregister_system_shared_memory(f"out_{tag}")
        shm.destroy_shared_memory_region(hin)
        shm.destroy_shared_memory_region(hout)


def test_grpc_timeout_is_deadline_exceeded_and_never_executed(server, demo_repo, path):
    served = server.scheduler.scheduler_metrics()["mlp"].requests_served
    blocker = block_device(server, 1.0)
    c = own_client(server.address)
    t0 = time.monotonic()
    code, _ = status_of(
        lambda: c.infer("mlp", [mlp_input(np.ones((1, 16), np.float32))], client_timeout=0.3)
    )
    assert code == "StatusCode.DEADLINE_EXCEEDED"
    assert time.monotonic() - t0 < 0.9  # answered at the deadline, not when the device is free
    blocker.join()
    time.sleep(0.2)
    assert server.scheduler.scheduler_metrics()["mlp"].requests_served == served
    assert_serves(server.address, demo_repo)


def test_client_cancellation_resets_the_call_and_it_never_runs(server, demo_repo, path):
    served = server.scheduler.scheduler_metrics()["mlp"].requests_served
    blocker = block_device(server, 1.0)

    async def main():
        client = aioclient.InferenceServerClient(server.address, channel_args=OWN_CONNECTION)
        try:
            inp = aioclient.InferInput("input_0", [1, 16], "FP32")
            inp.set_data_from_numpy(np.ones((1, 16), np.float32))
            tasks = [asyncio.create_task(client.infer("mlp", [inp])) for _ in range(4)]
            await asyncio.sleep(0.3)
            for t in tasks:
                t.cancel()  # grpc.aio sends RST_STREAM (CANCEL); no grpc-timeout was sent
            results = await asyncio.gather(*tasks, return_exceptions=True)
            return [type(r).__name__ for r in results]
        finally:
            await client.close()

    names = asyncio.run(main())
    assert names == ["CancelledError"] * 4
    blocker.join()
    time.sleep(0.2)
    metrics = server.scheduler.scheduler_metrics()["mlp"]
    assert metrics.requests_served == served and metrics.queue_depth == 0
    assert_serves(server.address, demo_repo)


def test_errors_carry_status_and_message(server, demo_repo, path):
    c = own_client(server.address)
    code, msg = status_of(lambda: c.infer("nope", [mlp_input(np.ones((1, 16), np.float32))]))
    assert code == "StatusCode.NOT_FOUND" and "nope" in msg
    code, msg = status_of(lambda: c.infer("mlp", [mlp_input(np.ones((1, 15), np.float32))]))
    assert code == "StatusCode.INVALID_ARGUMENT" and "16" in msg
    # A prefix announcing more bytes than the stream carries: malformed framing.
    reply = raw_grpc_call(server.address, INFER, b"\x00\x00\x00\x00\x40" + b"\x0a\x03mlp")
    assert reply.status == 3 and "truncated request" in reply.message
    assert_serves(server.address, demo_repo)


def test_compressed_requests_take_grpclibs_path(server, demo_repo, path):
    c = own_client(server.address)
    x = np.ones((1, 16), np.float32)
    before = FastUnary.calls
    packed = c.infer("mlp", [mlp_input(x)], compression_algorithm="gzip")
    assert FastUnary.calls == before
    np.testing.assert_allclose(
        packed.as_numpy("output"), ref.mlp(x, ref.weights(demo_repo, "mlp")), rtol=1e-5, atol=1e-5
    )
    c.infer("mlp", [mlp_input(x)])  # and a plain one after it on the same connection


def test_stream_infer_next_to_the_fast_path(server, demo_repo, path):
    c = own_client(server.address)
    c.infer("mlp", [mlp_input(np.ones((1, 16), np.float32))])
    results = []
    done = threading.Event()

    def callback(result, error):
        results.append((result, error))
        if len(results) == 3:
            done.set()

    c.start_stream(callback)
    try:
        for i in range(3):
            c.async_stream_infer("mlp", [mlp_input(np.full((1, 16), i, np.float32))])
        assert done.wait(30)
    finally:
        c.stop_stream()
    assert all(err is None for _, err in results), results
    assert len(results) == 3


def test_message_caps_are_resource_exhausted(demo_repo, path):
    running = start(demo_repo, grpc={"max_recv_msg_bytes": 1 << 16, "max_send_msg_bytes": 1 << 10})
    try:
        c = own_client(running.address)
        code, msg = status_of(lambda: c.infer("mlp", [mlp_input(np.ones((1, 20_000), np.float32))]))
        assert code == "StatusCode.RESOURCE_EXHAUSTED" and "larger than max" in msg
        code, msg = status_of(lambda: c.infer("mlp", [mlp_input(np.ones((64, 16), np.float32))]))
        assert code == "StatusCode.RESOURCE_EXHAUSTED" and "response larger than max" in msg
        out = c.infer("mlp", [mlp_input(np.ones((1, 16), np.float32))]).as_numpy("output")
        assert out.shape == (1, 8)
    finally:
        stop(running)

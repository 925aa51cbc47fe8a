"""The worker served in-process (``serve(..., blocking=False)``) under tritonclient load.

Covers the acceptance of the Worker core capability that needs to look inside the server:
no cross-talk under 64 concurrent clients with batching, cancelled queued requests never
executed, and every status the service maps, with the server still serving afterwards.
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from kserve_trio.worker.server import serve, stop
from tests.device_hold import hold_device
from tests.e2e import reference as ref
from tests.waiting import wait_until
from tests.worker.raw_h2 import grpc_frame, raw_grpc_call


def start(repo, **overrides):
    overrides.setdefault("endpoints", {})
    overrides["endpoints"].setdefault("port", 0)
    return serve(
        None, blocking=False, model_dirs=[str(repo)], model_control_mode="static", **overrides
    )


@pytest.fixture(scope="module")
def server(demo_repo):
    running = start(demo_repo, endpoints={"max_concurrent_requests": 256})
    yield running
    stop(running)


def mlp_input(x, name="input_0", datatype="FP32"):
    inp = grpcclient.InferInput(name, list(x.shape), datatype)
    inp.set_data_from_numpy(x)
    return inp


def status_of(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as err:
        call()
    return err.value.status(), err.value.message()


def assert_still_serving(url, demo_repo):
    c = grpcclient.InferenceServerClient(url)
    x = np.ones((2, 16), dtype=np.float32)
    out = c.infer("mlp", [mlp_input(x)]).as_numpy("output")
    np.testing.assert_allclose(out, ref.mlp(x, ref.weights(demo_repo, "mlp")), rtol=1e-5, atol=1e-5)


def test_64_concurrent_clients_get_their_own_results_and_batches_form(server, demo_repo):
    w = ref.weights(demo_repo, "mlp")
    before = server.scheduler.scheduler_metrics()["mlp"]

    async def main():
        clients = [aioclient.InferenceServerClient(server.address) for _ in range(8)]
        try:

            async def one(i):
                x = np.random.default_rng(i).standard_normal((1 + i % 3, 16), dtype=np.float32)
                inp = aioclient.InferInput("input_0", list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                outs = []
                for _ in range(5):
                    r = await clients[i % 8].infer("mlp", [inp])
                    outs.append(r.as_numpy("output"))
                return x, outs

            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            for c in clients:
                await c.close()

    results = asyncio.run(main())
    for x, outs in results:
        for out in outs:
            np.testing.assert_allclose(out, ref.mlp(x, w), rtol=1e-5, atol=1e-5)
    after = server.scheduler.scheduler_metrics()["mlp"]
    served = after.requests_served - before.requests_served
    dispatches = after.dispatch_count - before.dispatch_count
    assert served == 64 * 5
    assert dispatches < served, "coalescing never formed a batch of more than one request"
    assert any(size > 1 for size in after.batch_size_hist), after.batch_size_hist


def test_cancelled_queued_requests_are_never_executed(server):
    before = server.scheduler.scheduler_metrics()["mlp"].requests_served
    blocker = hold_device(server)

    def queued() -> int:
        return server.scheduler.scheduler_metrics()["mlp"].queue_depth

    async def main():
        client = aioclient.InferenceServerClient(server.address)
        try:

            async def one(i):
                inp = aioclient.InferInput("input_0", [1, 16], "FP32")
                inp.set_data_from_numpy(np.full((1, 16), i, dtype=np.float32))
                await client.infer("mlp", [inp])

            calls = [asyncio.ensure_future(one(i)) for i in range(100)]
            # every request queued behind the held device before any is cancelled, so none
            # can still be on its way to the server when the device frees up
            deadline = time.monotonic() + 30
            while queued() < 100:
                assert time.monotonic() < deadline, f"only {queued()} of 100 requests queued"
                await asyncio.sleep(0.01)
            for call in calls:
                call.cancel()  # RST_STREAM for each
            return await asyncio.gather(*calls, return_exceptions=True)
        finally:
            await client.close()

    outcomes = asyncio.run(main())
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes), outcomes[:3]
    wait_until(lambda: queued() == 0, 30, "the cancelled requests to leave the queue")
    blocker.release()
    assert server.scheduler.scheduler_metrics()["mlp"].requests_served == before


def test_unknown_model_is_not_found(server, demo_repo):
    c = grpcclient.InferenceServerClient(server.address)
    code, msg = status_of(lambda: c.infer("nope", [mlp_input(np.ones((1, 16), np.float32))]))
    assert code == "StatusCode.NOT_FOUND" and "unknown model: nope" in msg
    code, msg = status_of(lambda: c.get_model_metadata("nope"))
    assert code == "StatusCode.NOT_FOUND"
    assert_still_serving(server.address, demo_repo)


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (
            lambda: [mlp_input(np.ones((1, 16), np.float32), name="x")],
            "input 'x' is not declared by model 'mlp'",
        ),
        (lambda: [mlp_input(np.ones((1, 16), np.float64), datatype="FP64")], "FP64"),
        (lambda: [mlp_input(np.ones((16,), np.float32))], "rank"),
        (lambda: [mlp_input(np.ones((1, 15), np.float32))], "dim 1 has extent 15, expected 16"),
        (
            lambda: [mlp_input(np.ones((65, 16), np.float32))],
            "model 'mlp' accepts at most 64 rows per request (got 65)",
        ),
        (lambda: [], "requires input 'input_0'"),
    ],
)
def test_bad_inputs_are_invalid_argument(server, demo_repo, make, needle):
    c = grpcclient.InferenceServerClient(server.address)
    code, msg = status_of(lambda: c.infer("mlp", make()))
    assert code == "StatusCode.INVALID_ARGUMENT", msg
    assert needle in msg
    assert_still_serving(server.address, demo_repo)


def raw_infer(url, request, timeout=10):
    with grpc.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        return stub.ModelInfer(request, timeout=timeout)


def test_byte_length_mismatch_is_invalid_argument(server, demo_repo):
    req = service_pb2.ModelInferRequest(model_name="mlp")
    t = req.inputs.add(name="input_0", datatype="FP32", shape=[1, 16])
    del t
    req.raw_input_contents.append(b"\x00" * 60)
    with pytest.raises(grpc.RpcError) as err:
        raw_infer(server.address, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "64" in err.value.details() and "60" in err.value.details()
    assert_still_serving(server.address, demo_repo)


def test_compressed_requests_are_served_and_an_unknown_encoding_is_unimplemented(server, demo_repo):
    c = grpcclient.InferenceServerClient(server.address)
    x = np.ones((1, 16), np.float32)
    plain = c.infer("mlp", [mlp_input(x)]).as_numpy("output")
    for algorithm in ("gzip", "deflate"):
        packed = c.infer("mlp", [mlp_input(x)], compression_algorithm=algorithm)
        np.testing.assert_array_equal(packed.as_numpy("output"), plain)
    reply = raw_grpc_call(
        server.address,
        "/inference.GRPCInferenceService/ServerLive",
        grpc_frame(b"", flag=1),
        headers=(("grpc-encoding", "lz4"),),
    )
    assert reply.status == 12  # UNIMPLEMENTED
    assert "grpc-encoding 'lz4' is not supported" in reply.message
    assert_still_serving(server.address, demo_repo)


def test_expired_deadline_is_deadline_exceeded(server, demo_repo):
    blocker = hold_device(server)
    c = grpcclient.InferenceServerClient(server.address)
    # Triton's per-request `timeout` parameter (µs) expires while the request queues.
    code, msg = status_of(
        lambda: c.infer("mlp", [mlp_input(np.ones((1, 16), np.float32))], timeout=200_000)
    )
    assert code == "StatusCode.DEADLINE_EXCEEDED", msg
    blocker.release()
    assert_still_serving(server.address, demo_repo)


def burst(address: str, n: int, answered: list | None = None) -> list[tuple[str, str]]:
    """Send ``n`` concurrent one-row mlp requests; returns (status, message) per request, and
    appends each to ``answered`` as it comes."""

    async def main():
        client = aioclient.InferenceServerClient(address)
        try:

            async def one():
                inp = aioclient.InferInput("input_0", [1, 16], "FP32")
                inp.set_data_from_numpy(np.ones((1, 16), np.float32))
                try:
                    await client.infer("mlp", [inp])
                    result = ("OK", "")
                except InferenceServerException as exc:
                    result = (exc.status(), exc.message())
                if answered is not None:
                    answered.append(result)
                return result

            return await asyncio.gather(*(one() for _ in range(n)))
        finally:
            await client.close()

    return asyncio.run(main())


def burst_while_held(running, n: int, answered_while_held: int) -> list[tuple[str, str]]:
    """``burst`` while the device is held: the device is let go once ``answered_while_held``
    requests have been answered (the refused ones; the admitted ones wait on the device)."""
    answered: list = []
    box: dict[str, list] = {}
    blocker = hold_device(running)
    sender = threading.Thread(target=lambda: box.update(r=burst(running.address, n, answered)))
    sender.start()
    try:
        wait_until(
            lambda: len(answered) >= answered_while_held,
            30,
            f"{answered_while_held} requests answered while the device is held",
        )
    finally:
        blocker.release()
        sender.join(60)
    return box["r"]


def test_full_queue_is_resource_exhausted(demo_repo):
    running = start(
        demo_repo, scheduler={"max_queue_depth": 2}, endpoints={"max_concurrent_requests": 0}
    )
    try:
        results = burst_while_held(running, 8, 6)
        assert [r[0] for r in results].count("OK") == 2  # the queue held two; they ran later
        shed = [m for code, m in results if code == "StatusCode.RESOURCE_EXHAUSTED"]
        assert len(shed) == 6
        assert all("queue for model 'mlp' is full (2); request rejected" in m for m in shed)
        assert_still_serving(running.address, demo_repo)
    finally:
        stop(running)


def test_concurrency_cap_and_message_size_are_resource_exhausted(demo_repo):
    running = start(
        demo_repo,
        endpoints={"max_concurrent_requests": 4},
        grpc={"max_recv_msg_bytes": 1 << 20},
    )
    try:
        c = grpcclient.InferenceServerClient(running.address)
        code, msg = status_of(
            lambda: c.infer("mlp", [mlp_input(np.ones((1, 300_000), np.float32))])
        )
        assert code == "StatusCode.RESOURCE_EXHAUSTED" and "larger than max" in msg
        results = burst_while_held(running, 8, 4)
        assert [r[0] for r in results].count("OK") == 4
        shed = [m for code, m in results if code == "StatusCode.RESOURCE_EXHAUSTED"]
        assert len(shed) == 4
        assert all("concurrency cap (4" in m for m in shed)
        assert_still_serving(running.address, demo_repo)
    finally:
        stop(running)


def test_shutdown_answers_queued_requests_unavailable(demo_repo):
    running = start(demo_repo)
    blocker = hold_device(running)
    results: list = []

    def client_thread():
        c = grpcclient.InferenceServerClient(running.address)
        try:
            c.infer("mlp", [mlp_input(np.ones((1, 16), np.float32))])
            results.append("OK")
        except InferenceServerException as exc:
            results.append(exc.status())

    threads = [threading.Thread(target=client_thread) for _ in range(4)]
    for t in threads:
        t.start()
    wait_until(
        lambda: running.scheduler.scheduler_metrics()["mlp"].queue_depth == 4,
        what="four requests queued behind the busy device",
    )
    t0 = time.monotonic()
    stopper = threading.Thread(target=stop, args=(running,))
    stopper.start()
    wait_until(lambda: len(results) == 4, 30, "the queued requests answered by the drain")
    blocker.release()  # the drain lets the execution on the device finish
    stopper.join(30)
    # well within stop's 30 s timeout: the drain ended with the execution, not at the bound
    assert not stopper.is_alive() and time.monotonic() - t0 < 20.0
    for t in threads:
        t.join(5)
    assert results and set(results) <= {"OK", "StatusCode.UNAVAILABLE"}
    assert "StatusCode.UNAVAILABLE" in results


def test_stop_leaves_no_thread_behind(demo_repo):
    before = {t.ident for t in threading.enumerate()}
    running = start(demo_repo)
    c = grpcclient.InferenceServerClient(running.address)
    c.infer("mlp", [mlp_input(np.ones((1, 16), np.float32))])
    c.close()
    stop(running)

    def leftover() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]

    deadline = time.monotonic() + 10.0  # threads that were told to stop finish their last turn
    while leftover() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert leftover() == [], leftover()

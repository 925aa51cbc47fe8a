"""ModelStreamInfer on a worker served in-process: ids, errors that keep the stream open, the
concurrency cap, coalescing with unary requests, a client that disconnects, the end of the
client's half, framing errors, compression and shutdown.

The peers are grpcio's stub (it shows the ids of error answers, which tritonclient's stream
callback drops), tritonclient's ``start_stream`` and a bare HTTP/2 caller for bytes no client
would send.
"""

from __future__ import annotations

import queue
import struct
import threading
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from kserve_trio.core.protocol import compression
from kserve_trio.worker.server import serve, stop
from tests.device_hold import hold_device
from tests.e2e import reference as ref
from tests.waiting import wait_until
from tests.worker.raw_h2 import grpc_frame, raw_grpc_call

STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


def start(repo, **endpoints):
    return serve(
        None,
        blocking=False,
        model_dirs=[str(repo)],
        model_control_mode="static",
        endpoints={"port": 0, **endpoints},
    )


@pytest.fixture(scope="module")
def server(demo_repo):
    running = start(demo_repo, max_concurrent_requests=256)
    yield running
    stop(running)


def mlp_request(x: np.ndarray, rid: str, model: str = "mlp", datatype: str = "FP32"):
    req = service_pb2.ModelInferRequest(model_name=model, id=rid)
    req.inputs.add(name="input_0", datatype=datatype, shape=list(x.shape))
    req.raw_input_contents.append(x.tobytes())
    return req


class Feed:
    """A request iterator for grpcio's stream call that stays open until ``close``."""

    def __init__(self) -> None:
        self.items: queue.Queue = queue.Queue()

    def put(self, request) -> None:
        self.items.put(request)

    def close(self) -> None:
        self.items.put(None)

    def __iter__(self):
        while (item := self.items.get()) is not None:
            yield item


def mlp_metrics(running):
    return running.scheduler.scheduler_metrics()["mlp"]


def test_every_request_is_answered_with_its_id_and_errors_keep_the_stream_open(server, demo_repo):
    w = ref.weights(demo_repo, "mlp")
    rng = np.random.default_rng(0)
    feed = Feed()
    good: dict[str, np.ndarray] = {}
    bad: dict[str, str] = {}
    for i in range(20):
        rid = f"r{i}"
        if i % 5 == 2:
            feed.put(mlp_request(np.ones((1, 16), np.float32), rid, model="nope"))
            bad[rid] = "unknown model: nope"
        elif i % 5 == 4:
            feed.put(mlp_request(np.ones((2, 15), np.float32), rid))
            bad[rid] = "input 'input_0' dim 1 has extent 15, expected 16"
        else:
            x = rng.standard_normal((1 + i % 7 * 9, 16), dtype=np.float32)  # 1 to 55 rows
            feed.put(mlp_request(x, rid))
            good[rid] = x
    with grpc.insecure_channel(server.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        answers = stub.ModelStreamInfer(iter(feed), timeout=60)
        got = {}
        for _ in range(20):
            a = next(answers)
            got[a.infer_response.id] = a
        feed.put(mlp_request(good["r0"], "after"))  # the stream is still open
        again = next(answers)
        feed.close()
        assert list(answers) == []  # the end of our half ends the call, OK
    assert sorted(got) == sorted([*good, *bad])
    for rid, x in good.items():
        a = got[rid]
        assert a.error_message == "" and a.infer_response.model_name == "mlp"
        out = np.frombuffer(a.infer_response.raw_output_contents[0], np.float32)
        np.testing.assert_allclose(out.reshape(-1, 8), ref.mlp(x, w), rtol=1e-5, atol=1e-5)
    for rid, message in bad.items():
        assert got[rid].error_message == message
    assert got["r2"].infer_response.model_name == "nope"
    assert again.error_message == "" and again.infer_response.id == "after"
    assert wait_until(lambda: server.state.streams.count == 0)


def test_requests_over_the_concurrency_cap_wait_and_are_all_served(demo_repo):
    """A stream at the process's concurrency cap is backpressured, never failed: its requests
    take the cap's slots as they free up and every one is answered OK."""
    running = start(demo_repo, max_concurrent_requests=2)
    try:
        blocker = hold_device(running)
        feed = Feed()
        for i in range(6):
            feed.put(mlp_request(np.full((1, 16), i, np.float32), f"c{i}"))
        with grpc.insecure_channel(running.address) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            answers = stub.ModelStreamInfer(iter(feed), timeout=60)
            assert wait_until(lambda: running.state.inflight == 2)  # the cap, no more
            blocker.release()
            first = [next(answers) for _ in range(6)]
            feed.put(mlp_request(np.ones((1, 16), np.float32), "later"))
            later = next(answers)
            feed.close()
            assert list(answers) == []
        assert [a.error_message for a in first] == [""] * 6
        assert {a.infer_response.id for a in first} == {f"c{i}" for i in range(6)}
        assert later.error_message == "" and later.infer_response.id == "later"
        assert running.state.inflight == 0
    finally:
        stop(running)


def test_stream_requests_coalesce_with_unary_ones(server):
    before = mlp_metrics(server)
    blocker = hold_device(server)
    feed = Feed()
    with grpc.insecure_channel(server.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        answers = stub.ModelStreamInfer(iter(feed), timeout=60)
        for i in range(4):
            feed.put(mlp_request(np.full((1, 16), i, np.float32), f"s{i}"))
        unary = [
            stub.ModelInfer.future(mlp_request(np.full((1, 16), i, np.float32), f"u{i}"))
            for i in range(4)
        ]
        assert wait_until(lambda: mlp_metrics(server).queue_depth == 8)
        blocker.release()
        streamed = [next(answers) for _ in range(4)]
        replies = [f.result(timeout=30) for f in unary]
        feed.close()
        assert list(answers) == []
    after = mlp_metrics(server)
    assert sorted(a.infer_response.id for a in streamed) == ["s0", "s1", "s2", "s3"]
    assert sorted(r.id for r in replies) == ["u0", "u1", "u2", "u3"]
    assert after.requests_served - before.requests_served == 8
    assert after.dispatch_count - before.dispatch_count == 1  # one batch of all eight


def test_a_client_that_disconnects_mid_stream_leaves_nothing_queued(server):
    before = mlp_metrics(server)
    blocker = hold_device(server)
    feed = Feed()
    channel = grpc.insecure_channel(server.address)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    answers = stub.ModelStreamInfer(iter(feed), timeout=60)
    for i in range(6):
        feed.put(mlp_request(np.full((1, 16), i, np.float32), f"d{i}"))
    assert wait_until(lambda: mlp_metrics(server).queue_depth == 6)
    assert server.state.streams.count == 1 and server.state.inflight == 6
    answers.cancel()  # RST_STREAM while six requests wait for the device
    # dequeued while the device is still busy (the hold outlasts any wait below)
    assert wait_until(lambda: mlp_metrics(server).queue_depth == 0)
    assert wait_until(lambda: server.state.inflight == 0 and server.state.streams.count == 0)
    assert blocker.is_alive()
    blocker.release()
    stats = server.state.observer.stats_of("mlp")
    assert stats.fail.count >= 6
    feed.close()
    channel.close()
    c = grpcclient.InferenceServerClient(server.address)  # and the worker serves on
    inp = grpcclient.InferInput("input_0", [1, 16], "FP32")
    inp.set_data_from_numpy(np.ones((1, 16), np.float32))
    assert c.infer("mlp", [inp]).as_numpy("output").shape == (1, 8)
    # a request still queued would have run before this one or in its batch: none did
    assert mlp_metrics(server).requests_served == before.requests_served + 1


def messages(body: bytes) -> list[tuple[int, bytes]]:
    """The length-prefixed messages of a reply body, as (compressed flag, payload)."""
    out, pos = [], 0
    while pos < len(body):
        flag, length = struct.unpack(">BI", body[pos : pos + 5])
        out.append((flag, body[pos + 5 : pos + 5 + length]))
        pos += 5 + length
    return out


def answers_of(body: bytes) -> list[service_pb2.ModelStreamInferResponse]:
    return [service_pb2.ModelStreamInferResponse.FromString(p) for _, p in messages(body)]


def test_the_end_of_the_clients_half_answers_everything_then_ends_ok(server):
    body = b"".join(
        grpc_frame(mlp_request(np.full((2, 16), i, np.float32), f"h{i}").SerializeToString())
        for i in range(3)
    )
    reply = raw_grpc_call(server.address, STREAM, body)
    assert reply.status == 0, reply.message
    got = answers_of(reply.body)
    assert sorted(a.infer_response.id for a in got) == ["h0", "h1", "h2"]
    assert all(a.error_message == "" for a in got)


def test_a_malformed_message_is_an_error_answer_and_a_framing_error_ends_the_stream(server):
    good = grpc_frame(mlp_request(np.ones((1, 16), np.float32), "g1").SerializeToString())
    garbage = grpc_frame(b"\x0a\xff\xff\xff")  # field 1, a length past the end
    later = grpc_frame(mlp_request(np.ones((1, 16), np.float32), "g2").SerializeToString())
    cut = struct.pack(">BI", 0, 100) + b"\x0a\x03mlp"  # announces 100 bytes, sends 5
    reply = raw_grpc_call(server.address, STREAM, good + garbage + later + cut)
    assert reply.status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "truncated request" in reply.message
    got = answers_of(reply.body)
    assert len(got) == 3
    errors = [a for a in got if a.error_message]
    assert len(errors) == 1 and errors[0].error_message.startswith("malformed request message")
    assert errors[0].infer_response.id == ""
    assert sorted(a.infer_response.id for a in got if not a.error_message) == ["g1", "g2"]


def test_a_message_over_the_cap_ends_the_stream_resource_exhausted(demo_repo):
    running = serve(
        None,
        blocking=False,
        model_dirs=[str(demo_repo)],
        model_control_mode="static",
        endpoints={"port": 0},
        grpc={"max_recv_msg_bytes": 4096},
    )
    try:
        small = grpc_frame(mlp_request(np.ones((1, 16), np.float32), "s").SerializeToString())
        big = grpc_frame(mlp_request(np.ones((64, 16), np.float32), "b").SerializeToString())
        reply = raw_grpc_call(running.address, STREAM, small + big)
        assert reply.status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert "received message larger than max" in reply.message
        assert [a.infer_response.id for a in answers_of(reply.body)] == ["s"]
    finally:
        stop(running)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_stream_messages_are_served_and_answered_compressed(server, algorithm):
    plain = mlp_request(np.ones((1, 16), np.float32), "z").SerializeToString()
    reply = raw_grpc_call(
        server.address,
        STREAM,
        grpc_frame(compression.compress(plain, algorithm), flag=1) + grpc_frame(plain),
        headers=(("grpc-encoding", algorithm), ("grpc-accept-encoding", "identity,gzip,deflate")),
    )
    assert reply.status == 0, reply.message
    assert reply.headers.get("grpc-encoding") == algorithm
    got = messages(reply.body)
    assert [flag for flag, _ in got] == [1, 1]
    for _, payload in got:
        answer = service_pb2.ModelStreamInferResponse.FromString(
            bytes(compression.decompress(payload, algorithm, 1 << 20))
        )
        assert answer.error_message == "" and answer.infer_response.id == "z"


def test_tritonclient_compressed_stream(server, demo_repo):
    w = ref.weights(demo_repo, "mlp")
    c = grpcclient.InferenceServerClient(server.address)
    got: queue.Queue = queue.Queue()
    c.start_stream(
        callback=lambda result, error: got.put((result, error)), compression_algorithm="gzip"
    )
    try:
        x = np.random.default_rng(3).standard_normal((3, 16), dtype=np.float32)
        inp = grpcclient.InferInput("input_0", [3, 16], "FP32")
        inp.set_data_from_numpy(x)
        c.async_stream_infer("mlp", [inp], request_id="t1")
        result, error = got.get(timeout=30)
        assert error is None and result.get_response().id == "t1"
        np.testing.assert_allclose(result.as_numpy("output"), ref.mlp(x, w), rtol=1e-5, atol=1e-5)
    finally:
        c.stop_stream()


def test_shutdown_answers_the_queued_requests_and_ends_the_stream_unavailable(demo_repo):
    running = start(demo_repo)
    blocker = hold_device(running)
    feed = Feed()
    channel = grpc.insecure_channel(running.address)
    try:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        answers = stub.ModelStreamInfer(iter(feed), timeout=60)
        for i in range(3):
            feed.put(mlp_request(np.ones((1, 16), np.float32), f"q{i}"))
        assert wait_until(lambda: mlp_metrics(running).queue_depth == 3)
        stopper = threading.Thread(target=stop, args=(running,))
        started = time.monotonic()
        stopper.start()
        got = [next(answers) for _ in range(3)]
        blocker.release()  # the drain waits for the execution running on the device
        with pytest.raises(grpc.RpcError) as info:
            next(answers)
        stopper.join(30)
        # well within stop's 30 s timeout: the drain ended with the execution, not at the bound
        assert not stopper.is_alive() and time.monotonic() - started < 20.0
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert info.value.details() == "server is shutting down"
        assert {a.error_message for a in got} == {"server is shutting down"}
        assert sorted(a.infer_response.id for a in got) == ["q0", "q1", "q2"]
        assert running.state.streams.count == 0 and running.state.inflight == 0
    finally:
        feed.close()
        channel.close()
        blocker.release()
        if running._thread is not None and running._thread.is_alive():
            stop(running)

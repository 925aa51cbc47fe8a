"""A decompression bomb against the CLI worker: refused RESOURCE_EXHAUSTED once its output
passes the message cap, costing about the cap in memory (not the bomb's size, nor several
times the cap), while a concurrent client is served between its decompression steps."""

from __future__ import annotations

import threading
import time

import pytest

from tests.edge.memory_probe import MiB, mlp_input, peak_rss, rss
from tests.gateway.procs import Worker
from tests.ports import free_port
from tests.serving.bomb import zero_bomb
from tests.worker.raw_h2 import grpc_frame, raw_grpc_call

pytestmark = [pytest.mark.slow]

INFER = "/inference.GRPCInferenceService/ModelInfer"
CAP = 256 * MiB
BOMBS = 3


@pytest.fixture(scope="module")
def worker(demo_repo):
    w = Worker(
        demo_repo,
        "127.0.0.1",
        free_port(),
        env={
            "INFERENCE_SERVER_GRPC_MAX_RECV_MSG_BYTES": str(CAP),
            # room for the concurrent calls beside a bomb at the cap
            "INFERENCE_SERVER_LIMITS_MAX_INFLIGHT_BYTES": str(4 * CAP),
        },
    )
    try:
        w.wait_ready()
        yield w
    finally:
        w.stop()


@pytest.mark.timeout(120)
def test_a_gzip_bomb_costs_about_the_cap_and_a_concurrent_call_is_served_meanwhile(worker):
    bomb = grpc_frame(zero_bomb(8 << 30, "gzip"), flag=1)  # 8 GiB of zeros in a few MiB
    assert len(bomb) < 16 * MiB
    pid = worker.proc.pid
    client = worker.client()
    assert client.infer("mlp", [mlp_input()]).as_numpy("output").shape == (1, 8)
    before = rss(pid)
    bombs: list[tuple[float, float, int | None, str]] = []

    def send_bombs() -> None:
        for _ in range(BOMBS):
            started = time.monotonic()
            reply = raw_grpc_call(
                worker.url, INFER, bomb, headers=(("grpc-encoding", "gzip"),), timeout=60
            )
            bombs.append((started, time.monotonic(), reply.status, reply.message))

    sender = threading.Thread(target=send_bombs)
    sender.start()
    served: list[float] = []
    while sender.is_alive():
        result = client.infer("mlp", [mlp_input()], client_timeout=30)
        assert result.as_numpy("output").shape == (1, 8)
        served.append(time.monotonic())
    sender.join()
    assert [(status, "received message larger than max" in msg) for *_, status, msg in bombs] == [
        (8, True)
    ] * BOMBS, bombs
    grown = peak_rss(pid) - before
    # The output pieces up to the cap, one step beyond it and the compressed message.
    assert grown < CAP + CAP // 2, f"{grown // MiB} MiB for a {CAP // MiB} MiB cap"
    during = [t for t in served if any(start < t < end for start, end, *_ in bombs)]
    # Served between the bomb's steps, not only around it (5 calls in all during three bombs
    # when a bomb inflated in one go and held the event loop).
    assert len(during) >= 20, (len(during), len(served))
    assert worker.alive()

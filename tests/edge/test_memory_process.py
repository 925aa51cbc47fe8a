"""Per-process bounds against the CLI worker and the CLI gateway.

- Stream backpressure: a ModelStreamInfer stream with far more requests in flight than the
  process's concurrency cap is held back (its requests wait for the cap's slots), never failed
  with RESOURCE_EXHAUSTED.
- A decompression bomb is refused RESOURCE_EXHAUSTED once its output passes the message cap,
  costing about the cap in memory (not the bomb's size, nor several times the cap), while a
  concurrent client is served between its decompression steps; once the worker is idle its
  resident set comes back within 64 MiB of where it started (the idle trim).
"""

from __future__ import annotations

import queue

import pytest

from tests.edge.edge_procs import worker_and_gateway
from tests.edge.memory_attacks import bombs_beside_traffic, served_during
from tests.edge.memory_probe import MiB, mlp_input, peak_rss, rss, rss_comes_back
from tests.gateway.procs import Gateway, Worker
from tests.serving.bomb import zero_bomb
from tests.worker.raw_h2 import grpc_frame

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

CAP = 4
IN_FLIGHT = 1000
G = "KSERVE_TRIO_GATEWAY_"
MESSAGE_CAP = 256 * MiB
BOMBS = 3


@pytest.fixture(scope="module")
def servers(demo_repo):
    """A worker capped at ``CAP`` requests (and a 256 MiB message cap with room beside it in
    the bytes in flight), and a gateway in front of it capped the same."""
    with worker_and_gateway(
        demo_repo,
        worker_env={
            "INFERENCE_SERVER_ENDPOINTS_MAX_CONCURRENT_REQUESTS": str(CAP),
            "INFERENCE_SERVER_GRPC_MAX_RECV_MSG_BYTES": str(MESSAGE_CAP),
            "INFERENCE_SERVER_LIMITS_MAX_INFLIGHT_BYTES": str(4 * MESSAGE_CAP),
        },
        gateway_env={
            G + "GRPC_MAX_CONCURRENT_REQUESTS_PER_WORKER": str(CAP),
        },
    ) as pair:
        yield pair.worker, pair.gateway


def stream_burst(server: Worker | Gateway) -> list[str]:
    """``IN_FLIGHT`` requests written on one tritonclient stream before any is awaited; the
    error of each answer ("" for a success)."""
    client = server.client()
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i in range(IN_FLIGHT):
            client.async_stream_infer("mlp", [mlp_input(1, i % 7)], request_id=f"r{i}")
        got = [answers.get(timeout=60) for _ in range(IN_FLIGHT)]
    finally:
        client.stop_stream()
    ids = {result.get_response().id for result, error in got if error is None}
    assert ids <= {f"r{i}" for i in range(IN_FLIGHT)}
    return ["" if error is None else str(error) for _, error in got]


@pytest.mark.timeout(120)
def test_a_stream_far_over_the_workers_concurrency_cap_is_served_whole(servers):
    worker, _ = servers
    errors = stream_burst(worker)
    assert errors == [""] * IN_FLIGHT, {e for e in errors if e}
    assert worker.alive()


@pytest.mark.timeout(120)
def test_a_stream_far_over_the_gateways_concurrency_cap_is_served_whole(servers):
    worker, gateway = servers
    errors = stream_burst(gateway)
    assert errors == [""] * IN_FLIGHT, {e for e in errors if e}
    assert worker.alive() and gateway.alive()


@pytest.mark.timeout(120)
def test_a_gzip_bomb_costs_about_the_cap_and_a_concurrent_call_is_served_meanwhile(servers):
    worker, _ = servers
    bomb = grpc_frame(zero_bomb(1 << 30, "gzip"), flag=1)  # 1 GiB of zeros in 1 MiB
    assert len(bomb) < 16 * MiB
    pid = worker.proc.pid
    client = worker.client()
    assert client.infer("mlp", [mlp_input()]).as_numpy("output").shape == (1, 8)
    before = rss(pid)
    bombs, served = bombs_beside_traffic(worker.url, bomb, client, BOMBS)
    assert [(status, "received message larger than max" in msg) for *_, status, msg in bombs] == [
        (8, True)
    ] * BOMBS, bombs
    grown = peak_rss(pid) - before
    # The output pieces up to the cap, one step beyond it and the compressed message.
    assert grown < MESSAGE_CAP + MESSAGE_CAP // 2, (
        f"{grown // MiB} MiB for a {MESSAGE_CAP // MiB} MiB cap"
    )
    during = served_during(bombs, served)
    # Served between the bomb's steps, not only around it (5 calls in all during three bombs
    # when a bomb inflated in one go and held the event loop).
    assert len(during) >= 20, (len(during), len(served))
    assert worker.alive()
    back = rss_comes_back(pid, before, "the worker after gzip bombs")
    print(
        f"worker gzip bomb: RSS {before / MiB:.1f} MiB, peak growth {grown / MiB:.1f} MiB,",
        f"once idle {back / MiB:.1f} MiB",
    )

"""Stream backpressure against the CLI worker and the CLI gateway: a ModelStreamInfer stream
with far more requests in flight than the process's concurrency cap is held back (its requests
wait for the cap's slots), never failed with RESOURCE_EXHAUSTED."""

from __future__ import annotations

import queue

import pytest

from tests.edge.memory_probe import mlp_input
from tests.gateway.procs import Gateway, Worker
from tests.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

CAP = 4
IN_FLIGHT = 1000
G = "KSERVE_TRIO_GATEWAY_"


@pytest.fixture(scope="module")
def servers(demo_repo, tmp_path_factory):
    """A worker capped at ``CAP`` requests, and a gateway in front of it capped the same."""
    work = tmp_path_factory.mktemp("edge_streams")
    worker = Worker(
        demo_repo,
        "127.0.0.1",
        free_port(),
        env={"INFERENCE_SERVER_ENDPOINTS_MAX_CONCURRENT_REQUESTS": str(CAP)},
    )
    gateway = None
    try:
        worker.wait_ready()
        gateway = Gateway(
            work,
            {
                G + "WORKERS": worker.url,
                G + "GRPC_MAX_CONCURRENT_REQUESTS_PER_WORKER": str(CAP),
            },
        )
        gateway.wait_ready()
        yield worker, gateway
    finally:
        if gateway is not None:
            gateway.stop()
        worker.stop()


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

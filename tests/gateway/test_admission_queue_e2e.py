"""The gateway's admission queue end to end: a CLI worker serving the blocking ``sleepy`` and
``gate`` models behind the gateway CLI (on uvloop and on trio), driven by the stock tritonclient.

A burst far over the admission cap waits in the queue and is served whole; past the queue a
request is shed RESOURCE_EXHAUSTED; a queued request whose deadline passes is
DEADLINE_EXCEEDED and leaves the queue."""

from __future__ import annotations

import queue
import threading
import types

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.gate_model import Gate
from tests.gateway.procs import Gateway, gated_sleepy_worker
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
G = "KSERVE_TRIO_GATEWAY_"
BURST = 200


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    work = tmp_path_factory.mktemp("admission_queue")
    worker, gate = gated_sleepy_worker(work)
    try:
        worker.wait_ready()
        yield types.SimpleNamespace(worker=worker, work=work, gate=gate)
    finally:
        worker.stop()


def sleepy(seconds: float = 0.0) -> list[grpcclient.InferInput]:
    inp = grpcclient.InferInput("seconds", [1, 1], "FP32")
    inp.set_data_from_numpy(np.full((1, 1), seconds, np.float32))
    return [inp]


def gauge(gw: Gateway, name: str) -> float:
    for line in gw.admin("/metrics")[1].splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} in the gateway's /metrics")


def start_gateway(fleet, loop: str, **env: str) -> Gateway:
    gw = Gateway(fleet.work, {G + "WORKERS": fleet.worker.url, **env}, "--event-loop", loop)
    gw.wait_ready()
    return gw


@pytest.mark.parametrize("loop", ["uvloop", "trio"])
def test_a_burst_far_over_the_cap_waits_in_the_queue_and_is_served_whole(fleet, loop):
    gw = start_gateway(fleet, loop, **{G + "GRPC_MAX_CONCURRENT_REQUESTS_PER_WORKER": "4"})
    try:
        c = gw.client()  # one channel, as the probe that found the defect used
        done: queue.Queue = queue.Queue()
        for i in range(BURST):
            c.async_infer(
                "sleepy",
                sleepy(),
                callback=lambda result, error: done.put(error),
                request_id=str(i),
                client_timeout=120,
            )
        errors = [done.get(timeout=180) for _ in range(BURST)]
        assert [str(e) for e in errors if e is not None] == []
        assert gauge(gw, "gateway_requests_shed_total") == 0
        assert gauge(gw, "gateway_max_concurrent_requests") == 4
        assert gauge(gw, "gateway_queued_requests") == 0
    finally:
        assert gw.stop() == 0, gw.logs()


@pytest.mark.parametrize("loop", ["uvloop", "trio"])
def test_past_the_queue_a_call_is_shed_and_a_deadline_in_the_queue_is_deadline_exceeded(
    fleet, loop
):
    gw = start_gateway(
        fleet,
        loop,
        **{
            G + "GRPC_MAX_CONCURRENT_REQUESTS_PER_WORKER": "1",
            G + "GRPC_MAX_QUEUED_REQUESTS_PER_WORKER": "1",
        },
    )
    results: queue.Queue = queue.Queue()
    gate: Gate = fleet.gate

    def call(name: str, model: str) -> None:
        try:
            gw.client().infer(model, sleepy(), client_timeout=120)
            results.put((name, None))
        except InferenceServerException as exc:
            results.put((name, exc))

    threads = []
    try:
        c = gw.client()
        holder = threading.Thread(target=call, args=("holder", "gate"))
        holder.start()  # holds the one slot until the gate opens
        threads.append(holder)
        gate.wait_started()
        wait_until(lambda: gauge(gw, "gateway_inflight_requests") == 1, 30, "the slot taken")

        with pytest.raises(InferenceServerException) as info:  # waits, and its deadline passes
            c.infer("sleepy", sleepy(), client_timeout=1.0)
        assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED", info.value.message()
        wait_until(lambda: gauge(gw, "gateway_queued_requests") == 0, 30, "the queue left")
        assert gauge(gw, "gateway_inflight_requests") == 1  # the holder still holds the slot

        waiter = threading.Thread(target=call, args=("waiter", "sleepy"))
        waiter.start()
        threads.append(waiter)
        wait_until(lambda: gauge(gw, "gateway_queued_requests") == 1, 30, "the waiter queued")
        with pytest.raises(InferenceServerException) as info:  # beyond the queue: shed at once
            c.infer("sleepy", sleepy(), client_timeout=60)
        assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert "its queue is full (1 requests waiting" in info.value.message()
        assert gauge(gw, "gateway_requests_shed_total") == 1

        gate.open()
        for t in threads:
            t.join(120)
        outcomes = dict(results.get(timeout=1) for _ in threads)
        assert outcomes == {"holder": None, "waiter": None}  # both served in the end
        assert gauge(gw, "gateway_queued_requests") == 0
    finally:
        gate.open()
        for t in threads:
            t.join(120)
        assert gw.stop() == 0, gw.logs()

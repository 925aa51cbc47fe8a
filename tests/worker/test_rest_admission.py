"""The REST endpoint shares the inference core's admission with gRPC: at the concurrency cap a
REST request is shed 429 with the gRPC message (and counted as shed), while shutting down it is
503, and a failed request lands in the same Triton statistics. An in-process worker; the cap and
the shutdown flag are the worker state the core reads."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from kserve_trio.worker.server import serve, stop
from tests.ports import free_port

BODY = json.dumps(
    {"inputs": [{"name": "x", "shape": [4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
).encode()


@pytest.fixture(scope="module")
def worker(demo_repo):
    running = serve(
        None,
        blocking=False,
        model_dirs=[str(demo_repo)],
        models_include=["scale4"],
        model_control_mode="static",
        endpoints={"port": 0, "http_port": free_port(), "max_concurrent_requests": 1},
    )
    yield running
    stop(running)


def post(worker, path: str, body: bytes = BODY) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{worker.http_port}{path}", data=body)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def shed(worker) -> float:
    """``worker_requests_shed_total`` from the worker's own exposition."""
    for line in worker.state.metrics.exposition().decode().splitlines():
        if line.startswith("worker_requests_shed_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("worker_requests_shed_total is not exposed")


def stats(worker) -> dict:
    url = f"http://127.0.0.1:{worker.http_port}/v2/models/scale4/stats"
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())["model_stats"][0]["inference_stats"]


def test_the_cap_sheds_429_and_shutdown_is_503(worker):
    state = worker.state
    assert post(worker, "/v2/models/scale4/infer")[0] == 200
    shed_before = shed(worker)
    state.admission.inflight += 1  # one request in flight: the cap of 1 is reached
    try:
        assert post(worker, "/v2/models/scale4/infer") == (
            429,
            {"error": "server is at its concurrency cap (1 requests in flight)"},
        )
    finally:
        state.admission.inflight -= 1
    assert shed(worker) == shed_before + 1
    state.admission.draining = True
    try:
        assert post(worker, "/v2/models/scale4/infer") == (
            503,
            {"error": "server is shutting down"},
        )
    finally:
        state.admission.draining = False
    status, doc = post(worker, "/v2/models/scale4/infer")
    assert status == 200 and doc["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]


def test_failures_are_counted_in_the_shared_statistics(worker):
    before = stats(worker)
    bad = json.dumps(
        {"inputs": [{"name": "x", "shape": [3], "datatype": "FP32", "data": [1, 2, 3]}]}
    ).encode()
    assert post(worker, "/v2/models/scale4/infer", bad)[0] == 400
    assert post(worker, "/v2/models/scale4/infer")[0] == 200
    after = stats(worker)
    assert after["fail"]["count"] == before["fail"]["count"] + 1
    assert after["success"]["count"] == before["success"]["count"] + 1

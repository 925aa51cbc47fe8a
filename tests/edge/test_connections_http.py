"""The HTTP/1.1 deadlines of the CLI worker's REST and metrics ports (and the gateway's),
with small limits from the environment: ``INFERENCE_SERVER_LIMITS_HANDSHAKE_SECONDS=1``,
``..._IDLE_SECONDS=2``.

- slowloris (connections trickling a request head a byte at a time, each byte well within
  the idle limit): every one is closed within the head deadline plus slack, answered 408,
  counted ``refused_connections{reason="handshake_timeout"}``, while the worker's gRPC and a
  well-behaved REST client go on being served;
- a connection that sends nothing is closed at the head deadline too (no answer);
- a keep-alive connection with no request in progress closes after the idle limit
  (``reason="idle"``); one that keeps asking is never cut.
"""

from __future__ import annotations

import http.client
import time
from collections.abc import Iterator

import pytest

from tests.edge.idle_flood import Flood, Slowloris
from tests.edge.limited_procs import (
    LimitedGateway,
    LimitedWorker,
    counter,
    fresh_get,
    gateway_cap,
    get,
    worker_cap,
)

HEAD_SECONDS = 1.0
IDLE_SECONDS = 2.0
SLACK = 4.0
"""Added to every upper bound: the machine is shared and the reaper checks in steps."""
LOW = 0.9
"""Lower bounds are this fraction of the limit (the clocks of client and server differ)."""
SLOW_CLIENTS = 24
assert SLOW_CLIENTS < worker_cap() and SLOW_CLIENTS < gateway_cap()  # all admitted, then cut
LIMITS = {
    "LIMITS_HANDSHAKE_SECONDS": str(HEAD_SECONDS),
    "LIMITS_IDLE_SECONDS": str(IDLE_SECONDS),
}


@pytest.fixture(scope="module")
def worker(demo_repo) -> Iterator[LimitedWorker]:
    w = LimitedWorker(demo_repo, env={f"INFERENCE_SERVER_{k}": v for k, v in LIMITS.items()})
    try:
        w.wait_ready(60)
        yield w
    finally:
        assert w.stop() == 0, w.logs()


def refused(metrics_port: int, prefix: str, reason: str) -> float:
    status, body = fresh_get(metrics_port, "/metrics")
    assert status == 200, body
    return counter(body, f"{prefix}_edge_refused_connections_total", reason=reason)


def slowloris(port: int, served, n: int = SLOW_CLIENTS) -> tuple[float, bytes]:
    """``n`` trickling connections to ``port``; calls ``served()`` between rounds. The
    seconds until the server had closed all of them, and what they were sent."""
    start = time.monotonic()
    with Slowloris(port, n) as attack:
        while len(attack.closed) < n:
            assert time.monotonic() - start < HEAD_SECONDS + SLACK, len(attack.closed)
            attack.step()  # one byte per connection every 0.1 s: never idle for long
            served()
            attack.watch(0.1)
        return time.monotonic() - start, attack.received


@pytest.mark.timeout(60)
@pytest.mark.parametrize("port", ["rest", "metrics"])
def test_slowloris_is_closed_at_the_head_deadline_and_grpc_stays_served(
    worker: LimitedWorker, port: str
):
    client = worker.client()
    assert client.is_server_ready()
    before = refused(worker.metrics_port, "worker", "handshake_timeout")
    target = worker.http_port if port == "rest" else worker.metrics_port

    def served() -> None:
        assert client.is_server_ready()  # the worker's gRPC, all along

    took, received = slowloris(target, served)
    assert HEAD_SECONDS * LOW <= took <= HEAD_SECONDS + SLACK
    assert received.count(b"HTTP/1.1 408 ") == SLOW_CLIENTS
    assert refused(worker.metrics_port, "worker", "handshake_timeout") - before >= SLOW_CLIENTS
    assert fresh_get(worker.http_port, "/v2/health/ready")[0] == 200


@pytest.mark.timeout(60)
def test_a_connection_that_sends_nothing_is_closed_at_the_head_deadline(worker: LimitedWorker):
    start = time.monotonic()
    with Flood(worker.http_port, 5) as silent:
        took = silent.wait_closed(5, timeout=HEAD_SECONDS + SLACK)
        assert silent.received == b""  # nothing was asked: nothing is answered
    assert HEAD_SECONDS * LOW <= time.monotonic() - start and took <= HEAD_SECONDS + SLACK


@pytest.mark.timeout(60)
def test_an_idle_keep_alive_connection_closes_after_the_idle_limit(worker: LimitedWorker):
    before = refused(worker.metrics_port, "worker", "idle")
    conn = http.client.HTTPConnection("127.0.0.1", worker.http_port, timeout=10)
    try:
        assert get(conn, "/v2/health/ready")[0] == 200
        answered = time.monotonic()
        assert conn.sock is not None
        sock = conn.sock
        sock.settimeout(IDLE_SECONDS + SLACK)
        assert sock.recv(1) == b""  # closed by the server, with no request in progress
        idle = time.monotonic() - answered
    finally:
        conn.close()
    assert IDLE_SECONDS * LOW <= idle <= IDLE_SECONDS + SLACK
    assert refused(worker.metrics_port, "worker", "idle") - before >= 1


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_connection_that_keeps_asking_is_not_cut(worker: LimitedWorker):
    conn = http.client.HTTPConnection("127.0.0.1", worker.http_port, timeout=10)
    try:
        conn.connect()
        first = conn.sock
        end = time.monotonic() + IDLE_SECONDS + HEAD_SECONDS + 0.5
        while time.monotonic() < end:  # longer than both deadlines in all
            assert get(conn, "/v2/health/ready")[0] == 200
            time.sleep(0.3)  # real time must pass: asks spaced well within the idle limit
        assert conn.sock is first  # the same connection throughout
    finally:
        conn.close()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_the_gateways_rest_and_admin_ports_close_slowloris_too(
    worker: LimitedWorker, tmp_path_factory
):
    env = {f"KSERVE_TRIO_GATEWAY_{k}": v for k, v in LIMITS.items()}
    gw = LimitedGateway(tmp_path_factory.mktemp("edge_slow"), worker, env)
    try:
        gw.wait_ready(60)
        client = gw.client()
        for port in (gw.http_port, gw.metrics_port):
            took, received = slowloris(port, lambda: None)
            assert took <= HEAD_SECONDS + SLACK and received.count(b" 408 ") == SLOW_CLIENTS
            assert client.is_server_ready()
        assert refused(gw.metrics_port, "gateway", "handshake_timeout") >= 2 * SLOW_CLIENTS
    finally:
        assert gw.stop() == 0, gw.logs()

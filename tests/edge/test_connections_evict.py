"""A port's connection cap makes room by closing its longest-idle connection
(``serving.accept``), never one with a request or call in progress:

- ``ConnectionCap`` alone: the longest-idle connection is evicted for a new one, a busy one
  never; with none idle, or ``EVICTING_MAX`` evicted ones still closing, the new one is
  refused;
- an in-process REST server, on asyncio and trio: a connection that sent nothing and one whose
  request head is not complete are closed (no answer), one inside a request body is not; with
  every connection busy a new one is closed at once; on a TLS port (REST and gRPC), a
  connection still in its TLS handshake is evicted like any idle one;
- the CLI worker and the CLI gateway, on uvloop and trio, with ``limits.max_connections`` set
  to ``CAP`` from the environment: handshaken HTTP/2 connections with no call fill the gRPC
  port, and keep-alive and bare TCP connections the REST port; a new client is served at once,
  the longest-idle connection gets a GOAWAY(NO_ERROR) (gRPC) or is closed (REST), and
  ``*_edge_refused_connections_total{reason="evicted_idle"}`` counts it. With a call or request
  in progress on every connection, a new one is refused as before (``reason="max_connections"``)
  and none of them is touched.

The in-process HTTP/2 cases (both engines, a connection that never spoke HTTP/2) are in
``test_h2_server``.
"""

from __future__ import annotations

import functools
import http.client
import pathlib
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass

import anyio
import anyio.abc
import pytest
import tritonclient.grpc as grpcclient

from kserve_trio.core.process.config import EdgeLimits, TlsConfig
from kserve_trio.serving.accept import EVICTING_MAX, ConnectionCap, Slot
from kserve_trio.serving.edge_stats import EdgeStats
from kserve_trio.serving.grpc import GrpcServer, ServerSettings
from kserve_trio.serving.http import HttpRequest, HttpResponse, serve_app
from kserve_trio.serving.tls import server_ssl_context
from tests.client.test_tls import pki  # noqa: F401  (the session's throwaway PKI)
from tests.edge.h2_attacker import Attacker, ping
from tests.edge.idle_flood import Flood
from tests.edge.limited_procs import counter, fresh_get, get
from tests.edge.memory_probe import accepted_on
from tests.gateway.procs import Gateway, Proc, Worker
from tests.ports import free_port
from tests.waiting import succeeds_within, wait_until

BOUND = 20.0
"""Seconds: the bound on every outcome."""
SERVED_AT_ONCE = 5.0
"""A new client at a full port is served within this (the idle deadline is 300 s, the head
deadline 60 s)."""
CAP = 6


# ------------------------------------------------------------------------------ ConnectionCap


class Evicted:
    """What the cap evicted, by name."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def slot(self, cap: ConnectionCap, name: str) -> Slot:
        slot = cap.admit()
        assert slot is not None, name
        slot.bind(functools.partial(self.names.append, name))
        return slot


def test_at_the_cap_the_longest_idle_is_evicted_and_the_new_one_admitted():
    stats = EdgeStats()
    cap = ConnectionCap(2, stats, "t")
    evicted = Evicted()
    a, b = evicted.slot(cap, "a"), evicted.slot(cap, "b")
    a.busy()
    a.idle()  # a request came and was answered: a is now the most recently idle
    evicted.slot(cap, "c")
    assert evicted.names == ["b"] and b.evicted and not a.evicted
    assert stats.refused_connections == {"evicted_idle": 1}
    b.release()
    assert cap.open == 2 and cap.evicting == 0


def test_a_busy_connection_is_never_evicted_and_with_all_busy_the_new_one_is_refused():
    stats = EdgeStats()
    cap = ConnectionCap(2, stats, "t")
    evicted = Evicted()
    a, b = evicted.slot(cap, "a"), evicted.slot(cap, "b")
    a.busy()
    c = evicted.slot(cap, "c")  # b goes, not a (older, but busy)
    assert evicted.names == ["b"]
    b.release()
    c.busy()
    assert cap.admit() is None
    assert stats.refused_connections == {"evicted_idle": 1, "max_connections": 1}
    a.idle()  # its request answered: evictable again
    evicted.slot(cap, "d")
    assert evicted.names == ["b", "a"]


def test_evicted_connections_still_closing_are_bounded():
    stats = EdgeStats()
    cap = ConnectionCap(1, stats, "t")
    evicted = Evicted()
    slots = [evicted.slot(cap, str(i)) for i in range(EVICTING_MAX + 1)]  # each evicts the last
    assert cap.evicting == EVICTING_MAX and cap.open == EVICTING_MAX + 1
    assert cap.admit() is None  # none of the evicted has closed yet
    slots[0].release()
    evicted.slot(cap, "next")
    assert cap.open == EVICTING_MAX + 1
    assert stats.refused_connections == {"evicted_idle": EVICTING_MAX + 1, "max_connections": 1}


def test_a_port_without_a_cap_never_evicts():
    cap = ConnectionCap(0, EdgeStats(), "t")
    evicted = Evicted()
    for i in range(50):
        evicted.slot(cap, str(i))
    assert evicted.names == [] and cap.open == 50


# ------------------------------------------------------------------------------ in process


async def _ok(request: HttpRequest) -> HttpResponse:
    return HttpResponse(200, b'{"ok": true}')


POST_HEAD = b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n"
"""A request whose head says a body follows: in progress until the body has come."""


async def _answered(stream: anyio.abc.ByteStream, request: bytes, status: bytes) -> None:
    await stream.send(request)
    assert (await stream.receive()).startswith(b"HTTP/1.1 " + status)


async def _closed_with_nothing(stream: anyio.abc.ByteStream) -> None:
    with anyio.fail_after(BOUND):
        try:
            data = await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            return
    raise AssertionError(f"not closed: {data[:80]!r}")


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_rest_evicts_unfinished_heads_and_never_a_request_in_progress():
    stats = EdgeStats()
    limits = EdgeLimits(max_connections=2, handshake_seconds=60, idle_seconds=300)
    serve = functools.partial(serve_app, "127.0.0.1", 0, _ok, max_body_bytes=1 << 16)
    async with AsyncExitStack() as stack:
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)
        port = await tg.start(functools.partial(serve, limits=limits, stats=stats))

        async def connect() -> anyio.abc.ByteStream:
            return await stack.enter_async_context(await anyio.connect_tcp("127.0.0.1", port))

        body = await connect()  # inside a request body: the oldest, never evicted
        await _answered(body, POST_HEAD, b"100 ")
        await body.send(b"x")
        bare = await connect()  # never a byte
        partial = await connect()  # admitted in bare's place
        await _closed_with_nothing(bare)
        await partial.send(b"GET / HTTP/1.1\r\nHo")
        busy = await connect()  # in partial's place: a head not complete, closed with no 408
        await _closed_with_nothing(partial)
        await _answered(busy, POST_HEAD, b"100 ")
        refused = await connect()  # every connection inside a request: closed at once
        await _closed_with_nothing(refused)
        for one in (body, busy):  # their requests went on all along
            await _answered(one, b"xyz" if one is body else b"wxyz", b"200 ")
        assert stats.refused_connections == {"evicted_idle": 2, "max_connections": 1}


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.parametrize("port", ["grpc", "rest"])
async def test_a_connection_in_its_tls_handshake_is_evicted(port: str, pki):  # noqa: F811
    stats = EdgeStats()
    ctx = server_ssl_context(TlsConfig(str(pki / "server.pem"), str(pki / "server.key")))
    limits = EdgeLimits(max_connections=1, handshake_seconds=60)
    grpc = GrpcServer({}, ServerSettings(limits=limits), stats)
    async with anyio.create_task_group() as tg:
        if port == "grpc":
            bound = await tg.start(grpc.serve, "127.0.0.1", 0, ctx)
        else:
            rest = functools.partial(
                serve_app, "127.0.0.1", 0, _ok, max_body_bytes=1 << 16, ssl_context=ctx
            )
            bound = await tg.start(functools.partial(rest, limits=limits, stats=stats))
        async with await anyio.connect_tcp("127.0.0.1", bound) as first:  # no ClientHello
            async with await anyio.connect_tcp("127.0.0.1", bound):
                await _closed_with_nothing(first)
        assert stats.refused_connections == {"evicted_idle": 1}
        with anyio.fail_after(BOUND):
            await grpc.shutdown(1.0)
        tg.cancel_scope.cancel()


# ------------------------------------------------------------------------------ CLI processes


@dataclass
class Target:
    """A CLI worker or gateway with its gRPC, REST and metrics ports capped at ``CAP``."""

    proc: Proc
    grpc_port: int
    rest_port: int
    metrics_port: int
    prefix: str

    def refused(self, reason: str) -> float:
        status, body = fresh_get(self.metrics_port, "/metrics")
        assert status == 200, body
        return counter(body, f"{self.prefix}_edge_refused_connections_total", reason=reason)

    def client(self) -> grpcclient.InferenceServerClient:
        return grpcclient.InferenceServerClient(f"127.0.0.1:{self.grpc_port}")

    def quiet(self, port: int) -> None:
        """Wait until the process holds no connection on ``port``: an earlier test's that it
        is still closing count under the cap and cannot be evicted, so a test's own connections
        at the cap would be refused (or evict each other) while they last."""
        pid = self.proc.proc.pid
        wait_until(lambda: accepted_on(pid, port) == 0, BOUND, f"no connection left on {port}")


TARGETS = [(kind, loop) for kind in ("worker", "gateway") for loop in ("uvloop", "trio")]
LIMITS = {"LIMITS_MAX_CONNECTIONS": str(CAP), "LIMITS_HANDSHAKE_SECONDS": "60"}


@pytest.fixture(scope="module")
def backing(demo_repo: pathlib.Path) -> Iterator[Worker]:
    """The worker behind the gateways under test (its own ports are not attacked)."""
    worker = Worker(demo_repo, "127.0.0.1", free_port())
    try:
        worker.wait_ready(120)
        yield worker
    finally:
        assert worker.stop() == 0, worker.logs()


@pytest.fixture(scope="module", params=TARGETS, ids=[f"{k}-{loop}" for k, loop in TARGETS])
def target(
    request: pytest.FixtureRequest, demo_repo: pathlib.Path, tmp_path_factory
) -> Iterator[Target]:
    kind, loop = request.param
    rest = free_port()
    proc: Worker | Gateway
    if kind == "worker":
        env = {f"INFERENCE_SERVER_{k}": v for k, v in LIMITS.items()}
        env["INFERENCE_SERVER_ENDPOINTS_HTTP_PORT"] = str(rest)
        env["INFERENCE_SERVER_ENDPOINTS_EVENT_LOOP"] = loop
        proc = Worker(demo_repo, "127.0.0.1", free_port(), metrics_port=free_port(), env=env)
    else:
        worker: Worker = request.getfixturevalue("backing")
        g = "KSERVE_TRIO_GATEWAY_"
        env = {g + k: v for k, v in LIMITS.items()}
        env |= {g + "WORKERS": worker.url, g + "LISTEN_HTTP": f"127.0.0.1:{rest}"}
        env[g + "EVENT_LOOP"] = loop
        proc = Gateway(tmp_path_factory.mktemp(f"evict-{loop}"), env)
    try:
        proc.wait_ready(120)
        yield Target(proc, proc.port, rest, proc.metrics_port, kind)
    finally:
        assert proc.stop() == 0, proc.logs()


def _served_soon(call: Callable[[], object]) -> float:
    """Seconds until ``call()`` succeeds (a port whose last clients are still being closed
    may refuse a moment); past BOUND, the last failure is the cause."""
    return succeeds_within(call, BOUND, "served")


async def _handshaken(stack: AsyncExitStack, port: int, n: int) -> list[Attacker]:
    """``n`` HTTP/2 connections the server has read the SETTINGS of, oldest first."""
    out = []
    for _ in range(n):
        attacker = await stack.enter_async_context(Attacker.connect(port))
        assert await attacker.until(attacker.settings_acked, BOUND)
        out.append(attacker)
    return out


async def _alive(attacker: Attacker) -> bool:
    """The server still reads and answers this connection (a PING is acknowledged)."""
    acks = attacker.ping_acks()
    await attacker.send(ping())
    return await attacker.until(lambda: attacker.ping_acks() > acks, BOUND)


def _grpc_served(target: Target) -> None:
    client = target.client()
    try:
        assert client.is_server_ready() and client.is_model_ready("mlp")
    finally:
        client.close()


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_grpc_idle_connections_at_the_cap_make_room_for_a_new_client(target: Target):
    await anyio.to_thread.run_sync(target.quiet, target.grpc_port)
    before = target.refused("evicted_idle")
    async with AsyncExitStack() as stack:
        idle = await _handshaken(stack, target.grpc_port, CAP)
        start = time.monotonic()
        await anyio.to_thread.run_sync(_grpc_served, target)
        assert time.monotonic() - start < SERVED_AT_ONCE
        oldest = idle[0]
        assert await oldest.until_eof(BOUND)
        assert [(f.error_code, f.last_stream_id) for f in oldest.goaways] == [(0, 0)]
        assert await _alive(idle[-1]) and idle[-1].goaways == []  # the newest idle stays
    assert target.refused("evicted_idle") - before >= 1


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_grpc_connections_with_a_call_in_flight_are_never_evicted(target: Target):
    await anyio.to_thread.run_sync(target.quiet, target.grpc_port)
    async with AsyncExitStack() as stack:
        busy = await _handshaken(stack, target.grpc_port, CAP)
        for attacker in busy:  # a ModelInfer whose message never comes: in flight
            acks = attacker.ping_acks()
            await attacker.send(attacker.request(1), ping())
            assert await attacker.until(lambda a=attacker, n=acks: a.ping_acks() > n, BOUND)
        refused, evicted = target.refused("max_connections"), target.refused("evicted_idle")
        with socket.create_connection(("127.0.0.1", target.grpc_port), timeout=BOUND) as new:
            assert new.recv(1024) == b""  # closed at once, before the server's SETTINGS
        assert target.refused("max_connections") - refused >= 1
        assert target.refused("evicted_idle") == evicted
        for attacker in busy:
            assert await _alive(attacker) and attacker.goaways == []
    _served_soon(functools.partial(_grpc_served, target))  # once they have gone


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_rest_idle_connections_at_the_cap_make_room_for_new_clients(target: Target):
    target.quiet(target.rest_port)
    before = target.refused("evicted_idle")
    kept = [http.client.HTTPConnection("127.0.0.1", target.rest_port, timeout=BOUND)]
    kept += [http.client.HTTPConnection("127.0.0.1", target.rest_port, timeout=BOUND)]
    new = [
        http.client.HTTPConnection("127.0.0.1", target.rest_port, timeout=BOUND)
        for _ in range(len(kept) + 1)
    ]
    try:
        for conn in kept:  # kept alive, no request in progress: idle since their answer
            assert get(conn, "/v2/health/ready")[0] == 200
        with Flood(target.rest_port, CAP - len(kept)) as bare:  # never a byte
            for conn in new:  # each served at once, evicting the longest idle
                start = time.monotonic()
                assert get(conn, "/v2/health/ready")[0] == 200
                assert time.monotonic() - start < SERVED_AT_ONCE
            for conn in kept:
                assert conn.sock is not None and conn.sock.recv(1) == b""
            bare.wait_closed(1, BOUND)
            bare.watch()
            assert bare.closed == {bare.socks[0]} and bare.received == b""
    finally:
        for conn in kept + new:
            conn.close()
    assert target.refused("evicted_idle") - before >= len(kept) + 1


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_rest_connections_inside_a_request_are_never_evicted(target: Target):
    target.quiet(target.rest_port)
    busy = [socket.create_connection(("127.0.0.1", target.rest_port), timeout=BOUND)]
    try:
        while len(busy) < CAP:
            busy.append(socket.create_connection(("127.0.0.1", target.rest_port), timeout=BOUND))
        for sock in busy:
            sock.sendall(POST_HEAD.replace(b"POST / ", b"POST /v2/models/mlp/infer "))
            assert sock.recv(1024).startswith(b"HTTP/1.1 100 ")
            sock.sendall(b"{")
        refused, evicted = target.refused("max_connections"), target.refused("evicted_idle")
        with socket.create_connection(("127.0.0.1", target.rest_port), timeout=BOUND) as new:
            assert new.recv(1024) == b""  # closed at once
        assert target.refused("max_connections") - refused >= 1
        assert target.refused("evicted_idle") == evicted
        for sock in busy:  # each request goes on: its body ends, it is answered
            sock.sendall(b"xyz")
            assert sock.recv(1024).startswith(b"HTTP/1.1 4")
    finally:
        for sock in busy:
            sock.close()
    _served_soon(lambda: fresh_get(target.rest_port, "/v2/health/ready"))

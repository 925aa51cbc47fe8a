"""REST request bodies in the process's bytes in flight (``limits.max_inflight_bytes``), the
budget gRPC messages count in.

In process, on asyncio and trio: a real ``serve_app`` on a loopback port with its own
``InflightBytes``, raw loopback sockets as clients, each test waiting on the gauge
(``InflightBytes.used``) with a deadline. A body is charged at its ``Content-Length`` as soon
as its head is parsed, a chunked one piece by piece, a gzip one as it inflates; a body that
does not fit gets 429 with the gRPC refusal's message while the first is still being sent, and
fits once the first is answered; the gauge is back to 0 after every request and after a client
that leaves mid-body; requests pipelined before a refused body are answered first; a request
without a body, or a small one, is served as before.

End to end: a CLI worker (``INFERENCE_SERVER_ENDPOINTS_HTTP_PORT``, a 1 MiB
``INFERENCE_SERVER_LIMITS_MAX_INFLIGHT_BYTES``) and a CLI gateway (``KSERVE_TRIO_GATEWAY_LISTEN_
HTTP``, the same budget) each refuse a second large body 429 while a first one holds the bytes,
count it (``<prefix>_edge_refused_requests{reason="inflight_bytes"}``), and their
``<prefix>_edge_inflight_bytes`` gauge returns to 0.
"""

from __future__ import annotations

import functools
import json
import socket
import time
import zlib
from collections.abc import AsyncIterator, Callable

import anyio
import anyio.abc
import pytest

from kserve_trio.core.errors import ResourceExhausted
from kserve_trio.serving.admission import InflightBytes
from kserve_trio.serving.edge_stats import EdgeStats
from kserve_trio.serving.http import HttpRequest, HttpResponse, serve_app
from kserve_trio.serving.rest_routes import request_body
from tests.edge.rest_peer import good_infer_body, metric, read_reply, request, worker_metrics
from tests.gateway.procs import Gateway, Worker
from tests.ports import free_port

KIB = 1 << 10
BUDGET = 1024 * KIB
"""The bytes in flight cap of the in-process server."""
BODY_CAP = 4096 * KIB
LARGE = 768 * KIB
"""A body that fits the budget once, not twice."""
FIRST_PIECE = 64 * KIB
WAIT_SECONDS = 10.0


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


def refusal(held: int, needed: int, cap: int = BUDGET) -> str:
    """The message a gRPC call gets from the same budget with ``held`` bytes in flight."""
    budget = InflightBytes(cap)
    budget.used = held
    with pytest.raises(ResourceExhausted) as refused:
        budget.charge(needed)
    return refused.value.message


async def body_length(request: HttpRequest) -> HttpResponse:
    """The app: reads the body as the REST routes do (inflated when gzip) and says its size."""
    body = request_body(request, BODY_CAP)
    return HttpResponse(200, json.dumps({"body": len(body)}).encode())


class Served:
    """A running ``serve_app`` and the budget its bodies are charged to."""

    def __init__(self, port: int, inflight: InflightBytes, stats: EdgeStats) -> None:
        self.port, self.inflight, self.stats = port, inflight, stats

    async def connect(self) -> anyio.abc.SocketStream:
        return await anyio.connect_tcp("127.0.0.1", self.port)

    async def until(self, condition: Callable[[], bool], what: str) -> None:
        """Wait for ``condition`` (the server's tasks run meanwhile), at most WAIT_SECONDS."""
        deadline = anyio.current_time() + WAIT_SECONDS
        while not condition():
            assert anyio.current_time() < deadline, (what, self.inflight.used)
            await anyio.sleep(0.005)

    async def drained(self) -> None:
        await self.until(lambda: self.inflight.used == 0, "the gauge back to 0")


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    inflight, stats = InflightBytes(BUDGET), EdgeStats()
    serve = functools.partial(
        serve_app,
        "127.0.0.1",
        0,
        body_length,
        max_body_bytes=BODY_CAP,
        stats=stats,
        inflight=inflight,
    )
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve)
        yield Served(port, inflight, stats)
        tg.cancel_scope.cancel()


def head(length: int | None, extra: str = "") -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return f"POST /echo HTTP/1.1\r\nHost: t\r\n{framing}\r\n{extra}\r\n".encode()


def parse_replies(data: bytes) -> list[tuple[int, dict]]:
    """The whole replies at the start of ``data`` (status, JSON body), in order."""
    replies = []
    while True:
        top, sep, rest = data.partition(b"\r\n\r\n")
        if not sep:
            return replies
        length = next(
            int(line.split(b":")[1])
            for line in top.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        if len(rest) < length:
            return replies
        replies.append((int(top.split()[1]), json.loads(rest[:length])))
        data = rest[length:]


async def replies(stream: anyio.abc.SocketStream, count: int) -> list[tuple[int, dict]]:
    """The next ``count`` replies read from ``stream``, within WAIT_SECONDS."""
    data = b""
    with anyio.fail_after(WAIT_SECONDS):
        while len(parsed := parse_replies(data)) < count:
            data += await stream.receive()
    return parsed


async def reply(stream: anyio.abc.SocketStream) -> tuple[int, dict]:
    """One whole reply read from ``stream`` (status, JSON body), within WAIT_SECONDS."""
    return (await replies(stream, 1))[0]


async def whole(served: Served, body: bytes, extra: str = "") -> tuple[int, dict]:
    """One request with ``body`` on its own connection."""
    async with await served.connect() as stream:
        await stream.send(head(len(body), extra) + body)
        return await reply(stream)


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_second_large_body_is_429_while_the_first_is_sent_and_fits_once_it_is_answered(
    served: Served,
):
    first = await served.connect()
    await first.send(head(LARGE) + bytes(FIRST_PIECE))
    # charged at its Content-Length, before the rest of it has come
    await served.until(lambda: served.inflight.used == LARGE, "the first body charged")

    second = await served.connect()
    await second.send(head(LARGE) + bytes(FIRST_PIECE))
    status, body = await reply(second)
    assert status == 429, body
    assert body == {"error": refusal(LARGE, LARGE)}
    assert served.stats.refused_requests["inflight_bytes"] == 1
    await second.aclose()
    assert served.inflight.used == LARGE  # the refused body charged nothing

    small_status, small = await whole(served, b"x" * 100)  # a small body fits beside it
    assert (small_status, small) == (200, {"body": 100})

    await first.send(bytes(LARGE - FIRST_PIECE))
    assert await reply(first) == (200, {"body": LARGE})
    await first.aclose()
    await served.drained()

    assert await whole(served, bytes(LARGE)) == (200, {"body": LARGE})  # now it fits
    await served.drained()
    assert served.stats.refused_requests["inflight_bytes"] == 1


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_client_that_leaves_mid_body_gives_its_bytes_back(served: Served):
    announced = await served.connect()
    await announced.send(head(LARGE) + bytes(FIRST_PIECE))
    await served.until(lambda: served.inflight.used == LARGE, "the announced body charged")
    await announced.aclose()
    await served.drained()

    chunked = await served.connect()
    piece = 100 * KIB
    await chunked.send(head(None) + b"%x\r\n" % piece + bytes(piece) + b"\r\n")
    # a chunked body is charged as its pieces arrive
    await served.until(lambda: served.inflight.used == piece, "the chunked piece charged")
    await chunked.aclose()
    await served.drained()
    assert served.stats.refused_requests["inflight_bytes"] == 0


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_gzip_body_is_charged_as_it_inflates(served: Served):
    inflated = 512 * KIB
    packed = zlib.compress(bytes(inflated), wbits=31)
    gzip = "Content-Encoding: gzip\r\n"
    alone = await whole(served, packed, gzip)  # wire bytes and inflated bytes fit the budget
    assert alone == (200, {"body": inflated})
    await served.drained()

    holder = await served.connect()
    await holder.send(head(LARGE) + bytes(FIRST_PIECE))
    await served.until(lambda: served.inflight.used == LARGE, "the holder charged")
    status, body = await whole(served, packed, gzip)  # its wire bytes fit, its output not
    assert status == 429, body
    assert body["error"].startswith(f"server is at its in-flight bytes cap ({LARGE + len(packed)}")
    assert served.stats.refused_requests["inflight_bytes"] == 1
    await served.until(lambda: served.inflight.used == LARGE, "the refused request released")
    await holder.aclose()
    await served.drained()


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_one_request_alone_is_admitted_and_one_without_a_body_is_never_refused(
    served: Served,
):
    over = 2 * BUDGET  # over the budget on its own, under the body cap
    alone = await served.connect()
    await alone.send(head(over) + bytes(FIRST_PIECE))
    await served.until(lambda: served.inflight.used == over, "the lone body charged")
    async with await served.connect() as bodyless:
        await bodyless.send(b"GET /echo HTTP/1.1\r\nHost: t\r\n\r\n")
        assert await reply(bodyless) == (200, {"body": 0})
    assert served.inflight.used == over
    await alone.send(bytes(over - FIRST_PIECE))
    assert await reply(alone) == (200, {"body": over})
    await alone.aclose()
    await served.drained()
    assert served.stats.refused_requests["inflight_bytes"] == 0


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_requests_pipelined_before_a_refused_body_are_answered_first(served: Served):
    holder = await served.connect()
    await holder.send(head(LARGE) + bytes(FIRST_PIECE))
    await served.until(lambda: served.inflight.used == LARGE, "the holder charged")
    async with await served.connect() as pipelined:
        small = head(10) + b"x" * 10
        await pipelined.send(small + head(LARGE) + bytes(FIRST_PIECE))
        answered, refused = await replies(pipelined, 2)
        assert answered == (200, {"body": 10})
        # the small body still holds its 10 bytes when both came in one read
        held = {refusal(LARGE + 10, LARGE), refusal(LARGE, LARGE)}
        assert refused[0] == 429 and refused[1]["error"] in held, refused
    await served.until(lambda: served.inflight.used == LARGE, "only the holder left")
    await holder.aclose()
    await served.drained()


# ------------------------------------------------------------- a CLI worker and a gateway

CLI_BUDGET = 1 << 20
CLI_LARGE = 768 * KIB


def gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in the exposition")


def refuses_and_gives_back(http_port: int, exposition: Callable[[], str], prefix: str) -> None:
    """Against a CLI process with a ``CLI_BUDGET`` of bytes in flight: one client holds a
    ``CLI_LARGE`` inference body half sent, a second one is 429 with the gRPC refusal's message
    and counted, a small inference is served meanwhile, and once the first client leaves
    mid-body the ``<prefix>_edge_inflight_bytes`` gauge is 0 again (also after one more
    inference)."""

    def settles(value: float, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while (seen := gauge(exposition(), f"{prefix}_edge_inflight_bytes")) != value:
            assert time.monotonic() < deadline, (seen, value)
            time.sleep(0.02)

    def small_inference() -> None:
        status, body = request(http_port, "POST", "/v2/models/mlp/infer", good_infer_body())
        assert status == 200, body

    infer_head = (
        "POST /v2/models/mlp/infer HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Content-Length: {CLI_LARGE}\r\n\r\n"
    ).encode()
    refused = f"{prefix}_edge_refused_requests_total"
    counted = metric(exposition(), refused, "inflight_bytes")
    with socket.create_connection(("127.0.0.1", http_port), timeout=30) as first:
        first.sendall(infer_head + b" " * FIRST_PIECE)
        settles(CLI_LARGE)
        with socket.create_connection(("127.0.0.1", http_port), timeout=30) as second:
            second.sendall(infer_head + b" " * FIRST_PIECE)
            status, data = read_reply(second, time.monotonic() + 30)
        assert status == 429, data
        assert json.loads(data) == {"error": refusal(CLI_LARGE, CLI_LARGE, CLI_BUDGET)}
        assert metric(exposition(), refused, "inflight_bytes") == counted + 1
        small_inference()  # beside the held bytes
    settles(0)  # the first client left mid-body
    small_inference()
    settles(0)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_cli_worker_refuses_a_body_past_its_inflight_bytes_and_gives_them_back(demo_repo):
    http_port = free_port()
    worker = Worker(
        demo_repo,
        "127.0.0.1",
        free_port(),
        metrics_port=free_port(),
        env={
            "INFERENCE_SERVER_ENDPOINTS_HTTP_PORT": str(http_port),
            "INFERENCE_SERVER_LIMITS_MAX_INFLIGHT_BYTES": str(CLI_BUDGET),
        },
    )
    try:
        worker.wait_ready()
        refuses_and_gives_back(http_port, lambda: worker_metrics(worker), "worker")
        assert worker.alive(), worker.logs()
    finally:
        assert worker.stop() == 0, worker.logs()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_cli_gateway_refuses_a_body_past_its_inflight_bytes_and_gives_them_back(
    demo_repo, tmp_path
):
    worker = Worker(demo_repo, "127.0.0.1", free_port())
    gateway = None
    try:
        worker.wait_ready()
        http_port = free_port()
        env = {
            "KSERVE_TRIO_GATEWAY_WORKERS": worker.url,
            "KSERVE_TRIO_GATEWAY_LISTEN_HTTP": f"127.0.0.1:{http_port}",
            "KSERVE_TRIO_GATEWAY_LIMITS_MAX_INFLIGHT_BYTES": str(CLI_BUDGET),
        }
        gateway = Gateway(tmp_path, env)
        gateway.wait_ready()
        refuses_and_gives_back(http_port, lambda: gateway.admin("/metrics")[1], "gateway")
        assert gateway.alive(), gateway.logs()
    finally:
        if gateway is not None:
            assert gateway.stop() == 0, gateway.logs()
        worker.stop()

"""REST request bodies in the process's bytes in flight (``limits.max_inflight_bytes``), the
budget gRPC messages count in.

In process, on asyncio and trio: a real ``serve_app`` on a loopback port with its own
``InflightBytes``, raw loopback sockets as clients, each test waiting on the gauge
(``InflightBytes.used``) with a deadline. A body is charged as its bytes arrive, never at its
``Content-Length`` (silent announcers hold a byte each while others are served; a length past
the body cap is 413 at once), a gzip one also as it inflates; a body that does not fit gets 429
with the gRPC refusal's message while the first is still being sent, and fits once the first is
answered; the gauge is back to 0 after every request and after a client that leaves mid-body;
requests pipelined before a refused body are answered first; a request without a body, or a
small one, is served as before; a connection at its share is read no further, with no error,
until the lane frees.

The same against the CLI processes (a worker, a worker with front ends and a gateway, on uvloop
and trio) is in ``test_every_process_kind``.
"""

from __future__ import annotations

import functools
import json
import re
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
from tests.waiting import until

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
        await until(condition, WAIT_SECONDS, what)

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


HELD = 700 * KIB
"""What a holder sends of its LARGE body (and is charged) before it stops."""
REFUSED = re.compile(
    r"server is at its in-flight bytes cap \(\d+ of \d+ bytes of requests in flight; "
    r"this message needs \d+\)"
)
"""The gRPC refusal's message, its figures those of the piece that did not fit."""


async def holder(served: Served, sent: int = HELD) -> anyio.abc.SocketStream:
    """A connection that announces a LARGE body and sends ``sent`` bytes of it, once charged."""
    stream = await served.connect()
    await stream.send(head(LARGE) + bytes(sent))
    await served.until(lambda: served.inflight.used == sent, "the holder charged what it sent")
    return stream


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_body_is_charged_as_it_arrives_and_one_past_the_budget_is_429(served: Served):
    first = await holder(served, FIRST_PIECE)  # announced LARGE, charged what came
    await first.send(bytes(HELD - FIRST_PIECE))
    await served.until(lambda: served.inflight.used == HELD, "the rest charged as it came")

    second = await served.connect()
    await second.send(head(LARGE) + bytes(LARGE))  # passes the budget on the way
    status, body = await reply(second)
    assert REFUSED.fullmatch(refusal(HELD, LARGE))  # the pattern is the budget's message
    assert status == 429 and REFUSED.fullmatch(body["error"]), body
    assert served.stats.refused_requests["inflight_bytes"] == 1
    # given back with the refusal, while the refused connection still lingers
    assert served.inflight.used == HELD
    small_status, small = await whole(served, b"x" * 100)  # a small body fits beside it
    assert (small_status, small) == (200, {"body": 100})
    await second.aclose()

    await first.send(bytes(LARGE - HELD))
    assert await reply(first) == (200, {"body": LARGE})
    await first.aclose()
    await served.drained()

    assert await whole(served, bytes(LARGE)) == (200, {"body": LARGE})  # now it fits
    await served.drained()
    assert served.stats.refused_requests["inflight_bytes"] == 1


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_silent_announcers_hold_what_arrived_and_others_are_served(served: Served):
    """Connections announcing a body at the cap and sending one byte of it hold a byte each:
    whole bodies of most of the budget keep being served beside them; a ``Content-Length``
    past the body cap is 413 at once, to that caller only, and its connection closed."""
    silent = []
    for _ in range(8):
        stream = await served.connect()
        await stream.send(head(BODY_CAP) + b"x")
        silent.append(stream)
    await served.until(lambda: served.inflight.used == 8, "a byte charged per announcer")
    for _ in range(3):
        assert await whole(served, bytes(LARGE)) == (200, {"body": LARGE})
    async with await served.connect() as beyond:
        await beyond.send(head(BODY_CAP + 1))
        status, body = await reply(beyond)
        assert (status, body) == (
            413,
            {"error": f"received message larger than max ({BODY_CAP + 1} vs. {BODY_CAP})"},
        )
        with anyio.fail_after(WAIT_SECONDS), pytest.raises(anyio.EndOfStream):
            await beyond.receive()  # closed: its body will not be read
    assert served.inflight.used == 8
    for stream in silent:
        await stream.aclose()
    await served.drained()
    assert served.stats.refused_requests["inflight_bytes"] == 0


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_client_that_leaves_mid_body_gives_its_bytes_back(served: Served):
    announced = await holder(served, FIRST_PIECE)
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

    held = await holder(served)
    status, body = await whole(served, packed, gzip)  # its wire bytes fit, its output not
    assert status == 429, body
    assert body["error"].startswith(f"server is at its in-flight bytes cap ({HELD + len(packed)}")
    assert served.stats.refused_requests["inflight_bytes"] == 1
    await served.until(lambda: served.inflight.used == HELD, "the refused request released")
    await held.aclose()
    await served.drained()


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_one_request_alone_is_admitted_and_one_without_a_body_is_never_refused(
    served: Served,
):
    over = 2 * BUDGET  # over the budget on its own, under the body cap
    alone = await served.connect()
    await alone.send(head(over) + bytes(BUDGET + FIRST_PIECE))
    await served.until(lambda: served.inflight.used > BUDGET, "the lone body past the budget")
    async with await served.connect() as bodyless:
        await bodyless.send(b"GET /echo HTTP/1.1\r\nHost: t\r\n\r\n")
        assert await reply(bodyless) == (200, {"body": 0})
    await alone.send(bytes(over - BUDGET - FIRST_PIECE))
    assert await reply(alone) == (200, {"body": over})
    await alone.aclose()
    await served.drained()
    assert served.stats.refused_requests["inflight_bytes"] == 0


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_requests_pipelined_before_a_refused_body_are_answered_first(served: Served):
    held = await holder(served)
    async with await served.connect() as pipelined:
        small = head(10) + b"x" * 10
        await pipelined.send(small + head(LARGE) + bytes(LARGE))
        answered, refused = await replies(pipelined, 2)
        assert answered == (200, {"body": 10})
        assert refused[0] == 429 and REFUSED.fullmatch(refused[1]["error"]), refused
    await served.until(lambda: served.inflight.used == HELD, "only the holder left")
    await held.aclose()
    await served.drained()


SHARE = 256 * KIB
READ = 256 * KIB
"""The most one read of the server's gives the parser (what may cross the share)."""


@pytest.fixture
async def shared() -> AsyncIterator[Served]:
    """A server whose connections each have a SHARE of a BUDGET twice as large as usual."""
    inflight, stats = InflightBytes(4 * BUDGET, SHARE), EdgeStats()
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


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_connection_at_its_share_is_read_no_further_until_the_lane_frees(shared: Served):
    """Two bodies larger than the share: the first connection takes the lane and is charged
    what it sends; the second is read to its share (plus the read that crossed it) and then
    no further, with no error, while a small request is served; once the first body is whole
    the second takes the lane and is served too."""
    budget = shared.inflight
    first = await shared.connect()
    await first.send(head(LARGE) + bytes(HELD))
    await shared.until(lambda: budget.used == HELD and budget.lane is not None, "the lane")
    second = await shared.connect()
    await second.send(head(LARGE) + bytes(LARGE))  # all sent: the sockets buffer it
    await shared.until(lambda: budget.used >= HELD + SHARE, "the second read to its share")
    assert await whole(shared, b"y" * 1000) == (200, {"body": 1000})
    assert budget.used <= HELD + SHARE + READ  # and read no further
    await first.send(bytes(LARGE - HELD))
    assert await reply(first) == (200, {"body": LARGE})
    assert await reply(second) == (200, {"body": LARGE})
    for stream in (first, second):
        await stream.aclose()
    await shared.drained()
    assert budget.lane is None and shared.stats.refused_requests["inflight_bytes"] == 0

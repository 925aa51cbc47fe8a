"""The HTTP/1.1 server against what the parser leaves open: chunk extensions and heads that
never end, Host, absolute-form targets, ``Upgrade``, and pipelined requests around a fault.

In process, on uvloop and trio: a real ``serve_app`` on a loopback port whose app records each
request it runs and answers its path, query and body size; raw loopback sockets are the
clients, each reply read with a deadline. A chunked body whose extension never ends is 400 once
its framing passes ``MAX_CHUNK_EXTENSION_BYTES`` (while the client is still sending), as is a
100 KB one, and extension bytes count toward the body cap; a head still arriving past
``MAX_HEAD_BYTES`` is 431; an HTTP/1.1 request without one Host header is 400; an absolute-form
target is served by its path; an upgrade request (``curl --http2``'s) is answered in HTTP/1.1
and the connection stays usable; a request completed before a fault is run and answered before
the fault's 400, and bytes after ``Connection: close`` end the connection with the first answer.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import AsyncIterator

import anyio
import anyio.abc
import pytest

from kserve_trio.serving.edge_stats import EdgeStats
from kserve_trio.serving.http import HttpRequest, HttpResponse, serve_app
from kserve_trio.serving.http._server import MAX_CHUNK_EXTENSION_BYTES, MAX_HEAD_BYTES
from tests.edge.rest_peer import Reply, split_replies

KIB = 1 << 10
BODY_CAP = 64 * KIB
WAIT_SECONDS = 10.0
ENDLESS_GIVE_UP = 64 << 20
"""An endless extension or header is sent until the answer comes or this much was sent (far
past what the socket buffers hold: reaching it means the server read on without answering)."""
CURL_H2C = (
    "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
    "HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
)
"""What ``curl --http2`` adds to a request to an http:// URL."""


@pytest.fixture(params=[pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"), "trio"])
def anyio_backend(request: pytest.FixtureRequest):
    return request.param


class Served:
    """A running ``serve_app``: its port, its stats, the requests its app ran."""

    def __init__(self, port: int, stats: EdgeStats, ran: list[HttpRequest]) -> None:
        self.port, self.stats, self.ran = port, stats, ran

    async def connect(self) -> anyio.abc.SocketStream:
        return await anyio.connect_tcp("127.0.0.1", self.port)


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    stats, ran = EdgeStats(), []

    async def app(request: HttpRequest) -> HttpResponse:
        ran.append(request)
        doc = {"path": request.path, "query": request.query, "body": len(request.body)}
        return HttpResponse(200, json.dumps(doc).encode())

    serve = functools.partial(serve_app, "127.0.0.1", 0, app, max_body_bytes=BODY_CAP, stats=stats)
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve)
        yield Served(port, stats, ran)
        tg.cancel_scope.cancel()


async def exchange(served: Served, data: bytes, count: int = 1) -> tuple[list[Reply], bool]:
    """Send ``data`` on a new connection: the first ``count`` replies, and whether the server
    then closed the connection with nothing more (read to its end when the last reply says
    ``connection: close``), within WAIT_SECONDS."""
    async with await served.connect() as stream:
        await stream.send(data)
        replies = await replies_on(stream, count)
        if replies[-1][1].get("connection") != "close":
            return replies, False
        with anyio.fail_after(WAIT_SECONDS):
            try:
                more = await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return replies, True
        raise AssertionError(f"sent more after closing: {more[:200]!r}")


async def send_until_answered(
    stream: anyio.abc.SocketStream, block: bytes, give_up: int
) -> tuple[bytes, int]:
    """Send ``block`` after ``block`` until the server's answer arrives, or it stops taking
    them, or ``give_up`` bytes were sent: what arrived and how much was sent."""
    sent, received = 0, b""
    with anyio.fail_after(WAIT_SECONDS):
        while not split_replies(received)[0] and sent < give_up:
            with anyio.move_on_after(0.001):
                received += await stream.receive()  # the answer, once it is there
            try:
                await stream.send(block)
            except (anyio.BrokenResourceError, OSError):
                break  # answered, drained a while and closed
            sent += len(block)
        while not split_replies(received)[0]:
            received += await stream.receive()
    return received, sent


async def replies_on(stream: anyio.abc.SocketStream, count: int) -> list[Reply]:
    """The next ``count`` replies on an open connection, within WAIT_SECONDS."""
    received = b""
    with anyio.fail_after(WAIT_SECONDS):
        while len((found := split_replies(received))[0]) < count:
            received += await stream.receive()
    assert not found[1], found  # nothing beyond them
    return found[0]


def error(reply: Reply) -> str:
    return json.loads(reply[2])["error"]


def served_body(reply: Reply) -> dict:
    assert reply[0] == 200, reply
    return json.loads(reply[2])


def chunked_head(path: str = "/c") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n".encode()


# ----------------------------------------------------------------------- chunk extensions


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_an_endless_chunk_extension_is_400_while_it_is_sent_and_chunks_still_work(
    served: Served,
):
    async with await served.connect() as stream:
        await stream.send(chunked_head() + b"5;name=")
        received, sent = await send_until_answered(stream, b"e" * (64 * KIB), ENDLESS_GIVE_UP)
    assert sent < ENDLESS_GIVE_UP, "read on without answering"
    ((status, headers, body),), _ = split_replies(received)
    assert status == 400 and headers["connection"] == "close"
    assert json.loads(body)["error"] == (
        f"malformed HTTP request: more than {MAX_CHUNK_EXTENSION_BYTES} bytes of chunk "
        "extensions in one request body"
    )
    assert served.stats.refused_requests["chunk_extensions"] == 1
    assert served.ran == []
    # extensions up to the bound in all, over many small chunks, are served; past it, not
    chunks = 512
    for pad, status in (
        (MAX_CHUNK_EXTENSION_BYTES // chunks - 2, 200),
        (MAX_CHUNK_EXTENSION_BYTES // chunks, 400),
    ):
        extension = b";" + b"v" * pad
        body = b"1%s\r\nx\r\n" % extension * chunks + b"0;end\r\n\r\n"
        (reply,), _ = await exchange(served, chunked_head() + body)
        assert reply[0] == status, (len(extension) * chunks, reply)
    assert [r.body for r in served.ran] == [b"x" * chunks]


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_100_kb_extension_is_400_in_one_write_and_across_reads(served: Served):
    extension = b";x=" + b"v" * (100 * KIB)
    whole = chunked_head() + b"5" + extension + b"\r\nhello\r\n0\r\n\r\n"
    (reply,), closed = await exchange(served, whole)
    assert reply[0] == 400 and "chunk extensions" in error(reply) and closed
    async with await served.connect() as stream:  # one byte of it in each later piece
        await stream.send(chunked_head() + b"5" + extension[: 60 * KIB])
        await anyio.sleep(0)
        try:
            await stream.send(extension[60 * KIB :] + b"\r\nhello\r\n0\r\n\r\n")
        except (anyio.BrokenResourceError, OSError):
            pass  # answered already
        (reply,) = await replies_on(stream, 1)
    assert reply[0] == 400 and "chunk extensions" in error(reply)
    # zeros before a chunk size are framing too
    (reply,), _ = await exchange(
        served, chunked_head() + b"0" * (20 * KIB) + b"5\r\nhello\r\n0\r\n\r\n"
    )
    assert reply[0] == 400 and "chunk extensions" in error(reply)
    assert served.stats.refused_requests["chunk_extensions"] == 3
    assert served.ran == []


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_extension_bytes_count_toward_the_body_cap(served: Served):
    data = b"d" * (BODY_CAP - 1000)
    extension = b";x=" + b"v" * 3000  # within the extension bound
    body = b"%x%s\r\n%s\r\n0\r\n\r\n" % (len(data), extension, data)
    (reply,), closed = await exchange(served, chunked_head() + body)
    assert reply[0] == 413 and closed
    assert error(reply).startswith("received message larger than max (")
    assert error(reply).endswith(f" vs. {BODY_CAP})")
    plain = b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data)  # the same data alone fits
    (reply,), _ = await exchange(served, chunked_head() + plain)
    assert served_body(reply)["body"] == len(data)


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_head_line_that_never_ends_is_431_once_past_the_head_cap(served: Served):
    async with await served.connect() as stream:
        await stream.send(b"GET /h HTTP/1.1\r\nHost: t\r\nX-Long: ")
        received, sent = await send_until_answered(stream, b"v" * (16 * KIB), ENDLESS_GIVE_UP)
    (reply, *_), _ = split_replies(received)
    assert sent < ENDLESS_GIVE_UP, "read on without answering"
    assert reply[0] == 431 and error(reply) == f"request head larger than {MAX_HEAD_BYTES} bytes"
    # a long head within the cap, arriving in pieces, is served
    async with await served.connect() as stream:
        await stream.send(b"GET /h HTTP/1.1\r\nHost: t\r\nX-Long: " + b"v" * (40 * KIB))
        await anyio.sleep(0.01)  # pauses make the head arrive in separate reads
        await stream.send(b"\r\n\r")
        await anyio.sleep(0.01)
        await stream.send(b"\n")
        (reply,) = await replies_on(stream, 1)
    assert served_body(reply)["path"] == "/h"


# ---------------------------------------------------------------------- RFC 9112 / RFC 9110


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_an_http11_request_needs_exactly_one_host(served: Served):
    (reply,), closed = await exchange(served, b"GET /a HTTP/1.1\r\n\r\n")
    assert (reply[0], error(reply)) == (
        400,
        "malformed HTTP request: no Host header (RFC 9112 asks for exactly one)",
    )
    assert closed
    (reply,), closed = await exchange(served, b"GET /a HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n")
    assert reply[0] == 400 and "more than one Host header" in error(reply) and closed
    (reply,), _ = await exchange(served, b"GET /a HTTP/1.0\r\nHost: a\r\nHost: b\r\n\r\n")
    assert reply[0] == 400
    (reply,), _ = await exchange(served, b"GET /old HTTP/1.0\r\n\r\n")  # HTTP/1.0 needs none
    assert served_body(reply)["path"] == "/old"
    assert [r.path for r in served.ran] == ["/old"]


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_an_absolute_form_target_is_served_by_its_path(served: Served):
    port = served.port
    async with await served.connect() as stream:
        for target in (
            f"http://127.0.0.1:{port}/v2/health/ready",
            "HTTP://localhost/v2/models/m?q=1",
            "https://example.com",
        ):
            await stream.send(f"GET {target} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
            (reply,) = await replies_on(stream, 1)
            served_body(reply)
    assert [(r.path, r.query) for r in served.ran] == [
        ("/v2/health/ready", ""),
        ("/v2/models/m", "q=1"),
        ("/", ""),
    ]


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_an_h2c_upgrade_is_ignored_and_answered_in_http11(served: Served):
    async with await served.connect() as stream:
        # curl --http2's request: answered in HTTP/1.1, and the connection carries on
        await stream.send(f"GET /up HTTP/1.1\r\nHost: t\r\n{CURL_H2C}\r\n".encode())
        (reply,) = await replies_on(stream, 1)
        assert served_body(reply)["path"] == "/up"
        assert "connection" not in reply[1] and "upgrade" not in reply[1]
        # with a body: the body is read as a body, and the request after it as a request
        post = f"POST /body HTTP/1.1\r\nHost: t\r\n{CURL_H2C}Content-Length: 5\r\n\r\nhello"
        chunked = (
            f"POST /chunked HTTP/1.1\r\nHost: t\r\n{CURL_H2C}Transfer-Encoding: chunked\r\n\r\n"
        )
        await stream.send(
            post.encode()
            + chunked.encode()
            + b"3\r\nabc\r\n0\r\n\r\nGET /after HTTP/1.1\r\nHost: t\r\n\r\n"
        )
        replies = await replies_on(stream, 3)
    assert [served_body(r) for r in replies] == [
        {"path": "/body", "query": "", "body": 5},
        {"path": "/chunked", "query": "", "body": 3},
        {"path": "/after", "query": "", "body": 0},
    ]
    assert [r.path for r in served.ran] == ["/up", "/body", "/chunked", "/after"]
    assert "upgrade" not in served.ran[0].headers and "http2-settings" not in served.ran[0].headers
    # an upgrade that also asks to close is answered and closed
    close = "GET /last HTTP/1.1\r\nHost: t\r\nConnection: Upgrade, close\r\nUpgrade: h2c\r\n\r\n"
    (reply,), closed = await exchange(served, close.encode())
    assert served_body(reply)["path"] == "/last" and reply[1]["connection"] == "close" and closed
    # CONNECT asks for a tunnel, which is not served
    (reply,), closed = await exchange(served, b"CONNECT h:443 HTTP/1.1\r\nHost: h:443\r\n\r\n")
    assert (reply[0], error(reply), closed) == (501, "the CONNECT method is not served", True)


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
async def test_curl_http2_gets_its_http11_answer(served: Served):
    url = f"http://127.0.0.1:{served.port}/v2/models/m/infer"
    done = await anyio.run_process(
        [
            "curl",
            "-sS",
            "--http2",
            "--max-time",
            "10",
            "-w",
            "\n%{http_code} %{http_version}",
            "-H",
            "Content-Type: application/json",
            "--data-binary",
            '{"inputs":[]}',
            url,
        ],
    )
    body, _, status = done.stdout.decode().rpartition("\n")
    assert status == "200 1.1", done
    assert json.loads(body) == {"path": "/v2/models/m/infer", "query": "", "body": 13}


# -------------------------------------------------------------------- pipelining and faults


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_a_request_before_a_malformed_one_is_run_and_answered_first(served: Served):
    valid = b"POST /first HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc"
    for malformed in (b"NOT HTTP AT ALL\r\n\r\n", b"GET /second HTTP/1.1\r\n\r\n"):
        served.ran.clear()
        (first, second), closed = await exchange(served, valid + malformed, count=2)
        assert served_body(first) == {"path": "/first", "query": "", "body": 3}
        assert second[0] == 400 and error(second).startswith("malformed HTTP request: ")
        assert closed and [r.path for r in served.ran] == ["/first"]
    # the same for a request after it over a cap: the first is answered, then the refusal
    served.ran.clear()
    over = f"POST /big HTTP/1.1\r\nHost: t\r\nContent-Length: {BODY_CAP + 1}\r\n\r\n".encode()
    (first, second), closed = await exchange(served, valid + over, count=2)
    assert served_body(first)["path"] == "/first" and second[0] == 413 and closed


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_bytes_after_connection_close_end_the_connection_with_the_first_answer(
    served: Served,
):
    first = b"GET /closing HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    for after in (b"GET /next HTTP/1.1\r\nHost: t\r\n\r\n", b"garbage that is no request"):
        served.ran.clear()
        (reply,), closed = await exchange(served, first + after)
        assert served_body(reply)["path"] == "/closing" and reply[1]["connection"] == "close"
        assert closed and [r.path for r in served.ran] == ["/closing"]

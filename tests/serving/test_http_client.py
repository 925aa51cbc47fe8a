"""serving.http.HttpClient against loopback servers on both anyio backends: keep-alive reuse,
Content-Length, chunked and end-of-connection bodies, a server that closes or resets a
keep-alive connection, what is retried and what is not, timeouts, the per-host limit, caps and
TLS. The project's own server (``serve_connection``) answers where the test needs a correct
peer; a scripted one writes exact bytes where it needs a particular one."""

from __future__ import annotations

import json
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import pytest
from anyio.streams.tls import TLSListener

from kserve_trio.serving.http import (
    HttpClient,
    HttpClientError,
    HttpRequest,
    HttpResponse,
    serve_connection,
)
from kserve_trio.serving.http._client import encode_request
from kserve_trio.serving.http._connection import Connection
from tests.client.test_tls import pki  # noqa: F401  (the session's throwaway PKI)
from tests.waiting import until

pytestmark = pytest.mark.anyio

HOST = "127.0.0.1"
Handler = Callable[[anyio.abc.ByteStream], Awaitable[None]]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


class Peer:
    """What a test server saw: connections accepted, requests answered."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[HttpRequest] = []


@asynccontextmanager
async def listening(
    handler: Handler, ssl_context: ssl.SSLContext | None = None
) -> AsyncIterator[int]:
    """A loopback listener whose every connection runs ``handler``; yields the port."""
    tcp = await anyio.create_tcp_listener(local_host=HOST)
    port = tcp.extra(anyio.abc.SocketAttribute.local_port)
    listener: anyio.abc.Listener = (
        tcp if ssl_context is None else TLSListener(tcp, ssl_context, standard_compatible=False)
    )
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handler)
        yield port
        tg.cancel_scope.cancel()


async def echo(request: HttpRequest) -> HttpResponse:
    if request.path == "/sleep":
        await anyio.sleep(float(request.query))
    doc = {"method": request.method, "path": request.path, "headers": request.headers}
    body = request.body if request.path == "/echo" else json.dumps(doc).encode()
    return HttpResponse(200, body)


@asynccontextmanager
async def served(
    app: Callable[[HttpRequest], Awaitable[HttpResponse]] = echo,
    ssl_context: ssl.SSLContext | None = None,
) -> AsyncIterator[tuple[int, Peer]]:
    """The project's server answering with ``app``, counting connections and requests."""
    peer = Peer()

    async def recorded(request: HttpRequest) -> HttpResponse:
        peer.requests.append(request)
        return await app(request)

    async def handle(stream: anyio.abc.ByteStream) -> None:
        peer.connections += 1
        await serve_connection(stream, recorded, 1 << 30)

    async with listening(handle, ssl_context) as port:
        yield port, peer


async def read_head(stream: anyio.abc.ByteStream) -> bytes:
    """Bytes up to the end of a request head (the scripted servers get bodiless requests)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive()
    return data


def scripted(*answers: bytes, then_close: bool = False, peer: Peer | None = None) -> Handler:
    """A handler that answers the connection's n-th request with ``answers[n]`` exactly, then
    closes (``then_close``) or waits for the client to."""
    seen = peer or Peer()

    async def handle(stream: anyio.abc.ByteStream) -> None:
        seen.connections += 1
        async with stream:
            for answer in answers:
                head = await read_head(stream)
                seen.requests.append(HttpRequest("GET", head.split(b" ")[1].decode()))
                await stream.send(answer)
            if not then_close:
                with anyio.move_on_after(5):
                    try:
                        await stream.receive()
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        pass

    return handle


# ------------------------------------------------------------------------------- keep-alive


async def test_sequential_requests_reuse_one_connection():
    async with served() as (port, peer), HttpClient(per_host=4) as client:
        for i in range(5):
            reply = await client.request(HOST, port, "GET", f"/r{i}", headers=[("x-n", str(i))])
            assert reply.status == 200
            doc = json.loads(reply.body)
            assert doc["path"] == f"/r{i}" and doc["headers"]["x-n"] == str(i)
            assert doc["headers"]["host"] == f"{HOST}:{port}"
        assert peer.connections == 1
        assert client.open_connections(HOST, port) == 1


async def test_a_post_body_goes_out_and_comes_back_byte_for_byte_small_and_large():
    async with served() as (port, peer), HttpClient() as client:
        for size in (0, 200, 3 << 20):
            body = bytes(range(256)) * (size // 256)
            reply = await client.request(HOST, port, "POST", "/echo", body=body)
            assert reply.status == 200 and reply.body == body
            assert peer.requests[-1].headers["content-length"] == str(len(body))
        view = memoryview(bytearray(b"abc" * 1000))
        assert (await client.request(HOST, port, "PUT", "/echo", body=view)).body == bytes(view)
        assert peer.connections == 1


async def test_head_reads_no_body_and_keeps_the_connection():
    async with served() as (port, peer), HttpClient() as client:
        reply = await client.request(HOST, port, "HEAD", "/x")
        assert reply.status == 200 and reply.body == b""
        assert int(reply.header("Content-Length") or 0) > 0
        assert json.loads((await client.request(HOST, port, "GET", "/y")).body)["path"] == "/y"
        assert peer.connections == 1


# ------------------------------------------------------------------------------- framing


async def test_content_length_chunked_no_body_and_informational_responses_are_framed():
    answers = (
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\nx-a: 2\r\n\r\nhello",
        b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nTrailer-X: t\r\n\r\n",
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    )
    peer = Peer()
    async with listening(scripted(*answers, peer=peer)) as port, HttpClient() as client:
        first = await client.request(HOST, port, "GET", "/1")
        assert (first.status, first.body) == (200, b"hello")
        assert first.headers == ((b"Content-Length", b"5"), (b"X-A", b"1"), (b"x-a", b"2"))
        assert first.header("x-a") == "1" and first.header("missing") is None
        second = await client.request(HOST, port, "GET", "/2")
        assert (second.status, second.body) == (201, b"hello world")
        third = await client.request(HOST, port, "GET", "/3")
        assert (third.status, third.body) == (204, b"")
        fourth = await client.request(HOST, port, "GET", "/4")
        assert (fourth.status, fourth.body, fourth.headers) == (
            200,
            b"ok",
            ((b"Content-Length", b"2"),),
        )
        assert peer.connections == 1


async def test_a_body_split_over_many_writes_is_read_whole():
    async def handle(stream: anyio.abc.ByteStream) -> None:
        async with stream:
            await read_head(stream)
            # pauses between the writes make them separate segments for the client to join
            # (the reply does not depend on them); then the connection stays open a while
            await stream.send(b"HTTP/1.1 200 OK\r\nContent-")
            await anyio.sleep(0.01)
            await stream.send(b"Length: 10\r\n\r\n01234")
            await anyio.sleep(0.01)
            await stream.send(b"56789")
            await anyio.sleep(1)

    async with listening(handle) as port, HttpClient() as client:
        assert (await client.request(HOST, port, "GET", "/")).body == b"0123456789"


async def test_a_body_framed_by_the_end_of_the_connection_is_read_and_not_reused():
    peer = Peer()
    answer = b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end"
    async with listening(scripted(answer, then_close=True, peer=peer)) as port:
        async with HttpClient() as client:
            for _ in range(2):
                reply = await client.request(HOST, port, "GET", "/")
                assert (reply.status, reply.body) == (200, b"until the end")
            assert client.open_connections(HOST, port) == 0
    assert peer.connections == 2


async def test_connection_close_on_either_side_is_honoured():
    async with served() as (port, peer), HttpClient() as client:
        await client.request(HOST, port, "GET", "/", headers=[("connection", "close")])
        assert client.open_connections(HOST, port) == 0
        await client.request(HOST, port, "GET", "/")
        assert peer.connections == 2
    close = b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nConnection: close\r\n\r\nx"
    async with listening(scripted(close, then_close=True)) as port, HttpClient() as client:
        assert (await client.request(HOST, port, "GET", "/")).body == b"x"
        assert client.open_connections(HOST, port) == 0


# ------------------------------------------------------------------- closed connections, retry


async def test_a_server_closing_a_keep_alive_connection_between_requests_costs_nothing():
    closed = anyio.Event()
    peer = Peer()
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    async def handle(stream: anyio.abc.ByteStream) -> None:
        await scripted(answer, then_close=True, peer=peer)(stream)
        closed.set()  # keep-alive was promised, and the server closed anyway (an idle timeout)

    async with listening(handle) as port, HttpClient() as client:
        assert (await client.request(HOST, port, "GET", "/a")).body == b"ok"
        await closed.wait()
        await until(lambda: idle_and_stale(client, port), what="the FIN at the client's socket")
        assert (await client.request(HOST, port, "GET", "/b")).body == b"ok"
    assert peer.connections == 2
    assert [r.path for r in peer.requests] == ["/a", "/b"]


def idle_and_stale(client: HttpClient, port: int) -> bool:
    """Whether ``client``'s one idle connection to ``port`` has seen its server close or reset
    it (what the client's no-wait poll finds before it reuses a connection)."""
    (connection,) = client._hosts[(HOST, port)].idle
    return connection.stale()


def _reset(stream: anyio.abc.ByteStream) -> None:
    """Make the close of ``stream`` a TCP reset (SO_LINGER 0)."""
    raw = stream.extra(anyio.abc.SocketAttribute.raw_socket)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def test_a_server_resetting_a_keep_alive_connection_between_requests_costs_nothing():
    reset = anyio.Event()
    peer = Peer()
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    async def handle(stream: anyio.abc.ByteStream) -> None:
        first = peer.connections == 0
        if first:
            _reset(stream)
        await scripted(answer, then_close=first, peer=peer)(stream)
        if first:
            reset.set()

    async with listening(handle) as port, HttpClient() as client:
        await client.request(HOST, port, "GET", "/a")
        await reset.wait()
        await until(lambda: idle_and_stale(client, port), what="the RST at the client's socket")
        assert (await client.request(HOST, port, "GET", "/b")).body == b"ok"
    assert peer.connections == 2
    assert [r.path for r in peer.requests] == ["/a", "/b"]


class BrokenSend(anyio.abc.ByteStream):
    """A stream whose writes fail, as a connection the server reset just before the write
    (after the idle check) does where the write reports it."""

    def __init__(self, inner: anyio.abc.ByteStream) -> None:
        self.inner = inner

    async def send(self, item: bytes) -> None:
        raise anyio.BrokenResourceError

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def receive(self, max_bytes: int = 65536) -> bytes:
        return await self.inner.receive(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_reused_connection_that_breaks_before_the_request_is_written_is_retried_once():
    async with served() as (port, peer), HttpClient() as client:
        await client.request(HOST, port, "GET", "/a")
        (idle,) = client._hosts[(HOST, port)].idle
        idle.stream = BrokenSend(idle.stream)
        assert json.loads((await client.request(HOST, port, "GET", "/b")).body)["path"] == "/b"
        assert peer.connections == 2
        assert [r.path for r in peer.requests] == ["/a", "/b"]


async def test_a_new_connection_that_breaks_before_the_request_is_written_is_not_retried(
    monkeypatch,
):
    from kserve_trio.serving.http import _client

    opened: list[Connection] = []

    async def broken(*args) -> Connection:
        connection = await real(*args)
        connection.stream = BrokenSend(connection.stream)
        opened.append(connection)
        return connection

    real = _client.open_connection
    monkeypatch.setattr(_client, "open_connection", broken)
    async with served() as (port, peer), HttpClient() as client:
        with pytest.raises(HttpClientError, match="the connection broke sending"):
            await client.request(HOST, port, "GET", "/a")
        assert len(opened) == 1 and peer.requests == []
        assert client.open_connections(HOST, port) == 0


async def test_a_request_that_was_written_is_not_retried():
    peer = Peer()

    async def handle(stream: anyio.abc.ByteStream) -> None:
        peer.connections += 1
        async with stream:
            await read_head(stream)  # the request arrived; the server dies without answering

    async with listening(handle) as port, HttpClient() as client:
        with pytest.raises(HttpClientError, match="closed the connection before answering"):
            await client.request(HOST, port, "POST", "/infer", body=b"{}")
        assert peer.connections == 1
        assert client.open_connections(HOST, port) == 0


async def test_unreachable_malformed_truncated_and_oversized_answers_are_client_errors():
    async with HttpClient() as client:
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]  # bound, never listening: refused
            with pytest.raises(HttpClientError, match="cannot connect"):
                await client.request(HOST, port, "GET", "/")
    cases = [
        (b"SSH-2.0-OpenSSH\r\n\r\n", "no valid HTTP response"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "closed the connection inside"),
        (b"HTTP/1.1 200 OK\r\nContent-Len", "closed the connection inside"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 100, "over 64 bytes"),
    ]
    for answer, message in cases:
        async with listening(scripted(answer, then_close=True)) as port:
            async with HttpClient(max_body_bytes=64) as client:
                with pytest.raises(HttpClientError, match=message):
                    await client.request(HOST, port, "GET", "/")
                assert client.open_connections(HOST, port) == 0


# ------------------------------------------------------------------------ timeouts, the limit


async def test_a_timeout_closes_the_connection_and_the_next_request_works():
    async with served() as (port, peer), HttpClient() as client:
        start = anyio.current_time()
        with pytest.raises(TimeoutError, match=rf"no answer from {HOST}:{port} within 0\.2s"):
            await client.request(HOST, port, "GET", "/sleep?5", timeout=0.2)
        assert anyio.current_time() - start < 1.5
        assert client.open_connections(HOST, port) == 0
        reply = await client.request(HOST, port, "GET", "/sleep?0", timeout=5)
        assert reply.status == 200
        assert peer.connections == 2


async def test_at_most_per_host_connections_and_the_rest_wait_their_turn():
    inflight, peak, release = 0, 0, anyio.Event()

    async def blocking(request: HttpRequest) -> HttpResponse:
        nonlocal inflight, peak
        inflight += 1
        peak = max(peak, inflight)
        await release.wait()
        inflight -= 1
        return HttpResponse(200, request.path.encode())

    replies: list[bytes] = []
    async with served(blocking) as (port, peer), HttpClient(per_host=2) as client:

        async def one(i: int) -> None:
            replies.append((await client.request(HOST, port, "GET", f"/{i}", timeout=10)).body)

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(one, i)
            with anyio.fail_after(5):
                while inflight < 2:
                    await anyio.sleep(0.01)
            await anyio.sleep(0.1)  # an absence, looked for a while: no third connection opens
            assert inflight == 2 and client.open_connections(HOST, port) == 2
            # a seventh request finds no free connection within its timeout
            with pytest.raises(TimeoutError):
                await client.request(HOST, port, "GET", "/late", timeout=0.2)
            release.set()
        assert peak == 2 and peer.connections == 2
        assert sorted(replies) == sorted(f"/{i}".encode() for i in range(6))
        assert client.open_connections(HOST, port) == 2  # both kept, idle
    assert all(r.path != "/late" for r in peer.requests)


async def test_each_host_has_its_own_limit():
    async with served() as (a, _), served() as (b, _), HttpClient(per_host=1) as client:
        await client.request(HOST, a, "GET", "/")
        await client.request(HOST, b, "GET", "/")
        assert client.open_connections(HOST, a) == client.open_connections(HOST, b) == 1


async def test_an_idle_connection_past_its_age_is_closed_not_reused():
    async with served() as (port, peer), HttpClient(idle_seconds=0.05) as client:
        await client.request(HOST, port, "GET", "/")
        await anyio.sleep(0.1)  # real time past the 0.05 s idle age: the age is what is tested
        await client.request(HOST, port, "GET", "/")
        assert peer.connections == 2


async def test_a_closed_client_refuses_and_closes_its_connections():
    async with served() as (port, _):
        client = HttpClient()
        await client.request(HOST, port, "GET", "/")
        await client.aclose()
        assert client.open_connections(HOST, port) == 0
        with pytest.raises(HttpClientError, match="closed"):
            await client.request(HOST, port, "GET", "/")


# ------------------------------------------------------------------------------------ TLS


def _server_context(pki, cert: str = "server") -> ssl.SSLContext:  # noqa: F811
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(pki / f"{cert}.pem"), str(pki / f"{cert}.key"))
    return ctx


async def test_tls_checks_the_server_and_keeps_the_connection(pki):  # noqa: F811
    trusted = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    async with served(ssl_context=_server_context(pki)) as (port, peer):
        async with HttpClient(ssl_context=trusted) as client:
            for _ in range(3):
                assert (await client.request(HOST, port, "POST", "/echo", body=b"s")).body == b"s"
            assert peer.connections == 1
        async with HttpClient(ssl_context=ssl.create_default_context()) as client:
            with pytest.raises(HttpClientError, match="cannot connect"):
                await client.request(HOST, port, "GET", "/")
    async with served(ssl_context=_server_context(pki, "elsewhere")) as (port, _):
        async with HttpClient(ssl_context=trusted) as client:
            with pytest.raises(HttpClientError, match="cannot connect"):
                await client.request(HOST, port, "GET", "/")


# ------------------------------------------------------------------------------ pure parts


def test_the_request_head_is_the_clients_own_where_it_must_be():
    head, close = encode_request(
        "POST",
        "/v2/models/m/infer?x=1",
        "w:8000",
        [("Host", "evil"), ("content-length", "1"), ("x-trace", "t"), ("Connection", "close")],
        3,
    )
    assert head == (
        b"POST /v2/models/m/infer?x=1 HTTP/1.1\r\nhost: w:8000\r\ncontent-length: 3\r\n"
        b"x-trace: t\r\nConnection: close\r\n\r\n"
    )
    assert close
    for headers, target in (([("x", "a\r\nb: c")], "/"), ([("x\n", "a")], "/"), ([], "/ x")):
        with pytest.raises(ValueError, match="CR, LF or space"):
            encode_request("GET", target, "w:1", headers, None)

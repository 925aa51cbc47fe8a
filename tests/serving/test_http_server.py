"""serving.http on a real loopback server: keep-alive, the caps, 100-continue, HEAD, errors,
pipelining, and the admin endpoints on the same stack. Raw sockets are the client, so every
byte on the wire is what the test sent."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request

import anyio
import pytest

from kserve_trio.core.errors import NotFound
from kserve_trio.core.process.config import EdgeLimits
from kserve_trio.serving.admin_http import serve_http
from kserve_trio.serving.http import HttpRequest, HttpResponse, serve_app

CAP = 4096
IDLE = 1.0


async def app(request: HttpRequest) -> HttpResponse:
    if request.path == "/slow":
        await anyio.sleep(1.5)  # longer than the idle limit: a request in progress is never cut
    if request.path == "/boom":
        raise RuntimeError("kaboom")
    if request.path == "/missing":
        raise NotFound("model 'x' is not here")
    if request.path == "/big":
        return HttpResponse(200, [b"a" * 300_000, memoryview(b"b" * 400_000)], "text/plain")
    doc = {"method": request.method, "path": request.path, "query": request.query}
    doc["body"] = len(request.body)
    doc["te"] = request.headers.get("transfer-encoding", "")
    return HttpResponse(200, json.dumps(doc).encode())


class Server:
    """``serve_app`` (and the admin server) on a background thread's event loop."""

    def __init__(self) -> None:
        self.port = self.admin_port = 0
        self._ready = threading.Event()
        self._stop: anyio.Event | None = None
        self._token = None
        self._thread = threading.Thread(target=lambda: anyio.run(self._main), daemon=True)

    async def _main(self) -> None:
        self._stop = anyio.Event()
        self._token = anyio.lowlevel.current_token()
        async with anyio.create_task_group() as tg:
            self.port = await tg.start(
                lambda task_status: serve_app(
                    "127.0.0.1",
                    0,
                    app,
                    max_body_bytes=CAP,
                    limits=EdgeLimits(idle_seconds=IDLE),
                    task_status=task_status,
                )
            )
            self.admin_port = await tg.start(
                lambda task_status: serve_http(
                    "127.0.0.1",
                    0,
                    exposition=lambda: b"m 1\n",
                    ready=lambda: False,
                    task_status=task_status,
                )
            )
            self._ready.set()
            await self._stop.wait()
            tg.cancel_scope.cancel()

    def __enter__(self) -> Server:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        anyio.from_thread.run_sync(self._stop.set, token=self._token)
        self._thread.join(10)


@pytest.fixture(scope="module")
def server():
    with Server() as s:
        yield s


_BUFFERS: dict[int, bytes] = {}


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response from ``sock`` (by Content-Length); bytes after it wait for the next call."""
    buf = _BUFFERS.pop(id(sock), b"")
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise EOFError(f"closed after {buf!r}")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    length = int(headers.get("content-length", 0))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    _BUFFERS[id(sock)] = rest[length:]
    return status, headers, rest[:length]


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    _BUFFERS.pop(id(sock), None)
    return sock


def closed(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_keep_alive_serves_several_requests_on_one_connection(server):
    with connect(server.port) as sock:
        for i in range(3):
            sock.sendall(f"GET /x/{i}?q=1 HTTP/1.1\r\nHost: h\r\n\r\n".encode())
            status, headers, body = read_response(sock)
            assert status == 200 and headers["content-type"] == "application/json"
            assert json.loads(body) == {
                "method": "GET",
                "path": f"/x/{i}",
                "query": "q=1",
                "body": 0,
                "te": "",
            }
            assert "connection" not in headers


def test_pipelined_requests_are_answered_in_order(server):
    with connect(server.port) as sock:
        body = b"z" * 10
        one = b"POST /a HTTP/1.1\r\nHost: h\r\nContent-Length: 10\r\n\r\n" + body
        sock.sendall(one + b"GET /b HTTP/1.1\r\nHost: h\r\n\r\n" + one.replace(b"/a", b"/c"))
        paths = [json.loads(read_response(sock)[2])["path"] for _ in range(3)]
        assert paths == ["/a", "/b", "/c"]


def test_connection_close_and_http10_close_after_the_reply(server):
    with connect(server.port) as sock:
        sock.sendall(b"GET /x HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
        status, headers, _ = read_response(sock)
        assert status == 200 and headers["connection"] == "close"
        assert closed(sock)
    with connect(server.port) as sock:
        sock.sendall(b"GET /x HTTP/1.0\r\n\r\n")
        assert read_response(sock)[0] == 200
        assert closed(sock)


def test_a_body_over_the_cap_is_refused_before_it_is_read(server):
    with connect(server.port) as sock:
        sock.sendall(b"POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: 5000\r\n\r\n")
        status, headers, body = read_response(sock)
        assert status == 413
        assert json.loads(body) == {"error": "received message larger than max (5000 vs. 4096)"}
        assert headers["connection"] == "close" and closed(sock)
    # a chunked body is counted as it arrives
    with connect(server.port) as sock:
        chunk = b"y" * 3000
        sock.sendall(
            b"POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n%s\r\n" % (len(chunk), chunk) * 2
            + b"0\r\n\r\n"
        )
        status, _, body = read_response(sock)
        assert status == 413 and "larger than max (6000 vs. 4096)" in json.loads(body)["error"]
    # within the cap, chunked works and the server kept serving
    with connect(server.port) as sock:
        sock.sendall(
            b"POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
        )
        status, _, body = read_response(sock)
        assert status == 200 and json.loads(body)["body"] == 11


def test_a_client_that_sends_the_whole_oversized_body_still_reads_the_answer(server):
    body = b"q" * 2_000_000  # far past the socket buffers: the server must read and drop it
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}/x", data=body, method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 413
    assert json.loads(err.value.read()) == {
        "error": "received message larger than max (2000000 vs. 4096)"
    }


def test_expect_100_continue_is_answered_before_the_body(server):
    with connect(server.port) as sock:
        sock.sendall(
            b"POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n"
        )
        assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(b"abcd")
        status, _, body = read_response(sock)
        assert status == 200 and json.loads(body)["body"] == 4


def test_head_has_the_headers_and_no_body(server):
    with connect(server.port) as sock:
        sock.sendall(b"HEAD /x HTTP/1.1\r\nHost: h\r\n\r\n")
        sock.settimeout(5)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(1000)
        head, _, rest = data.partition(b"\r\n\r\n")
        assert int(head.split(b"content-length: ")[1].split(b"\r\n")[0]) > 0
        assert rest == b""
        sock.sendall(b"GET /after HTTP/1.1\r\nHost: h\r\n\r\n")  # the connection still works
        assert json.loads(read_response(sock)[2])["path"] == "/after"


def test_errors_are_json_and_the_server_keeps_serving(server):
    with connect(server.port) as sock:
        sock.sendall(b"GET /boom HTTP/1.1\r\nHost: h\r\n\r\n")
        status, _, body = read_response(sock)
        assert status == 500 and json.loads(body) == {
            "error": "internal error: RuntimeError('kaboom')"
        }
        sock.sendall(b"GET /missing HTTP/1.1\r\nHost: h\r\n\r\n")
        status, _, body = read_response(sock)
        assert status == 404 and json.loads(body) == {"error": "model 'x' is not here"}
    with connect(server.port) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        status, _, body = read_response(sock)
        assert status == 400 and json.loads(body)["error"].startswith("malformed HTTP request")
        assert closed(sock)
    with connect(server.port) as sock:
        sock.sendall(b"GET /x HTTP/1.1\r\nHost: h\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n")
        assert read_response(sock)[0] == 431
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/still") as r:
        assert json.loads(r.read())["path"] == "/still"


def test_a_large_reply_arrives_whole_from_its_pieces(server):
    with connect(server.port) as sock:
        sock.sendall(b"GET /big HTTP/1.1\r\nHost: h\r\n\r\n")
        status, headers, body = read_response(sock)
        assert status == 200 and int(headers["content-length"]) == 700_000
        assert body == b"a" * 300_000 + b"b" * 400_000


def test_admin_endpoints_run_on_the_same_stack(server):
    base = f"http://127.0.0.1:{server.admin_port}"
    with urllib.request.urlopen(base + "/metrics") as r:
        assert r.status == 200 and r.read() == b"m 1\n"
    with urllib.request.urlopen(base + "/healthz") as r:
        assert r.read() == b"ok"
    for path, status in (("/readyz", 503), ("/nope", 404)):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base + path)
        assert err.value.code == status
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(urllib.request.Request(base + "/metrics", data=b"x"))
    assert err.value.code == 405
    with connect(server.admin_port) as sock:  # scrapers may keep the connection
        for _ in range(2):
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: h\r\n\r\n")
            assert read_response(sock)[2] == b"ok"


def test_an_idle_connection_does_not_block_others(server):
    idle = connect(server.port)
    try:
        t0 = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/x") as r:
            assert r.status == 200
        assert time.monotonic() - t0 < 5
    finally:
        idle.close()


def test_a_connection_waiting_for_bytes_past_the_idle_limit_is_closed(server):
    t0 = time.monotonic()
    with connect(server.port) as idle, connect(server.port) as stalled:
        stalled.sendall(b"GET /x HTTP/1.1\r\nHost: h\r\n")  # a head that never ends
        assert closed(idle) and closed(stalled)
    assert IDLE <= time.monotonic() - t0 < IDLE * 10  # at the limit, not long before
    with connect(server.port) as sock:  # a slow answer is not cut, and keep-alive goes on
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: h\r\n\r\n")
        assert read_response(sock)[0] == 200
        sock.sendall(b"GET /after-slow HTTP/1.1\r\nHost: h\r\n\r\n")
        assert json.loads(read_response(sock)[2])["path"] == "/after-slow"

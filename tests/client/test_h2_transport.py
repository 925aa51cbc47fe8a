"""The client transport: its pure per-call half, then real calls on asyncio and trio, on both
HTTP/2 engines, against a test gRPC server (small windows, so large messages wait for
WINDOW_UPDATE both ways) and a scripted raw HTTP/2 server (replies a gRPC server never sends:
HTTP errors, compressed messages, GOAWAY, REFUSED_STREAM, a one-stream limit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import anyio
import anyio.abc
import h2.errors
import h2.settings
import pytest

from kserve_trio.client.errors import RpcError
from kserve_trio.client.h2_transport import H2Transport, _Call
from kserve_trio.client.transport import Endpoint
from kserve_trio.core.errors import StatusCode
from kserve_trio.core.protocol import compression
from kserve_trio.http2 import ENGINES
from tests.client.echo_server import (
    GRPC_OK_HEADERS,
    EchoServer,
    Raw,
    ScriptedH2Server,
    goaway_frame,
    grpc_frame,
    ok_reply,
)
from tests.waiting import until, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def when_in_flight(t: H2Transport, action: Callable[[], object]) -> threading.Thread:
    """Run ``action`` on a thread once ``t`` has a call in flight on its connection (a fixed
    delay can fire before the call has started, on a loaded machine)."""

    def run() -> None:
        wait_until(lambda: t._conn is not None and t._conn.calls, what="a call in flight")
        action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture(autouse=True, params=ENGINES)
def http2_engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every transport test on each HTTP/2 engine (an endpoint takes the engine the
    environment names)."""
    monkeypatch.setenv("KSERVE_TRIO_CLIENT_HTTP2_ENGINE", request.param)
    return request.param


ECHO = "/test.Echo/Echo"


# --------------------------------------------------------------------------------------------
# Pure pieces


def _finished(*events, cap=1 << 20) -> _Call:
    call = _Call("Echo", cap)
    for kind, value in events:
        if kind == "headers":
            call.headers(value)
        elif kind == "data":
            assert call.data(value)
        elif kind == "reset":
            call.reset_code = value
    call.done = True
    return call


def _raises(call: _Call) -> RpcError:
    with pytest.raises(RpcError) as info:
        call.message("h:1")
    return info.value


def test_call_assembles_a_message_split_over_frames():
    body = bytes(range(200))
    frame = grpc_frame(body)
    call = _finished(
        ("headers", GRPC_OK_HEADERS),
        ("data", frame[:3]),
        ("data", frame[3:50]),
        ("data", frame[50:]),
        ("headers", [(b"grpc-status", b"0")]),
    )
    assert call.message("h:1") == body
    single = _finished(
        ("headers", GRPC_OK_HEADERS), ("data", frame), ("headers", [(b"grpc-status", b"0")])
    )
    assert single.message("h:1") == body


def test_call_with_a_trailers_only_error_raises_the_server_status():
    call = _finished(
        (
            "headers",
            [
                *GRPC_OK_HEADERS,
                (b"grpc-status", b"5"),
                (b"grpc-message", b"model %27m%27 not found"),
            ],
        )
    )
    err = _raises(call)
    assert err.status is StatusCode.NOT_FOUND
    assert err.message == "model 'm' not found"
    assert err.method == "Echo"


def test_call_without_grpc_status_maps_the_http_status():
    err = _raises(_finished(("headers", [(b":status", b"503")])))
    assert (err.status, err.message) == (StatusCode.UNAVAILABLE, "HTTP status 503 from h:1")
    err = _raises(_finished(("headers", GRPC_OK_HEADERS)))
    assert (err.status, err.message) == (
        StatusCode.UNKNOWN,
        "the reply from h:1 has no grpc-status",
    )


def test_call_reset_by_the_server():
    err = _raises(_finished(("reset", h2.errors.ErrorCodes.INTERNAL_ERROR)))
    assert (err.status, err.message) == (
        StatusCode.INTERNAL,
        "stream reset by h:1 (INTERNAL_ERROR)",
    )


def test_call_with_an_unknown_status_number_is_unknown():
    err = _raises(_finished(("headers", [*GRPC_OK_HEADERS, (b"grpc-status", b"99")])))
    assert err.status is StatusCode.UNKNOWN


def test_call_ok_without_a_message_is_internal():
    err = _raises(_finished(("headers", [*GRPC_OK_HEADERS, (b"grpc-status", b"0")])))
    assert (err.status, err.message) == (StatusCode.INTERNAL, "the server sent no reply message")


def test_call_truncated_message_is_unavailable():
    call = _finished(
        ("headers", GRPC_OK_HEADERS),
        ("data", grpc_frame(b"abcdef")[:8]),
        ("headers", [(b"grpc-status", b"0")]),
    )
    err = _raises(call)
    assert (err.status, err.message) == (StatusCode.UNAVAILABLE, "truncated reply (3 of 6 bytes)")


def test_call_refuses_a_reply_over_the_cap_from_its_length_prefix():
    call = _Call("Echo", 10)
    assert call.data(grpc_frame(b"x" * 11)[:5]) is False  # refused before the payload arrives
    err = _raises(call)
    assert (err.status, err.message) == (
        StatusCode.RESOURCE_EXHAUSTED,
        "received message larger than max (11 vs. 10)",
    )
    assert err.retryable is False


def test_call_refuses_a_bad_flag_and_second_messages():
    call = _Call("Echo", 100)
    assert call.data(b"\x02" + grpc_frame(b"abc")[1:]) is False
    err = _raises(call)
    assert (err.status, err.message) == (StatusCode.INTERNAL, "malformed reply: compressed flag 2")
    call = _Call("Echo", 100)
    assert call.data(grpc_frame(b"abc") + grpc_frame(b"d")) is False
    err = _raises(call)
    assert err.status is StatusCode.INTERNAL
    assert err.message == "the server sent more than one reply message for a unary call"


# --------------------------------------------------------------------------------------------
# Against a grpclib server


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.fixture(scope="module")
def echo():
    with EchoServer() as server:
        yield server


def transport(port: int, **caps) -> H2Transport:
    return H2Transport(Endpoint("127.0.0.1", port, **caps))


@pytest.mark.anyio
async def test_unary_round_trips_small_and_empty_messages(echo):
    async with transport(echo.port) as t:
        assert await t.unary(ECHO, b"hello", Raw, timeout=5) == b"hello"
        assert await t.unary(ECHO, b"", Raw, timeout=5) == b""
        assert await t.unary("/test.Echo/Empty", b"x", Raw) == b""


@pytest.mark.anyio
async def test_metadata_and_deadline_reach_the_server(echo):
    async with transport(echo.port) as t:
        started = time.monotonic()
        reply = await t.unary(
            "/test.Echo/Metadata", b"", Raw, timeout=20.5, metadata={"X-Request-Tag": "abc"}
        )
        took = time.monotonic() - started
        seen = json.loads(reply)
        assert seen["metadata"]["x-request-tag"] == "abc"
        assert 20.5 - took <= seen["deadline"] <= 20.5  # short only by the call's own time
        reply = await t.unary("/test.Echo/Metadata", b"", Raw)
        assert json.loads(reply)["deadline"] is None


@pytest.mark.anyio
async def test_server_status_and_percent_encoded_message_come_back(echo):
    text = "model 'é' says 100% no"
    async with transport(echo.port) as t:
        with pytest.raises(RpcError) as info:
            await t.unary(
                ECHO,
                b"x",
                Raw,
                metadata={"x-status": "9", "x-message-bin": text.encode()},
            )
    assert info.value.status is StatusCode.FAILED_PRECONDITION
    assert info.value.message == text
    assert str(info.value) == f"FAILED_PRECONDITION (Echo): {text}"


@pytest.mark.anyio
async def test_deadline_exceeded_resets_the_stream_and_keeps_the_connection(echo):
    before, calls_before = echo.service.cancelled, echo.service.calls
    async with transport(echo.port) as t:
        started = time.monotonic()
        with pytest.raises(RpcError) as info:
            await t.unary(ECHO, b"x", Raw, timeout=0.2, metadata={"x-sleep": "60"})
        assert time.monotonic() - started < 30  # the deadline ended it, not the 60 s handler
        assert info.value.status is StatusCode.DEADLINE_EXCEEDED
        assert info.value.message == (
            f"deadline of 0.200s exceeded calling Echo on 127.0.0.1:{echo.port}"
        )
        conn = t._conn
        assert await t.unary(ECHO, b"after", Raw, timeout=5) == b"after"
        assert t._conn is conn
    # the late call's handler, if the server started it before the reset came (a loaded
    # machine may not have), is cancelled: none is left running
    started_late = echo.service.calls - calls_before - 1
    await until(lambda: echo.service.cancelled - before == started_late, what="handler cancelled")


@pytest.mark.anyio
async def test_a_non_positive_timeout_fails_before_sending(echo):
    calls = echo.service.calls
    async with transport(echo.port) as t:
        with pytest.raises(RpcError) as info:
            await t.unary(ECHO, b"x", Raw, timeout=0)
    assert info.value.status is StatusCode.DEADLINE_EXCEEDED
    assert info.value.message == f"deadline exceeded before Echo was sent to 127.0.0.1:{echo.port}"
    assert echo.service.calls == calls


@pytest.mark.anyio
async def test_outer_cancellation_resets_the_stream(echo):
    before, calls_before = echo.service.cancelled, echo.service.calls
    async with transport(echo.port) as t:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: t.unary(ECHO, b"x", Raw, metadata={"x-sleep": "60"}))
            await until(lambda: echo.service.calls > calls_before, what="the call on the server")
            tg.cancel_scope.cancel()
        assert await t.unary(ECHO, b"next", Raw, timeout=5) == b"next"
    await until(lambda: echo.service.cancelled > before, what="the server's handler cancelled")


@pytest.mark.anyio
async def test_large_messages_cross_small_server_windows_both_ways(echo):
    big = os.urandom(20 << 20)  # 5x grpclib's 4 MiB window
    async with transport(echo.port) as t:
        assert await t.unary(ECHO, big, Raw, timeout=60) == big
        reply = await t.unary(ECHO, b"", Raw, timeout=60, metadata={"x-reply-bytes": str(9 << 20)})
        assert len(reply) == 9 << 20
        assert reply[:256] == bytes(range(256))


@pytest.mark.anyio
async def test_concurrent_calls_share_one_connection(echo):
    results: dict[int, bytes] = {}
    async with transport(echo.port) as t:

        async def one(i: int) -> None:
            payload = bytes([i]) * (1 + i * 997)
            results[i] = await t.unary(ECHO, payload, Raw, timeout=30)

        async with anyio.create_task_group() as tg:
            for i in range(64):
                tg.start_soon(one, i)
        conn = t._conn
    assert all(results[i] == bytes([i]) * (1 + i * 997) for i in range(64))
    assert conn is not None and not conn.calls


@pytest.mark.anyio
async def test_send_cap_refuses_before_sending(echo):
    calls = echo.service.calls
    async with transport(echo.port, max_send_message_length=100) as t:
        with pytest.raises(RpcError) as info:
            await t.unary(ECHO, b"x" * 101, Raw)
    assert info.value.status is StatusCode.RESOURCE_EXHAUSTED
    assert info.value.message == "sent message larger than max (101 vs. 100)"
    assert info.value.retryable is False
    assert echo.service.calls == calls


@pytest.mark.anyio
async def test_receive_cap_refuses_the_reply_and_keeps_the_connection(echo):
    async with transport(echo.port, max_receive_message_length=1000) as t:
        with pytest.raises(RpcError) as info:
            await t.unary(ECHO, b"", Raw, metadata={"x-reply-bytes": str(5 << 20)})
        assert info.value.status is StatusCode.RESOURCE_EXHAUSTED
        assert info.value.message == f"received message larger than max ({5 << 20} vs. 1000)"
        assert await t.unary(ECHO, b"ok", Raw, timeout=5) == b"ok"


@pytest.mark.anyio
async def test_unparsable_reply_is_internal(echo):
    class Strict:
        @classmethod
        def FromString(cls, data):
            raise ValueError("not a message")

    async with transport(echo.port) as t:
        with pytest.raises(RpcError) as info:
            await t.unary(ECHO, b"x", Strict)
    assert (info.value.status, info.value.message) == (
        StatusCode.INTERNAL,
        "cannot parse the Echo reply: not a message",
    )


@pytest.mark.anyio
async def test_nothing_listening_is_unavailable():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with transport(port) as t:
        with pytest.raises(RpcError) as info:
            await t.unary(ECHO, b"x", Raw, timeout=5)
    assert info.value.status is StatusCode.UNAVAILABLE
    assert info.value.message.startswith(f"cannot reach 127.0.0.1:{port}: ")


@pytest.mark.anyio
async def test_close_from_another_thread_fails_the_call_in_flight(echo):
    async with transport(echo.port) as t:
        assert await t.unary(ECHO, b"warm", Raw) == b"warm"
        closer = when_in_flight(t, t.close)
        started = time.monotonic()
        with pytest.raises(RpcError) as info:
            await t.unary(ECHO, b"x", Raw, timeout=60, metadata={"x-sleep": "60"})
        closer.join()
        assert time.monotonic() - started < 30  # the close ended it, not the 60 s handler
        assert info.value.status is StatusCode.UNAVAILABLE
        assert await t.unary(ECHO, b"reconnected", Raw, timeout=5) == b"reconnected"


# --------------------------------------------------------------------------------------------
# A server process that dies and comes back


def _spawn(port: int = 0) -> tuple[subprocess.Popen, int]:
    code = (
        "import sys, time\n"
        "from tests.client.echo_server import EchoServer\n"
        f"s = EchoServer(port={port}).start()\n"
        "print(s.port, flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline()
    assert line.strip(), "the echo server process did not start"
    return proc, int(line)


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(10)


@pytest.mark.anyio
async def test_a_restarted_server_is_reached_again_without_an_error():
    proc, port = _spawn()
    try:
        async with transport(port) as t:
            assert await t.unary(ECHO, b"one", Raw, timeout=5) == b"one"
            _kill(proc)
            with pytest.raises(RpcError) as info:
                await t.unary(ECHO, b"two", Raw, timeout=5)
            assert info.value.status is StatusCode.UNAVAILABLE
            assert info.value.message.startswith(f"cannot reach 127.0.0.1:{port}")
            proc, _ = _spawn(port)
            assert await t.unary(ECHO, b"three", Raw, timeout=5) == b"three"
            _kill(proc)
            proc, _ = _spawn(port)
            # the idle connection's EOF is noticed before the next call uses it
            assert await t.unary(ECHO, b"four", Raw, timeout=5) == b"four"
    finally:
        _kill(proc)


@pytest.mark.anyio
async def test_a_server_dying_mid_call_is_unavailable():
    proc, port = _spawn()
    try:
        async with transport(port) as t:
            assert await t.unary(ECHO, b"warm", Raw, timeout=5) == b"warm"
            when_in_flight(t, proc.kill)
            with pytest.raises(RpcError) as info:
                await t.unary(ECHO, b"x", Raw, timeout=60, metadata={"x-sleep": "60"})
            assert info.value.status is StatusCode.UNAVAILABLE
            assert info.value.message in (
                f"connection to 127.0.0.1:{port} was closed by the server",
                f"connection to 127.0.0.1:{port} lost: [Errno 104] Connection reset by peer",
            )
    finally:
        _kill(proc)


# --------------------------------------------------------------------------------------------
# Against the scripted raw HTTP/2 server


@pytest.mark.anyio
async def test_http_error_without_grpc_status_is_mapped():
    reply = ("reply", [(b":status", b"503")], b"", None)
    with ScriptedH2Server(lambda *a: reply) as server:
        async with transport(server.port) as t:
            with pytest.raises(RpcError) as info:
                await t.unary(ECHO, b"x", Raw, timeout=5)
    assert info.value.status is StatusCode.UNAVAILABLE
    assert info.value.message == f"HTTP status 503 from 127.0.0.1:{server.port}"


@pytest.mark.anyio
@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
async def test_compressed_replies_are_decompressed(algorithm):
    packed = compression.compress(b"z" * 1000, algorithm)
    headers = [*GRPC_OK_HEADERS, (b"grpc-encoding", algorithm.encode())]
    reply = ("reply", headers, grpc_frame(packed, compressed=True), [(b"grpc-status", b"0")])
    with ScriptedH2Server(lambda *a: reply) as server:
        async with transport(server.port) as t:
            assert await t.unary(ECHO, b"x", Raw, timeout=5) == b"z" * 1000


@pytest.mark.anyio
async def test_a_compressed_reply_without_an_algorithm_or_over_the_cap_is_refused():
    bomb = compression.compress(bytes(4096), "gzip")
    cases = [
        (
            GRPC_OK_HEADERS,
            grpc_frame(b"z", compressed=True),
            (StatusCode.INTERNAL, "the reply is flagged compressed but names no grpc-encoding"),
        ),
        (
            [*GRPC_OK_HEADERS, (b"grpc-encoding", b"gzip")],
            grpc_frame(b"not gzip", compressed=True),
            (StatusCode.INTERNAL, None),
        ),
        (
            [*GRPC_OK_HEADERS, (b"grpc-encoding", b"gzip")],
            grpc_frame(bomb, compressed=True),
            (
                StatusCode.RESOURCE_EXHAUSTED,
                "received message larger than max (more than 1024 vs. 1024)",
            ),
        ),
    ]
    for headers, data, (status, message) in cases:
        reply = ("reply", headers, data, [(b"grpc-status", b"0")])
        with ScriptedH2Server(lambda *a, reply=reply: reply) as server:
            async with transport(server.port, max_receive_message_length=1024) as t:
                with pytest.raises(RpcError) as info:
                    await t.unary(ECHO, b"x", Raw, timeout=5)
        assert info.value.status is status
        assert info.value.retryable is False
        if message is not None:
            assert info.value.message == message
        else:
            assert info.value.message.startswith("cannot decompress the gzip message")


@pytest.mark.anyio
@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
async def test_an_endpoint_with_compression_sends_compressed_requests(algorithm):
    seen: list[bytes] = []

    def script(conn_index, request_index, stream_id, body):
        seen.append(body)
        return ok_reply(b"ok")

    message = b"abc" * 500
    with ScriptedH2Server(script) as server:
        endpoint = Endpoint("127.0.0.1", server.port, compression=algorithm)
        async with H2Transport(endpoint) as t:
            assert await t.unary(ECHO, message, Raw, timeout=5) == b"ok"
        async with transport(server.port) as plain:
            assert await plain.unary(ECHO, message, Raw, timeout=5) == b"ok"
    (packed_body, plain_body) = seen
    assert packed_body[0] == 1 and int.from_bytes(packed_body[1:5], "big") == len(packed_body) - 5
    assert bytes(compression.decompress(packed_body[5:], algorithm, 1 << 20)) == message
    assert len(packed_body) < len(message)
    first, second = server.request_headers
    assert first[b"grpc-encoding"] == algorithm.encode()
    assert first[b"grpc-accept-encoding"] == b"identity,deflate,gzip"
    assert plain_body == grpc_frame(message)
    assert b"grpc-encoding" not in second and b"grpc-accept-encoding" not in second


def test_an_unknown_compression_is_refused():
    with pytest.raises(ValueError, match="compression must be None, 'gzip' or 'deflate', got 'br'"):
        Endpoint("h", 1, compression="br")


@pytest.mark.anyio
async def test_goaway_before_processing_is_retried_on_a_fresh_connection():
    def script(conn_index, request_index, stream_id, body):
        return ("goaway", 0) if conn_index == 0 else ok_reply(body[5:])

    with ScriptedH2Server(script) as server:
        async with transport(server.port) as t:
            assert await t.unary(ECHO, b"payload", Raw, timeout=5) == b"payload"
    assert server.connections == 2


class _GatedStream(anyio.abc.ByteStream):
    """A client connection's byte stream whose next ``receive`` can be held at a gate, so a
    test decides what another task does while one task is the connection's reader."""

    def __init__(self, inner: anyio.abc.ByteStream) -> None:
        self.inner = inner
        self.gate: anyio.Event | None = None
        self.entered = anyio.Event()

    async def receive(self, max_bytes: int = 65536) -> bytes:
        gate, self.gate = self.gate, None
        if gate is not None:
            self.entered.set()
            await gate.wait()
        return await self.inner.receive(max_bytes)

    async def send(self, item: bytes) -> None:
        await self.inner.send(item)

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()

    @property
    def extra_attributes(self):
        return self.inner.extra_attributes


@pytest.mark.anyio
async def test_a_call_joining_while_an_idle_goaway_is_read_is_still_answered(monkeypatch):
    """The server says GOAWAY on an idle connection. The next call reads it (``catch_up``);
    a second call that joined the connection meanwhile (it saw someone reading and waits to be
    woken) must still get its reply after the first has moved to a fresh connection. (Before
    the fix it waited until its deadline: found as a hung call when a worker restarted under a
    streaming client on trio, where a receive that has data still yields to other tasks.)"""
    goaway_now = threading.Event()
    second_sent = threading.Event()
    moved_on = threading.Event()

    def idle_goaway(sock):
        goaway_now.wait(10)
        sock.sendall(goaway_frame((1 << 31) - 1))  # no new streams; the open ones may finish

    def script(conn_index, request_index, stream_id, body):
        if conn_index == 0 and stream_id == 1:
            return (*ok_reply(body[5:]), idle_goaway)
        if conn_index == 0:  # the joiner's call: answered only once the first call moved on
            second_sent.set()
            moved_on.wait(10)
        else:
            moved_on.set()
        return ok_reply(body[5:])

    streams: list[_GatedStream] = []
    connect = anyio.connect_tcp

    async def gated_connect(*args, **kwargs):
        streams.append(_GatedStream(await connect(*args, **kwargs)))
        return streams[-1]

    monkeypatch.setattr(anyio, "connect_tcp", gated_connect)
    with ScriptedH2Server(script) as server:
        async with transport(server.port) as t:
            with anyio.fail_after(20):
                assert await t.unary(ECHO, b"one", Raw, timeout=15) == b"one"
                conn = t._conn
                assert conn is not None
                goaway_now.set()
                while not conn.peek_idle():  # the GOAWAY has arrived, unread
                    await anyio.sleep(0.005)
                gate = streams[0].gate = anyio.Event()
                results: dict[str, bytes] = {}

                async def call(name: str) -> None:
                    results[name] = await t.unary(ECHO, name.encode(), Raw, timeout=15)

                async def join_then_open_the_gate() -> None:
                    await streams[0].entered.wait()  # the first call is reading the GOAWAY
                    tg.start_soon(call, "joiner")
                    await anyio.to_thread.run_sync(second_sent.wait, 10)
                    gate.set()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(call, "first")
                    tg.start_soon(join_then_open_the_gate)
    assert results == {"first": b"first", "joiner": b"joiner"}
    assert server.connections == 2


@pytest.mark.anyio
async def test_refused_stream_is_retried_once_then_reported():
    def refuse_first(conn_index, request_index, stream_id, body):
        if request_index == 0:
            return ("reset", h2.errors.ErrorCodes.REFUSED_STREAM)
        return ok_reply(body[5:])

    with ScriptedH2Server(refuse_first) as server:
        async with transport(server.port) as t:
            assert await t.unary(ECHO, b"again", Raw, timeout=5) == b"again"
    assert server.requests == 2

    def always(*args):
        return ("reset", h2.errors.ErrorCodes.REFUSED_STREAM)

    with ScriptedH2Server(always) as server:
        async with transport(server.port) as t:
            with pytest.raises(RpcError) as info:
                await t.unary(ECHO, b"x", Raw, timeout=5)
    assert info.value.status is StatusCode.UNAVAILABLE
    assert info.value.message == f"stream reset by 127.0.0.1:{server.port} (REFUSED_STREAM)"
    assert server.requests == 2


@pytest.mark.anyio
async def test_the_peers_stream_limit_is_respected():
    def slow(c, r, s, body):
        time.sleep(0.02)  # widens the window in which a second stream would overlap the first
        return ok_reply(body[5:])

    settings = {h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 1}
    with ScriptedH2Server(slow, settings) as server:
        async with transport(server.port) as t:
            await t.unary(ECHO, b"warm", Raw, timeout=5)  # the server's SETTINGS arrive
            results = []

            async def one(i):
                results.append(await t.unary(ECHO, str(i).encode(), Raw, timeout=10))

            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(one, i)
    assert sorted(results) == [str(i).encode() for i in range(6)]
    assert server.max_open == 1


# --------------------------------------------------------------------------------------------
# One vocabulary: every failure is an RpcError with its status, message and method


def test_failures_report_their_status_and_message(echo):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]

    class Strict:
        @classmethod
        def FromString(cls, data):
            raise ValueError("not a message")

    async def outcomes() -> list:
        seen = []

        async def record(port, call, **caps):
            t = H2Transport(Endpoint("127.0.0.1", port, **caps))
            try:
                await call(t)
                seen.append(None)
            except RpcError as exc:
                seen.append((exc.status, exc.message, exc.method))
            finally:
                await t.aclose()

        meta = {"x-status": "5", "x-message": "model 'm' 100% missing"}
        await record(echo.port, lambda t: t.unary(ECHO, b"x", Raw, metadata=meta))
        slow = {"x-sleep": "60"}
        await record(echo.port, lambda t: t.unary(ECHO, b"x", Raw, timeout=0.2, metadata=slow))
        await record(echo.port, lambda t: t.unary(ECHO, b"x", Raw, timeout=0))
        await record(echo.port, lambda t: t.unary(ECHO, b"x" * 11, Raw), max_send_message_length=10)
        big = {"x-reply-bytes": "4096"}
        await record(
            echo.port,
            lambda t: t.unary(ECHO, b"", Raw, metadata=big),
            max_receive_message_length=100,
        )
        await record(echo.port, lambda t: t.unary(ECHO, b"x", Strict))
        await record(echo.port, lambda t: t.unary(ECHO, b"ok", Raw))
        return seen

    addr = f"127.0.0.1:{echo.port}"
    assert anyio.run(outcomes, backend="asyncio") == [
        (StatusCode.NOT_FOUND, "model 'm' 100% missing", "Echo"),
        (
            StatusCode.DEADLINE_EXCEEDED,
            f"deadline of 0.200s exceeded calling Echo on {addr}",
            "Echo",
        ),
        (StatusCode.DEADLINE_EXCEEDED, f"deadline exceeded before Echo was sent to {addr}", "Echo"),
        (StatusCode.RESOURCE_EXHAUSTED, "sent message larger than max (11 vs. 10)", "Echo"),
        (StatusCode.RESOURCE_EXHAUSTED, "received message larger than max (4096 vs. 100)", "Echo"),
        (StatusCode.INTERNAL, "cannot parse the Echo reply: not a message", "Echo"),
        None,
    ]

    async def unreachable():
        t = H2Transport(Endpoint("127.0.0.1", closed_port))
        with pytest.raises(RpcError) as info:
            await t.unary(ECHO, b"x", Raw, timeout=5)
        await t.aclose()
        return info.value.status, info.value.message.split(":")[0]

    assert anyio.run(unreachable) == (StatusCode.UNAVAILABLE, "cannot reach 127.0.0.1")


def test_close_from_another_thread_on_uvloop(echo):
    """uvloop's transport socket has no shutdown(): ``close`` still ends the connection."""

    async def main():
        async with transport(echo.port) as t:
            assert await t.unary(ECHO, b"warm", Raw) == b"warm"
            closer = when_in_flight(t, t.close)
            with pytest.raises(RpcError) as info:
                await t.unary(ECHO, b"x", Raw, timeout=60, metadata={"x-sleep": "60"})
            closer.join()
            assert info.value.status is StatusCode.UNAVAILABLE
            assert await t.unary(ECHO, b"again", Raw, timeout=5) == b"again"

    started = time.monotonic()
    anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
    assert time.monotonic() - started < 30  # the close ended it, not the 60 s handler


# --------------------------------------------------------------------------------------------
# Transport selection


@pytest.mark.anyio
async def test_default_transport_is_h2_on_both_loops(anyio_backend):
    from kserve_trio.client.transport import default_transport_factory

    assert isinstance(default_transport_factory(Endpoint("h", 1)), H2Transport)

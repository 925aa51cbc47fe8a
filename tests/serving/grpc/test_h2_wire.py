"""``GrpcServer`` driven frame by frame by a raw ``h2`` client (``h2_peer.Peer``), on asyncio
and trio: how requests may arrive (split into tiny writes, large frames), flow control both
ways, client resets before and during the reply, the two-phase GOAWAY of a shutdown and of the
maximum connection age, keepalive, PING, protocol errors the server must survive, and the
statuses a call can end with (deadline, handler errors, unknown path, caps, compression).

Every test is bounded by ``anyio.fail_after``; where the server's timers are involved the
settings are small and the bounds generous, and nothing asserts that anything was quick.
"""

from __future__ import annotations

import dataclasses
import gzip
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import h2.settings
import pytest
from h2.errors import ErrorCodes
from hyperframe.frame import GoAwayFrame, HeadersFrame, PingFrame, RstStreamFrame

from kserve_trio.core.errors import NotFound, StatusCode
from kserve_trio.serving.grpc import (
    MAX_FRAME_BYTES,
    Call,
    GrpcError,
    GrpcServer,
    Limits,
    Method,
    RawMessage,
    ServerSettings,
    raw_unary,
    stream,
)
from tests.serving.grpc.h2_peer import MAX_STREAM_ID, Peer, grpc_frame
from tests.waiting import until  # server state the client cannot read off the wire

pytestmark = pytest.mark.anyio

LIMITS = Limits(max_recv_bytes=8 << 20, max_send_bytes=8 << 20)
CAPPED = Limits(max_recv_bytes=1 << 20, max_send_bytes=1 << 20)
BOUND = 10  # seconds: the bound on every test's outcome
FAIL_TEXT = "model 'é' says 100% no"
Codes = h2.settings.SettingCodes


def pattern(n: int) -> bytes:
    """``n`` bytes that show where a slice came from if a reply is reordered or cut."""
    return (bytes(range(256)) * (n // 256 + 1))[:n]


class Probe:
    """The test methods and what they saw (made on the test's event loop)."""

    def __init__(self) -> None:
        self.handled = 0  # raw handlers entered: a refused call never counts
        self.started = anyio.Event()
        self.release = anyio.Event()
        self.cancelled: list[str] = []
        self.cancelled_event = anyio.Event()

    def _saw_cancel(self, name: str) -> None:
        self.cancelled.append(name)
        self.cancelled_event.set()

    async def echo(self, call: Call, message: RawMessage) -> bytes:
        self.handled += 1
        return bytes(call.plain(message))

    async def slow(self, call: Call, message: RawMessage) -> bytes:
        """Answers once the test sets ``release``."""
        self.handled += 1
        self.started.set()
        try:
            await self.release.wait()
        except anyio.get_cancelled_exc_class():
            self._saw_cancel("slow")
            raise
        return b"slow done"

    async def big(self, call: Call, message: RawMessage) -> bytes:
        """``pattern(n)`` for the decimal ``n`` the request carries."""
        self.handled += 1
        return pattern(int(call.plain(message)))

    async def big_stream(self, call: Call) -> None:
        """``big`` sent as one stream message by the handler itself, so a reset that comes
        while the reply is being sent lands in the handler."""
        message = await call.receive()
        assert message is not None
        self.handled += 1
        self.started.set()
        try:
            await call.send(pattern(int(call.plain(message))))
        except anyio.get_cancelled_exc_class():
            self._saw_cancel("big_stream")
            raise

    async def echo_stream(self, call: Call) -> None:
        """Each message back as it arrives."""
        self.handled += 1
        try:
            while (message := await call.receive()) is not None:
                await call.send(bytes(call.plain(message)))
        except anyio.get_cancelled_exc_class():
            self._saw_cancel("echo_stream")
            raise

    async def fail(self, call: Call, message: RawMessage) -> bytes:
        """Raises what the request names."""
        self.handled += 1
        kind = bytes(message.data).decode()
        if kind == "grpc":
            raise GrpcError(StatusCode.FAILED_PRECONDITION, FAIL_TEXT)
        if kind == "serving":
            raise NotFound("unknown model: m")
        if kind == "timeout":
            raise TimeoutError()
        raise RuntimeError("boom")

    def methods(self) -> dict[str, Method]:
        return {
            "/t.T/Echo": raw_unary(self.echo, LIMITS, "Echo"),
            "/t.T/Capped": raw_unary(self.echo, CAPPED, "Capped"),
            "/t.T/Slow": raw_unary(self.slow, LIMITS, "Slow"),
            "/t.T/Big": raw_unary(self.big, LIMITS, "Big"),
            "/t.T/BigStream": stream(self.big_stream, LIMITS, "BigStream"),
            "/t.T/Stream": stream(self.echo_stream, LIMITS, "Stream"),
            "/t.T/Fail": raw_unary(self.fail, LIMITS, "Fail"),
        }


@dataclass
class Served:
    server: GrpcServer
    port: int
    probe: Probe


@asynccontextmanager
async def served(settings: ServerSettings | None, engine: str) -> AsyncIterator[Served]:
    """A ``GrpcServer`` on the test's loop on HTTP/2 ``engine``, shut down (the test's slow
    calls released) after."""
    probe = Probe()
    settings = dataclasses.replace(settings or ServerSettings(), http2_engine=engine)
    server = GrpcServer(probe.methods(), settings)
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.serve, "127.0.0.1", 0)
        try:
            yield Served(server, port, probe)
        finally:
            probe.release.set()
            with anyio.fail_after(BOUND):
                await server.shutdown(1.0)


@pytest.fixture()
async def srv(http2_engine: str) -> AsyncIterator[Served]:
    async with served(None, http2_engine) as s:
        yield s


async def echo_ok(peer: Peer, payload: bytes = b"still serving") -> None:
    reply = await peer.call("/t.T/Echo", grpc_frame(payload))
    assert (reply.status, reply.messages) == (0, [payload]), reply


async def healthy(port: int) -> None:
    """A fresh connection is served."""
    async with Peer.connect(port) as peer:
        await echo_ok(peer)


# ------------------------------------------------------------------------------ arrival


async def test_a_request_written_7_bytes_at_a_time_is_answered(srv: Served):
    with anyio.fail_after(BOUND):
        async with Peer.connect(srv.port, initiate=False) as peer:
            peer.conn.initiate_connection()
            sid = peer.open("/t.T/Echo", [("x-pad", "p" * 100)])
            peer.conn.send_data(sid, grpc_frame(pattern(3000)), end_stream=True)
            data = peer.conn.data_to_send()
            for i in range(0, len(data), 7):
                await peer.send_raw(data[i : i + 7])
            reply = await peer.wait(sid)
    assert (reply.status, reply.messages) == (0, [pattern(3000)])


@pytest.mark.parametrize("frame_size", [16 << 10, 1 << 20], ids=["16KiB", "1MiB"])
async def test_frames_are_cut_to_the_clients_max_frame_size_and_the_servers_is_accepted(
    srv: Served, frame_size: int
):
    n = 3 << 20
    settings = {Codes.MAX_FRAME_SIZE: frame_size, Codes.INITIAL_WINDOW_SIZE: 16 << 20}
    with anyio.fail_after(BOUND):
        async with Peer.connect(srv.port, settings, connection_window=16 << 20) as peer:
            big = await peer.call("/t.T/Big", grpc_frame(str(n).encode()))
            sizes = [len(f.data) for f in peer.data_frames(1)]
            echoed = await peer.call("/t.T/Echo", grpc_frame(pattern(n)))
            assert peer.conn.max_outbound_frame_size == MAX_FRAME_BYTES  # what we sent in
    assert (big.status, big.messages) == (0, [pattern(n)])
    assert max(sizes) <= frame_size
    if frame_size > 16 << 10 and srv.server.settings.http2_engine == "h2":
        # the large frames were used, not only allowed (libnghttp2 frames DATA at 16 KiB)
        assert max(sizes) > 16 << 10
    assert (echoed.status, echoed.messages) == (0, [pattern(n)])


async def test_a_reply_larger_than_the_clients_window_arrives_whole_as_windows_open(
    srv: Served,
):
    n, step = 300 << 10, 4096
    settings = {Codes.INITIAL_WINDOW_SIZE: step}
    with anyio.fail_after(BOUND):
        async with Peer.connect(srv.port, settings, manual_window=True) as peer:
            sid = peer.open("/t.T/Big")
            await peer.flush()
            await peer.send_body(sid, grpc_frame(str(n).encode()))
            reply = peer.replies[sid]
            granted, updates = step, 0
            while not reply.done:
                received = sum(len(f.data) for f in peer.data_frames(sid))
                assert received <= granted  # never more than the window we opened
                if received == granted:  # the server must be waiting for us: open more
                    peer.conn.increment_flow_control_window(step, sid)
                    peer.conn.increment_flow_control_window(step)
                    await peer.flush()
                    granted += step
                    updates += 1
                assert await peer.receive()
    assert (reply.status, reply.messages) == (0, [pattern(n)])
    assert updates >= n // step


# ------------------------------------------------------------------------------ resets


async def test_a_reset_mid_request_never_runs_or_cancels_the_handler_and_serving_goes_on(
    srv: Served,
):
    probe = srv.probe
    with anyio.fail_after(BOUND):
        async with Peer.connect(srv.port) as peer:
            # Half a message, then RST_STREAM: the handler never gets a message to run on.
            half = peer.open("/t.T/Echo")
            peer.conn.send_data(half, grpc_frame(b"0123456789")[:8])
            await peer.flush()
            peer.conn.reset_stream(half, ErrorCodes.CANCEL)
            await peer.flush()
            # A whole message but the client's side still open: the handler runs; the reset
            # cancels it.
            open_ = peer.open("/t.T/Slow")
            peer.conn.send_data(open_, grpc_frame(b"x"))
            await peer.flush()
            await probe.started.wait()
            peer.conn.reset_stream(open_, ErrorCodes.CANCEL)
            await peer.flush()
            await probe.cancelled_event.wait()
            await until(lambda: srv.server.running_calls() == 0)
            assert probe.handled == 1  # only Slow ran
            await echo_ok(peer)  # the same connection serves on
        await healthy(srv.port)
    assert probe.cancelled == ["slow"]
    assert not peer.replies[half].done and not peer.replies[open_].done  # nothing answered


async def test_a_reset_while_a_stream_handler_waits_for_a_message_cancels_it(srv: Served):
    probe = srv.probe
    with anyio.fail_after(BOUND):
        async with Peer.connect(srv.port) as peer:
            sid = peer.open("/t.T/Stream")
            reply = peer.replies[sid]
            await peer.send_body(sid, grpc_frame(b"one"), end=False)
            await peer.until(lambda: reply.messages == [b"one"])  # now waiting for the next
            peer.conn.reset_stream(sid, ErrorCodes.CANCEL)
            await peer.flush()
            with anyio.move_on_after(2):  # the bug: the handler returns instead
                await probe.cancelled_event.wait()
            await until(lambda: srv.server.running_calls() == 0)
            await echo_ok(peer)
    assert probe.cancelled == ["echo_stream"]


async def test_a_reset_mid_reply_cancels_the_handler_and_serving_goes_on(srv: Served):
    probe = srv.probe
    settings = {Codes.INITIAL_WINDOW_SIZE: 4096}
    with anyio.fail_after(BOUND):
        async with Peer.connect(srv.port, settings, manual_window=True) as peer:
            sid = peer.open("/t.T/BigStream")
            await peer.flush()
            await peer.send_body(sid, grpc_frame(str(300 << 10).encode()), end=False)
            await peer.until(lambda: bool(peer.data_frames(sid)))  # the reply has begun
            peer.conn.reset_stream(sid, ErrorCodes.CANCEL)
            await peer.flush()
            with anyio.move_on_after(2):  # the bug: the handler gets CallClosed instead
                await probe.cancelled_event.wait()
            await until(lambda: srv.server.running_calls() == 0)
            await echo_ok(peer)
        await healthy(srv.port)
    assert probe.cancelled == ["big_stream"]


# ------------------------------------------------------------------------------ drain


def drain_frames(peer: Peer) -> list[tuple[str, int | bytes]]:
    """The GOAWAYs (last stream id) and server PINGs (opaque data), in arrival order."""
    out: list[tuple[str, int | bytes]] = []
    for frame in peer.frames:
        if isinstance(frame, GoAwayFrame):
            out.append(("goaway", frame.last_stream_id))
        elif isinstance(frame, PingFrame) and "ACK" not in frame.flags:
            out.append(("ping", frame.opaque_data))
    return out


async def test_shutdown_is_a_two_phase_goaway_that_lets_the_call_in_flight_finish(srv: Served):
    probe = srv.probe
    with anyio.fail_after(BOUND):
        async with Peer.connect(srv.port) as peer, anyio.create_task_group() as tg:
            slow = peer.open("/t.T/Slow")
            await peer.flush()
            await peer.send_body(slow, grpc_frame(b"x"))
            await probe.started.wait()
            tg.start_soon(srv.server.shutdown, float(BOUND))
            await peer.until(lambda: len(peer.goaways) >= 2)
            seen = drain_frames(peer)
            assert [kind for kind, _ in seen] == ["goaway", "ping", "goaway"]
            assert seen[0][1] == MAX_STREAM_ID and seen[2][1] == slow
            assert peer.goaways[-1].error_code == 0
            # A stream opened after the real last stream id is never served: h2 refuses it
            # (REFUSED_STREAM), libnghttp2 ignores it (the GOAWAY told the client so).
            late = peer.open("/t.T/Echo")
            await peer.flush()
            await peer.send_body(late, grpc_frame(b"late"))
            if srv.server.settings.http2_engine == "h2":
                refused = await peer.wait(late)
                assert refused.reset == ErrorCodes.REFUSED_STREAM
            probe.release.set()
            done = await peer.wait(slow)
            assert (done.status, done.messages) == (0, [b"slow done"])
            await peer.until_eof()
            assert peer.replies[late].status is None
    assert probe.handled == 1 and probe.cancelled == []


async def test_a_connection_attempt_during_the_drain_is_refused(srv: Served):
    probe = srv.probe
    with anyio.fail_after(BOUND):
        async with Peer.connect(srv.port) as peer, anyio.create_task_group() as tg:
            slow = peer.open("/t.T/Slow")
            await peer.flush()
            await peer.send_body(slow, grpc_frame(b"x"))
            await probe.started.wait()
            tg.start_soon(srv.server.shutdown, float(BOUND))
            await peer.until(lambda: len(peer.goaways) >= 2)
            try:
                late = await anyio.connect_tcp("127.0.0.1", srv.port)
            except OSError:
                refused = True  # the client tries another server at once
            else:
                refused = False
                await late.aclose()
            probe.release.set()
            done = await peer.wait(slow)
    assert done.status == 0
    assert refused


async def test_a_ping_is_answered(srv: Served):
    with anyio.fail_after(BOUND):
        async with Peer.connect(srv.port) as peer:
            await peer.ping(b"12345678")
    assert peer.ping_acks == [b"12345678"]


KEEPALIVE = ServerSettings(keepalive_seconds=0.2, keepalive_timeout_seconds=0.3)


async def test_an_idle_client_that_answers_keepalive_pings_stays_connected(http2_engine: str):
    async with served(KEEPALIVE, http2_engine) as s:
        with anyio.fail_after(BOUND):
            async with Peer.connect(s.port) as peer:  # h2 acknowledges every PING
                await peer.until(lambda: len(peer.server_pings) >= 3)
                assert peer.goaways == [] and not peer.eof
                await echo_ok(peer)


async def test_a_client_that_does_not_answer_keepalive_pings_is_closed_with_goaway(
    http2_engine: str,
):
    async with served(KEEPALIVE, http2_engine) as s:
        with anyio.fail_after(BOUND):
            async with Peer.connect(s.port, feed=False) as peer:  # reads, never answers
                await peer.until_eof()
            await healthy(s.port)
    kinds = [kind for kind, _ in drain_frames(peer)]
    assert kinds[0] == "ping" and kinds[-1] == "goaway"
    assert peer.goaways[-1].additional_data == b"keepalive timeout"


async def test_max_connection_age_drains_the_connection_and_lets_the_call_finish(http2_engine: str):
    aged = ServerSettings(max_connection_age_seconds=0.3, max_connection_age_grace_seconds=0.5)
    async with served(aged, http2_engine) as s:
        with anyio.fail_after(BOUND):
            async with Peer.connect(s.port) as peer:
                slow = peer.open("/t.T/Slow")
                await peer.flush()
                await peer.send_body(slow, grpc_frame(b"x"))
                await s.probe.started.wait()
                await peer.until(lambda: bool(peer.goaways))
                s.probe.release.set()
                done = await peer.wait(slow)
                await peer.until_eof()
            await healthy(s.port)
    assert (done.status, done.messages) == (0, [b"slow done"])
    assert [g.last_stream_id for g in peer.goaways] == [MAX_STREAM_ID, slow]


# ------------------------------------------------------------------------------ protocol errors


async def test_a_malformed_preface_closes_that_connection_and_the_server_serves_on(srv: Served):
    with anyio.fail_after(BOUND):
        async with Peer.connect(srv.port, feed=False, initiate=False) as peer:
            await peer.send_raw(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(64)))
            await peer.until_eof()
        await healthy(srv.port)
    assert srv.probe.handled == 1


async def test_headers_on_a_closed_stream_are_never_served_and_the_server_survives(srv: Served):
    """h2 answers with a connection or stream error; libnghttp2 ignores frames on a stream id it
    has seen close (it cannot remember every closed stream, so it never guesses): either way
    the reused id never reaches a handler."""
    with anyio.fail_after(BOUND):
        async with Peer.connect(srv.port) as peer:
            await echo_ok(peer, b"first")
            block = peer.headers_block(
                [
                    (":method", "POST"),
                    (":scheme", "http"),
                    (":path", "/t.T/Echo"),
                    (":authority", "127.0.0.1"),
                    ("content-type", "application/grpc"),
                    ("te", "trailers"),
                ]
            )
            await peer.send_frame(HeadersFrame(1, block, flags=["END_HEADERS", "END_STREAM"]))

            def answered() -> bool:
                return any(
                    isinstance(f, GoAwayFrame)
                    or (isinstance(f, RstStreamFrame) and f.stream_id == 1)
                    for f in peer.frames
                )

            if srv.server.settings.http2_engine == "h2":
                while not answered() and await peer.receive():
                    pass
                assert answered()
            else:
                await echo_ok(peer, b"ignored, and served on")
        await healthy(srv.port)
    handled = 2 if srv.server.settings.http2_engine == "h2" else 3
    assert srv.probe.handled == handled  # the calls sent; never the reused id


# ------------------------------------------------------------------------------ statuses


@pytest.mark.parametrize(
    "timeout",
    [
        "0n",
        "1n",
    ],
)
async def test_an_expired_grpc_timeout_is_deadline_exceeded_without_running_the_handler(
    srv: Served, timeout: str
):
    with anyio.fail_after(BOUND):
        async with Peer.connect(srv.port) as peer:
            # HEADERS and the whole message in one write: nothing left for the handler to wait
            # for, so only the deadline check can keep it from running.
            sid = peer.open("/t.T/Echo", [("grpc-timeout", timeout)])
            peer.conn.send_data(sid, grpc_frame(b"x"), end_stream=True)
            await peer.flush()
            reply = await peer.wait(sid)
            assert reply.status == StatusCode.DEADLINE_EXCEEDED, reply
            await echo_ok(peer)
    assert srv.probe.handled == 1  # the health check only


@pytest.mark.parametrize(
    ("kind", "status", "raw_message"),
    [
        ("grpc", StatusCode.FAILED_PRECONDITION, "model '%C3%A9' says 100%25 no"),
        ("serving", StatusCode.NOT_FOUND, "unknown model: m"),
        ("timeout", StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"),
        ("bug", StatusCode.INTERNAL, "internal error: RuntimeError('boom')"),
    ],
)
async def test_a_handler_exception_ends_the_call_with_its_status_and_an_encoded_message(
    srv: Served, kind: str, status: StatusCode, raw_message: str
):
    with anyio.fail_after(BOUND):
        async with Peer.connect(srv.port) as peer:
            reply = await peer.call("/t.T/Fail", grpc_frame(kind.encode()))
            await echo_ok(peer)
    assert (reply.status, reply.raw_message) == (status, raw_message)
    if kind == "grpc":
        assert reply.message == FAIL_TEXT


async def test_an_unknown_path_is_unimplemented(srv: Served):
    with anyio.fail_after(BOUND):
        async with Peer.connect(srv.port) as peer:
            reply = await peer.call("/t.T/Nope", grpc_frame(b"x"))
    assert (reply.status, reply.message) == (
        StatusCode.UNIMPLEMENTED,
        "method not found: /t.T/Nope",
    )
    assert srv.probe.handled == 0


async def test_a_message_over_the_receive_cap_is_resource_exhausted(srv: Served):
    with anyio.fail_after(BOUND):
        async with Peer.connect(srv.port) as peer:
            reply = await peer.call("/t.T/Capped", grpc_frame(bytes(2_000_000)))
            await echo_ok(peer)
    assert (reply.status, reply.message) == (
        StatusCode.RESOURCE_EXHAUSTED,
        "received message larger than max (2000000 vs. 1048576)",
    )


async def test_a_gzip_message_is_decompressed_by_plain(srv: Served):
    payload = b"tensor bytes " * 1000
    packed = gzip.compress(payload)
    with anyio.fail_after(BOUND):
        async with Peer.connect(srv.port) as peer:
            reply = await peer.call(
                "/t.T/Echo", grpc_frame(packed, flag=1), [("grpc-encoding", "gzip")]
            )
    assert len(packed) < len(payload)
    assert (reply.status, reply.messages) == (0, [payload])


async def test_a_streaming_echo_answers_each_message_before_the_next_is_sent(srv: Served):
    with anyio.fail_after(BOUND):
        async with Peer.connect(srv.port) as peer:
            sid = peer.open("/t.T/Stream")
            reply = peer.replies[sid]
            for i in range(5):
                await peer.send_body(sid, grpc_frame(f"m{i}".encode()), end=False)
                await peer.until(lambda i=i: len(reply.messages) == i + 1)
            peer.conn.end_stream(sid)
            await peer.flush()
            await peer.wait(sid)
    assert (reply.status, reply.messages) == (0, [f"m{i}".encode() for i in range(5)])


async def test_a_reset_that_lands_after_its_call_finished_loses_no_later_call(srv: Served):
    """A reset asked for in the same loop turn as the call's last wake-up reaches the call task
    only after the call has ended, while it waits for its next call: that task must leave the
    idle list, or two later calls could be handed to it and one would never be answered."""
    with anyio.fail_after(BOUND):
        async with Peer.connect(srv.port) as peer:
            sid = peer.open("/t.T/Slow")
            peer.conn.send_data(sid, grpc_frame(b"x"), end_stream=True)
            await peer.flush()
            await srv.probe.started.wait()
            (conn,) = srv.server.connections
            (call,) = conn.calls.values()
            # One synchronous step: the handler is woken (its reply then needs no await), and
            # the client's reset is processed before the handler runs.
            srv.probe.release.set()
            call.on_reset()
            while conn.calls:
                await anyio.sleep(0.01)
            srv.probe.release = anyio.Event()
            srv.probe.started = anyio.Event()
            firsts = [peer.open("/t.T/Slow"), peer.open("/t.T/Slow")]
            for first in firsts:
                peer.conn.send_data(first, grpc_frame(b"y"), end_stream=True)
            await peer.flush()
            while srv.probe.handled < 3:
                await anyio.sleep(0.01)
            srv.probe.release.set()
            replies = [await peer.wait(first) for first in firsts]
            assert [r.status for r in replies] == [0, 0]
            await echo_ok(peer)

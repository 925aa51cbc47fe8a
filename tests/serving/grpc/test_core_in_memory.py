"""The gRPC protocol core (``ServerConnection``) driven by bytes alone: no socket, no transport
but a recording one, and its timers on trio's ``MockClock``, so every timer rule is tested at
the instant it is due, never on real time.

A client engine (the other engine of each pair, or the same) produces the client's bytes; the
test moves bytes between the two and lets the tasks run (``settle``)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
import trio
import trio.testing

from kserve_trio.core.process.config import EdgeLimits
from kserve_trio.http2 import (
    ENGINES,
    DataReceived,
    EngineSettings,
    GoAwayReceived,
    PingAcknowledged,
    ResponseReceived,
    StreamReset,
    TrailersReceived,
    new_engine,
)
from kserve_trio.serving.grpc import (
    Call,
    Limits,
    RawMessage,
    ServerConnection,
    ServerSettings,
    raw_unary,
)

pytestmark = pytest.mark.anyio

LIMITS = Limits(1 << 20, 1 << 20)
REQUEST = [
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":authority", b"memory"),
    (b"te", b"trailers"),
    (b"content-type", b"application/grpc"),
]


@pytest.fixture()
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock()


@pytest.fixture()
def anyio_backend(clock: trio.testing.MockClock):
    """trio with a clock only the test moves."""
    return ("trio", {"clock": clock})


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    return request.param


class Recorder:
    """A ``Transport`` that holds nothing: the test takes ``data_to_send`` itself."""

    def __init__(self) -> None:
        self.stopped = False
        self.paused = False

    def wake_writer(self) -> None:
        pass

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def buffered(self) -> int:
        return 0

    def stop(self) -> None:
        self.stopped = True

    async def flush(self) -> None:
        pass

    async def linger(self) -> None:
        pass

    def peer(self) -> str:
        return "memory"


class Handlers:
    def __init__(self) -> None:
        self.release = anyio.Event()
        self.entered = 0
        self.cancelled = 0

    async def echo(self, call: Call, message: RawMessage) -> bytes:
        self.entered += 1
        return bytes(call.plain(message))

    async def hold(self, call: Call, message: RawMessage) -> bytes:
        self.entered += 1
        try:
            await self.release.wait()
        except anyio.get_cancelled_exc_class():
            self.cancelled += 1
            raise
        return b"held"


@dataclasses.dataclass
class Wire:
    """The server's core and a client engine, back to back."""

    conn: ServerConnection
    transport: Recorder
    client: object
    events: list
    unread: bytes = b""

    def move(self, *, client_reads: bool = True) -> None:
        """One exchange: the client's bytes to the server, the server's to the client (unless
        ``client_reads`` is false: a client that does not read yet; they wait for it)."""
        data = self.client.data_to_send()  # type: ignore[attr-defined]
        if data:
            self.conn.feed(data)
        self.unread += self.conn.data_to_send()
        if self.unread and client_reads:
            out, self.unread = self.unread, b""
            self.events += self.client.receive(out)  # type: ignore[attr-defined]

    async def settle(self, *, client_reads: bool = True) -> None:
        """Move bytes and let every task run until nothing changes."""
        for _ in range(4):
            self.move(client_reads=client_reads)
            await trio.testing.wait_all_tasks_blocked()
        self.move(client_reads=client_reads)

    def call(self, path: str, message: bytes, timeout: str | None = None) -> int:
        headers = [(b":path", path.encode()), *REQUEST]
        if timeout:
            headers.append((b"grpc-timeout", timeout.encode()))
        sid = self.client.send_request(headers)  # type: ignore[attr-defined]
        framed = len(message).to_bytes(5, "big")
        self.client.send_data(sid, framed + message, end_stream=True)  # type: ignore[attr-defined]
        return sid

    def status(self, sid: int) -> int | None:
        for event in self.events:
            if isinstance(event, (TrailersReceived, ResponseReceived)) and event.stream_id == sid:
                for key, value in event.headers:
                    if key == b"grpc-status":
                        return int(value)
        return None

    def body(self, sid: int) -> bytes:
        data = b"".join(
            e.data for e in self.events if isinstance(e, DataReceived) and e.stream_id == sid
        )
        return data[5:]

    def goaways(self) -> list[GoAwayReceived]:
        return [e for e in self.events if isinstance(e, GoAwayReceived)]


@asynccontextmanager
async def wire(
    engine: str, settings: ServerSettings | None = None
) -> AsyncIterator[tuple[Wire, Handlers]]:
    handlers = Handlers()
    methods = {
        "/t.T/Echo": raw_unary(handlers.echo, LIMITS, "Echo"),
        "/t.T/Hold": raw_unary(handlers.hold, LIMITS, "Hold"),
    }
    settings = dataclasses.replace(settings or ServerSettings(), http2_engine=engine)
    transport = Recorder()
    closed: list[ServerConnection] = []
    conn = ServerConnection(methods, settings, transport, closed.append)
    client = new_engine("ngh2", EngineSettings(client=True))
    async with anyio.create_task_group() as tg:
        conn.start()
        await tg.start(conn.run)
        client.initiate()
        w = Wire(conn, transport, client, [])
        await w.settle()
        try:
            yield w, handlers
        finally:
            handlers.release.set()
            conn.close_calls()
    assert closed == [conn]


async def test_a_unary_call_is_answered_from_bytes_alone(engine: str):
    async with wire(engine) as (w, _):
        sid = w.call("/t.T/Echo", b"hello, memory")
        await w.settle()
        assert (w.status(sid), w.body(sid)) == (0, b"hello, memory")


async def test_a_call_is_answered_deadline_exceeded_at_its_deadline_and_not_before(
    engine: str, clock: trio.testing.MockClock
):
    async with wire(engine) as (w, handlers):
        sid = w.call("/t.T/Hold", b"x", timeout="5S")
        await w.settle()
        clock.jump(4.999)
        await w.settle()
        assert w.status(sid) is None and handlers.cancelled == 0
        clock.jump(0.002)
        await w.settle()
        assert w.status(sid) == 4  # DEADLINE_EXCEEDED
        assert handlers.cancelled == 1
        after = w.call("/t.T/Echo", b"next")  # the connection serves on
        await w.settle()
        assert w.status(after) == 0


async def test_a_keepalive_ping_answered_keeps_the_connection(
    engine: str, clock: trio.testing.MockClock
):
    settings = ServerSettings(keepalive_seconds=10.0, keepalive_timeout_seconds=5.0)
    async with wire(engine, settings) as (w, _):
        for _ in range(3):
            clock.jump(10.0)
            await w.settle()  # the client engine answers the server's PING
            clock.jump(5.0)
            await w.settle()
        assert w.goaways() == [] and not w.transport.stopped
        sid = w.call("/t.T/Echo", b"still here")
        await w.settle()
        assert w.status(sid) == 0


async def test_a_keepalive_ping_unanswered_ends_the_connection_with_goaway(
    engine: str, clock: trio.testing.MockClock
):
    settings = ServerSettings(keepalive_seconds=10.0, keepalive_timeout_seconds=5.0)
    async with wire(engine, settings) as (w, _):
        # The client spoke at the start: the first check (10 s) finds that and waits another
        # period; the second sends the PING, which nobody answers.
        clock.jump(10.0)
        await w.settle(client_reads=False)
        clock.jump(10.0)
        await w.settle(client_reads=False)
        clock.jump(4.9)
        await w.settle(client_reads=False)
        assert not w.transport.stopped
        clock.jump(0.2)
        await w.settle()
        assert w.transport.stopped
        (goaway,) = w.goaways()
        assert goaway.code == 0 and goaway.debug == b"keepalive timeout"


async def test_an_idle_connection_gets_goaway_after_the_idle_time_and_a_busy_one_does_not(
    engine: str, clock: trio.testing.MockClock
):
    settings = ServerSettings(limits=EdgeLimits(idle_seconds=30.0))
    async with wire(engine, settings) as (w, handlers):
        sid = w.call("/t.T/Hold", b"x")
        await w.settle()
        clock.jump(60.0)  # a call runs: never idle
        await w.settle()
        assert w.goaways() == []
        handlers.release.set()
        await w.settle()
        assert w.status(sid) == 0
        clock.jump(29.9)
        await w.settle()
        assert w.goaways() == []
        clock.jump(0.2)
        await w.settle()
        (goaway,) = w.goaways()
        assert goaway.code == 0 and w.transport.stopped
        assert w.conn.stats.refused_connections["idle"] == 1


async def test_a_client_that_never_completes_its_handshake_is_closed_at_the_deadline(
    engine: str, clock: trio.testing.MockClock
):
    handlers = Handlers()
    methods = {"/t.T/Echo": raw_unary(handlers.echo, LIMITS, "Echo")}
    settings = ServerSettings(limits=EdgeLimits(handshake_seconds=10.0), http2_engine=engine)
    transport = Recorder()
    conn = ServerConnection(methods, settings, transport, lambda _: None)
    async with anyio.create_task_group() as tg:
        conn.start()
        await tg.start(conn.run)
        conn.feed(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")  # the preface and no SETTINGS
        clock.jump(9.9)
        await trio.testing.wait_all_tasks_blocked()
        assert not transport.stopped
        clock.jump(0.2)
        await trio.testing.wait_all_tasks_blocked()
        assert transport.stopped
    assert conn.stats.refused_connections["handshake_timeout"] == 1


async def test_the_maximum_age_drains_the_connection_and_its_grace_ends_the_calls_left(
    engine: str, clock: trio.testing.MockClock
):
    settings = ServerSettings(
        max_connection_age_seconds=100.0, max_connection_age_grace_seconds=5.0
    )
    async with wire(engine, settings) as (w, handlers):
        sid = w.call("/t.T/Hold", b"x")
        await w.settle()
        clock.jump(111.0)  # past the age and its jitter (at most 10%)
        await w.settle()
        goaways = w.goaways()
        assert [g.last_stream_id for g in goaways] == [2**31 - 1, sid]  # both phases
        assert not w.transport.stopped  # the call in flight may finish
        clock.jump(5.1)
        await w.settle()
        assert w.transport.stopped and handlers.cancelled == 1


async def test_the_two_phase_drain_lets_the_call_in_flight_finish(engine: str):
    async with wire(engine) as (w, handlers):
        sid = w.call("/t.T/Hold", b"x")
        await w.settle()
        w.conn.start_drain()
        await w.settle(client_reads=False)
        w.events += w.client.receive(w.unread)  # type: ignore[attr-defined]
        w.unread = b""
        assert [g.last_stream_id for g in w.goaways()] == [2**31 - 1]  # phase one, then its PING
        await w.settle()  # the client answers the PING: phase two
        assert [g.last_stream_id for g in w.goaways()] == [2**31 - 1, sid]
        assert not w.transport.stopped
        handlers.release.set()
        await w.settle()
        assert (w.status(sid), w.body(sid)) == (0, b"held")
        assert w.transport.stopped  # the last call ended: so does the connection
        assert w.conn.stats.goaways["NO_ERROR"] == 2


async def test_a_reset_call_is_cancelled_and_the_connection_serves_on(engine: str):
    async with wire(engine) as (w, handlers):
        sid = w.call("/t.T/Hold", b"x")
        await w.settle()
        w.client.reset_stream(sid, 8)  # type: ignore[attr-defined]
        await w.settle()
        assert handlers.cancelled == 1 and not w.conn.calls
        assert not any(isinstance(e, StreamReset) and e.stream_id == sid for e in w.events)
        after = w.call("/t.T/Echo", b"on")
        await w.settle()
        assert w.status(after) == 0


async def test_the_server_pings_and_answers_pings_through_the_engine(engine: str):
    async with wire(engine) as (w, _):
        w.client.ping(b"12345678")  # type: ignore[attr-defined]
        await w.settle()
        w.conn.engine.ping(b"fromsrv!")
        await w.settle()
        assert any(isinstance(e, PingAcknowledged) for e in w.events)

"""The HTTP/2 frame-level defences of an in-process ``GrpcServer``, on asyncio and trio and on
both HTTP/2 engines, against raw attackers (``h2_attacker.Attacker``) and a well-behaved h2
client (``h2_peer.Peer``):

- streams beyond SETTINGS_MAX_CONCURRENT_STREAMS are refused one by one (REFUSED_STREAM) in
  the client's first flight, and the connection serves on;
- rapid resets end the connection (GOAWAY ENHANCE_YOUR_CALM), a moderate share does not; a
  reset call never reaches its handler, and what arrives for it still opens the connection
  window;
- a header block held open past the header-list cap, floods of control frames and of pings end
  the connection before h2 buffers or answers them; a keepalive within the ping rule does not;
- an idle connection gets GOAWAY(NO_ERROR) before it is closed, a silent one is closed at the
  handshake deadline; every GOAWAY is counted in ``EdgeStats``;
- at the port's connection cap a new connection evicts the longest-idle one (GOAWAY(NO_ERROR)
  first when it spoke HTTP/2, none when it did not), never one with a call in flight: with
  every connection busy the new one is closed at once.

Each test is bounded; timers are small and the bounds generous."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import pytest
from h2.errors import ErrorCodes
from hyperframe.frame import GoAwayFrame, HeadersFrame, WindowUpdateFrame

from kserve_trio.core.process.config import EdgeLimits
from kserve_trio.http2 import ENGINES
from kserve_trio.serving.edge_stats import EdgeStats
from kserve_trio.serving.grpc import Call, GrpcServer, Limits, RawMessage, ServerSettings, raw_unary
from tests.edge.h2_attacker import (
    Attacker,
    continuation,
    data,
    grpc_message,
    ping,
    priority,
    raw_frame,
    rst,
    settings,
    window_update,
)
from tests.serving.grpc.h2_peer import Peer, grpc_frame
from tests.waiting import until

pytestmark = pytest.mark.anyio

BOUND = 20.0  # seconds: the bound on every outcome
CALLS = Limits(max_recv_bytes=1 << 20, max_send_bytes=1 << 20)
ECHO, HOLD = "/t.T/Echo", "/t.T/Hold"
CALM = int(ErrorCodes.ENHANCE_YOUR_CALM)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    return request.param


class Handlers:
    """Echo, and Hold (answers once ``release`` is set); ``entered`` counts handler runs."""

    def __init__(self) -> None:
        self.entered = 0
        self.release = anyio.Event()

    async def echo(self, call: Call, message: RawMessage) -> bytes:
        self.entered += 1
        return bytes(call.plain(message))

    async def hold(self, call: Call, message: RawMessage) -> bytes:
        self.entered += 1
        await self.release.wait()
        return b"held"


@dataclass
class Served:
    server: GrpcServer
    port: int
    handlers: Handlers

    @property
    def stats(self) -> EdgeStats:
        return self.server.stats


@asynccontextmanager
async def served(engine: str, **limits: float) -> AsyncIterator[Served]:
    handlers = Handlers()
    methods = {
        ECHO: raw_unary(handlers.echo, CALLS, "Echo"),
        HOLD: raw_unary(handlers.hold, CALLS, "Hold"),
    }
    settings = ServerSettings(limits=EdgeLimits(**limits), http2_engine=engine)  # type: ignore[arg-type]
    server = GrpcServer(methods, settings)
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.serve, "127.0.0.1", 0)
        try:
            yield Served(server, port, handlers)
        finally:
            handlers.release.set()
            with anyio.fail_after(BOUND):
                await server.shutdown(1.0)


async def echo_ok(peer: Peer, payload: bytes = b"still serving") -> None:
    reply = await peer.call(ECHO, grpc_frame(payload))
    assert (reply.status, reply.messages) == (0, [payload]), reply


async def healthy(port: int) -> None:
    """A fresh, well-behaved connection is served."""
    async with Peer.connect(port) as peer:
        await echo_ok(peer)


def goaway_of(attacker: Attacker) -> tuple[int, bytes]:
    assert attacker.goaways, "no GOAWAY"
    frame = attacker.goaways[-1]
    return frame.error_code, frame.additional_data


# ------------------------------------------------------------------------------ streams


@pytest.mark.timeout(60)
@pytest.mark.slow
async def test_a_first_flight_burst_past_the_stream_limit_is_refused_stream_by_stream(engine):
    """1100 requests in the client's first write, before it has read our SETTINGS (h2's own
    default of 100 would end the connection at the 101st): the first 1024 run, the other 76 are
    REFUSED_STREAM, and the same connection is served on."""
    async with served(engine) as s, Peer.connect(s.port, initiate=False) as peer:
        with anyio.fail_after(BOUND):
            peer.conn.initiate_connection()
            sids = []
            for _ in range(1100):
                sid = peer.open(HOLD)
                peer.conn.send_data(sid, grpc_frame(b"x"), end_stream=True)
                sids.append(sid)
            await peer.flush()
            await peer.until(lambda: sum(r.reset is not None for r in peer.replies.values()) >= 76)
            await until(lambda: s.handlers.entered == 1024, BOUND, "1024 calls entered")
            refused = [sid for sid in sids if peer.replies[sid].reset is not None]
            assert refused == sids[1024:]
            assert {peer.replies[sid].reset for sid in refused} == {int(ErrorCodes.REFUSED_STREAM)}
            s.handlers.release.set()
            await peer.until(lambda: all(peer.replies[sid].done for sid in sids[:1024]))
            assert {peer.replies[sid].status for sid in sids[:1024]} == {0}
            await echo_ok(peer)
            assert peer.goaways == []
    if engine == "h2":  # libnghttp2 refuses a stream without telling its user
        assert s.stats.refused_streams == 76


@pytest.mark.timeout(60)
async def test_streams_past_a_small_limit_are_refused_while_the_first_are_served(engine):
    async with served(engine, max_concurrent_streams=4) as s, Attacker.connect(s.port) as a:
        with anyio.fail_after(BOUND):
            open_ = [1, 3, 5, 7]
            extra = [9, 11, 13]
            await a.send(*(a.request(sid, HOLD) for sid in open_ + extra))
            assert await a.until(lambda: len(a.resets(ErrorCodes.REFUSED_STREAM)) == 3)
            assert a.resets(ErrorCodes.REFUSED_STREAM) == extra
            s.handlers.release.set()
            await a.send(*(data(sid, grpc_message(b"x"), end_stream=True) for sid in open_))
            assert await a.until(lambda: all(a.status(sid) is not None for sid in open_))
            assert [a.status(sid) for sid in open_] == [0, 0, 0, 0]
            await a.send(a.request(15, ECHO), data(15, grpc_message(b"y"), end_stream=True))
            assert await a.until(lambda: a.status(15) is not None)
            assert a.status(15) == 0 and a.goaways == []
    if engine == "h2":  # libnghttp2 refuses a stream without telling its user
        assert s.stats.refused_streams == 3


# ------------------------------------------------------------------------------ resets


@pytest.mark.timeout(60)
async def test_rapid_resets_get_goaway_enhance_your_calm_and_never_reach_a_handler(engine):
    # 400 in one write: under the engine's reset-rate burst, so the premature-reset rule is
    # what ends it (on one read libnghttp2 would meet its own rate limit first)
    async with served(engine, premature_reset_min_streams=100) as s:
        with anyio.fail_after(BOUND):
            async with Attacker.connect(s.port) as a:
                burst = []
                for i in range(400):
                    sid = 1 + 2 * i
                    short = grpc_message(b"x" * 64)[:-1]  # the request one byte short
                    burst += [a.request(sid, HOLD), data(sid, short), rst(sid)]
                await a.send(*burst)
                assert await a.until(lambda: bool(a.goaways))
                assert await a.until_eof(BOUND)
            assert goaway_of(a) == (CALM, b"too_many_premature_resets")
            await until(
                lambda: s.server.running_calls() == 0 and not s.server.connections,
                BOUND,
                "all ended",
            )
            await healthy(s.port)
    assert s.handlers.entered == 1  # the health check: no reset call reached its handler
    assert s.stats.premature_resets >= 51
    assert s.stats.goaways["ENHANCE_YOUR_CALM"] == 1


@pytest.mark.timeout(60)
async def test_a_moderate_share_of_early_cancellations_does_not_trip_the_reset_rule(engine):
    async with served(engine, premature_reset_min_streams=20) as s, Attacker.connect(s.port) as a:
        with anyio.fail_after(BOUND):
            for i in range(120):
                sid = 1 + 2 * i
                frames = [a.request(sid, ECHO)]
                if i % 5 < 2:  # 40% cancelled before the request is complete
                    frames += [data(sid, b"\x00\x00"), rst(sid)]
                else:
                    frames.append(data(sid, grpc_message(b"ok"), end_stream=True))
                await a.send(*frames)
                if i % 5 >= 2:
                    assert await a.until(lambda sid=sid: a.status(sid) is not None), sid
                    assert a.status(sid) == 0
            assert a.goaways == [] and not a.eof
    assert s.stats.premature_resets == 48


@pytest.mark.timeout(60)
async def test_a_reset_flood_that_reconnects_meets_a_stricter_judge_each_time(engine):
    """A peer (127.0.0.2) floods rapid resets and reconnects after each GOAWAY: probation
    halves the window its next connection is judged over, down to the floor, so each ends
    after fewer streams than the one before; a well-behaved client from 127.0.0.1 is served
    between the rounds."""
    async with served(engine, premature_reset_min_streams=128) as s:
        ended_after = []
        for _ in range(6):
            before = s.stats.premature_resets
            with anyio.fail_after(BOUND):
                async with Attacker.connect(s.port, local_host="127.0.0.2") as a:
                    burst = []
                    for i in range(200):
                        sid = 1 + 2 * i
                        short = grpc_message(b"x" * 64)[:-1]
                        burst += [a.request(sid, HOLD), data(sid, short), rst(sid)]
                    await a.send(*burst)
                    assert await a.until(lambda: bool(a.goaways))
                    assert await a.until_eof(BOUND)
            assert goaway_of(a) == (CALM, b"too_many_premature_resets")
            ended_after.append(s.stats.premature_resets - before)
            await healthy(s.port)
    windows = [128, 64, 32, 16, 8, 8]
    assert all(n >= w for n, w in zip(ended_after, windows, strict=True)), ended_after
    assert ended_after[-1] < ended_after[0] // 4, ended_after
    assert s.handlers.entered == 6  # the health checks only


@pytest.mark.timeout(60)
async def test_a_peer_opening_connections_beyond_its_rate_has_them_closed_at_once(engine):
    """Two connections a second for 127.0.0.2: of twenty opened in a row most are closed
    at once (counted ``peer_rate``); 127.0.0.1 opens its own two."""
    async with served(engine, max_connections_per_peer_per_second=2) as s:
        with anyio.fail_after(BOUND):
            for _ in range(20):
                async with Attacker.connect(s.port, local_host="127.0.0.2", preface=False):
                    pass
        # 2 at once, then 2 a second: at least 10 of 20 refused unless the accepts took 4 s
        await until(lambda: s.stats.refused_connections["peer_rate"] >= 10, BOUND, "10 refused")
        await healthy(s.port)  # another address: its own two a second
        await healthy(s.port)


@pytest.mark.timeout(60)
async def test_data_for_a_reset_stream_is_still_given_back_to_the_connection_window(engine):
    """A 64 KiB connection window: 60 KiB sent on a stream the client reset, then a 30 KiB
    request, which fits only if the first was acknowledged (h2 gives a window back once half
    of it is used)."""
    window = dict(connection_window_bytes=65535, stream_window_bytes=65535)
    async with (
        served(engine, **window, max_frame_bytes=1 << 14) as s,
        Attacker.connect(s.port) as a,
    ):
        with anyio.fail_after(BOUND):
            body = grpc_message(b"z" * (60 << 10))
            await a.send(a.request(1, ECHO), data(1, b"\x00\x00"), rst(1))
            pieces = [body[i : i + 16384] for i in range(0, len(body), 16384)]
            await a.send(*(data(1, p) for p in pieces))

            def given_back() -> int:
                return sum(
                    f.window_increment
                    for f in a.frames
                    if isinstance(f, WindowUpdateFrame) and f.stream_id == 0
                )

            assert await a.until(lambda: given_back() >= 32 << 10)
            await a.send(a.request(3, ECHO))
            body = grpc_message(b"z" * (30 << 10))
            pieces = [body[i : i + 16384] for i in range(0, len(body), 16384)]
            await a.send(
                *(data(3, p, end_stream=n == len(pieces) - 1) for n, p in enumerate(pieces))
            )
            assert await a.until(lambda: a.status(3) is not None)
            assert a.status(3) == 0
    assert s.handlers.entered == 1


# ------------------------------------------------------------------------------ header blocks


@pytest.mark.timeout(60)
async def test_a_continuation_hold_gets_goaway_before_the_block_passes_the_cap(engine):
    """h2: the frame guard's header-block rule; libnghttp2: its CONTINUATION count and
    header-list bounds. Either way GOAWAY(ENHANCE_YOUR_CALM) before the block is held."""
    cap = 16 << 10
    async with served(engine, max_header_list_bytes=cap) as s:
        with anyio.fail_after(BOUND):
            async with Attacker.connect(s.port) as a:
                head = raw_frame(0x1, 0, 1, a.header_block(ECHO))  # HEADERS, no END_HEADERS
                sent = len(head)
                await a.send(head)
                while not a.goaways and sent <= cap + (4 << 10):
                    if not await a.send(continuation(1, b"\x00" * 1024)):
                        break
                    sent += 1024
                    with anyio.move_on_after(0.05):
                        await a.receive()
                await a.until(lambda: bool(a.goaways), BOUND)
            assert goaway_of(a)[0] == CALM
            if engine == "h2":  # h2 buffers a whole block: one announced at 1 MiB is refused
                # at its frame header (libnghttp2 decodes a block as it streams in, and holds
                # none of it)
                async with Attacker.connect(s.port) as b:
                    await b.send(raw_frame(0x1, 0, 1, b.header_block(ECHO)))
                    await b.send(continuation(1, b"\x00" * (1 << 20))[: 9 + 1000])
                    await b.until(lambda: bool(b.goaways), BOUND)
                assert goaway_of(a) == goaway_of(b) == (CALM, b"header_block_too_large")
            await healthy(s.port)
    assert s.stats.goaways["ENHANCE_YOUR_CALM"] == (2 if engine == "h2" else 1)


# ------------------------------------------------------------------------------ floods


FLOODS = {
    "settings": lambda: settings(),
    "window_update": lambda: window_update(0, 1),
    "priority": lambda: priority(3),
    "empty_data": lambda: data(1, b""),
    "unknown_type": lambda: raw_frame(0xFA, 0, 0, b"abcd"),
}


FLOOD_DEBUG = {"h2": b"control_frame_flood", "ngh2": None}
"""The GOAWAY's debug data per engine (None: libnghttp2's own words, not checked)."""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", list(FLOODS))
async def test_a_control_frame_flood_gets_goaway_and_a_trickle_does_not(kind: str, engine: str):
    """On ngh2, SETTINGS and PING floods meet libnghttp2's bound on queued acknowledgements and
    the others its glitch rate; a WINDOW_UPDATE flood is one it leaves alone (it answers
    nothing to one, docs/limits.md), so there the connection serves on."""
    frame = FLOODS[kind]()
    async with served(engine, max_control_frames_per_second=200) as s:
        with anyio.fail_after(BOUND):
            async with Attacker.connect(s.port) as calm:  # within the rate
                await calm.send(calm.request(1, HOLD), frame * 50)
                await calm.send(ping(b"trickle!"))
                assert await calm.until(lambda: calm.ping_acks() == 1)
                assert calm.goaways == []
            async with Attacker.connect(s.port) as a:
                await a.send(a.request(1, HOLD), frame * 5000)
                if engine == "ngh2" and kind == "window_update":
                    await a.send(ping(b"served!!"))
                    assert await a.until(lambda: a.ping_acks() == 1)
                    assert a.goaways == []
                    return
                assert await a.until(lambda: bool(a.goaways), BOUND)
                assert await a.until_eof(BOUND)
            code, debug = goaway_of(a)
            assert code == CALM
            if FLOOD_DEBUG[engine] is not None:
                assert debug == FLOOD_DEBUG[engine]
            await healthy(s.port)


@pytest.mark.timeout(60)
async def test_a_ping_flood_gets_too_many_pings_and_a_keepalive_within_the_rule_does_not(engine):
    rule = dict(min_ping_interval_seconds=0.2, max_ping_strikes=2)
    async with served(engine, **rule) as s:
        with anyio.fail_after(BOUND):
            async with Peer.connect(s.port) as keepalive:
                for n in range(3):  # each one at least the interval after the last
                    before = anyio.current_time()
                    await keepalive.ping(b"keep%04d" % n)
                    await echo_ok(keepalive)  # data flows between pings too
                    await keepalive.ping(b"data%04d" % n)
                    # the spacing is the subject: more than the interval passes between pings
                    await anyio.sleep(max(0.0, 0.35 - (anyio.current_time() - before)))
                assert keepalive.goaways == []
            async with Attacker.connect(s.port) as a:
                await a.send(*(ping(b"%08d" % n) for n in range(10)))
                assert await a.until(lambda: bool(a.goaways), BOUND)
                assert await a.until_eof(BOUND)
            assert goaway_of(a) == (CALM, b"too_many_pings")
            await healthy(s.port)


@pytest.mark.timeout(60)
async def test_a_reply_the_server_sends_resets_the_ping_strikes(engine):
    """Three quick pings are two strikes; the reply to the client's call (data we send, none
    received) starts them over, so three more are not the third strike."""
    rule = dict(min_ping_interval_seconds=10.0, max_ping_strikes=2)
    async with served(engine, **rule) as s, Attacker.connect(s.port) as a:
        with anyio.fail_after(BOUND):
            await a.send(a.request(1, HOLD), data(1, grpc_message(b"x"), end_stream=True))
            await until(lambda: s.handlers.entered == 1, BOUND, "the call entered")
            await a.send(*(ping(b"before%02d" % n) for n in range(3)))
            assert await a.until(lambda: a.ping_acks() == 3)
            s.handlers.release.set()
            assert await a.until(lambda: a.status(1) == 0)
            await a.send(*(ping(b"after%03d" % n) for n in range(3)))
            assert await a.until(lambda: a.ping_acks() == 6)
            assert a.goaways == []
            await a.send(ping(b"toomany!"))  # now the third strike
            assert await a.until(lambda: bool(a.goaways))
            assert goaway_of(a) == (CALM, b"too_many_pings")


# ------------------------------------------------------------------------------ idle, handshake


@pytest.mark.timeout(60)
async def test_an_idle_connection_gets_goaway_no_error_and_a_busy_one_does_not(engine):
    async with served(engine, idle_seconds=0.3) as s:
        with anyio.fail_after(BOUND):
            async with Attacker.connect(s.port) as busy:  # a call longer than the idle time
                await busy.send(busy.request(1, HOLD), data(1, grpc_message(b"x"), end_stream=True))
                await until(lambda: s.handlers.entered == 1, BOUND, "the call entered")
                await anyio.sleep(0.9)  # three idle times pass with the call open: no GOAWAY
                s.handlers.release.set()
                assert await busy.until(lambda: busy.status(1) == 0)
                assert await busy.until(lambda: bool(busy.goaways), BOUND)  # idle after it
                assert await busy.until_eof(BOUND)
            kinds = [f.__class__ for f in busy.frames]
            trailers = max(i for i, kind in enumerate(kinds) if kind is HeadersFrame)
            assert kinds.index(GoAwayFrame) > trailers  # never while the call ran
            frame = busy.goaways[-1]
            assert (frame.error_code, frame.last_stream_id) == (0, 1)
    assert s.stats.refused_connections["idle"] == 1
    assert s.stats.goaways["NO_ERROR"] >= 1


@pytest.mark.timeout(60)
async def test_a_silent_connection_is_closed_at_the_handshake_deadline_and_a_prompt_one_is_not(
    engine,
):
    async with served(engine, handshake_seconds=0.3, idle_seconds=0) as s:
        with anyio.fail_after(BOUND):
            async with Attacker.connect(s.port, preface=False) as silent:
                assert await silent.until_eof(BOUND)
            async with Attacker.connect(s.port, preface=False) as half:  # preface, no SETTINGS
                await half.send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                assert await half.until_eof(BOUND)
            async with Peer.connect(s.port) as prompt:
                await anyio.sleep(0.9)  # three handshake times pass: a prompt one is not cut
                await echo_ok(prompt)
                assert prompt.goaways == []
    assert s.stats.refused_connections["handshake_timeout"] == 2


async def hold_call(attacker: Attacker, handlers: Handlers, calls: int) -> None:
    """A Hold call on stream 1 of ``attacker``, in flight once it is the ``calls``-th."""
    await attacker.send(attacker.request(1, HOLD), data(1, grpc_message(b"x"), end_stream=True))
    await until(lambda: handlers.entered == calls, BOUND, f"{calls} calls entered")


@pytest.mark.timeout(60)
async def test_at_the_cap_the_longest_idle_connection_is_evicted_and_a_busy_one_never(engine):
    async with served(engine, max_connections=3) as s:
        with anyio.fail_after(BOUND):
            async with (
                Attacker.connect(s.port, preface=False) as bare,
                Attacker.connect(s.port) as idle,
                Attacker.connect(s.port) as busy,
            ):
                assert await idle.until(idle.settings_acked)  # it spoke HTTP/2
                await hold_call(busy, s.handlers, 1)
                async with Attacker.connect(s.port) as first:  # the longest idle goes: bare
                    assert await bare.until_eof(BOUND)
                    assert bare.goaways == []  # it never spoke HTTP/2
                    await hold_call(first, s.handlers, 2)
                    async with Attacker.connect(s.port) as second:  # then idle, with a GOAWAY
                        assert await idle.until_eof(BOUND)
                        assert [(f.error_code, f.last_stream_id) for f in idle.goaways] == [(0, 0)]
                        await hold_call(second, s.handlers, 3)
                        async with Attacker.connect(s.port, preface=False) as refused:
                            assert await refused.until_eof(BOUND)  # every one busy: refused
                            assert refused.frames == []
                        s.handlers.release.set()
                        for one in (busy, first, second):
                            assert await one.until(lambda one=one: one.status(1) == 0)
                            assert one.goaways == [] and not one.eof
        assert s.stats.refused_connections == {"evicted_idle": 2, "max_connections": 1}
        assert s.stats.goaways == {"NO_ERROR": 1}


@pytest.mark.timeout(60)
async def test_the_drain_goaways_are_counted(engine):
    async with served(engine) as s:
        peer_cm = Peer.connect(s.port)
        async with peer_cm as peer:
            await echo_ok(peer)
            with anyio.fail_after(BOUND):
                await s.server.shutdown(1.0)
    assert s.stats.goaways["NO_ERROR"] == 2  # the drain's two phases

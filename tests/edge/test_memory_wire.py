"""The memory bounds of ``serving.grpc`` in process, on asyncio and trio, driven by a raw
HTTP/2 peer: the connection's inbound buffer stops the socket being read, a reply that cannot
make progress is reset, a message that stops half-way meets its receive deadline, the bytes in
flight refuse a unary call and hold a stream back, and a bomb inflates a bounded step at a time.
"""

from __future__ import annotations

import dataclasses

import anyio
import h2.settings
import pytest
from h2.errors import ErrorCodes

from kserve_trio.core.errors import ResourceExhausted
from kserve_trio.core.process.config import EdgeLimits
from kserve_trio.core.protocol import compression
from kserve_trio.serving.admission import InflightBytes
from kserve_trio.serving.grpc import (
    Call,
    GrpcServer,
    Limits,
    RawMessage,
    ServerSettings,
    raw_unary,
    stream,
)
from tests.serving.bomb import zero_bomb
from tests.serving.grpc.h2_peer import Peer, grpc_frame
from tests.waiting import until

pytestmark = pytest.mark.anyio

MiB = 1 << 20
BOUND = 20  # seconds: the bound on every outcome
EDGE = EdgeLimits(
    max_connection_buffer_bytes=1 * MiB,
    send_stall_seconds=0.5,
    message_receive_seconds=0.5,
)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


class Handlers:
    def __init__(self, budget: InflightBytes) -> None:
        self.budget = budget
        self.limits = Limits(8 * MiB, 8 * MiB, inflight=budget)
        self.never = anyio.Event()

    async def hold(self, call: Call) -> None:
        """A stream handler that reads nothing."""
        await self.never.wait()

    async def echo(self, call: Call, message: RawMessage) -> bytes:
        return bytes(call.plain(message))

    async def big(self, call: Call, message: RawMessage) -> bytes:
        return b"x" * (256 << 10)

    async def echo_stream(self, call: Call) -> None:
        while (message := await call.receive(wait=True)) is not None:
            await call.send(bytes(call.plain(message)))
            call.done_with(message)

    def methods(self) -> dict:
        lim = self.limits
        return {
            "/t.T/Hold": stream(self.hold, lim, "Hold"),
            "/t.T/Echo": raw_unary(self.echo, lim, "Echo"),
            "/t.T/Big": raw_unary(self.big, lim, "Big"),
            "/t.T/EchoStream": stream(self.echo_stream, lim, "EchoStream"),
        }


@dataclasses.dataclass
class Served:
    server: GrpcServer
    port: int
    handlers: Handlers


async def serve(test, budget_bytes: int = 0, share_bytes: int = 0, edge: EdgeLimits = EDGE) -> None:
    handlers = Handlers(InflightBytes(budget_bytes, share_bytes))
    server = GrpcServer(handlers.methods(), ServerSettings(limits=edge))
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.serve, "127.0.0.1", 0)
        try:
            with anyio.fail_after(BOUND):
                await test(Served(server, port, handlers))
        finally:
            handlers.never.set()
            with anyio.fail_after(BOUND):
                await server.shutdown(0.5)


async def opened(peer: Peer) -> None:
    await peer.until(lambda: peer.conn.outbound_flow_control_window > 1 << 20)


@pytest.mark.timeout(60)
async def test_a_connection_whose_calls_take_nothing_stops_being_read():
    async def test(s: Served) -> None:
        async with Peer.connect(s.port) as peer:
            await opened(peer)
            sid = peer.open("/t.T/Hold")
            chunk = b"\0" * (64 << 10)
            sent = 0
            while sent < 48 * MiB and peer.conn.local_flow_control_window(sid) >= len(chunk):
                peer.conn.send_data(sid, chunk)
                with anyio.move_on_after(0.5) as write:
                    await peer.flush()
                if write.cancelled_caught:
                    break
                sent += len(chunk)
            (conn,) = s.server.connections
            assert sent < 24 * MiB  # the 64 MiB stream window was never the bound
            assert conn.inbound_bytes <= EDGE.max_connection_buffer_bytes + 2 * MiB

    await serve(test)


@pytest.mark.timeout(60)
async def test_a_reply_a_window_0_client_never_lets_out_is_reset_after_the_stall():
    async def test(s: Served) -> None:
        settings = {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0}
        async with Peer.connect(s.port, settings) as peer:
            await opened(peer)
            reply = await peer.call("/t.T/Big", grpc_frame(b"go"))
            assert reply.reset == ErrorCodes.CANCEL
        async with Peer.connect(s.port) as peer:
            assert (await peer.call("/t.T/Echo", grpc_frame(b"ok"))).status == 0

    await serve(test)


@pytest.mark.timeout(60)
async def test_a_message_that_stops_half_way_meets_its_receive_deadline():
    async def test(s: Served) -> None:
        async with Peer.connect(s.port) as peer:
            await opened(peer)
            sid = peer.open("/t.T/Echo")
            peer.conn.send_data(sid, grpc_frame(b"\0" * 1000)[:600])
            await peer.flush()
            reply = await peer.wait(sid)
            assert reply.status == 4, reply  # DEADLINE_EXCEEDED
            assert "limits.message_receive_seconds" in reply.message

    await serve(test)


@pytest.mark.timeout(60)
async def test_past_the_bytes_in_flight_a_unary_call_is_refused_and_a_stream_waits():
    async def test(s: Served) -> None:
        budget = s.handlers.budget
        async with Peer.connect(s.port) as holder, Peer.connect(s.port) as other:
            await opened(holder)
            await opened(other)
            held = holder.open("/t.T/Echo")
            body = grpc_frame(b"\0" * (3 * MiB + 1000))[: 3 * MiB]  # 3 MiB of it, not all
            await holder.send_body(held, body, end=False)
            await until(lambda: budget.used >= 3 * MiB - 10, BOUND, "3 MiB held")
            refused = await other.call("/t.T/Echo", grpc_frame(b"\0" * (2 * MiB)))
            assert refused.status == 8 and "in-flight bytes cap" in refused.message
            sid = other.open("/t.T/EchoStream")
            await other.flush()
            await other.send_body(sid, grpc_frame(b"y" * (2 * MiB)))
            reply = await other.wait(sid)  # after the holder's receive deadline frees room
            assert holder.replies[held].status == 4 or (await holder.wait(held)).status == 4
            assert (reply.status, reply.messages) == (0, [b"y" * (2 * MiB)])
        await until(lambda: not budget.used, BOUND, "the bytes freed")

    await serve(test, budget_bytes=4 * MiB)


@pytest.mark.timeout(60)
async def test_silent_announcers_hold_none_of_the_bytes_in_flight():
    """Streams whose prefixes announce large messages and send nothing more (a few bytes on the
    wire each) are charged nothing: every other client keeps being served, until the
    announcers' receive deadline ends them."""

    async def test(s: Served) -> None:
        budget = s.handlers.budget
        async with Peer.connect(s.port) as silent, Peer.connect(s.port) as other:
            await opened(silent)
            for _ in range(8):
                sid = silent.open("/t.T/Echo")
                silent.conn.send_data(sid, grpc_frame(b"\0" * (3 * MiB))[:10])  # 3 MiB each
            await silent.flush()
            for n in range(3):
                reply = await other.call("/t.T/Echo", grpc_frame(b"z" * (2 * MiB)))
                assert (reply.status, len(reply.messages[0])) == (0, 2 * MiB), (n, reply)
            assert budget.used <= 8 * 10
            stream_sid = other.open("/t.T/EchoStream")
            await other.flush()
            await other.send_body(stream_sid, grpc_frame(b"s" * MiB))
            reply = await other.wait(stream_sid)
            assert (reply.status, reply.messages) == (0, [b"s" * MiB])

    await serve(test, budget_bytes=4 * MiB)


@pytest.mark.timeout(60)
async def test_a_connection_past_its_share_waits_for_the_lane_and_both_messages_get_through():
    """Two connections each send 3 of a 4 MiB message with a 2 MiB share per connection: the
    first takes the lane and is charged its 3 MiB, the second is charged at most its share and
    read no further (what came uncharged sits in its inbound buffer), a third client is served
    meanwhile; once the first message is whole the second takes the lane and is whole too."""
    share = 2 * MiB
    whole = 4 * MiB

    async def test(s: Served) -> None:
        budget = s.handlers.budget
        body = grpc_frame(b"f" * whole)
        async with (
            Peer.connect(s.port) as first,
            Peer.connect(s.port) as second,
            Peer.connect(s.port) as other,
        ):
            for peer in (first, second, other):
                await opened(peer)
            one = first.open("/t.T/Echo")
            await first.send_body(one, body[: 3 * MiB], end=False)
            await until(lambda: budget.used >= 3 * MiB - 5, BOUND, "3 MiB held")
            (lane,) = [c.share(budget) for c in s.server.connections if c.share(budget).arriving]
            assert budget.lane is lane
            two = second.open("/t.T/Echo")
            await second.send_body(two, body[: 3 * MiB], end=False)
            buffer = EDGE.max_connection_buffer_bytes

            def held_back() -> list:
                """The second connection once charged up to its share and then read until its
                inbound buffer is full (and no more)."""
                return [
                    c
                    for c in s.server.connections
                    if c.share(budget) is not lane
                    and c.share(budget).arriving
                    and c.inbound_bytes >= buffer
                ]

            await until(held_back, BOUND, "a connection held back")
            (waiting,) = held_back()
            assert waiting.share(budget).arriving <= share
            reply = await other.call("/t.T/Echo", grpc_frame(b"o" * MiB))
            assert (reply.status, reply.messages) == (0, [b"o" * MiB])
            assert budget.lane is lane
            await first.send_body(one, body[3 * MiB :])
            assert (await first.wait(one)).messages == [b"f" * whole]
            await second.send_body(two, body[3 * MiB :])
            assert (await second.wait(two)).messages == [b"f" * whole]
        await until(lambda: not budget.used, BOUND, "the bytes freed")
        assert budget.lane is None

    edge = dataclasses.replace(EDGE, message_receive_seconds=BOUND)
    await serve(test, budget_bytes=16 * MiB, share_bytes=share, edge=edge)


@pytest.mark.timeout(60)
async def test_a_message_whole_before_its_connection_gets_the_lane_is_served_whole():
    """A unary call past its connection's share sends all of its message and the end of its
    stream while another connection holds the lane: the server has read all of it when the
    lane frees, and the call is served the whole message (the end of the stream that came
    while the charge waited was once taken for a truncated message)."""
    share = 2 * MiB
    whole = 4 * MiB

    async def test(s: Served) -> None:
        budget = s.handlers.budget
        body = grpc_frame(b"f" * whole)
        async with Peer.connect(s.port) as first, Peer.connect(s.port) as second:
            for peer in (first, second):
                await opened(peer)
            one = first.open("/t.T/Echo")
            await first.send_body(one, body[: 3 * MiB], end=False)
            await until(
                lambda: budget.lane is not None and budget.used >= 3 * MiB - 5, BOUND, "a lane"
            )
            two = second.open("/t.T/Echo")
            await second.send_body(two, body)  # all of it, and the end of the stream
            await second.ping(b"read all")  # acknowledged once every frame before it was read
            assert not second.replies[two].done and budget.lane is not None
            await first.send_body(one, body[3 * MiB :])
            assert (await first.wait(one)).messages == [b"f" * whole]
            reply = await second.wait(two)
            assert (reply.status, reply.messages) == (0, [b"f" * whole]), reply.message
        await until(lambda: budget.used == 0 and budget.lane is None, BOUND, "all freed")

    edge = dataclasses.replace(
        EDGE, message_receive_seconds=BOUND, max_connection_buffer_bytes=16 * MiB
    )
    await serve(test, budget_bytes=16 * MiB, share_bytes=share, edge=edge)


@pytest.mark.timeout(60)
def test_a_bomb_inflates_in_bounded_steps_and_is_refused_past_its_cap():
    cap = 16 * MiB
    inflater = compression.Inflater(zero_bomb(256 * MiB, "gzip"), "gzip", cap)
    steps = 0
    with pytest.raises(ResourceExhausted, match="received message larger than max"):
        while not inflater.done:
            assert inflater.step() <= compression.INFLATE_STEP_BYTES
            assert inflater.size <= cap + compression.INFLATE_STEP_BYTES
            steps += 1
    assert steps >= cap // compression.INFLATE_STEP_BYTES


@pytest.mark.timeout(60)
def test_one_request_alone_is_admitted_whatever_the_bytes_in_flight():
    budget = InflightBytes(10)
    budget.charge(100)  # alone: admitted past the cap
    with pytest.raises(ResourceExhausted):
        budget.charge(1)  # someone else's
    budget.charge(5, own=100)  # its own further bytes
    budget.release(105)
    assert budget.used == 0 and budget.refused == 1

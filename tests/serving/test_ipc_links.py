"""The channel's two ends against each other in one process: a front end's ``DeviceLink`` and
the device process's ``FrontendLink`` over a real Unix socket pair and real memfd arenas, the
device's calls served by a scripted ``RpcServer``.

What is pinned: every message is a frozen dataclass (never a tuple) that crosses the channel
equal to itself; a call reaches the server as its class with its fields (the trace context
among them) and its answer comes back with its status, reply and detail; a client's cancel
cancels the device's work and is still answered; a request slot is never reused while the
device may read it; reply slots come back (``Free``) so the reply arena keeps serving; a
message or reply that does not fit its arena travels in the frame; and whichever end dies,
the other learns it: the device cancels the dead front end's work, a front end answers its
waiting calls UNAVAILABLE.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import socket
import typing
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import anyio.abc
import pytest

from kserve_trio.core.errors import NotFound, StatusCode
from kserve_trio.core.logging import LogSettings
from kserve_trio.core.process.config import ServerConfig
from kserve_trio.serving import ipc
from kserve_trio.serving.ipc import (
    DEVICE_GONE_TEXT,
    Arena,
    Call,
    Channel,
    DeviceLink,
    Drain,
    Edge,
    ForwardedRpc,
    FrontendLink,
    Hello,
    InferCall,
    Log,
    Ready,
    Reply,
    RestCall,
    RestHead,
    RpcShape,
    StreamCall,
    StreamOrigin,
    UnaryCall,
    read_hello,
)

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])]

ARENA = 4096
TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\nvendor=x"

Serve = Callable[[Call, bytes, int], Awaitable[Reply]]


class Scripted:
    """An ``RpcServer`` whose answer the test chooses; it records what it was asked."""

    def __init__(self, answer: Serve) -> None:
        self.answer = answer
        self.seen: list[tuple[Call, bytes, int]] = []

    async def serve(self, call: Call, data, deadline_ns: int) -> Reply:
        self.seen.append((call, bytes(data), deadline_ns))
        return await self.answer(call, data, deadline_ns)


async def echo(call: Call, data, deadline_ns: int) -> Reply:
    return Reply([b"re:", bytes(data)])


@dataclass
class Pair:
    """Both ends of one channel, running."""

    device: FrontendLink
    frontend: DeviceLink
    server: Scripted
    logs: list[LogSettings] = field(default_factory=list)
    drained: anyio.Event = field(default_factory=anyio.Event)
    device_ended: anyio.Event = field(default_factory=anyio.Event)
    frontend_ended: anyio.Event = field(default_factory=anyio.Event)
    sockets: tuple[socket.socket, socket.socket] | None = None


def _arena_pair(size: int) -> tuple[Arena, Arena]:
    fd = Arena.create_fd("kserve_trio-test-links", size)
    try:
        return Arena(fd, size), Arena(fd, size)
    finally:
        os.close(fd)


@contextlib.asynccontextmanager
async def linked(
    answer: Serve = echo, *, request_arena: int = ARENA, reply_arena: int = ARENA
) -> AsyncIterator[Pair]:
    device_sock, frontend_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    requests_device, requests_frontend = _arena_pair(request_arena)
    replies_device, replies_frontend = _arena_pair(reply_arena)
    device_channel = Channel(await anyio.abc.SocketStream.from_socket(device_sock))
    frontend_channel = Channel(await anyio.abc.SocketStream.from_socket(frontend_sock))
    server = Scripted(answer)
    pair = Pair(
        FrontendLink(0, device_channel, requests_device, replies_device, server),
        DeviceLink(frontend_channel, requests_frontend, replies_frontend),
        server,
        sockets=(device_sock, frontend_sock),
    )

    async def run_device() -> None:
        await pair.device.serve()
        pair.device_ended.set()

    async def run_frontend() -> None:
        with contextlib.suppress(ipc.ChannelClosed):
            async with anyio.create_task_group() as tg:
                tg.start_soon(frontend_channel.run_writer)
                await pair.frontend.run_reader(pair.drained.set, pair.logs.append)
                tg.cancel_scope.cancel()
        pair.frontend_ended.set()

    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run_device)
                tg.start_soon(run_frontend)
                yield pair
                tg.cancel_scope.cancel()
    finally:
        await frontend_channel.aclose()
        requests_frontend.close()
        replies_frontend.close()


async def until(condition: Callable[[], object], what: str) -> None:
    """Wait for ``condition`` (checked as the event loop turns) within the test's deadline."""
    with anyio.fail_after(10):
        while not condition():
            await anyio.sleep(0.001)


# ---------------------------------------------------------------- the messages


def _message_classes() -> list[type]:
    return [c for c in typing.get_args(ipc.Message)]


def test_every_message_is_a_frozen_dataclass_not_a_tuple(anyio_backend):
    classes = _message_classes()
    assert {c.__name__ for c in classes} == {
        "Ready",
        "Request",
        "Cancel",
        "Free",
        "Edge",
        "Pong",
        "Hello",
        "Done",
        "Log",
        "Drain",
        "Ping",
    }
    for cls in [*classes, *typing.get_args(ipc.Call), ipc.Slot, StreamOrigin, RestHead]:
        assert dataclasses.is_dataclass(cls), cls
        assert cls.__dataclass_params__.frozen, cls  # type: ignore[attr-defined]
        assert not issubclass(cls, tuple), cls
        assert hasattr(cls, "__slots__"), cls


def test_messages_cross_pickle_equal_to_themselves(anyio_backend):
    config = ServerConfig()
    rpcs = (ForwardedRpc("/p/ServerLive", "ServerLive", RpcShape.UNARY),)
    messages = [
        Ready(8001, 8000),
        ipc.Request(7, InferCall(TRACE), 123, ipc.Slot(128, 1000)),
        ipc.Request(8, RestCall("POST", "/v2", "a=1", {"x": "y"}), 0, b"body"),
        ipc.Cancel(7),
        ipc.Free((0, 64)),
        Edge("worker_edge 1\n"),
        ipc.Pong(3),
        Hello(config, 2, rpcs, "shutting down"),
        ipc.Done(7, 0, "", ipc.Slot(0, 10), StreamOrigin("m", "id")),
        ipc.Done(8, 0, "", b"{}", RestHead(200, "application/json", (("a", "b"),))),
        Log(LogSettings()),
        Drain(),
        ipc.Ping(3),
    ]
    batch = pickle.loads(pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL))
    assert batch == messages
    assert [type(m) for m in batch] == [type(m) for m in messages]


def test_a_front_end_reads_its_hello_before_any_event_loop(anyio_backend):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    hello = Hello(ServerConfig(), 1, (), "bye")

    async def send() -> None:
        channel = Channel(await anyio.abc.SocketStream.from_socket(a))
        channel.send(hello)
        channel.send(ipc.Ping(1))
        async with anyio.create_task_group() as tg:
            tg.start_soon(channel.run_writer)
            await until(lambda: channel.frames_sent == 1, "the first frame written")
            tg.cancel_scope.cancel()
        await channel.aclose()

    anyio.run(send, backend=anyio_backend)
    try:
        assert read_hello(b) == hello
    finally:
        b.close()


def test_a_channel_that_starts_otherwise_is_refused(anyio_backend):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.close()
    with pytest.raises(ipc.ChannelClosed):
        read_hello(b)
    b.close()


# ---------------------------------------------------------------- calls and answers


async def test_each_call_class_reaches_the_server_with_its_fields_and_is_answered():
    async def answer(call: Call, data, deadline_ns: int) -> Reply:
        match call:
            case StreamCall():
                return Reply([b"stream"], StreamOrigin("mlp", "r1"))
            case RestCall():
                return Reply([b"{}"], RestHead(201, "application/json", (("x-a", "1"),)))
        return Reply([b"re:", bytes(data)])

    async with linked(answer) as pair:
        link = pair.frontend
        unary = await link.request(UnaryCall("ServerLive"), b"\x01\x02", 111)
        infer = await link.request(InferCall(TRACE), b"x" * 500, 222)
        streamed = await link.request(StreamCall(None), b"s", 333)
        rest = await link.request(RestCall("POST", "/v2/models/m/infer", "", {"h": "v"}), b"{", 0)

    assert [c for c, _, _ in pair.server.seen] == [
        UnaryCall("ServerLive"),
        InferCall(TRACE),
        StreamCall(None),
        RestCall("POST", "/v2/models/m/infer", "", {"h": "v"}),
    ]
    assert pair.server.seen[1][1:] == (b"x" * 500, 222), "the message and deadline as sent"
    assert (unary.status, unary.reply, unary.detail) == (0, b"re:\x01\x02", None)
    assert infer.reply == b"re:" + b"x" * 500
    assert (streamed.reply, streamed.detail) == (b"stream", StreamOrigin("mlp", "r1"))
    assert (rest.reply, rest.detail) == (b"{}", RestHead(201, "application/json", (("x-a", "1"),)))
    assert pair.device.served == 4
    assert pair.frontend.served == 3, "unary RPCs are not the idle trim's activity"


async def test_a_failure_is_answered_with_its_status():
    async def answer(call: Call, data, deadline_ns: int) -> Reply:
        if isinstance(call, UnaryCall):
            raise NotFound("no such model")
        raise RuntimeError("a bug")

    async with linked(answer) as pair:
        missing = await pair.frontend.request(UnaryCall("ModelReady"), b"", 0)
        bug = await pair.frontend.request(InferCall(), b"x", 0)
    assert (missing.status, missing.message) == (int(StatusCode.NOT_FOUND), "no such model")
    assert bug.status == int(StatusCode.INTERNAL)
    assert "a bug" in bug.message


async def test_a_cancelled_call_cancels_the_device_work_and_its_slot_comes_back():
    started, cancelled = anyio.Event(), anyio.Event()

    async def answer(call: Call, data, deadline_ns: int) -> Reply:
        if isinstance(call, UnaryCall):
            return await echo(call, data, deadline_ns)
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()
        raise AssertionError("unreachable")

    async with linked(answer) as pair:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(pair.frontend.request, InferCall(), b"x" * 1000, 0)
                await started.wait()
                assert pair.frontend.request_bytes_held > 0
                scope.cancel()
        await cancelled.wait()
        # the device still answers (CANCELLED), and only that answer gives the slot back
        await until(lambda: pair.frontend.request_bytes_held == 0, "the request slot back")
        assert pair.device.in_flight == 0
        assert pair.frontend.in_flight == 0
        after = await pair.frontend.request(UnaryCall("ServerLive"), b"ok", 0)
    assert after.reply == b"re:ok", "the link serves on after a cancel"


async def test_a_request_slot_is_not_reused_while_the_device_still_reads_it():
    """The client gives up, but the device's work ignores the cancel for a while (a batch on
    the device): its message stays intact under later requests until it answers."""
    reading, release = anyio.Event(), anyio.Event()
    first_seen: list[bytes] = []

    async def answer(call: Call, data, deadline_ns: int) -> Reply:
        if isinstance(call, InferCall):
            with anyio.CancelScope(shield=True):
                reading.set()
                await release.wait()
                first_seen.append(bytes(data))  # read after later requests were written
        return Reply([bytes(data)])

    first = b"A" * 3000
    async with linked(answer) as pair:
        try:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(pair.frontend.request, InferCall(), first, 0)
                    await reading.wait()
                    scope.cancel()
            later = [await pair.frontend.request(UnaryCall("X"), b"B" * 3000, 0) for _ in range(3)]
            assert pair.frontend.inline == 3, "no room beside the held slot: in the frame"
        finally:
            release.set()  # never leave the shielded work waiting, a failure included
        await until(lambda: pair.frontend.request_bytes_held == 0, "the first slot back")
        again = await pair.frontend.request(UnaryCall("X"), b"C" * 3000, 0)
    assert first_seen == [first]
    assert [a.reply for a in later] == [b"B" * 3000] * 3
    assert again.reply == b"C" * 3000
    assert pair.frontend.inline == 3, "once the slot is back, the arena serves again"


async def test_reply_slots_come_back_so_the_reply_arena_keeps_serving():
    async def answer(call: Call, data, deadline_ns: int) -> Reply:
        return Reply([bytes(data) * 1000])

    async with linked(answer) as pair:
        for i in range(50):  # 50 replies of 1000 bytes through a 4096-byte arena
            answered = await pair.frontend.request(UnaryCall("X"), bytes([i]), 0)
            assert answered.reply == bytes([i]) * 1000
        await until(lambda: pair.device.reply_bytes_held == 0, "every reply slot freed")
        assert pair.device.inline_replies == 0, "every reply travelled in the arena"


async def test_what_does_not_fit_its_arena_travels_in_the_frame():
    big = os.urandom(3 * ARENA)

    async def answer(call: Call, data, deadline_ns: int) -> Reply:
        return Reply([bytes(data), bytes(data)])

    async with linked(answer) as pair:
        answered = await pair.frontend.request(InferCall(), big, 0)
        small = await pair.frontend.request(InferCall(), b"abc", 0)
    assert answered.reply == big + big
    assert pair.server.seen[0][1] == big
    assert pair.frontend.inline == 1
    assert pair.device.inline_replies == 1
    assert small.reply == b"abcabc"


async def test_many_calls_at_once_are_each_answered_with_their_own_reply():
    async def answer(call: Call, data, deadline_ns: int) -> Reply:
        await anyio.sleep(0)
        return Reply([bytes(data)])

    replies: dict[int, bytes] = {}
    async with linked(answer) as pair:

        async def one(i: int) -> None:
            replies[i] = (
                await pair.frontend.request(UnaryCall("X"), str(i).encode() * 100, 0)
            ).reply

        async with anyio.create_task_group() as tg:
            for i in range(200):
                tg.start_soon(one, i)
    assert replies == {i: str(i).encode() * 100 for i in range(200)}
    assert pair.frontend.channel.frames_sent < 200, "requests queued together share a frame"


# ---------------------------------------------------------------- the control messages


async def test_ready_edge_ping_log_and_drain_reach_the_other_end():
    async with linked() as pair:
        pair.frontend.channel.send(Ready(50051, 8000))
        pair.frontend.channel.send(Edge("worker_edge_connections 3\n"))
        await pair.device.ready.wait()
        assert pair.device.ports == (50051, 8000)
        with anyio.fail_after(10):
            assert await pair.device.ping()
        assert pair.device.edge_exposition == "worker_edge_connections 3\n"
        settings = LogSettings(log_verbose_level=1)
        pair.device.channel.send(Log(settings))
        pair.device.channel.send(Drain())
        await pair.drained.wait()
        assert pair.logs == [settings]


# ---------------------------------------------------------------- a peer that dies


async def test_a_front_end_that_dies_has_its_device_work_cancelled():
    started, cancelled = anyio.Event(), anyio.Event()

    async def answer(call: Call, data, deadline_ns: int) -> Reply:
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()
        raise AssertionError("unreachable")

    async with linked(answer) as pair:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pair.frontend.request, InferCall(), b"x", 0)
            await started.wait()
            assert pair.sockets is not None
            pair.sockets[1].shutdown(socket.SHUT_RDWR)  # the front end's end goes
            await cancelled.wait()
            await pair.device_ended.wait()
            tg.cancel_scope.cancel()
        assert pair.device.in_flight == 0


async def test_calls_waiting_on_a_device_that_dies_are_answered_unavailable():
    started = anyio.Event()

    async def answer(call: Call, data, deadline_ns: int) -> Reply:
        started.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    answers: list[ipc.Answer] = []
    async with linked(answer) as pair:

        async def call() -> None:
            answers.append(await pair.frontend.request(InferCall(), b"x", 0))

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await started.wait()
            assert pair.sockets is not None
            pair.sockets[0].shutdown(socket.SHUT_RDWR)  # the device's end goes
        await pair.frontend_ended.wait()
        late = await pair.frontend.request(UnaryCall("ServerLive"), b"", 0)
    gone = (int(StatusCode.UNAVAILABLE), DEVICE_GONE_TEXT)
    assert [(a.status, a.message) for a in answers] == [gone]
    assert (late.status, late.message) == gone, "a call after the end is refused at once"

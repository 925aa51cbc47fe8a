"""A cancellation that lands as one call ends never reaches the next call its task serves.

The race, forced step by step: call A's handler is woken (its result is ready), and in the same
loop turn its deadline passes (the timer cancels A) and the client's bytes for call B are queued
to arrive. A's handler then ends without another checkpoint, so the cancellation is still
undelivered when A's task goes back to wait for work, and B is handed to that very task before
the event loop would deliver it. When a task kept one cancel scope across calls, B's first
checkpoint raised A's cancellation and B was answered OK with no message (a success status
and no reply); every call now runs in a scope of its own.

The ordering is made with the event loop's own "call soon" (asyncio's ``call_soon``, trio's
``run_sync_soon``), so the test needs no timing: A's wake-up, then B's bytes, then the cancel
scope's delivery."""

from __future__ import annotations

import asyncio
import dataclasses

import anyio
import pytest
import sniffio
import trio
import trio.lowlevel

from kserve_trio.core.errors import StatusCode
from kserve_trio.http2 import (
    ENGINES,
    DataReceived,
    EngineSettings,
    ResponseReceived,
    TrailersReceived,
    new_engine,
)
from kserve_trio.serving.grpc import (
    Call,
    GrpcError,
    Limits,
    RawMessage,
    ServerConnection,
    ServerSettings,
    raw_unary,
)
from tests.serving.grpc.test_core_in_memory import REQUEST, Recorder

pytestmark = pytest.mark.anyio

LIMITS = Limits(1 << 20, 1 << 20)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    return request.param


def call_soon(fn) -> None:
    """Run ``fn`` in the event loop's next turn, after what is already queued."""
    if sniffio.current_async_library() == "asyncio":
        asyncio.get_running_loop().call_soon(fn)
    else:
        trio.lowlevel.current_trio_token().run_sync_soon(fn)


def request_bytes(client, path: str, message: bytes, timeout: str | None = None) -> int:
    headers = [(b":path", path.encode()), *REQUEST]
    if timeout:
        headers.append((b"grpc-timeout", timeout.encode()))
    sid = client.send_request(headers)
    client.send_data(sid, len(message).to_bytes(5, "big") + message, end_stream=True)
    return sid


async def test_a_cancellation_that_lands_as_a_call_ends_never_reaches_the_next(engine: str):
    woken = anyio.Event()
    entered = anyio.Event()

    async def first(call: Call, message: RawMessage) -> bytes:
        entered.set()
        await woken.wait()
        raise GrpcError(StatusCode.FAILED_PRECONDITION, "first call's own end")  # no checkpoint

    async def echo(call: Call, message: RawMessage) -> bytes:
        await anyio.lowlevel.checkpoint()  # where a stale cancellation would land
        return bytes(call.plain(message))

    methods = {
        "/t.T/First": raw_unary(first, LIMITS, "First"),
        "/t.T/Echo": raw_unary(echo, LIMITS, "Echo"),
    }
    settings = dataclasses.replace(ServerSettings(), http2_engine=engine)
    conn = ServerConnection(methods, settings, Recorder(), lambda _: None)
    client = new_engine("ngh2", EngineSettings(client=True))
    events: list = []

    def exchange() -> None:
        data = client.data_to_send()
        if data:
            conn.feed(data)
        out = conn.data_to_send()
        if out:
            events.extend(client.receive(out))

    async with anyio.create_task_group() as tg:
        conn.start()
        await tg.start(conn.run)
        client.initiate()
        exchange()
        a = request_bytes(client, "/t.T/First", b"a", timeout="1H")
        exchange()
        await entered.wait()
        (call_a,) = conn.calls.values()
        assert call_a.deadline is not None
        b = request_bytes(client, "/t.T/Echo", b"the second call's reply")
        # One synchronous step: A's wake-up is queued, then B's bytes, then A expires (its
        # cancellation cannot be delivered before A's task has run).
        woken.set()
        call_soon(exchange)
        conn.on_timer(call_a.deadline + 1.0)
        with anyio.fail_after(10):
            while not (status(events, a) is not None and status(events, b) is not None):
                await anyio.sleep(0)
                exchange()
        conn.close_calls()
    assert status(events, a) in (StatusCode.DEADLINE_EXCEEDED, StatusCode.FAILED_PRECONDITION)
    assert status(events, b) == StatusCode.OK
    assert body(events, b) == b"the second call's reply"


def status(events: list, sid: int) -> int | None:
    for event in events:
        if isinstance(event, (TrailersReceived, ResponseReceived)) and event.stream_id == sid:
            for key, value in event.headers:
                if key == b"grpc-status":
                    return int(value)
    return None


def body(events: list, sid: int) -> bytes:
    data = b"".join(e.data for e in events if isinstance(e, DataReceived) and e.stream_id == sid)
    return data[5:]

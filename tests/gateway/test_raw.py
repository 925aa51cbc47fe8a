"""The raw-bytes call shapes the gateway forwards with (``serving.grpc``'s ``Call``,
``raw_unary`` and ``stream``) on a real ``GrpcServer``: message bytes as they arrived
(compressed ones still compressed, ``plain`` inflating them within the cap), the framing rules
and caps with their statuses, large replies framed from the payload, and stream replies from
concurrent tasks that never interleave."""

from __future__ import annotations

import gzip
import json
import os
import random
import struct
import zlib
from collections.abc import AsyncIterator

import anyio
import pytest

from kserve_trio.client.errors import RpcError
from kserve_trio.client.h2_transport import H2Transport
from kserve_trio.client.transport import Endpoint
from kserve_trio.core.errors import StatusCode
from kserve_trio.gateway.fleet.pool import RawReply
from kserve_trio.serving.grpc import Call, GrpcServer, Limits, Method, RawMessage, raw_unary, stream
from tests.worker.raw_h2 import RawReply as RawH2Reply
from tests.worker.raw_h2 import grpc_frame, raw_grpc_call

pytestmark = pytest.mark.anyio
LIMITS = Limits(max_recv_bytes=1 << 20, max_send_bytes=4 << 20)
BIG = os.urandom(3 << 20)


async def info(call: Call, message: RawMessage) -> bytes:
    """What the handler was given: the message as it arrived and what the call says of it."""
    doc = {
        "encoding": call.encoding,
        "compressed": message.compressed,
        "data": message.data.hex(),
        "plain": bytes(call.plain(message)).hex(),
        "deadline": call.deadline is not None,
        "metadata": dict(call.metadata),
    }
    return json.dumps(doc).encode()


async def big(call: Call, message: RawMessage) -> bytes:
    return BIG


async def too_big(call: Call, message: RawMessage) -> bytes:
    return b"x" * (LIMITS.max_send_bytes + 1)


async def echo_stream(call: Call) -> None:
    """Each message back 5000 times over (several frames per reply), from its own task, the
    tasks finishing in random order."""

    async def answer(data: bytes) -> None:
        await anyio.sleep(random.random() * 0.05)
        await call.send(data * 5000)

    async with anyio.create_task_group() as tg:
        while (message := await call.receive()) is not None:
            tg.start_soon(answer, message.data)


METHODS: dict[str, Method] = {
    "/t.T/Info": raw_unary(info, LIMITS, "Info"),
    "/t.T/Big": raw_unary(big, LIMITS, "Big"),
    "/t.T/TooBig": raw_unary(too_big, LIMITS, "TooBig"),
    "/t.T/Stream": stream(echo_stream, LIMITS, "Stream"),
}


@pytest.fixture()
async def server() -> AsyncIterator[str]:
    srv = GrpcServer(METHODS)
    async with anyio.create_task_group() as tg:
        port = await tg.start(srv.serve, "127.0.0.1", 0)
        try:
            yield f"127.0.0.1:{port}"
        finally:
            with anyio.fail_after(10):
                await srv.shutdown(1.0)


async def call(address: str, method: str, payload: bytes, **kw) -> bytes:
    host, port = address.rsplit(":", 1)
    async with H2Transport(Endpoint(host=host, port=int(port))) as t:
        return await t.unary(method, payload, RawReply, timeout=10.0, **kw)


async def raw(address: str, path: str, body: bytes, headers=()) -> RawH2Reply:
    return await anyio.to_thread.run_sync(
        lambda: raw_grpc_call(address, path, body, headers=tuple(headers))
    )


def messages(body: bytes) -> list[bytes]:
    """The length-prefixed messages of a reply body, each checked whole."""
    out = []
    pos = 0
    while pos < len(body):
        flag, length = struct.unpack_from(">BI", body, pos)
        assert flag == 0
        out.append(body[pos + 5 : pos + 5 + length])
        assert len(out[-1]) == length, "a message cut short"
        pos += 5 + length
    return out


async def test_a_message_arrives_as_sent_and_plain_inflates_a_compressed_one(server):
    doc = json.loads(await call(server, "/t.T/Info", b"hello", metadata={"x-k": "v"}))
    assert doc == {
        "encoding": "identity",
        "compressed": False,
        "data": b"hello".hex(),
        "plain": b"hello".hex(),
        "deadline": True,
        "metadata": {"x-k": "v"},
    }
    for name, packed in (("gzip", gzip.compress(b"hello" * 9)), ("deflate", zlib.compress(b"hi"))):
        doc = json.loads(await call(server, "/t.T/Info", packed, compressed_with=name))
        assert doc["encoding"] == name and doc["compressed"] is True
        assert bytes.fromhex(doc["data"]) == packed  # still compressed: forwardable as is
        assert bytes.fromhex(doc["plain"]) in (b"hello" * 9, b"hi")


@pytest.mark.parametrize(
    ("body", "headers", "status", "message"),
    [
        (b"", (), StatusCode.INVALID_ARGUMENT, "empty request: no message was sent"),
        (b"\x00\x00", (), StatusCode.INVALID_ARGUMENT, "ended inside the 5-byte gRPC message"),
        (grpc_frame(b"abc")[:-1], (), StatusCode.INVALID_ARGUMENT, "ended inside the 3-byte"),
        (grpc_frame(b"a", flag=2), (), StatusCode.INVALID_ARGUMENT, "compressed flag 2"),
        (grpc_frame(b"a", flag=1), (), StatusCode.INVALID_ARGUMENT, "without a grpc-encoding"),
        (
            struct.pack(">BI", 0, (1 << 20) + 1),
            (),
            StatusCode.RESOURCE_EXHAUSTED,
            "received message larger than max (1048577 vs. 1048576)",
        ),
        (
            grpc_frame(gzip.compress(b"\0" * (2 << 20)), flag=1),
            (("grpc-encoding", "gzip"),),
            StatusCode.RESOURCE_EXHAUSTED,
            "received message larger than max",
        ),
        (
            grpc_frame(b"not gzip", flag=1),
            (("grpc-encoding", "gzip"),),
            StatusCode.INVALID_ARGUMENT,
            "cannot decompress the gzip message",
        ),
        (grpc_frame(b"a"), (("grpc-encoding", "br"),), StatusCode.UNIMPLEMENTED, "'br'"),
    ],
)
async def test_framing_errors_and_caps_have_their_statuses(server, body, headers, status, message):
    reply = await raw(server, "/t.T/Info", body, headers)
    assert reply.status == int(status), reply
    assert message in reply.message


async def test_a_large_reply_arrives_intact_and_one_over_the_cap_is_refused(server):
    assert await call(server, "/t.T/Big", b"") == BIG
    with pytest.raises(RpcError) as err:
        await call(server, "/t.T/TooBig", b"")
    assert err.value.status is StatusCode.RESOURCE_EXHAUSTED
    assert "response larger than max" in err.value.message


async def test_stream_replies_from_concurrent_tasks_never_interleave(server):
    sent = [f"<{i:03d}>".encode() for i in range(40)]
    reply = await raw(server, "/t.T/Stream", b"".join(grpc_frame(d) for d in sent))
    assert reply.status == int(StatusCode.OK), reply
    assert sorted(messages(reply.body)) == sorted(d * 5000 for d in sent)  # each reply whole

"""``serving.raw``'s handlers on a real ``GrpcServer``: message bytes as they arrived
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

import anyio
import grpclib.client
import grpclib.const
import pytest

from kserve_trio.client.errors import RpcError
from kserve_trio.client.h2_transport import H2Transport
from kserve_trio.client.transport import Endpoint
from kserve_trio.core.errors import StatusCode
from kserve_trio.gateway.pool import RawReply
from kserve_trio.serving.grpc_adapter import EncodedMessage, Limits
from kserve_trio.serving.grpc_server import GrpcServer
from kserve_trio.serving.raw import RawCall, RawMessage, raw_stream, raw_unary
from tests.worker.raw_h2 import grpc_frame, raw_grpc_call

pytestmark = pytest.mark.anyio
LIMITS = Limits(max_recv_bytes=1 << 20, max_send_bytes=4 << 20)
BIG = os.urandom(3 << 20)


class Service:
    def __mapping__(self):
        return {
            "/t.T/Info": raw_unary(self.info, LIMITS, "Info"),
            "/t.T/Big": raw_unary(self.big, LIMITS, "Big"),
            "/t.T/TooBig": raw_unary(self.too_big, LIMITS, "TooBig"),
            "/t.T/Stream": raw_stream(self.stream, LIMITS, "Stream"),
        }

    async def info(self, call: RawCall, message: RawMessage) -> bytes:
        doc = {
            "encoding": call.encoding,
            "compressed": message.compressed,
            "data": message.data.hex(),
            "plain": call.plain(message).hex(),
            "deadline": call.deadline is not None,
            "metadata": dict(call.metadata),
        }
        return json.dumps(doc).encode()

    async def big(self, call: RawCall, message: RawMessage) -> bytes:
        return BIG

    async def too_big(self, call: RawCall, message: RawMessage) -> bytes:
        return b"x" * (LIMITS.max_send_bytes + 1)

    async def stream(self, call: RawCall) -> None:
        async def answer(data: bytes) -> None:
            await anyio.sleep(random.random() * 0.05)
            await call.send(data * 5000)  # 5000x each message: several frames per reply

        async with anyio.create_task_group() as tg:
            while (message := await call.receive()) is not None:
                tg.start_soon(answer, message.data)


@pytest.fixture()
async def server():
    srv = GrpcServer([Service()])
    await srv.start("127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{srv.port}"
    finally:
        srv.close()
        await srv.wait_closed()


async def call(address: str, method: str, payload: bytes, **kw) -> bytes:
    host, port = address.rsplit(":", 1)
    async with H2Transport(Endpoint(host=host, port=int(port))) as t:
        return await t.unary(method, payload, RawReply, timeout=10.0, **kw)


async def raw(address: str, path: str, body: bytes, headers=()) -> object:
    return await anyio.to_thread.run_sync(
        lambda: raw_grpc_call(address, path, body, headers=tuple(headers))
    )


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
    with pytest.raises(RpcError) as info:
        await call(server, "/t.T/TooBig", b"")
    assert info.value.status is StatusCode.RESOURCE_EXHAUSTED
    assert "response larger than max" in info.value.message


async def test_stream_replies_from_concurrent_tasks_never_interleave(server):
    host, port = server.rsplit(":", 1)
    channel = grpclib.client.Channel(host, int(port))
    try:
        async with channel.request(
            "/t.T/Stream",
            grpclib.const.Cardinality.STREAM_STREAM,
            EncodedMessage,
            EncodedMessage,
        ) as stream:
            sent = [f"<{i:03d}>".encode() for i in range(40)]
            for data in sent:
                await stream.send_message(EncodedMessage(data))
            await stream.end()
            got = [bytes(m) async for m in stream]
        assert sorted(got) == sorted(d * 5000 for d in sent)  # each reply whole
    finally:
        channel.close()

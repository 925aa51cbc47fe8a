"""The channel's frame encoding (``serving.ipc._framing``): every message crosses equal to
itself and of its class, whatever its field values (hypothesis draws them, strings with lone
surrogates and integers past 64 bits among them); the per-request messages cross as plain
records of their fields, no class of ours named; and any bytes at all either decode to messages or raise
``MalformedFrame``, never another error (hypothesis fuzzes whole frames and valid frames
corrupted or cut). A frame that does not parse ends the channel that reads it, as if the peer
had closed it, and a first frame that does not parse is refused.
"""

from __future__ import annotations

import pickle
import pickletools
import socket
import struct
import typing

import anyio
import anyio.abc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kserve_trio.core.logging import LogSettings
from kserve_trio.serving import ipc
from kserve_trio.serving.ipc import (
    Cancel,
    Channel,
    Done,
    Drain,
    Edge,
    Free,
    InferCall,
    Log,
    Ping,
    Pong,
    Ready,
    Request,
    RestCall,
    RestHead,
    Slot,
    StreamCall,
    StreamOrigin,
    UnaryCall,
    first_batch,
)
from kserve_trio.serving.ipc._framing import MalformedFrame, decode, encode

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ids = st.integers(min_value=0, max_value=2**63 - 1) | st.integers(min_value=2**63, max_value=2**70)
signed = st.integers(min_value=-(2**63), max_value=2**63 - 1)
texts = st.text(max_size=40)  # any code point, lone surrogates included
slots = st.builds(Slot, ids, ids)
payloads = st.binary(max_size=200) | slots
calls = (
    st.builds(UnaryCall, texts)
    | st.builds(InferCall, st.none() | texts)
    | st.builds(StreamCall, st.none() | texts)
    | st.builds(RestCall, texts, texts, texts, st.dictionaries(texts, texts, max_size=4))
)
details = (
    st.none()
    | st.builds(StreamOrigin, texts, texts)
    | st.builds(
        RestHead,
        st.integers(min_value=100, max_value=599),
        texts,
        st.lists(st.tuples(texts, texts), max_size=4).map(tuple),
    )
)
hot = (
    st.builds(Request, ids, calls, signed, payloads)
    | st.builds(Done, ids, st.integers(min_value=0, max_value=16), texts, payloads, details)
    | st.builds(Cancel, ids)
    | st.builds(Free, st.lists(ids, max_size=20).map(tuple))
    | st.builds(Ping, ids)
    | st.builds(Pong, ids)
)
rare = (
    st.builds(Ready, st.integers(0, 65535), st.integers(0, 65535))
    | st.builds(Edge, texts)
    | st.just(Drain())
    | st.just(Log(LogSettings()))
)  # Hello crosses a real channel in test_ipc_links (read_hello)
batches = st.lists(hot | rare, max_size=12)


def _decodes_or_refuses(frame: bytes) -> None:
    try:
        batch = decode(frame)
    except MalformedFrame:
        return
    assert all(type(m) in _MESSAGE_CLASSES for m in batch), batch


_MESSAGE_CLASSES = set(typing.get_args(ipc.Message))


@FUZZ
@given(batches)
def test_every_batch_crosses_equal_to_itself_and_of_its_classes(batch):
    got = decode(encode(batch))
    assert got == batch
    assert [type(m) for m in got] == [type(m) for m in batch]


def test_the_messages_of_a_request_and_its_answer_cross_as_plain_records():
    """No class of ours in the frame: the per-request messages travel as tuples of their
    fields (pickle's C paths only) and the reader builds them; a frozen call is shared."""
    batch = [
        Request(1, UnaryCall("ServerLive"), 0, Slot(0, 10)),
        Request(2, InferCall("00-ab-cd-01"), 5, b"x"),
        Request(3, StreamCall(), 5, b"x"),
        Request(4, RestCall("GET", "/v2", "", {"accept": "*/*"}), 0, b""),
        Done(1, 0, "", Slot(0, 10), StreamOrigin("m", "r")),
        Done(4, 0, "", b"{}", RestHead(200, "application/json", (("a", "b"),))),
        Done(5, 13, "bad", b""),
        Cancel(1),
        Free((0, 64)),
        Ping(1),
        Pong(1),
    ]
    frame = encode(batch)
    assert all(op.name not in ("GLOBAL", "STACK_GLOBAL", "EXT1", "REDUCE") for op, *_ in
               pickletools.genops(frame))  # fmt: skip
    assert decode(frame) == batch
    again = decode(encode([Request(9, UnaryCall("ServerLive"), 0, b"")]))[0]
    assert isinstance(again, Request)
    assert again.call is typing.cast(Request, decode(frame)[0]).call


def test_a_record_of_another_shape_is_refused_with_what_is_wrong():
    with pytest.raises(MalformedFrame, match="does not parse"):
        decode(pickle.dumps([(1, 7, 0)]))
    with pytest.raises(MalformedFrame, match="unknown record kind"):
        decode(pickle.dumps([(99, 7)]))
    with pytest.raises(MalformedFrame, match="not a list"):
        decode(pickle.dumps((1, 2)))
    with pytest.raises(MalformedFrame, match="a record is a str"):
        decode(pickle.dumps(["Request"]))
    with pytest.raises(MalformedFrame, match="does not unpickle"):
        decode(b"\x80\x05junk")


@FUZZ
@given(st.binary(max_size=300))
def test_any_bytes_decode_to_messages_or_are_refused(frame):
    _decodes_or_refuses(frame)


@FUZZ
@given(st.lists(hot, min_size=1, max_size=12), st.data())
def test_a_corrupted_or_cut_frame_decodes_to_messages_or_is_refused(batch, data):
    """Frames of the per-request messages, which name no class. A rare message is pickled with
    its class's module path, and a byte flipped there can name any module pickle will then
    import (jax or torch: seconds each, 46 s for this test once in the suite); the channel runs
    between two processes of ours, so what its frames name is trusted, and the records' shapes
    are what a reader must check."""
    frame = bytearray(encode(batch))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(frame) - 1))
        frame[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(frame)))
    _decodes_or_refuses(bytes(frame[:cut]))
    _decodes_or_refuses(bytes(frame))


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_frame_that_does_not_parse_ends_the_channel(anyio_backend):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    good = encode([Ping(1)])
    bad = b"\xfe garbage"
    a.sendall(struct.pack(">I", len(good)) + good + struct.pack(">I", len(bad)) + bad)
    reader = Channel(await anyio.abc.SocketStream.from_socket(b))
    with anyio.fail_after(10):
        got = [batch async for batch in reader.batches()]  # ends although `a` is still open
    assert got == [[Ping(1)]]
    await reader.aclose()
    a.close()


def test_a_first_frame_that_does_not_parse_is_refused():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    bad = pickle.dumps([(99, 7)])
    a.sendall(struct.pack(">I", len(bad)) + bad)
    try:
        with pytest.raises(ipc.ChannelClosed, match="does not parse"):
            first_batch(b)
    finally:
        a.close()
        b.close()

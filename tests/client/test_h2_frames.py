"""The client's own HTTP/2 framing: header blocks against the stock HPACK decoder and encoder,
the frame reader on every split of its input, and a connection's handling of the frames a
server may send (padding, priority, CONTINUATION, PING, SETTINGS, protocol errors), driven
without a socket."""

from __future__ import annotations

import random

import hpack
import pytest

from kserve_trio.client import _h2_frames as fr
from kserve_trio.client._h2_call import _Call
from kserve_trio.client._h2_connection import Connection
from kserve_trio.core.errors import StatusCode

HEADERS = [
    (b":method", b"POST"),  # a full static entry
    (b":scheme", b"http"),
    (b":path", b"/inference.GRPCInferenceService/ModelInfer"),  # a static name
    (b":authority", b"127.0.0.1:8001"),
    (b"te", b"trailers"),
    (b"content-type", b"application/grpc"),
    (b"user-agent", b"kserve_trio-h2/1"),  # static name 58: a two-byte index
    (b"grpc-timeout", b"9999999u"),  # a new name
    (b"x-long", b"v" * 300),  # a length over the 7-bit prefix
]


def test_header_blocks_decode_to_their_fields_and_leave_the_table_empty():
    decoder = hpack.Decoder()
    block = fr.TABLE_SIZE_ZERO + fr.header_block(HEADERS)
    for _ in range(3):  # the same bytes mean the same fields each time
        assert [tuple(h) for h in decoder.decode(block, raw=True)] == HEADERS
        block = fr.header_block(HEADERS)
    assert len(decoder.header_table.dynamic_entries) == 0
    assert decoder.header_table.maxsize == 0


def test_indexed_only_blocks_are_recognised():
    assert fr.indexed_only(b"\x88\xbf")
    assert fr.indexed_only(b"\xff\x81\x05")  # index 127 + continuation bytes
    assert not fr.indexed_only(b"\xff\x81")  # the index never ends
    assert not fr.indexed_only(b"\x88\x40\x01a\x01b")  # a literal with indexing
    assert not fr.indexed_only(fr.TABLE_SIZE_ZERO)
    assert not fr.indexed_only(fr.header_field(b"grpc-status", b"0"))


def _frames() -> bytes:
    return b"".join(
        [
            fr.settings_frame({fr.MAX_FRAME_SIZE: 1 << 20}),
            fr.frame(fr.DATA, fr.END_STREAM, 1, bytes(range(200))),
            fr.frame(fr.PING, 0, 0, b"12345678"),
            fr.frame(fr.DATA, 0, 3, b""),
            fr.window_update(0, 1000),
        ]
    )


def test_the_frame_reader_gives_the_same_frames_whatever_the_split():
    data = _frames()
    want = [(t, f, s, bytes(p)) for t, f, s, p in fr.FrameReader(1 << 20).feed(data)]
    assert [t for t, *_ in want] == [fr.SETTINGS, fr.DATA, fr.PING, fr.DATA, fr.WINDOW_UPDATE]
    assert want[1] == (fr.DATA, fr.END_STREAM, 1, bytes(range(200)))
    for cut in range(1, len(data)):
        reader = fr.FrameReader(1 << 20)
        got = reader.feed(data[:cut]) + reader.feed(data[cut:])
        assert [(t, f, s, bytes(p)) for t, f, s, p in got] == want, cut
    reader = fr.FrameReader(1 << 20)  # one byte at a time
    got = [x for i in range(len(data)) for x in reader.feed(data[i : i + 1])]
    assert [(t, f, s, bytes(p)) for t, f, s, p in got] == want


def test_the_frame_reader_refuses_a_frame_over_the_advertised_size():
    with pytest.raises(fr.FrameError) as info:
        fr.FrameReader(16384).feed(fr.frame_header(fr.DATA, 0, 1, 16385))
    assert info.value.code == fr.FRAME_SIZE_ERROR


def test_a_block_over_the_frame_size_goes_out_in_continuation_frames():
    block = fr.header_block(HEADERS) * 3
    frames = fr.FrameReader(1 << 20).feed(fr.headers_frames(5, block, 100))
    assert [(t, f, s) for t, f, s, _ in frames] == (
        [(fr.HEADERS, 0, 5)]
        + [(fr.CONTINUATION, 0, 5)] * (len(frames) - 2)
        + [(fr.CONTINUATION, fr.END_HEADERS, 5)]
    )
    assert b"".join(bytes(p) for *_, p in frames) == block


# --------------------------------------------------------------------------------------------
# A connection's dispatch, without a socket


class _NoStream:
    def extra(self, attribute, default=None):
        return default


def _connection_with_call(sid: int = 1) -> tuple[Connection, _Call]:
    conn = Connection(_NoStream(), "test:1")  # type: ignore[arg-type]
    call = _Call("ModelInfer", 1 << 20)
    call.stream_id, call.window, call.local_closed = sid, conn.initial_window, True
    conn.calls[sid] = call
    return conn, call


def _server_frames(
    encoder: hpack.Encoder, body: bytes, status: bytes = b"0", sid: int = 1
) -> bytes:
    head = encoder.encode([(b":status", b"200"), (b"content-type", b"application/grpc")])
    trailers = encoder.encode([(b"grpc-status", status), (b"grpc-message", b"m" * 40)])
    message = b"\x00" + len(body).to_bytes(4, "big") + body
    padded = bytes((7,)) + message + bytes(7)
    priority = bytes((3,)) + b"\x00\x00\x00\x00\x10" + head + bytes(3)  # pad 3, priority 5
    return b"".join(
        [
            fr.frame(fr.HEADERS, fr.END_HEADERS | fr.PADDED | fr.PRIORITY_FLAG, sid, priority),
            fr.frame(fr.DATA, fr.PADDED, sid, padded),
            fr.frame(fr.HEADERS, fr.END_STREAM, sid, trailers[:5]),
            fr.frame(fr.CONTINUATION, 0, sid, trailers[5:9]),
            fr.frame(fr.CONTINUATION, fr.END_HEADERS, sid, trailers[9:]),
        ]
    )


def test_padded_prioritised_and_continued_frames_make_one_reply():
    conn, call = _connection_with_call()
    conn.dispatch(conn.reader.feed(_server_frames(hpack.Encoder(), b"reply")))
    assert call.done and call.remote_closed
    assert bytes(call.message("test:1")) == b"reply"
    assert call.message_text == "m" * 40
    assert call.unacked == 5 + 5 + 8  # padding counts against the window


def test_reply_headers_decode_right_while_the_servers_table_changes():
    conn = Connection(_NoStream(), "test:1")  # type: ignore[arg-type]
    encoder = hpack.Encoder()
    encoder.header_table_size = 200  # small: a new status evicts, indices move
    rng = random.Random(0)
    cached = 0
    for sid in range(1, 400, 2):
        call = _Call("ModelInfer", 1 << 20)
        call.stream_id = sid
        conn.calls[sid] = call
        status = str(rng.choice([0, 0, 0, 5, 13])).encode()
        conn.dispatch(conn.reader.feed(_server_frames(encoder, b"x", status, sid)))
        assert call.done and call.status == int(status), sid
        assert call.http_status == 200
        cached = max(cached, len(conn.decoded))
    assert 0 < cached <= 64  # indexed-only blocks were decoded from the cache


def test_ping_and_settings_are_answered_and_applied():
    conn, call = _connection_with_call()
    conn.dispatch(
        conn.reader.feed(
            fr.frame(fr.PING, 0, 0, b"abcdefgh")
            + fr.frame(fr.PING, fr.ACK, 0, b"ignored!")
            + fr.settings_frame({fr.INITIAL_WINDOW_SIZE: 1 << 20, fr.MAX_FRAME_SIZE: 1 << 16, 3: 7})
            + fr.window_update(1, 10)
            + fr.window_update(0, 20)
        )
    )
    assert conn.out == [fr.frame(fr.PING, fr.ACK, 0, b"abcdefgh"), fr.SETTINGS_ACK]
    assert call.window == (1 << 20) + 10
    assert conn.send_window == fr.DEFAULT_WINDOW + 20
    assert (conn.max_frame, conn.max_streams) == (1 << 16, 7)


def test_a_reset_and_a_goaway_end_their_calls():
    conn, call = _connection_with_call(1)
    other = _Call("ModelInfer", 1 << 20)
    other.stream_id = 3
    conn.calls[3] = other
    conn.dispatch(conn.reader.feed(fr.rst_stream(1, 7) + fr.goaway(0, 1)))
    assert call.done and call.refused and call.reset_code == 7
    assert other.done and other.refused and other.error is not None
    assert other.error.status is StatusCode.UNAVAILABLE
    assert conn.draining and not conn.usable


@pytest.mark.parametrize(
    "data, code",
    [
        (fr.frame(fr.DATA, 0, 0, b"x"), fr.PROTOCOL_ERROR),
        (fr.frame(fr.HEADERS, fr.END_HEADERS, 0, b"\x88"), fr.PROTOCOL_ERROR),
        (fr.frame(fr.CONTINUATION, fr.END_HEADERS, 1, b"\x88"), fr.PROTOCOL_ERROR),
        (fr.frame(fr.HEADERS, 0, 1, b"\x88") + fr.frame(fr.DATA, 0, 1, b""), fr.PROTOCOL_ERROR),
        (fr.frame(fr.PUSH_PROMISE, 0, 1, bytes(4)), fr.PROTOCOL_ERROR),
        (fr.frame(fr.SETTINGS, 0, 0, bytes(5)), fr.FRAME_SIZE_ERROR),
        (fr.frame(fr.PING, 0, 0, bytes(7)), fr.FRAME_SIZE_ERROR),
        (fr.window_update(0, 0), fr.PROTOCOL_ERROR),
        (fr.window_update(0, fr.MAX_WINDOW), fr.FLOW_CONTROL_ERROR),
        (fr.frame(fr.DATA, fr.PADDED, 1, b"\x05ab"), fr.PROTOCOL_ERROR),
        (fr.settings_frame({fr.MAX_FRAME_SIZE: 100}), fr.PROTOCOL_ERROR),
    ],
)
def test_protocol_errors_are_refused_with_their_code(data, code):
    conn, _call = _connection_with_call()
    with pytest.raises(fr.FrameError) as info:
        conn.dispatch(conn.reader.feed(data))
    assert info.value.code == code

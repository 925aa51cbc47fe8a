"""Both HTTP/2 engines keep the seam's rules, each against the other, in memory (no socket)."""

from __future__ import annotations

import itertools

import pytest

from kserve_trio.http2 import (
    ENGINES,
    DataReceived,
    Engine,
    EngineSettings,
    ErrorCode,
    GoAwayReceived,
    PeerError,
    PingAcknowledged,
    RequestReceived,
    ResponseReceived,
    StreamGone,
    StreamReset,
    TrailersReceived,
    new_engine,
)

REQUEST = [
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":path", b"/svc/Method"),
    (b":authority", b"test"),
    (b"te", b"trailers"),
    (b"content-type", b"application/grpc"),
]
PAIRS = list(itertools.product(ENGINES, ENGINES))


class Pair:
    """A server engine and a client engine wired back to back."""

    def __init__(self, server: str, client: str, **settings: int) -> None:
        self.server = new_engine(server, EngineSettings(client=False, **settings))
        self.client = new_engine(client, EngineSettings(client=True))
        self.client.initiate()
        self.server.initiate()
        self.server_events: list = []
        self.client_events: list = []
        self.pump()

    def pump(self, rounds: int = 6) -> None:
        for _ in range(rounds):
            data = self.client.data_to_send()
            if data:
                self.server_events += self.server.receive(data)
            data = self.server.data_to_send()
            if data:
                self.client_events += self.client.receive(data)

    def take(self, side: str) -> list:
        events = getattr(self, f"{side}_events")
        setattr(self, f"{side}_events", [])
        return events


def body(events: list, sid: int) -> bytes:
    return b"".join(e.data for e in events if isinstance(e, DataReceived) and e.stream_id == sid)


def consume(engine: Engine, events: list) -> None:
    for e in events:
        if isinstance(e, DataReceived) and e.flow_length:
            engine.acknowledge(e.stream_id, e.flow_length)


@pytest.mark.parametrize(("server", "client"), PAIRS)
def test_a_request_and_a_reply_larger_than_every_window_cross_whole(
    server: str, client: str
) -> None:
    pair = Pair(server, client)
    sid = pair.client.send_request(REQUEST)
    message = bytes(range(256)) * 1000  # 256 kB: four times the default window
    pair.client.send_data(sid, message, end_stream=True)
    received: list = []
    for _ in range(50):
        pair.pump(1)
        events = pair.take("server")
        received += events
        consume(pair.server, events)
    opened = [e for e in received if isinstance(e, RequestReceived)]
    assert opened and opened[0].stream_id == sid
    assert (b":path", b"/svc/Method") in list(opened[0].headers)
    assert body(received, sid) == message
    assert any(isinstance(e, DataReceived) and e.end_stream for e in received)

    pair.server.send_headers(sid, [(b":status", b"200")])
    pair.server.send_data(sid, message)
    assert pair.server.pending(sid) > 0  # queued beyond the client's window (queued sends)
    pair.server.send_trailers(sid, [(b"grpc-status", b"0")])
    replies: list = []
    for _ in range(50):
        pair.pump(1)
        events = pair.take("client")
        replies += events
        consume(pair.client, events)
    assert pair.server.pending(sid) == 0
    assert any(isinstance(e, ResponseReceived) for e in replies)
    assert body(replies, sid) == message
    trailers = [e for e in replies if isinstance(e, TrailersReceived)]
    assert trailers and (b"grpc-status", b"0") in list(trailers[0].headers)
    # the trailers came after every byte of the body (trailers last)
    assert replies.index(trailers[0]) > max(
        i for i, e in enumerate(replies) if isinstance(e, DataReceived)
    )


@pytest.mark.parametrize(("server", "client"), PAIRS)
def test_unacknowledged_data_holds_the_peer_back(server: str, client: str) -> None:
    pair = Pair(server, client, stream_window=1000, connection_window=1000)
    sid = pair.client.send_request(REQUEST)
    pair.client.send_data(sid, b"x" * 5000, end_stream=True)
    pair.pump()
    assert len(body(pair.take("server"), sid)) <= 1000  # nothing acknowledged: no more came
    pair.pump()
    assert body(pair.take("server"), sid) == b""


@pytest.mark.parametrize(("server", "client"), PAIRS)
def test_a_reset_reaches_the_peer_and_drops_what_was_queued(server: str, client: str) -> None:
    pair = Pair(server, client)
    sid = pair.client.send_request(REQUEST, end_stream=True)
    pair.pump()
    pair.server.send_headers(sid, [(b":status", b"200")])
    pair.server.send_data(sid, b"y" * 200_000)
    pair.server.reset_stream(sid, ErrorCode.CANCEL)
    pair.pump()
    assert pair.server.pending(sid) == 0
    resets = [e for e in pair.take("client") if isinstance(e, StreamReset)]
    assert resets and resets[0].stream_id == sid and resets[0].code == ErrorCode.CANCEL
    with pytest.raises(StreamGone):
        pair.server.send_trailers(sid, [(b"grpc-status", b"0")])
        pair.server.send_data(sid, b"z")


@pytest.mark.parametrize("server", ENGINES)
def test_ping_is_answered_and_the_two_phase_goaway_keeps_running_streams(server: str) -> None:
    # (h2 as a client closes its side on the first GOAWAY: libnghttp2 is the peer here)
    pair = Pair(server, "ngh2")
    sid = pair.client.send_request(REQUEST, end_stream=True)
    pair.pump()
    pair.server.ping(b"abcdefgh")
    pair.server.goaway_notice()
    pair.pump()
    assert any(
        isinstance(e, PingAcknowledged) and e.data == b"abcdefgh" for e in pair.take("server")
    )
    first = [e for e in pair.take("client") if isinstance(e, GoAwayReceived)]
    assert first and first[0].last_stream_id == 2**31 - 1
    pair.server.goaway()
    pair.server.send_headers(sid, [(b":status", b"200")])
    pair.server.send_data(sid, b"after the goaway")
    pair.server.send_trailers(sid, [(b"grpc-status", b"0")])
    pair.pump()
    events = pair.take("client")
    final = [e for e in events if isinstance(e, GoAwayReceived)]
    assert final and final[-1].last_stream_id == sid
    assert body(events, sid) == b"after the goaway"


@pytest.mark.parametrize("server", ENGINES)
def test_a_peer_error_is_raised_with_the_rfc_code_and_its_goaway_queued(server: str) -> None:
    engine = new_engine(server, EngineSettings())
    engine.initiate()
    engine.data_to_send()
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
    engine.receive(preface)
    with pytest.raises(PeerError) as raised:
        engine.receive(b"\x00\x00\x08\x06\x00\x00\x00\x00\x01" + b"12345678")  # PING on stream 1
    assert raised.value.code == ErrorCode.PROTOCOL_ERROR
    out = engine.data_to_send()
    assert b"\x07\x00\x00\x00\x00\x00" in out  # a GOAWAY frame went out


@pytest.mark.parametrize("server", ENGINES)
def test_an_hpack_error_is_a_compression_error(server: str) -> None:
    engine = new_engine(server, EngineSettings())
    engine.initiate()
    engine.data_to_send()
    engine.receive(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
    with pytest.raises(PeerError) as raised:
        engine.receive(b"\x00\x00\x01\x01\x05\x00\x00\x00\x01" + b"\x80")  # index 0
    assert raised.value.code == ErrorCode.COMPRESSION_ERROR
    out = engine.data_to_send()
    goaway = out[out.rindex(b"\x07\x00\x00\x00\x00\x00") - 3 :]
    assert int.from_bytes(goaway[13:17], "big") == ErrorCode.COMPRESSION_ERROR

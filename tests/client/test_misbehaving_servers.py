"""The client transport against servers that misbehave, on both HTTP/2 engines and both event
loops: each call ends with the right status within its deadline, and the next call, on a new
connection, succeeds.

``MisbehavingServer`` speaks raw HTTP/2 (hyperframe for the frames, hpack for the headers) on
a thread: its first connection misbehaves as the scenario says, every later one is a plain
echo server."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

import anyio
import hpack
import pytest
from hyperframe.frame import (
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from kserve_trio.client.errors import RpcError
from kserve_trio.client.h2_transport import H2Transport
from kserve_trio.client.transport import Endpoint
from kserve_trio.core.errors import StatusCode
from kserve_trio.http2 import ENGINES
from tests.client.echo_server import Raw, grpc_frame

ECHO = "/test.Echo/Echo"
BOUND = 10.0  # seconds: every call of a test ends well within this
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
OK_HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc")]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    return request.param


class Peer:
    """One accepted connection: frames in, frames out."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()

    def send(self, *frames: Frame | bytes) -> None:
        self.sock.sendall(b"".join(f if isinstance(f, bytes) else f.serialize() for f in frames))

    def frames(self):
        """Frames as they arrive, until the client closes."""
        while True:
            while len(self.buffer) < 9:
                data = self.sock.recv(1 << 16)
                if not data:
                    return
                self.buffer += data
            frame, length = Frame.parse_frame_header(memoryview(self.buffer[:9]))
            while len(self.buffer) < 9 + length:
                data = self.sock.recv(1 << 16)
                if not data:
                    return
                self.buffer += data
            frame.parse_body(memoryview(self.buffer[9 : 9 + length]))
            self.buffer = self.buffer[9 + length :]
            yield frame

    def requests(self):
        """(stream id, message bytes) of each request once its stream has ended."""
        bodies: dict[int, bytes] = {}
        for frame in self.frames():
            if isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
                self.send(SettingsFrame(0, flags=["ACK"]))
            elif isinstance(frame, HeadersFrame):
                self.decoder.decode(frame.data)
                bodies[frame.stream_id] = b""
                if "END_STREAM" in frame.flags:
                    yield frame.stream_id, b""
            elif isinstance(frame, DataFrame):
                bodies[frame.stream_id] = bodies.get(frame.stream_id, b"") + frame.data
                if frame.data:
                    self.send(
                        WindowUpdateFrame(0, window_increment=len(frame.data)),
                        WindowUpdateFrame(frame.stream_id, window_increment=len(frame.data)),
                    )
                if "END_STREAM" in frame.flags:
                    yield frame.stream_id, bodies.pop(frame.stream_id)[5:]

    def headers(self, sid: int, headers: list[tuple[bytes, bytes]], end: bool = False) -> bytes:
        flags = ["END_HEADERS", *(["END_STREAM"] if end else [])]
        return HeadersFrame(sid, self.encoder.encode(headers), flags=flags).serialize()

    def ok(self, sid: int, message: bytes) -> None:
        self.send(
            self.headers(sid, OK_HEADERS),
            DataFrame(sid, grpc_frame(message)),
            self.headers(sid, [(b"grpc-status", b"0")], end=True),
        )


Scenario = Callable[[Peer], None]


class MisbehavingServer:
    """A thread that serves raw HTTP/2: ``scenario`` on the first connection, echo after."""

    def __init__(self, scenario: Scenario, settings: dict[int, int] | None = None) -> None:
        self.scenario = scenario
        self.settings = settings or {}
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            index = self.connections
            self.connections += 1
            threading.Thread(target=self._serve, args=(sock, index), daemon=True).start()

    def _serve(self, sock: socket.socket, index: int) -> None:
        peer = Peer(sock)
        try:
            head = b""
            while len(head) < len(PREFACE):
                data = sock.recv(len(PREFACE) - len(head))
                if not data:
                    return
                head += data
            if index == 0:
                self.scenario(peer)
                return
            peer.send(SettingsFrame(0))
            for sid, message in peer.requests():
                peer.ok(sid, message)
        except OSError:
            return
        finally:
            sock.close()

    def close(self) -> None:
        self.listener.close()


def greeted(peer: Peer, settings: dict[int, int] | None = None) -> None:
    frame = SettingsFrame(0)
    frame.settings = settings or {}
    peer.send(frame)


# ---------------------------------------------------------------------------------- scenarios


def bad_frame(peer: Peer) -> None:
    greeted(peer)
    for _sid, _ in peer.requests():
        peer.send(b"\x00\x00\x03\x00\x00\x00\x00\x00\x00abc")  # DATA on stream 0
        return


def rst_mid_reply(peer: Peer) -> None:
    greeted(peer)
    for sid, _ in peer.requests():
        peer.send(
            peer.headers(sid, OK_HEADERS),
            DataFrame(sid, grpc_frame(b"x" * 100)[:50]),
            RstStreamFrame(sid, error_code=2),
        )
        for _ in peer.frames():  # until the client leaves
            pass
        return


def trailers_only_error(peer: Peer) -> None:
    greeted(peer)
    for sid, _ in peer.requests():
        error = [*OK_HEADERS, (b"grpc-status", b"5"), (b"grpc-message", b"no%20such%20model")]
        peer.send(peer.headers(sid, error, end=True))


def malformed_headers(peer: Peer) -> None:
    greeted(peer)
    for sid, _ in peer.requests():
        peer.send(HeadersFrame(sid, b"\xff\xff\xff\xff\xff", flags=["END_HEADERS"]))  # HPACK
        for _ in peer.frames():
            pass
        return


def oversized_headers(peer: Peer) -> None:
    greeted(peer)
    for sid, _ in peer.requests():
        # (no Huffman coding: hpack's pure-Python coder takes seconds over 200 KiB)
        block = peer.encoder.encode([*OK_HEADERS, (b"x-big", b"v" * (200 << 10))], huffman=False)
        frames = [block[i : i + 16384] for i in range(0, len(block), 16384)]
        out = [HeadersFrame(sid, frames[0])]
        for n, piece in enumerate(frames[1:], start=1):
            from hyperframe.frame import ContinuationFrame

            flags = ["END_HEADERS"] if n == len(frames) - 1 else []
            out.append(ContinuationFrame(sid, piece, flags=flags))
        peer.send(*out)
        for _ in peer.frames():
            pass
        return


def window_held_at_zero(peer: Peer) -> None:
    greeted(peer, {SettingsFrame.INITIAL_WINDOW_SIZE: 0})
    for _ in peer.frames():  # reads, acknowledges nothing, opens no window
        if isinstance(_, SettingsFrame) and "ACK" not in _.flags:
            peer.send(SettingsFrame(0, flags=["ACK"]))


def never_answers(peer: Peer) -> None:
    for _ in peer.frames():  # not even its SETTINGS
        pass


def early_goaway(peer: Peer) -> None:
    greeted(peer)
    seen: list[tuple[int, bytes]] = []
    for sid, message in peer.requests():
        seen.append((sid, message))
        if len(seen) == 2:
            (first, first_message), _ = seen
            peer.send(GoAwayFrame(0, last_stream_id=first, error_code=0))
            peer.ok(first, first_message)
            for _ in peer.frames():
                pass
            return


# ---------------------------------------------------------------------------------- the tests


async def next_call_succeeds(server: MisbehavingServer, engine: str) -> None:
    async with H2Transport(Endpoint("127.0.0.1", server.port, http2_engine=engine)) as t:
        assert await t.unary(ECHO, b"fresh", Raw, timeout=BOUND) == b"fresh"


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("scenario", "status", "timeout"),
    [
        (bad_frame, StatusCode.UNAVAILABLE, BOUND),
        (rst_mid_reply, StatusCode.INTERNAL, BOUND),
        (trailers_only_error, StatusCode.NOT_FOUND, BOUND),
        (malformed_headers, StatusCode.UNAVAILABLE, BOUND),
        (oversized_headers, StatusCode.UNAVAILABLE, BOUND),
        (window_held_at_zero, StatusCode.DEADLINE_EXCEEDED, 0.5),
        (never_answers, StatusCode.DEADLINE_EXCEEDED, 0.5),
    ],
    ids=lambda value: getattr(value, "__name__", None),
)
async def test_a_misbehaving_server_ends_the_call_with_its_status_in_time(
    scenario: Scenario, status: StatusCode, timeout: float, engine: str
):
    server = MisbehavingServer(scenario)
    try:
        with anyio.fail_after(BOUND + 5):
            async with H2Transport(Endpoint("127.0.0.1", server.port, http2_engine=engine)) as t:
                with pytest.raises(RpcError) as info:
                    await t.unary(ECHO, b"request", Raw, timeout=timeout)
            assert info.value.status is status, info.value
            if scenario is trailers_only_error:
                assert info.value.message == "no such model"
            await next_call_succeeds(server, engine)
    finally:
        server.close()


@pytest.mark.anyio
async def test_an_early_goaway_finishes_the_call_it_covers_and_retries_the_other(engine: str):
    server = MisbehavingServer(early_goaway)
    try:
        with anyio.fail_after(BOUND + 5):
            async with H2Transport(Endpoint("127.0.0.1", server.port, http2_engine=engine)) as t:
                results: dict[str, bytes] = {}

                async def call(name: str) -> None:
                    results[name] = await t.unary(ECHO, name.encode(), Raw, timeout=BOUND)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(call, "one")
                    tg.start_soon(call, "two")
        assert results == {"one": b"one", "two": b"two"}
        assert server.connections == 2  # the call past the GOAWAY went to a new connection
    finally:
        server.close()

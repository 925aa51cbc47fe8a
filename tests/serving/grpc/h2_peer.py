"""A raw HTTP/2 gRPC client for the server layer's tests: ``h2``'s client-side connection on a
plain anyio TCP stream, with every frame the server sends also recorded as hyperframe parsed it.

It is what the tests need and no gRPC client gives: the bytes go out in whatever writes a test
chooses (``send_raw``), flow control can be driven by hand (``manual_window``), frames a
client would refuse can be sent (``send_frame`` with h2's own HPACK encoder), and a GOAWAY is
recorded but never fed to h2 (h2 would close its side for good and refuse to send anything
more, where these tests must go on: answer the drain PING, open a stream after the GOAWAY).
With ``feed=False`` nothing is fed to h2 at all: a client that reads and never answers.
"""

from __future__ import annotations

import struct
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import anyio.abc
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
from hyperframe.frame import DataFrame, Frame, GoAwayFrame, PingFrame

Headers = Iterable[tuple[str, str]]

MAX_STREAM_ID = 2**31 - 1


def grpc_frame(payload: bytes, *, flag: int = 0) -> bytes:
    """``payload`` behind a 5-byte gRPC message prefix (``flag``: the compressed byte)."""
    return struct.pack(">BI", flag, len(payload)) + payload


def grpc_messages(body: bytes | bytearray) -> list[bytes]:
    """The length-prefixed messages of a reply body, each checked whole."""
    out: list[bytes] = []
    pos = 0
    while pos < len(body):
        _, length = struct.unpack_from(">BI", body, pos)
        message = bytes(body[pos + 5 : pos + 5 + length])
        assert len(message) == length, "a reply message was cut short"
        out.append(message)
        pos += 5 + length
    return out


@dataclass
class Reply:
    """What one stream received: response headers, body bytes, trailers, how it ended."""

    headers: dict[str, str] = field(default_factory=dict)
    data: bytearray = field(default_factory=bytearray)
    trailers: dict[str, str] = field(default_factory=dict)
    ended: bool = False
    reset: int | None = None  # the RST_STREAM error code

    @property
    def done(self) -> bool:
        return self.ended or self.reset is not None

    @property
    def status(self) -> int | None:
        """grpc-status, from the trailers or a trailers-only response."""
        value = self.trailers.get("grpc-status", self.headers.get("grpc-status"))
        return None if value is None else int(value)

    @property
    def raw_message(self) -> str:
        """grpc-message as it was on the wire (percent-encoded)."""
        return self.trailers.get("grpc-message", self.headers.get("grpc-message", ""))

    @property
    def message(self) -> str:
        return urllib.parse.unquote(self.raw_message)

    @property
    def messages(self) -> list[bytes]:
        return grpc_messages(self.data)


def take_frames(buffer: bytearray) -> list[tuple[Frame, bytes]]:
    """The whole frames at the front of ``buffer``, parsed, each with its bytes; they are
    removed from it (a partial frame stays for the next read)."""
    out: list[tuple[Frame, bytes]] = []
    while len(buffer) >= 9:
        length = int.from_bytes(buffer[:3], "big")
        if len(buffer) < 9 + length:
            break
        raw = bytes(buffer[: 9 + length])
        del buffer[: 9 + length]
        frame, _ = Frame.parse_frame_header(memoryview(raw[:9]))
        frame.parse_body(memoryview(raw[9:]))
        out.append((frame, raw))
    return out


class Peer:
    """One client connection (module docstring). Read with ``receive`` or ``until``."""

    def __init__(
        self,
        stream: anyio.abc.ByteStream,
        settings: dict[h2.settings.SettingCodes, int] | None = None,
        *,
        feed: bool = True,
        manual_window: bool = False,
    ) -> None:
        self.stream = stream
        self.feed = feed
        self.manual_window = manual_window
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        if settings:
            self.conn.local_settings = h2.settings.Settings(client=True, initial_values=settings)
            self.conn.max_inbound_frame_size = self.conn.local_settings.max_frame_size
        self.frames: list[Frame] = []
        self.replies: dict[int, Reply] = {}
        self.ping_acks: list[bytes] = []
        self.eof = False
        self._buffer = bytearray()

    # ---------------------------------------------------------------- connection

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        port: int,
        settings: dict[h2.settings.SettingCodes, int] | None = None,
        *,
        feed: bool = True,
        manual_window: bool = False,
        connection_window: int = 0,
        initiate: bool = True,
    ) -> AsyncIterator[Peer]:
        """A connected peer that has sent its preface and SETTINGS (``connection_window``:
        bytes added to the connection's receive window at once; ``initiate=False``: nothing
        sent yet, the test writes the preface itself)."""
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            peer = cls(stream, settings, feed=feed, manual_window=manual_window)
            if initiate:
                peer.conn.initiate_connection()
                if connection_window:
                    peer.conn.increment_flow_control_window(connection_window)
                await peer.flush()
            yield peer

    async def flush(self) -> None:
        """Write what h2 has queued."""
        data = self.conn.data_to_send()
        if data:
            await self.stream.send(data)

    async def send_raw(self, data: bytes) -> None:
        await self.stream.send(data)

    async def send_frame(self, frame: Frame) -> None:
        """A frame h2 would not send, written as is (after what h2 has queued)."""
        await self.flush()
        await self.stream.send(frame.serialize())

    def headers_block(self, headers: Headers) -> bytes:
        """``headers`` HPACK-encoded with h2's own encoder (the server's decoder stays in step)."""
        return self.conn.encoder.encode(list(headers))

    # ---------------------------------------------------------------- reading

    async def receive(self) -> bool:
        """One read from the socket, its frames recorded and (but GOAWAY) fed to h2, h2's
        answers written; False at the end of the stream."""
        try:
            chunk = await self.stream.receive(1 << 16)
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            self.eof = True
            return False
        self._buffer += chunk
        for frame, raw in take_frames(self._buffer):
            self.frames.append(frame)
            if self.feed and not isinstance(frame, GoAwayFrame):
                self._dispatch(self.conn.receive_data(raw))
        if self.feed:
            await self.flush()
        return True

    async def until(self, condition: Callable[[], bool]) -> None:
        """Read until ``condition()`` holds; AssertionError when the stream ends first."""
        while not condition():
            if not await self.receive():
                assert condition(), "the server closed the connection first"
                return

    async def until_eof(self) -> None:
        """Read until the server closes the connection."""
        while await self.receive():
            pass

    def _dispatch(self, events: list[h2.events.Event]) -> None:
        for event in events:
            sid: int = getattr(event, "stream_id", 0) or 0
            reply = self.replies.get(sid)
            if isinstance(event, h2.events.ResponseReceived) and reply is not None:
                reply.headers.update(dict(event.headers))  # type: ignore[arg-type]
            elif isinstance(event, h2.events.TrailersReceived) and reply is not None:
                reply.trailers.update(dict(event.headers))  # type: ignore[arg-type]
            elif isinstance(event, h2.events.DataReceived) and reply is not None:
                reply.data += event.data or b""
                if not self.manual_window and event.flow_controlled_length:
                    self.conn.acknowledge_received_data(event.flow_controlled_length, sid)
            elif isinstance(event, h2.events.StreamEnded) and reply is not None:
                reply.ended = True
            elif isinstance(event, h2.events.StreamReset) and reply is not None:
                reply.reset = int(event.error_code or 0)
            elif isinstance(event, h2.events.PingAckReceived):
                self.ping_acks.append(bytes(event.ping_data or b""))

    # ---------------------------------------------------------------- frames seen

    @property
    def goaways(self) -> list[GoAwayFrame]:
        return [f for f in self.frames if isinstance(f, GoAwayFrame)]

    @property
    def server_pings(self) -> list[PingFrame]:
        """PINGs the server sent (not its acknowledgements of ours)."""
        return [f for f in self.frames if isinstance(f, PingFrame) and "ACK" not in f.flags]

    def data_frames(self, sid: int) -> list[DataFrame]:
        return [f for f in self.frames if isinstance(f, DataFrame) and f.stream_id == sid]

    # ---------------------------------------------------------------- calls

    def open(self, path: str, headers: Headers = (), *, end: bool = False) -> int:
        """Queue a request's HEADERS; the new stream's id."""
        sid = self.conn.get_next_available_stream_id()
        self.replies[sid] = Reply()
        self.conn.send_headers(
            sid,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", "127.0.0.1"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                *headers,
            ],
            end_stream=end,
        )
        return sid

    async def send_body(self, sid: int, body: bytes, *, end: bool = True) -> None:
        """``body`` on stream ``sid`` in frames the server's windows and frame size allow,
        reading its WINDOW_UPDATEs while a window is shut; stops when the stream is answered
        before the body is all sent (the server may refuse early)."""
        view = memoryview(body)
        pos = 0
        reply = self.replies[sid]
        while True:
            if reply.done:
                return
            room = min(self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size)
            if room > 0 or pos == len(view):
                piece = bytes(view[pos : pos + room])
                pos += len(piece)
                last = pos == len(view)
                try:
                    self.conn.send_data(sid, piece, end_stream=end and last)
                except h2.exceptions.StreamClosedError:
                    return
                await self.flush()
                if last:
                    return
                continue
            if not await self.receive():
                return

    async def wait(self, sid: int) -> Reply:
        """Read until stream ``sid`` has ended or was reset."""
        reply = self.replies[sid]
        await self.until(lambda: reply.done)
        return reply

    async def call(self, path: str, body: bytes, headers: Headers = ()) -> Reply:
        """One whole request (``body`` as is, then END_STREAM) and its reply."""
        sid = self.open(path, headers)
        await self.flush()
        await self.send_body(sid, body)
        return await self.wait(sid)

    async def ping(self, opaque: bytes) -> None:
        """Send a PING and read until its acknowledgement."""
        self.conn.ping(opaque)
        await self.flush()
        await self.until(lambda: opaque in self.ping_acks)


__all__ = ["MAX_STREAM_ID", "Peer", "Reply", "grpc_frame", "grpc_messages"]

"""A raw HTTP/2 client for the edge tests: frames written as bytes (hyperframe + an HPACK encoder
kept in step with the server's decoder), in whatever order and number no client library would
send them, and every frame the server answers recorded (its header blocks decoded).

It never acknowledges, retries or obeys anything on its own: a test says what goes out. It is
the attacker of ``test_h2_*`` (floods, rapid resets, CONTINUATION holds, stream bursts, silent
and idle connections), against an in-process ``GrpcServer`` and the CLI worker and gateway.
"""

from __future__ import annotations

import math
import struct
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import hpack
from h2.errors import ErrorCodes
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from tests.serving.grpc.h2_peer import take_frames

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
INFER_PATH = "/inference.GRPCInferenceService/ModelInfer"


def grpc_message(payload: bytes) -> bytes:
    """``payload`` behind the 5-byte gRPC message prefix."""
    return struct.pack(">BI", 0, len(payload)) + payload


def raw_frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    """Any frame, a type HTTP/2 does not define included."""
    return struct.pack(">HBBBL", len(payload) >> 8, len(payload) & 0xFF, kind, flags, sid) + (
        payload
    )


def settings() -> bytes:
    return SettingsFrame(0).serialize()


def ping(opaque: bytes = b"12345678") -> bytes:
    frame = PingFrame(0)
    frame.opaque_data = opaque
    return frame.serialize()


def window_update(sid: int, increment: int) -> bytes:
    frame = WindowUpdateFrame(sid)
    frame.window_increment = increment
    return frame.serialize()


def priority(sid: int) -> bytes:
    frame = PriorityFrame(sid)
    frame.depends_on = 0
    frame.stream_weight = 15
    return frame.serialize()


def data(sid: int, payload: bytes, *, end_stream: bool = False) -> bytes:
    return DataFrame(sid, payload, flags=["END_STREAM"] if end_stream else []).serialize()


def rst(sid: int, code: ErrorCodes = ErrorCodes.CANCEL) -> bytes:
    return RstStreamFrame(sid, error_code=int(code)).serialize()


def continuation(sid: int, fragment: bytes, *, end_headers: bool = False) -> bytes:
    return ContinuationFrame(
        sid, fragment, flags=["END_HEADERS"] if end_headers else []
    ).serialize()


class Attacker:
    """One raw connection (module docstring)."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.frames: list[Frame] = []
        self.headers: dict[int, list[dict[str, str]]] = {}
        self.eof = False
        self._buffer = bytearray()

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        port: int,
        host: str = "127.0.0.1",
        *,
        preface: bool = True,
        local_host: str | None = None,
    ) -> AsyncIterator[Attacker]:
        """A connection that has sent the preface and an empty SETTINGS (``preface=False``:
        nothing sent), from ``local_host`` when given (another loopback address is another
        peer to the server)."""
        async with await anyio.connect_tcp(host, port, local_host=local_host) as stream:
            attacker = cls(stream)
            if preface:
                await attacker.send(PREFACE + settings())
            yield attacker

    async def send(self, *chunks: bytes) -> bool:
        """Write ``chunks`` as one write; False when the server has closed the connection."""
        try:
            await self.stream.send(b"".join(chunks))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return False
        return True

    def request(
        self,
        sid: int,
        path: str = INFER_PATH,
        *,
        end_stream: bool = False,
        extra: Iterable[tuple[str, str]] = (),
    ) -> bytes:
        """A gRPC request's HEADERS frame (one block, END_HEADERS)."""
        block = self.header_block(path, extra)
        flags = ["END_HEADERS", "END_STREAM"] if end_stream else ["END_HEADERS"]
        return HeadersFrame(sid, block, flags=flags).serialize()

    def header_block(self, path: str = INFER_PATH, extra: Iterable[tuple[str, str]] = ()) -> bytes:
        """A request's header block, HPACK-encoded (the server's decoder follows along)."""
        return self.encoder.encode(
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", "127.0.0.1"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                *extra,
            ]
        )

    # ------------------------------------------------------------------ reading

    async def receive(self) -> bool:
        """One read, its frames recorded; False at the end of the stream."""
        try:
            chunk = await self.stream.receive(1 << 16)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            self.eof = True
            return False
        self._buffer += chunk
        for frame, _raw in take_frames(self._buffer):
            self.frames.append(frame)
            if isinstance(frame, HeadersFrame):
                decoded = self.decoder.decode(frame.data, raw=False)
                fields = {str(k): str(v) for k, v in decoded}
                self.headers.setdefault(frame.stream_id, []).append(fields)
        return True

    async def until(self, condition: Callable[[], bool], timeout: float = math.inf) -> bool:
        """Read until ``condition()`` holds (True) or the server closes first (False)."""
        with anyio.move_on_after(timeout):
            while not condition():
                if not await self.receive():
                    return condition()
            return True
        return condition()

    async def until_eof(self, timeout: float) -> bool:
        """Read until the server closes the connection; False when it did not within
        ``timeout``."""
        with anyio.move_on_after(timeout):
            while await self.receive():
                pass
        return self.eof

    # ------------------------------------------------------------------ what came back

    @property
    def goaways(self) -> list[GoAwayFrame]:
        return [f for f in self.frames if isinstance(f, GoAwayFrame)]

    def resets(self, code: ErrorCodes) -> list[int]:
        """Stream ids the server reset with ``code``."""
        return [
            f.stream_id
            for f in self.frames
            if isinstance(f, RstStreamFrame) and f.error_code == int(code)
        ]

    def settings_acked(self) -> bool:
        """Whether the server has read our SETTINGS (it acknowledged them)."""
        return any(isinstance(f, SettingsFrame) and "ACK" in f.flags for f in self.frames)

    def ping_acks(self) -> int:
        return sum(1 for f in self.frames if isinstance(f, PingFrame) and "ACK" in f.flags)

    def status(self, sid: int) -> int | None:
        """The grpc-status the server ended stream ``sid`` with (None: not yet)."""
        for fields in self.headers.get(sid, []):
            if "grpc-status" in fields:
                return int(fields["grpc-status"])
        return None


__all__ = [
    "INFER_PATH",
    "PREFACE",
    "Attacker",
    "continuation",
    "data",
    "grpc_message",
    "ping",
    "priority",
    "raw_frame",
    "rst",
    "settings",
    "window_update",
]

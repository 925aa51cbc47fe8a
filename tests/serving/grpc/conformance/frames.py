"""What a conformance case builds its bytes with: ``Wire``, one per connection, holding the
client's HPACK encoder (in step with the server's decoder), the SETTINGS the server sent, and
the highest stream id the case used; frames come out as bytes (``raw_frame``), so a case can
write any frame, the malformed ones included. ``AwaitEnd`` in a case's list makes the runner
read until a stream has ended before it writes the rest.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import hpack
import numpy as np
from hpack.hpack import encode_integer
from hyperframe.frame import SettingsFrame

from kserve_trio.proto import inference as pb
from tests.edge.h2_attacker import raw_frame
from tests.serving.grpc.h2_peer import grpc_frame

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS = 0x0, 0x1, 0x2, 0x3, 0x4
PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0x5, 0x6, 0x7, 0x8, 0x9
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20

READY = "/inference.GRPCInferenceService/ServerReady"
INFER = "/inference.GRPCInferenceService/ModelInfer"
ECHO_MODEL = "echo"
ECHO_INPUT = np.arange(4, dtype=np.float32).reshape(1, 4)

Fields = list[tuple[str, str]]


@dataclass(frozen=True)
class AwaitEnd:
    """Read until stream ``stream`` has ended (or was reset) before writing on."""

    stream: int


def echo_request() -> bytes:
    """A ModelInfer request for the ``echo`` model as one gRPC message."""
    tensor = pb.ModelInferRequestInferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    request = pb.ModelInferRequest(
        model_name=ECHO_MODEL, inputs=[tensor], raw_input_contents=[ECHO_INPUT.tobytes()]
    )
    return grpc_frame(request.SerializeToString())


def hpack_int(value: int, prefix_bits: int, flags: int = 0) -> bytes:
    """An HPACK integer with ``flags`` in the bits of its first byte above the prefix."""
    encoded = encode_integer(value, prefix_bits)
    encoded[0] |= flags
    return bytes(encoded)


def literal(name: bytes, value: bytes) -> bytes:
    """A literal field without indexing, with a new name, neither string Huffman-coded (the
    server's dynamic table is left as it was)."""
    return hpack_int(len(name), 7) + name + hpack_int(len(value), 7) + value


def settings_payload(*pairs: tuple[int, int]) -> bytes:
    return b"".join(struct.pack(">HI", key, value) for key, value in pairs)


def padded(payload: bytes, pad: int) -> bytes:
    """A padded frame's payload: the pad length byte, ``payload``, ``pad`` zero bytes."""
    return bytes([pad]) + payload + bytes(pad)


@dataclass
class Wire:
    """One connection's frame builder (module docstring)."""

    server_settings: Mapping[int, int]
    encoder: hpack.Encoder = field(default_factory=hpack.Encoder)
    top_stream: int = 0

    @property
    def max_frame_size(self) -> int:
        return self.server_settings.get(SettingsFrame.MAX_FRAME_SIZE, 1 << 14)

    @property
    def initial_window(self) -> int:
        return self.server_settings.get(SettingsFrame.INITIAL_WINDOW_SIZE, (1 << 16) - 1)

    @property
    def header_table_size(self) -> int:
        return self.server_settings.get(SettingsFrame.HEADER_TABLE_SIZE, 4096)

    def next_stream(self) -> int:
        """The lowest odd stream id above every one the case used."""
        return self.top_stream + 1 if self.top_stream % 2 == 0 else self.top_stream + 2

    # ------------------------------------------------------------------ frames

    def frame(self, kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
        self.top_stream = max(self.top_stream, stream & 0x7FFFFFFF)
        return raw_frame(kind, flags, stream, payload)

    def head(self, kind: int, flags: int, stream: int, length: int) -> bytes:
        """A frame header alone, announcing ``length`` bytes (the case sends what it likes)."""
        self.top_stream = max(self.top_stream, stream)
        return struct.pack(">HBBBL", length >> 8, length & 0xFF, kind, flags, stream)

    def data(
        self, stream: int, payload: bytes, *, end: bool = False, pad: int | None = None
    ) -> bytes:
        flags = END_STREAM if end else 0
        if pad is not None:
            flags |= PADDED
            payload = padded(payload, pad)
        return self.frame(DATA, flags, stream, payload)

    def headers(
        self,
        stream: int,
        block: bytes,
        *,
        end: bool = False,
        end_headers: bool = True,
        pad: int | None = None,
        depends_on: int | None = None,
    ) -> bytes:
        """HEADERS carrying ``block`` (``depends_on``: with the PRIORITY flag, weight 16)."""
        flags = (END_STREAM if end else 0) | (END_HEADERS if end_headers else 0)
        if depends_on is not None:
            flags |= PRIORITY_FLAG
            block = struct.pack(">LB", depends_on, 15) + block
        if pad is not None:
            flags |= PADDED
            block = padded(block, pad)
        return self.frame(HEADERS, flags, stream, block)

    def continuation(self, stream: int, block: bytes, *, end_headers: bool = True) -> bytes:
        return self.frame(CONTINUATION, END_HEADERS if end_headers else 0, stream, block)

    def priority(self, stream: int, depends_on: int) -> bytes:
        return self.frame(PRIORITY, 0, stream, struct.pack(">LB", depends_on, 15))

    def rst(self, stream: int, code: int = 0x8) -> bytes:
        return self.frame(RST_STREAM, 0, stream, struct.pack(">L", code))

    def settings(self, *pairs: tuple[int, int], stream: int = 0) -> bytes:
        return self.frame(SETTINGS, 0, stream, settings_payload(*pairs))

    def ping(self, opaque: bytes = b"\x01" * 8, *, flags: int = 0, stream: int = 0) -> bytes:
        return self.frame(PING, flags, stream, opaque)

    def window_update(self, stream: int, increment: int) -> bytes:
        return self.frame(WINDOW_UPDATE, 0, stream, struct.pack(">L", increment))

    # ------------------------------------------------------------------ requests

    def block(self, fields: Iterable[tuple[str, str]]) -> bytes:
        """``fields`` HPACK-encoded as given (order, case and duplicates kept)."""
        return self.encoder.encode(list(fields))

    @staticmethod
    def request_fields(
        path: str = READY,
        *,
        extra: Iterable[tuple[str, str]] = (),
        without: Iterable[str] = (),
        method: str = "POST",
    ) -> Fields:
        """A gRPC request's fields, ``without`` those named, ``extra`` appended."""
        drop = set(without)
        fields = [
            (":method", method),
            (":scheme", "http"),
            (":path", path),
            (":authority", "127.0.0.1"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        return [f for f in fields if f[0] not in drop] + list(extra)

    def request(
        self,
        stream: int = 1,
        path: str = READY,
        *,
        end: bool = False,
        extra: Iterable[tuple[str, str]] = (),
        without: Iterable[str] = (),
        method: str = "POST",
    ) -> bytes:
        """One request's HEADERS frame (END_HEADERS; ``end``: END_STREAM too)."""
        fields = self.request_fields(path, extra=extra, without=without, method=method)
        return self.headers(stream, self.block(fields), end=end)

    def fields_request(self, fields: Iterable[tuple[str, str]], stream: int = 1) -> bytes:
        """A request of exactly ``fields``, with END_STREAM (nothing else is sent on it)."""
        return self.headers(stream, self.block(fields), end=True)

    def echo_call(self, stream: int) -> bytes:
        """A whole ModelInfer call on the echo model: HEADERS, one DATA with END_STREAM."""
        return self.request(stream, INFER) + self.data(stream, echo_request(), end=True)


__all__ = [
    "ACK",
    "CONTINUATION",
    "DATA",
    "ECHO_INPUT",
    "ECHO_MODEL",
    "END_HEADERS",
    "END_STREAM",
    "GOAWAY",
    "HEADERS",
    "INFER",
    "PADDED",
    "PING",
    "PRIORITY",
    "PRIORITY_FLAG",
    "PUSH_PROMISE",
    "READY",
    "RST_STREAM",
    "SETTINGS",
    "WINDOW_UPDATE",
    "AwaitEnd",
    "Wire",
    "echo_request",
    "hpack_int",
    "literal",
    "padded",
    "settings_payload",
]

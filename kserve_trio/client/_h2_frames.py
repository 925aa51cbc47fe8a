"""HTTP/2 frames for the client connection: writing them, reading them, and header blocks.

No I/O and no connection state: ``_h2_connection`` owns the state (windows, settings, streams)
and calls these. What the client needs of RFC 9113 and no more, because a general HTTP/2 state
machine costs a gRPC client more CPU per call than its whole own work (docs/benchmarks.md,
"Client"):

- ``frame`` / ``frame_header`` and the small control frames (SETTINGS, WINDOW_UPDATE,
  RST_STREAM, GOAWAY, PING) as bytes;
- ``FrameReader``: the byte stream cut into ``(type, flags, stream id, payload)`` with the
  payloads as views of the received bytes (a DATA payload is not copied), refusing a frame over
  the size we advertised;
- ``header_field`` / ``header_block``: HPACK without the dynamic table. Each field is a static
  table index or a literal that is never added to a table, so a block's bytes depend only on
  its fields: a transport encodes its fixed request headers once and reuses the bytes. (The
  peer's table stays empty; ``TABLE_SIZE_ZERO`` at the start of a connection's first block
  says so.) Reply headers are decoded with ``hpack.Decoder``, the full HPACK decoder.
"""

from __future__ import annotations

import struct

from hpack.table import HeaderTable

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# frame types
DATA = 0x0
HEADERS = 0x1
PRIORITY = 0x2
RST_STREAM = 0x3
SETTINGS = 0x4
PUSH_PROMISE = 0x5
PING = 0x6
GOAWAY = 0x7
WINDOW_UPDATE = 0x8
CONTINUATION = 0x9

# flags
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

# settings
HEADER_TABLE_SIZE = 0x1
ENABLE_PUSH = 0x2
MAX_CONCURRENT_STREAMS = 0x3
INITIAL_WINDOW_SIZE = 0x4
MAX_FRAME_SIZE = 0x5

# error codes
NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
FLOW_CONTROL_ERROR = 0x3
FRAME_SIZE_ERROR = 0x6
CANCEL = 0x8
COMPRESSION_ERROR = 0x9

DEFAULT_WINDOW = 65535
DEFAULT_FRAME = 16384
MAX_WINDOW = (1 << 31) - 1
MAX_STREAM_ID = (1 << 31) - 1

TABLE_SIZE_ZERO = b"\x20"
"""An HPACK dynamic table size update to 0: the first bytes of a connection's first block."""

_HEAD = struct.Struct(">IBI")  # (length << 8) | type, flags, stream id
_U32 = struct.Struct(">I")
_SETTING = struct.Struct(">HI")


class FrameError(Exception):
    """The peer broke the protocol: the connection must end with ``code`` (an HTTP/2 error)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------------------------
# Writing


def frame_header(ftype: int, flags: int, stream_id: int, length: int) -> bytes:
    """The 9-byte header of a frame whose payload is ``length`` bytes."""
    return _HEAD.pack((length << 8) | ftype, flags, stream_id)


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return _HEAD.pack((len(payload) << 8) | ftype, flags, stream_id) + payload


def settings_frame(values: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(_SETTING.pack(k, v) for k, v in values.items()))


SETTINGS_ACK = frame(SETTINGS, ACK, 0)


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(increment))


def rst_stream(stream_id: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, _U32.pack(code))


def goaway(code: int, last_stream_id: int = 0) -> bytes:
    return frame(GOAWAY, 0, 0, _U32.pack(last_stream_id) + _U32.pack(code))


def headers_frames(stream_id: int, block: bytes, max_frame: int) -> bytes:
    """HEADERS (and CONTINUATION frames when ``block`` is over the peer's frame size)."""
    if len(block) <= max_frame:
        return frame(HEADERS, END_HEADERS, stream_id, block)
    parts = [block[i : i + max_frame] for i in range(0, len(block), max_frame)]
    out = [frame(HEADERS, 0, stream_id, parts[0])]
    for part in parts[1:-1]:
        out.append(frame(CONTINUATION, 0, stream_id, part))
    out.append(frame(CONTINUATION, END_HEADERS, stream_id, parts[-1]))
    return b"".join(out)


# --------------------------------------------------------------------------------------------
# Reading


def u32(payload: memoryview, offset: int = 0) -> int:
    return _U32.unpack_from(payload, offset)[0]


def settings_values(payload: memoryview) -> list[tuple[int, int]]:
    if len(payload) % 6:
        raise FrameError(FRAME_SIZE_ERROR, f"a SETTINGS frame of {len(payload)} bytes")
    return [_SETTING.unpack_from(payload, i) for i in range(0, len(payload), 6)]


def unpad(payload: memoryview, flags: int) -> memoryview:
    """A DATA or HEADERS payload without its padding (``PADDED``)."""
    if not flags & PADDED:
        return payload
    if not payload:
        raise FrameError(PROTOCOL_ERROR, "a padded frame without a pad length")
    pad = payload[0]
    if pad >= len(payload):
        raise FrameError(PROTOCOL_ERROR, f"padding of {pad} bytes in a {len(payload)}-byte frame")
    return payload[1 : len(payload) - pad]


class FrameReader:
    """Received bytes in, whole frames out (``feed``). The bytes of a frame not yet complete
    are kept as they arrived and joined once it is (a large frame received in many pieces is
    not re-copied on each)."""

    __slots__ = ("max_frame", "need", "parts", "size")

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self.parts: list[bytes | memoryview] = []  # the start of an incomplete frame
        self.size = 0  # bytes in parts
        self.need = 0  # bytes the incomplete frame needs in all (header included)

    def feed(self, data: bytes) -> list[tuple[int, int, int, memoryview]]:
        """Every frame completed by ``data``, payloads as views of the received bytes;
        ``FrameError`` for a frame over ``max_frame``."""
        if self.parts:
            self.parts.append(data)
            self.size += len(data)
            if self.size < self.need:
                return []
            data = b"".join(self.parts)
            self.parts = []
        view = memoryview(data)
        size = len(data)
        pos = 0
        frames = []
        unpack = _HEAD.unpack_from
        while size - pos >= 9:
            word, flags, sid = unpack(data, pos)
            length = word >> 8
            if length > self.max_frame:
                raise FrameError(
                    FRAME_SIZE_ERROR, f"a frame of {length} bytes (the limit is {self.max_frame})"
                )
            end = pos + 9 + length
            if end > size:
                self.need = 9 + length
                break
            frames.append((word & 0xFF, flags, sid & MAX_STREAM_ID, view[pos + 9 : end]))
            pos = end
        else:
            self.need = 9
        if pos < size:
            self.parts = [view[pos:]]
            self.size = size - pos
        return frames


# --------------------------------------------------------------------------------------------
# HPACK without the dynamic table

_FULL: dict[tuple[bytes, bytes], int] = {}
_NAME: dict[bytes, int] = {}
for _index, (_name, _value) in enumerate(HeaderTable.STATIC_TABLE, 1):
    _FULL.setdefault((_name, _value), _index)
    _NAME.setdefault(_name, _index)


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer with a ``prefix_bits`` prefix, ORed into ``first``."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(data: bytes) -> bytes:
    return _integer(len(data), 7, 0) + data  # a plain (not Huffman-coded) string literal


def header_field(name: bytes, value: bytes) -> bytes:
    """One header field: an indexed static entry, or a literal never added to a table."""
    index = _FULL.get((name, value))
    if index is not None:
        return _integer(index, 7, 0x80)
    index = _NAME.get(name)
    if index is not None:
        return _integer(index, 4, 0x00) + _string(value)
    return b"\x00" + _string(name) + _string(value)


def header_block(headers: list[tuple[bytes, bytes]]) -> bytes:
    return b"".join(header_field(n, v) for n, v in headers)


def indexed_only(block: bytes | memoryview) -> bool:
    """Whether every field of ``block`` is an indexed one (``1xxxxxxx``, RFC 7541 6.1): such a
    block leaves the decoder's table as it was, so it decodes the same until a block that is
    not indexed-only (an insertion, a size update) is decoded."""
    i, n = 0, len(block)
    while i < n:
        b = block[i]
        if b < 0x80:
            return False
        i += 1
        if b == 0xFF:  # the index continues in the bytes that follow
            while i < n and block[i] & 0x80:
                i += 1
            i += 1
    return i == n


__all__ = [
    "PREFACE",
    "FrameError",
    "FrameReader",
    "frame",
    "frame_header",
    "header_block",
    "header_field",
    "headers_frames",
    "indexed_only",
    "settings_frame",
    "window_update",
]

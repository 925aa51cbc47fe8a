"""The seam between our gRPC layer and an HTTP/2 implementation: what we ask of an engine.

An engine is one HTTP/2 connection's state with no I/O (sans-IO): bytes in (``receive``),
typed events out, bytes to send (``data_to_send``). It owns framing, HPACK, stream states and
flow control; what it may never do is block, spawn, or touch a socket. Two engines implement
the seam (``ngh2`` over libnghttp2, ``h2`` in pure Python) and everything above it is written
against ``Engine`` alone.

The rules every engine keeps (cited by name below and by the engines):

- *Queued sends*: ``send_data`` never fails for lack of window: what the peer's flow control
  does not admit yet is queued in the engine and framed by a later ``data_to_send`` as
  WINDOW_UPDATEs come. ``pending(stream_id)`` says how much of a stream's DATA still waits; a
  sender that bounds its memory waits on that, not on the windows.
- *Trailers last*: ``send_trailers`` goes after every byte queued before it on the stream.
  ``reset_stream`` drops what the stream still had queued, except a NO_ERROR reset (RFC 9113
  8.1: a server that has answered asks the client to stop sending its request), which goes
  after the whole response.
- *Consumed, then acknowledged*: received DATA takes window until ``acknowledge`` gives it back
  (never automatically), so a slow reader holds the peer back instead of buffering.
- *Peer errors*: a peer that breaks the protocol or a defence makes ``receive`` raise
  ``PeerError`` with the connection error's code, the GOAWAY saying so already queued in
  ``data_to_send``. A stream error (a malformed request, one stream too many) is answered by
  the engine with RST_STREAM and surfaces as ``StreamReset(remote=False)``.
- *Gone streams*: sending on a stream that is closed (or reset) raises ``StreamGone``.
- *Two-phase GOAWAY*: ``goaway_notice`` is the first phase of a graceful shutdown (GOAWAY with
  the largest stream id, new streams still accepted); ``goaway`` is the final one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

from kserve_trio.http2._events import Event, Header

MAX_STREAM_ID = 2**31 - 1
MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65535
DEFAULT_FRAME = 16384


class ErrorCode(IntEnum):
    """The error codes of RST_STREAM and GOAWAY (RFC 9113, section 7)."""

    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    CONNECT_ERROR = 0xA
    ENHANCE_YOUR_CALM = 0xB
    INADEQUATE_SECURITY = 0xC
    HTTP_1_1_REQUIRED = 0xD


def code_name(code: int) -> str:
    """An error code's RFC name (its number when HTTP/2 does not name it)."""
    try:
        return ErrorCode(code).name
    except ValueError:
        return str(code)


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """One connection's HTTP/2 parameters and the defences the engine enforces itself.

    The receive side (windows, frame size, streams, header list) is what we advertise in our
    SETTINGS. The defences are the engine's own per-connection bounds: an engine that has a
    native rule for one applies it (libnghttp2 has all of them), the pure-Python engine applies
    its equivalent before it parses the bytes.
    """

    client: bool = False
    stream_window: int = DEFAULT_WINDOW
    connection_window: int = DEFAULT_WINDOW
    max_frame: int = DEFAULT_FRAME
    max_concurrent_streams: int = 0
    """0: none advertised."""
    max_header_list: int = 65536
    """The decoded header list a block may carry (RFC 9113's size: each field + 32)."""
    max_header_fields: int = 1024
    max_continuations: int = 8
    """CONTINUATION frames after one HEADERS."""
    max_settings_entries: int = 32
    max_outbound_acks: int = 1000
    """SETTINGS and PING acknowledgements queued and not yet taken by ``data_to_send``."""
    reset_rate: tuple[int, int] = (1000, 33)
    """RST_STREAM frames from the peer: a bucket of (burst, refill per second)."""
    glitch_rate: tuple[int, int] = (10000, 330)
    """Frames that serve no purpose (empty DATA, PRIORITY, unknown types, needless SETTINGS,
    stream errors...): a bucket of (burst, refill per second)."""


class PeerError(Exception):
    """The peer broke the protocol or a defence: the connection is over (*peer errors*). ``code`` and
    ``debug`` are what the queued GOAWAY says; ``rule`` names a defence of ours when one
    tripped (for the edge counters), else it is empty."""

    def __init__(self, code: int, reason: str, debug: bytes = b"", rule: str = "") -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.debug = debug
        self.rule = rule


class StreamGone(Exception):
    """Nothing more can be sent on the stream: it is closed or was reset."""


class Engine(Protocol):
    """One HTTP/2 connection as our layer drives it (module docstring)."""

    name: str

    def initiate(self) -> None:
        """Queue our preface (client) and SETTINGS, with the connection window raised."""
        ...

    def receive(self, data: bytes) -> list[Event]:
        """Bytes from the peer; what happened (*peer errors*)."""
        ...

    def data_to_send(self) -> bytes:
        """Everything queued for the peer now, in order (empty when nothing is)."""
        ...

    def send_request(self, headers: Iterable[Header], end_stream: bool = False) -> int:
        """Open a stream with request ``headers`` (client side); its id."""
        ...

    def send_headers(
        self, stream_id: int, headers: Iterable[Header], end_stream: bool = False
    ) -> None:
        """Response headers of ``stream_id`` (server side)."""
        ...

    def send_data(
        self, stream_id: int, data: bytes | bytearray | memoryview, end_stream: bool = False
    ) -> None:
        """Queue DATA (*queued sends*)."""
        ...

    def send_trailers(self, stream_id: int, headers: Iterable[Header]) -> None:
        """Trailing headers, ending our side of the stream (*trailers last*)."""
        ...

    def end_stream(self, stream_id: int) -> None:
        """End our side of the stream with no more data (client side: the request is whole)."""
        ...

    def reset_stream(self, stream_id: int, code: int = ErrorCode.CANCEL) -> None:
        """RST_STREAM; nothing happens when the stream is closed already (*trailers last*)."""
        ...

    def acknowledge(self, stream_id: int, n: int) -> None:
        """``n`` received bytes of ``stream_id`` are consumed: give them back (*consumed, then acknowledged*)."""
        ...

    def pending(self, stream_id: int) -> int:
        """DATA bytes of ``stream_id`` queued and not yet framed (*queued sends*)."""
        ...

    def send_window(self, stream_id: int) -> int:
        """How much DATA of ``stream_id`` the peer's windows (the stream's and the
        connection's) admit now: queued DATA beyond it waits for WINDOW_UPDATE."""
        ...

    def ping(self, data: bytes) -> None:
        """A PING with 8 bytes of ``data``."""
        ...

    def goaway_notice(self) -> None:
        """The first phase of a graceful shutdown (*two-phase GOAWAY*)."""
        ...

    def goaway(self, code: int = ErrorCode.NO_ERROR, debug: bytes = b"") -> None:
        """The final GOAWAY, naming the last stream we processed (*two-phase GOAWAY*)."""
        ...

    @property
    def peer_max_streams(self) -> int:
        """The peer's SETTINGS_MAX_CONCURRENT_STREAMS (a very large number when it set none)."""
        ...


__all__ = [
    "DEFAULT_FRAME",
    "DEFAULT_WINDOW",
    "MAX_STREAM_ID",
    "MAX_WINDOW",
    "Engine",
    "EngineSettings",
    "ErrorCode",
    "PeerError",
    "StreamGone",
    "code_name",
]

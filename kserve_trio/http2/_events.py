"""What an HTTP/2 engine tells its user: one frozen class per kind of thing that happened.

Both engines translate their own events into these, so nothing above the seam knows which
engine runs. They are read-only by convention, not frozen: a frozen dataclass sets each field
through ``object.__setattr__``, which costs a small call a few microseconds on the hot path. Header names and values stay ``bytes`` (HPACK's own form): the gRPC layer decodes
only the few it reads. An event about the connection as a whole has no stream id.
"""

from __future__ import annotations

from dataclasses import dataclass

Header = tuple[bytes, bytes]
"""One header field as it travels: lower-case name, value."""


@dataclass(slots=True)
class RequestReceived:
    """A client opened ``stream_id`` with these request headers (server side)."""

    stream_id: int
    headers: list[Header]
    end_stream: bool


@dataclass(slots=True)
class ResponseReceived:
    """The response headers of ``stream_id`` (client side); ``end_stream``: trailers-only."""

    stream_id: int
    headers: list[Header]
    end_stream: bool


@dataclass(slots=True)
class TrailersReceived:
    """The trailing headers of ``stream_id``; they always end the peer's side of it."""

    stream_id: int
    headers: list[Header]


@dataclass(slots=True)
class DataReceived:
    """A DATA payload of ``stream_id``. ``flow_length`` is what it took of the flow-control
    windows (padding included); ``acknowledge`` gives it back once the data is consumed."""

    stream_id: int
    data: bytes
    flow_length: int
    end_stream: bool


@dataclass(slots=True)
class StreamReset:
    """``stream_id`` ended abnormally with ``code`` (an ``ErrorCode`` value): reset by the peer
    (``remote``), or by the engine for a stream error of the peer's (RST_STREAM sent)."""

    stream_id: int
    code: int
    remote: bool = True


@dataclass(slots=True)
class WindowOpened:
    """The peer gave more flow-control window (``stream_id`` 0: the connection's) or changed
    the initial window: queued DATA may move, senders waiting for room may go on."""

    stream_id: int


@dataclass(slots=True)
class SettingsReceived:
    """The peer's SETTINGS arrived (its first one completes its preface); a changed initial
    window moves queued DATA like a WINDOW_UPDATE does."""


@dataclass(slots=True)
class PingReceived:
    """The peer's PING (the engine has queued its acknowledgement)."""

    data: bytes


@dataclass(slots=True)
class PingAcknowledged:
    """The peer answered our PING carrying ``data``."""

    data: bytes


@dataclass(slots=True)
class GoAwayReceived:
    """The peer's GOAWAY: it opens no stream after ``last_stream_id``."""

    last_stream_id: int
    code: int
    debug: bytes


Event = (
    RequestReceived
    | ResponseReceived
    | TrailersReceived
    | DataReceived
    | StreamReset
    | WindowOpened
    | SettingsReceived
    | PingReceived
    | PingAcknowledged
    | GoAwayReceived
)

__all__ = [
    "DataReceived",
    "Event",
    "GoAwayReceived",
    "Header",
    "PingAcknowledged",
    "PingReceived",
    "RequestReceived",
    "ResponseReceived",
    "SettingsReceived",
    "StreamReset",
    "TrailersReceived",
    "WindowOpened",
]

"""The HTTP/2 engine seam: one connection's HTTP/2 as bytes in, typed events out, bytes to send.

Our gRPC server (``serving.grpc``) and client transport run on an ``Engine`` and never on an
HTTP/2 library directly. Two engines implement it: ``ngh2`` (libnghttp2, the default) and ``h2``
(pure Python, the fallback). It sits beside ``core`` at the bottom of the layers, so the client
can use it as the servers do.

- ``Engine``, ``EngineSettings``, ``ErrorCode``, ``PeerError``, ``StreamGone`` and the rules
  every engine keeps (``_engine``);
- the events (``_events``);
- ``new_engine``, ``ENGINES``, ``DEFAULT_ENGINE`` (``_choice``).
"""

from __future__ import annotations

from kserve_trio.http2._choice import (
    DEFAULT_ENGINE,
    ENGINES,
    EngineName,
    check_engine,
    new_engine,
)
from kserve_trio.http2._engine import (
    DEFAULT_FRAME,
    DEFAULT_WINDOW,
    MAX_STREAM_ID,
    MAX_WINDOW,
    Engine,
    EngineSettings,
    ErrorCode,
    PeerError,
    StreamGone,
    code_name,
)
from kserve_trio.http2._events import (
    DataReceived,
    Event,
    GoAwayReceived,
    Header,
    PingAcknowledged,
    PingReceived,
    RequestReceived,
    ResponseReceived,
    SettingsReceived,
    StreamReset,
    TrailersReceived,
    WindowOpened,
)

__all__ = [
    "DEFAULT_ENGINE",
    "DEFAULT_FRAME",
    "DEFAULT_WINDOW",
    "ENGINES",
    "MAX_STREAM_ID",
    "MAX_WINDOW",
    "DataReceived",
    "Engine",
    "EngineName",
    "EngineSettings",
    "ErrorCode",
    "Event",
    "GoAwayReceived",
    "Header",
    "PeerError",
    "PingAcknowledged",
    "PingReceived",
    "RequestReceived",
    "ResponseReceived",
    "SettingsReceived",
    "StreamGone",
    "StreamReset",
    "TrailersReceived",
    "WindowOpened",
    "check_engine",
    "code_name",
    "new_engine",
]

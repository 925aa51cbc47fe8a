"""The HTTP/2 and connection settings of our gRPC servers.

- ``limits``: the edge limits (``core.process.config.EdgeLimits``, the ``limits:`` block of the worker's
  and the gateway's configuration: windows, frame size, streams, header list, handshake and
  idle deadlines, flood and memory bounds). Its defaults are owned there.
- Keepalive: a PING after ``keepalive_seconds`` without a received frame; no answer within
  ``keepalive_timeout_seconds`` closes the connection (grpc-core's server defaults: 2 h, 20 s).
- ``max_connection_age_seconds`` (0: none): a connection older than this (plus up to 10%
  jitter, so connections made together do not all leave together) is drained with GOAWAY and
  closed after ``max_connection_age_grace_seconds``. It is how long-lived client connections
  move to new server processes.
- ``drain_ping_timeout_seconds``: how long the first phase of a graceful GOAWAY waits for the
  PING that proves the client has seen it before the real last stream id is sent.
- ``http2_engine``: which HTTP/2 engine the connections run (``kserve_trio.http2``), chosen
  once per process.

``engine_settings`` is the one mapping from the edge limits to what an engine enforces itself:
windows, frame size, streams and header list as advertised, the control-frame rate as the
engine's glitch rate, the reset rate; the per-block bounds (CONTINUATION frames, header
fields, SETTINGS entries, queued acknowledgements) are fixed here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kserve_trio.core.logging import get_logger
from kserve_trio.core.process import MAX_FRAME_BYTES, WINDOW_BYTES, EdgeLimits
from kserve_trio.http2 import DEFAULT_ENGINE, EngineSettings

MAX_CONTINUATIONS = 8
"""CONTINUATION frames after one HEADERS (a header block of more is an attack)."""
MAX_HEADER_FIELDS = 256
"""Fields in one header block (a gRPC request has about ten)."""
MAX_SETTINGS_ENTRIES = 32
"""Entries in one SETTINGS frame (HTTP/2 defines nine settings)."""
MAX_OUTBOUND_ACKS = 1000
"""SETTINGS and PING acknowledgements queued for a client that does not read."""


@dataclass(frozen=True)
class ServerSettings:
    """One server's HTTP/2 settings and connection lifetimes (module docstring)."""

    limits: EdgeLimits = field(default_factory=EdgeLimits)
    keepalive_seconds: float = 7200.0
    keepalive_timeout_seconds: float = 20.0
    max_connection_age_seconds: float = 0.0
    max_connection_age_grace_seconds: float = 5.0
    drain_ping_timeout_seconds: float = 1.0
    http2_engine: str = DEFAULT_ENGINE


def engine_settings(limits: EdgeLimits) -> EngineSettings:
    """What a server connection's engine enforces, from the edge limits (module docstring)."""
    rate = limits.max_control_frames_per_second
    resets = limits.max_resets_per_second
    return EngineSettings(
        client=False,
        stream_window=limits.stream_window_bytes,
        connection_window=limits.connection_window_bytes,
        max_frame=limits.max_frame_bytes,
        max_concurrent_streams=limits.max_concurrent_streams,
        max_header_list=limits.max_header_list_bytes,
        max_header_fields=MAX_HEADER_FIELDS,
        max_continuations=MAX_CONTINUATIONS,
        max_settings_entries=MAX_SETTINGS_ENTRIES,
        max_outbound_acks=MAX_OUTBOUND_ACKS,
        reset_rate=(resets, resets),
        glitch_rate=(rate, rate),
    )


REMOVED_SWITCHES = {
    "KSERVE_TRIO_GRPC_FAST_UNARY": "every unary call takes the one call path now",
    "KSERVE_TRIO_H2_TUNING": "the HTTP/2 settings are ServerSettings, always in force",
}
"""Environment switches of the server layer that no longer exist, and why."""


def warn_removed_switches() -> None:
    """One warning per removed switch that is still set, naming it."""
    log = get_logger("kserve_trio.serving.grpc")
    for name, why in REMOVED_SWITCHES.items():
        if name in os.environ:
            log.warning("removed_switch_ignored", variable=name, detail=f"{name} is gone: {why}")


__all__ = [
    "MAX_CONTINUATIONS",
    "MAX_FRAME_BYTES",
    "MAX_HEADER_FIELDS",
    "MAX_OUTBOUND_ACKS",
    "MAX_SETTINGS_ENTRIES",
    "REMOVED_SWITCHES",
    "WINDOW_BYTES",
    "ServerSettings",
    "engine_settings",
    "warn_removed_switches",
]

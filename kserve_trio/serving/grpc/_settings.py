"""The HTTP/2 and connection settings of our gRPC servers: one owner for every default.

- ``WINDOW_BYTES``: the stream and connection receive windows we advertise. 64 MiB lets a
  request of tens of MB arrive without waiting for WINDOW_UPDATE round trips (the defaults of
  4 MiB and less stall large tensors; docs/benchmarks.md).
- ``MAX_FRAME_BYTES``: the SETTINGS_MAX_FRAME_SIZE we advertise (1 MiB instead of 16 KiB), so a
  large tensor arrives in few frames, each of which costs h2's pure-Python framing.
- ``MAX_CONCURRENT_STREAMS``: streams a client may have open on one connection.
- Keepalive: a PING after ``keepalive_seconds`` without a received frame; no answer within
  ``keepalive_timeout_seconds`` closes the connection (grpc-core's server defaults: 2 h, 20 s).
- ``max_connection_age_seconds`` (0: none): a connection older than this (plus up to 10%
  jitter, so connections made together do not all leave together) is drained with GOAWAY and
  closed after ``max_connection_age_grace_seconds``. It is how long-lived client connections
  move to new server processes.
- ``drain_ping_timeout_seconds``: how long the first phase of a graceful GOAWAY waits for the
  PING that proves the client has seen it before the real last stream id is sent.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kserve_trio.core.logging import get_logger

WINDOW_BYTES = 64 << 20
MAX_FRAME_BYTES = 1 << 20
MAX_CONCURRENT_STREAMS = 1024
MAX_HEADER_LIST_BYTES = 64 << 10


@dataclass(frozen=True)
class ServerSettings:
    """One server's HTTP/2 settings and connection lifetimes (module docstring)."""

    window_bytes: int = WINDOW_BYTES
    max_frame_bytes: int = MAX_FRAME_BYTES
    max_concurrent_streams: int = MAX_CONCURRENT_STREAMS
    max_header_list_bytes: int = MAX_HEADER_LIST_BYTES
    keepalive_seconds: float = 7200.0
    keepalive_timeout_seconds: float = 20.0
    max_connection_age_seconds: float = 0.0
    max_connection_age_grace_seconds: float = 5.0
    drain_ping_timeout_seconds: float = 1.0
    handshake_timeout_seconds: float = 10.0


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
    "MAX_CONCURRENT_STREAMS",
    "MAX_FRAME_BYTES",
    "MAX_HEADER_LIST_BYTES",
    "REMOVED_SWITCHES",
    "WINDOW_BYTES",
    "ServerSettings",
    "warn_removed_switches",
]

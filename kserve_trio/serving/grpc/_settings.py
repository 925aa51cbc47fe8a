"""The HTTP/2 and connection settings of our gRPC servers.

- ``limits``: the edge limits (``core.config.EdgeLimits``, the ``limits:`` block of the worker's
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
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kserve_trio.core.config import MAX_FRAME_BYTES, WINDOW_BYTES, EdgeLimits
from kserve_trio.core.logging import get_logger


@dataclass(frozen=True)
class ServerSettings:
    """One server's HTTP/2 settings and connection lifetimes (module docstring)."""

    limits: EdgeLimits = field(default_factory=EdgeLimits)
    keepalive_seconds: float = 7200.0
    keepalive_timeout_seconds: float = 20.0
    max_connection_age_seconds: float = 0.0
    max_connection_age_grace_seconds: float = 5.0
    drain_ping_timeout_seconds: float = 1.0


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
    "MAX_FRAME_BYTES",
    "REMOVED_SWITCHES",
    "WINDOW_BYTES",
    "ServerSettings",
    "warn_removed_switches",
]

"""Edge limits: every bound a server puts on what one client (or all of them) may make it hold.

One dataclass, ``EdgeLimits``, is the ``limits:`` block of both configurations (the worker's
``limits.*`` / ``INFERENCE_SERVER_LIMITS_*`` and the gateway's ``limits.*`` /
``KSERVE_TRIO_GATEWAY_LIMITS_*``); its field defaults are the one owner of each default. The
servers (``serving.grpc``, ``serving.http``) read the values from it; ``docs/limits.md`` says what
a client sees at each limit and how the defaults compare with Envoy's, nginx's and grpc-core's.

A value of 0 turns a count, size or time limit off, except where a field says otherwise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kserve_trio.core.errors import ConfigError

WINDOW_BYTES = 64 << 20
"""The default HTTP/2 stream and connection receive windows our servers advertise."""
MAX_FRAME_BYTES = 1 << 20
"""The default SETTINGS_MAX_FRAME_SIZE our servers advertise (fewer frames per large tensor)."""


@dataclass(frozen=True)
class EdgeLimits:
    """The limits of one server process's public ports (module docstring)."""

    # --- connections and file descriptors -----------------------------------------------------
    max_connections: int = 1000
    """Open connections per listener; one more is accepted and closed at once. The effective cap
    is also bounded by the process's descriptor budget (``serving.fd_budget``)."""
    handshake_seconds: float = 10.0
    """From accept to a usable connection: TLS, the HTTP/2 preface and SETTINGS, or a whole
    HTTP/1.1 request head (slowloris)."""
    idle_seconds: float = 300.0
    """A connection with no open stream or request for this long is closed (HTTP/2: GOAWAY
    NO_ERROR first)."""

    # --- HTTP/2 ---------------------------------------------------------------------------------
    stream_window_bytes: int = WINDOW_BYTES
    """SETTINGS_INITIAL_WINDOW_SIZE: bytes a client may send on one stream before we acknowledge."""
    connection_window_bytes: int = WINDOW_BYTES
    """The connection's receive window (all streams together)."""
    max_frame_bytes: int = MAX_FRAME_BYTES
    """SETTINGS_MAX_FRAME_SIZE we advertise."""
    max_concurrent_streams: int = 1024
    """SETTINGS_MAX_CONCURRENT_STREAMS; a stream beyond it is refused (RST_STREAM REFUSED_STREAM)."""
    max_header_list_bytes: int = 64 << 10
    """SETTINGS_MAX_HEADER_LIST_SIZE; a header block whose fragments pass it ends the connection."""
    premature_reset_seconds: float = 1.0
    """A stream the client resets within this long of opening it counts as premature."""
    premature_reset_min_streams: int = 500
    """Premature resets are judged over this many recent streams: more than half premature ->
    GOAWAY(ENHANCE_YOUR_CALM)."""
    min_ping_interval_seconds: float = 300.0
    """Pings from a client closer together than this while no data flows are strikes."""
    max_ping_strikes: int = 2
    """Strikes beyond this -> GOAWAY(ENHANCE_YOUR_CALM, "too_many_pings"); 0: the first strike
    (grpc-core's meaning; ``min_ping_interval_seconds: 0`` turns the rule off)."""
    max_control_frames_per_second: int = 10000
    """SETTINGS, PING, PRIORITY, WINDOW_UPDATE, empty DATA and unknown frames a connection may
    send per second before GOAWAY(ENHANCE_YOUR_CALM): a token bucket of one second's worth,
    refilled at this rate (on ngh2, libnghttp2's glitch rate limit, which also counts the
    client's stream errors)."""
    max_resets_per_second: int = 1000
    """RST_STREAM frames a connection may send per second before GOAWAY(ENHANCE_YOUR_CALM): a
    token bucket of one second's worth, refilled at this rate (libnghttp2's stream reset rate
    limit on ngh2). Rapid-reset floods meet the premature-reset rule long before this."""
    max_connections_per_peer_per_second: int = 1000
    """New connections one peer address may open per second on a port (a token bucket of one
    second's worth); beyond it they are closed at once. 0: no bound."""
    peer_probation_seconds: float = 60.0
    """A peer one of whose connections was ended for abuse (GOAWAY ENHANCE_YOUR_CALM) is on
    probation this long after its latest abuse: its new connections are judged over a smaller
    premature-reset window and it may open fewer per second, both divided by a strictness that
    doubles per abuse (up to 64). 0: off."""
    max_connection_buffer_bytes: int = 16 << 20
    """Inbound bytes a connection may have buffered (received, not yet taken by its calls)
    before we stop reading its socket."""
    max_send_queue_bytes: int = 4 << 20
    """Outbound bytes queued for one connection beyond which its senders wait."""
    send_stall_seconds: float = 30.0
    """A reply that cannot make progress (flow control, a full send queue) for this long is
    reset."""

    # --- messages -------------------------------------------------------------------------------
    message_receive_seconds: float = 60.0
    """A message that has started to arrive must be complete within this long."""
    max_inflight_bytes: int = 256 << 20
    """Bytes of requests being received and queued in the whole process; beyond it streams wait
    and unary calls get RESOURCE_EXHAUSTED (one request alone is always admitted up to the
    message cap)."""
    max_inflight_bytes_per_connection: int = 32 << 20
    """Of those, what one connection's messages still arriving may hold; at it the connection
    is read no further until one of them is whole, except one connection at a time (so a
    message larger than this still arrives)."""
    max_name_bytes: int = 1024
    """Model, input, output and parameter-key names longer than this are refused
    (INVALID_ARGUMENT / 400) before any other work."""
    max_tensors: int = 1024
    """Inputs (and requested outputs) per request."""
    max_parameters: int = 256
    """Parameters per request or tensor."""

    # --- REST -------------------------------------------------------------------------------------
    max_json_depth: int = 64
    """Nesting depth of a JSON body; deeper is 400."""


LIMIT_FIELDS: tuple[dataclasses.Field, ...] = dataclasses.fields(EdgeLimits)


def limits_env_rows(prefix: str) -> tuple[tuple[str, str, str], ...]:
    """The environment table rows of the ``limits`` block: ``(prefix + LIMITS_<FIELD>,
    limits.<field>, kind)``, one per field, so the tables never miss a limit."""
    return tuple(
        (f"{prefix}LIMITS_{f.name.upper()}", f"limits.{f.name}", str(f.type)) for f in LIMIT_FIELDS
    )


def validate_limits(limits: EdgeLimits, prefix: str = "limits") -> None:
    """Every limit is >= 0; the windows and frame size stay inside what HTTP/2 allows."""
    for f in LIMIT_FIELDS:
        value = getattr(limits, f.name)
        if value < 0:
            raise ConfigError(f"must be >= 0 (got {value})", f"{prefix}.{f.name}")
    if not (1 << 14) <= limits.max_frame_bytes <= (1 << 24) - 1:
        raise ConfigError(
            f"must be in 16384..16777215 (got {limits.max_frame_bytes})",
            f"{prefix}.max_frame_bytes",
        )
    for name in ("stream_window_bytes", "connection_window_bytes"):
        value = getattr(limits, name)
        if not (1 << 16) - 1 <= value <= (1 << 31) - 1:
            raise ConfigError(f"must be in 65535..2147483647 (got {value})", f"{prefix}.{name}")


__all__ = [
    "LIMIT_FIELDS",
    "MAX_FRAME_BYTES",
    "WINDOW_BYTES",
    "EdgeLimits",
    "limits_env_rows",
    "validate_limits",
]

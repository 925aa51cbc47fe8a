"""A bare HTTP/2 gRPC caller for tests that must send what no gRPC client would: any bytes as
the request body (a truncated length prefix, a body shorter than its prefix), then END_STREAM.

``raw_grpc_call`` opens one connection per call with ``h2`` directly and returns the
``grpc-status`` and decoded ``grpc-message`` the server answered (from trailers, or from a
trailers-only response).
"""

from __future__ import annotations

import socket
import struct
import urllib.parse
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import h2.exceptions


@dataclass(frozen=True)
class RawReply:
    """What the server answered: gRPC status number, its message, and the body bytes."""

    status: int | None
    message: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


def grpc_frame(payload: bytes, *, flag: int = 0) -> bytes:
    """``payload`` behind a well-formed 5-byte gRPC prefix (``flag`` = compressed byte)."""
    return struct.pack(">BI", flag, len(payload)) + payload


def _send_body(
    sock: socket.socket, conn: h2.connection.H2Connection, stream_id: int, body: bytes
) -> list:
    """Send ``body`` with END_STREAM in frames the server's settings and windows allow, reading
    its SETTINGS and WINDOW_UPDATE frames while the window is shut. Returns the events received
    meanwhile (the server may answer before the whole body is sent)."""
    view = memoryview(body)
    pos = 0
    events: list = []
    while True:
        if conn.state_machine.state.name == "CLOSED" or any(
            isinstance(e, h2.events.StreamEnded | h2.events.StreamReset) for e in events
        ):
            return events
        room = min(conn.local_flow_control_window(stream_id), conn.max_outbound_frame_size)
        if room > 0 or pos == len(view):
            piece = bytes(view[pos : pos + room])
            pos += len(piece)
            try:
                conn.send_data(stream_id, piece, end_stream=pos == len(view))
            except h2.exceptions.StreamClosedError:
                return events
            sock.sendall(conn.data_to_send())
            if pos == len(view):
                return events
            continue
        chunk = sock.recv(65536)
        if not chunk:
            return events
        events.extend(conn.receive_data(chunk))
        sock.sendall(conn.data_to_send())


def raw_grpc_call(
    address: str,
    path: str,
    body: bytes,
    *,
    timeout: float = 10.0,
    headers: tuple[tuple[str, str], ...] = (),
) -> RawReply:
    """POST ``body`` verbatim as one DATA frame with END_STREAM to ``path`` on ``address``
    (``headers`` are sent after the standard ones)."""
    host, port = address.rsplit(":", 1)
    conn = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
    )
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        conn.initiate_connection()
        stream_id = conn.get_next_available_stream_id()
        conn.send_headers(
            stream_id,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", address),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                *headers,
            ],
        )
        sock.sendall(conn.data_to_send())
        early = _send_body(sock, conn, stream_id, body)
        answered: dict[str, str] = {}
        data = bytearray()
        ended = False
        while not ended:
            if early:
                received, early = early, []
            else:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                received = conn.receive_data(chunk)
            for event in received:
                if getattr(event, "stream_id", stream_id) != stream_id:
                    continue
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    answered.update(dict(event.headers))
                elif isinstance(event, h2.events.DataReceived):
                    data += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, stream_id)
                elif isinstance(event, h2.events.StreamReset):
                    raise ConnectionError(f"stream reset by the server ({event.error_code})")
                elif isinstance(event, h2.events.StreamEnded):
                    ended = True
            pending = conn.data_to_send()
            if pending:
                sock.sendall(pending)
    status = answered.get("grpc-status")
    return RawReply(
        status=int(status) if status is not None else None,
        message=urllib.parse.unquote(answered.get("grpc-message", "")),
        body=bytes(data),
        headers=answered,
    )


__all__ = ["RawReply", "grpc_frame", "raw_grpc_call"]

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
        conn.send_data(stream_id, body, end_stream=True)
        sock.sendall(conn.data_to_send())
        answered: dict[str, str] = {}
        data = bytearray()
        ended = False
        while not ended:
            chunk = sock.recv(65536)
            if not chunk:
                break
            for event in conn.receive_data(chunk):
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

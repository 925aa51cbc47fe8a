"""A scriptable ``serving.grpc`` server on its own thread and asyncio loop, for transport tests.

Serves ``/test.Echo/<Method>`` with raw-bytes messages (no codec), X
HTTP/2 settings (4 MiB windows, 16 KiB frames) rather than our servers' large ones, so flow
control is exercised both ways:

- ``Echo``: the request bytes back. Request metadata steers it: ``x-sleep`` (seconds, before
  replying), ``x-reply-bytes`` (reply with that many bytes instead), ``x-status`` with
  ``x-message`` or UTF-8 ``x-message-bin`` (fail with that status and message).
- ``Metadata``: a JSON object of the request's metadata and remaining deadline.
- ``Empty``: an empty reply message.

``cancelled`` counts handlers interrupted by a client reset; ``calls`` counts handled calls.
Runs on any anyio backend's test because it lives on its own thread.
"""

from __future__ import annotations

import json
import ssl
import threading
from typing import Any

import anyio

from kserve_trio.core.errors import StatusCode
from kserve_trio.core.process.config import EdgeLimits
from kserve_trio.serving.grpc import (
    Call,
    GrpcError,
    Limits,
    Method,
    RawMessage,
    ServerSettings,
    raw_unary,
)
from tests.threaded_grpc import ThreadedGrpcServer

LIMITS = Limits(max_recv_bytes=512 << 20, max_send_bytes=512 << 20)
SMALL_WINDOWS = ServerSettings(
    limits=EdgeLimits(
        stream_window_bytes=4 << 20, connection_window_bytes=4 << 20, max_frame_bytes=16 << 10
    )
)
"""Common client-library windows and HTTP/2's default frame size: many WINDOW_UPDATEs and frames."""


class Raw(bytes):
    """Message bytes as a reply type: the transport's ``FromString`` hands them back as is."""

    def SerializeToString(self) -> bytes:
        return self

    @classmethod
    def FromString(cls, data: bytes) -> Raw:
        return cls(data)


def _remaining(call: Call) -> float | None:
    """Seconds left before the call's deadline (None without one)."""
    return None if call.deadline is None else call.deadline - anyio.current_time()


class EchoService:
    """The handlers of the module docstring and what they count (read from any thread)."""

    def __init__(self) -> None:
        self.calls = 0
        self.cancelled = 0
        self.lock = threading.Lock()

    async def _echo(self, call: Call, message: RawMessage) -> bytes:
        meta = call.metadata
        with self.lock:
            self.calls += 1
        try:
            if "x-sleep" in meta:
                await anyio.sleep(float(meta["x-sleep"]))
        except anyio.get_cancelled_exc_class():
            with self.lock:
                self.cancelled += 1
            raise
        if "x-status" in meta:
            text = meta.get("x-message", "")
            if "x-message-bin" in meta:
                raw = meta["x-message-bin"]
                text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
            raise GrpcError(StatusCode(int(meta["x-status"])), str(text))
        if "x-reply-bytes" in meta:
            n = int(meta["x-reply-bytes"])
            return bytes(range(256)) * (n // 256) + bytes(n % 256)
        return bytes(call.plain(message))

    async def _metadata(self, call: Call, message: RawMessage) -> bytes:
        meta: dict[str, Any] = {}
        for key, value in call.metadata.items():
            meta[key] = value.decode("latin-1") if isinstance(value, bytes) else value
        return json.dumps({"metadata": meta, "deadline": _remaining(call)}).encode()

    async def _empty(self, call: Call, message: RawMessage) -> bytes:
        return b""

    def methods(self) -> dict[str, Method]:
        return {
            "/test.Echo/Echo": raw_unary(self._echo, LIMITS, "Echo"),
            "/test.Echo/Metadata": raw_unary(self._metadata, LIMITS, "Metadata"),
            "/test.Echo/Empty": raw_unary(self._empty, LIMITS, "Empty"),
        }


class EchoServer(ThreadedGrpcServer):
    """``EchoServer(ssl_context=None).start()`` → ``.port``; ``.stop()``."""

    settings = SMALL_WINDOWS

    def __init__(self, ssl_context: ssl.SSLContext | None = None, port: int = 0) -> None:
        self.ssl_context = ssl_context
        self.service = EchoService()
        self.port = port

    def methods(self) -> dict[str, Method]:
        return self.service.methods()


# --------------------------------------------------------------------------------------------
# A scripted raw HTTP/2 server, for replies a gRPC server never sends


class ScriptedH2Server:
    """A plain-socket HTTP/2 server on threads whose replies come from ``script``.

    ``script(conn_index, request_index, stream_id, body) -> action``, where the action is one
    of: ``("reply", headers, data, trailers)`` (``data`` raw DATA bytes, ``trailers`` ``None``
    for none), ``("reset", error_code)``, ``("goaway", last_stream_id)`` (GOAWAY, then the
    connection is closed); a ``("reply", ...)`` may carry a fifth item, ``after(sock)``,
    called with the socket once the reply is sent (before the next read: it may wait, and
    write raw frames the h2 state machine need not know about, such as a GOAWAY that keeps the
    connection open). ``settings`` are sent as the server's initial SETTINGS.
    ``connections`` and ``requests`` count what arrived; ``max_open`` is the largest number
    of streams open at once on one connection; ``request_headers`` holds each request's headers
    (a dict of bytes), in arrival order.
    """

    def __init__(self, script, settings: dict[int, int] | None = None) -> None:
        import socket

        self.script = script
        self.settings = settings or {}
        self.connections = 0
        self.requests = 0
        self.max_open = 0
        self.request_headers: list[dict[bytes, bytes]] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stop = False
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._accept_loop, daemon=True)
        self._accept.start()

    def _accept_loop(self) -> None:
        while not self._stop:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                index = self.connections
                self.connections += 1
            t = threading.Thread(target=self._serve, args=(sock, index), daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, sock, conn_index: int) -> None:
        import h2.config
        import h2.connection
        import h2.events
        import h2.settings

        conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding=None)
        )
        conn.local_settings = h2.settings.Settings(client=False, initial_values=self.settings)
        conn.initiate_connection()
        sock.sendall(conn.data_to_send())
        bodies: dict[int, bytearray] = {}
        try:
            while True:
                data = sock.recv(1 << 16)
                if not data:
                    return
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.RequestReceived):
                        bodies[event.stream_id] = bytearray()
                        with self._lock:
                            self.max_open = max(self.max_open, len(bodies))
                            self.request_headers.append(dict(event.headers))
                    elif isinstance(event, h2.events.DataReceived):
                        bodies[event.stream_id] += event.data
                        conn.acknowledge_received_data(
                            event.flow_controlled_length, event.stream_id
                        )
                    elif isinstance(event, h2.events.StreamEnded):
                        body = bytes(bodies.pop(event.stream_id))
                        with self._lock:
                            request_index = self.requests
                            self.requests += 1
                        action = self.script(conn_index, request_index, event.stream_id, body)
                        if action[0] == "goaway":
                            conn.close_connection(last_stream_id=action[1])
                            sock.sendall(conn.data_to_send())
                            return
                        if action[0] == "reset":
                            conn.reset_stream(event.stream_id, action[1])
                        else:
                            _, headers, payload, trailers, *after = action
                            conn.send_headers(
                                event.stream_id, headers, end_stream=not payload and not trailers
                            )
                            if payload:
                                conn.send_data(event.stream_id, payload, end_stream=not trailers)
                            if trailers:
                                conn.send_headers(event.stream_id, trailers, end_stream=True)
                            if after:
                                sock.sendall(conn.data_to_send())
                                after[0](sock)
                    elif isinstance(event, h2.events.StreamReset):
                        bodies.pop(event.stream_id, None)
                out = conn.data_to_send()
                if out:
                    sock.sendall(out)
        except OSError:
            return
        finally:
            sock.close()

    def close(self) -> None:
        self._stop = True
        self._listener.close()

    def __enter__(self) -> ScriptedH2Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


GRPC_OK_HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc")]


def grpc_frame(message: bytes, *, compressed: bool = False) -> bytes:
    """A length-prefixed gRPC message."""
    return bytes([1 if compressed else 0]) + len(message).to_bytes(4, "big") + message


def goaway_frame(last_stream_id: int, error_code: int = 0) -> bytes:
    """A raw GOAWAY frame (stream 0, no debug data)."""
    payload = last_stream_id.to_bytes(4, "big") + error_code.to_bytes(4, "big")
    return len(payload).to_bytes(3, "big") + bytes([7, 0]) + bytes(4) + payload


def ok_reply(message: bytes):
    """The action of a normal unary reply carrying ``message``."""
    return ("reply", GRPC_OK_HEADERS, grpc_frame(message), [(b"grpc-status", b"0")])

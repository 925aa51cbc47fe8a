"""A raw HTTP/2 client on a plain blocking socket: it writes whatever bytes a conformance case
builds and records what the server answers, frame by frame (hyperframe parses them, hpack
decodes the header blocks): the server's SETTINGS and their ACKs, a GOAWAY (code, last stream
id, debug data), each RST_STREAM's code by stream, each stream's header blocks, body bytes and
END_STREAM, PING acknowledgements, and the end of the connection.

Nothing is answered on the client's own (no WINDOW_UPDATE, no PING ACK) except the SETTINGS ACK
of ``handshake``: what goes out is what the case says. Every wait is bounded: ``wait_for``
gives up ``deadline`` seconds after it started and fails with what the server did send
(``transcript``), so a server that answers nothing fails its case instead of hanging the run.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import hpack
from h2.errors import ErrorCodes
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from tests.edge.h2_attacker import PREFACE, settings
from tests.serving.grpc.h2_peer import take_frames

DEADLINE_SECONDS = 5.0
"""How long one wait for the server's answer may take (loopback answers take milliseconds)."""


def code_name(code: int) -> str:
    """An HTTP/2 error code's name (its number when HTTP/2 defines none)."""
    try:
        return ErrorCodes(code).name
    except ValueError:
        return f"0x{code:x}"


@dataclass(frozen=True)
class GoAway:
    """The server's GOAWAY."""

    code: int
    last_stream_id: int
    debug: bytes

    def __str__(self) -> str:
        return (
            f"GOAWAY({code_name(self.code)}, last_stream_id={self.last_stream_id}, "
            f"debug={self.debug[:80]!r})"
        )


class RawClient:
    """One client connection (module docstring); ``connect`` makes one."""

    def __init__(self, sock: socket.socket, deadline: float = DEADLINE_SECONDS) -> None:
        self.sock = sock
        self.deadline = deadline
        self.decoder = hpack.Decoder()
        self.server_settings: dict[int, int] = {}
        self.settings_seen = False
        self.settings_acks = 0
        self.goaway: GoAway | None = None
        self.resets: dict[int, int] = {}
        self.fields: dict[int, list[dict[str, str]]] = {}
        self.body: dict[int, bytearray] = {}
        self.ended: set[int] = set()
        self.ping_acks: list[bytes] = []
        self.closed = False
        self.transcript: list[str] = []
        self._buffer = bytearray()
        self._block: tuple[int, bool, bytearray] | None = None  # stream, END_STREAM, fragments

    @classmethod
    @contextmanager
    def connect(cls, port: int, deadline: float = DEADLINE_SECONDS) -> Iterator[RawClient]:
        with socket.create_connection(("127.0.0.1", port), timeout=deadline) as sock:
            # Each write goes at once: Nagle's algorithm would hold a case's frames behind the
            # delayed ACK of the handshake's last write (40 ms a case).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            yield cls(sock, deadline)

    # ------------------------------------------------------------------ writing

    def send(self, data: bytes) -> None:
        """Write ``data``; a connection the server has already ended is not an error here (the
        case's outcome judges what the server answered)."""
        try:
            self.sock.sendall(data)
        except OSError as exc:
            self.transcript.append(f"(write failed: {exc.__class__.__name__})")

    def handshake(self) -> None:
        """The client preface and an empty SETTINGS; wait for the server's SETTINGS and
        acknowledge them."""
        self.send(PREFACE + settings())
        self.wait_for(lambda: self.settings_seen, "the server's SETTINGS")
        self.send(SettingsFrame(0, flags=["ACK"]).serialize())

    # ------------------------------------------------------------------ reading

    def wait_for(self, condition: Callable[[], bool], what: str) -> None:
        """Read until ``condition()`` holds or the server closes the connection (the caller
        judges which); AssertionError when neither happens within the deadline."""
        end = time.monotonic() + self.deadline
        while not condition() and not self.closed:
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"no answer within {self.deadline} s waiting for {what}; "
                    f"the server sent: {self.answer()}"
                )
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError as exc:  # a reset: the server closed with our bytes unread
                self.transcript.append(f"(reset: {exc.__class__.__name__})")
                chunk = b""
            if not chunk:
                self.closed = True
                self.transcript.append("close")
                break
            self._buffer += chunk
            for frame, _raw in take_frames(self._buffer):
                self._record(frame)

    def settle(self, sid: int, seconds: float = 1.0) -> None:
        """Read on for at most ``seconds`` until stream ``sid`` is done or the connection ends,
        so that a failure shows what the server did with the stream after all."""
        deadline, self.deadline = self.deadline, seconds
        try:
            self.wait_for(lambda: self.done(sid) or self.goaway is not None, "")
        except AssertionError:
            pass
        finally:
            self.deadline = deadline

    def answer(self) -> str:
        """What the server sent, in order, but its handshake SETTINGS and window updates."""
        return ", ".join(self.transcript) or "nothing"

    def _record(self, frame: Frame) -> None:
        sid = frame.stream_id
        if isinstance(frame, SettingsFrame):
            if "ACK" in frame.flags:
                self.settings_acks += 1
            else:
                self.settings_seen = True
                self.server_settings.update(frame.settings)
            return
        if isinstance(frame, WindowUpdateFrame):
            return
        if isinstance(frame, GoAwayFrame):
            self.goaway = GoAway(
                frame.error_code, frame.last_stream_id, bytes(frame.additional_data)
            )
            self.transcript.append(str(self.goaway))
        elif isinstance(frame, RstStreamFrame):
            self.resets[sid] = frame.error_code
            self.transcript.append(f"RST_STREAM({sid}, {code_name(frame.error_code)})")
        elif isinstance(frame, PingFrame):
            if "ACK" in frame.flags:
                self.ping_acks.append(bytes(frame.opaque_data))
                self.transcript.append(f"PING_ACK({bytes(frame.opaque_data)!r})")
            else:
                self.transcript.append("PING")
        elif isinstance(frame, HeadersFrame):
            self._block = (sid, "END_STREAM" in frame.flags, bytearray(frame.data))
            if "END_HEADERS" in frame.flags:
                self._end_block()
        elif isinstance(frame, ContinuationFrame) and self._block is not None:
            self._block[2].extend(frame.data)
            if "END_HEADERS" in frame.flags:
                self._end_block()
        elif isinstance(frame, DataFrame):
            self.body.setdefault(sid, bytearray()).extend(frame.data)
            if "END_STREAM" in frame.flags:
                self.ended.add(sid)
            self.transcript.append(
                f"DATA({sid}, {len(frame.data)} bytes{', END_STREAM' if sid in self.ended else ''})"
            )
        else:
            self.transcript.append(f"{frame.__class__.__name__}({sid})")

    def _end_block(self) -> None:
        assert self._block is not None
        sid, end_stream, block = self._block
        self._block = None
        decoded = {str(k): str(v) for k, v in self.decoder.decode(bytes(block), raw=False)}
        self.fields.setdefault(sid, []).append(decoded)
        if end_stream:
            self.ended.add(sid)
        shown = " ".join(
            f"{k}={v[:60]}"
            for k, v in decoded.items()
            if k in (":status", "grpc-status", "grpc-message")
        )
        self.transcript.append(f"HEADERS({sid}, {shown}{', END_STREAM' if end_stream else ''})")

    # ------------------------------------------------------------------ a stream's answer

    def done(self, sid: int) -> bool:
        """Stream ``sid`` has ended or was reset."""
        return sid in self.ended or sid in self.resets

    def http_status(self, sid: int) -> str | None:
        blocks = self.fields.get(sid, [])
        return blocks[0].get(":status") if blocks else None

    def grpc_status(self, sid: int) -> int | None:
        """grpc-status from the stream's last header block carrying one (the trailers, or a
        trailers-only response)."""
        for block in reversed(self.fields.get(sid, [])):
            if "grpc-status" in block:
                return int(block["grpc-status"])
        return None


__all__ = ["DEADLINE_SECONDS", "GoAway", "RawClient", "code_name"]

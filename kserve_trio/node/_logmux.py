"""One output stream for a whole node: every child's lines prefixed with ``[name] ``.

``LineSplitter`` turns a byte stream into whole lines (pure: bytes in, lines out); ``LogSink``
writes ``[name] <line>`` records to the supervisor's stream, one ``write`` per line under a
lock, so lines of different children never interleave and a structlog JSON line stays valid
JSON once its prefix is stripped. The supervisor's own events are ``[supervisor] ...`` lines.
"""

from __future__ import annotations

import threading
from typing import TextIO

SUPERVISOR = "supervisor"
MAX_LINE_BYTES = 1 << 20
"""A child that writes this much without a newline has its buffer emitted as a line, so one
runaway writer cannot grow the supervisor's memory without bound."""


class LineSplitter:
    """Accumulates bytes and hands out complete lines (without their ``\\n``).

    Rules:
    1. ``feed`` returns every line completed by the new bytes, in order;
    2. a partial line stays buffered until its newline arrives, or until it reaches
       ``max_line`` bytes, when it is returned as it stands;
    3. ``flush`` (at end of stream) returns the trailing partial line, if any.
    """

    def __init__(self, max_line: int = MAX_LINE_BYTES) -> None:
        self._buf = bytearray()
        self._max = max_line

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        lines: list[bytes] = []
        start = 0
        while True:
            end = self._buf.find(b"\n", start)
            if end < 0:
                break
            lines.append(bytes(self._buf[start:end]))
            start = end + 1
        del self._buf[:start]
        while len(self._buf) >= self._max:
            lines.append(bytes(self._buf[: self._max]))
            del self._buf[: self._max]
        return lines

    def flush(self) -> list[bytes]:
        if not self._buf:
            return []
        line = bytes(self._buf)
        self._buf.clear()
        return [line]


def prefixed(name: str, line: str) -> str:
    """``[name] line`` plus the newline."""
    return f"[{name}] {line}\n"


class LogSink:
    """Writes prefixed lines to a text stream, whole lines only, from any thread."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def line(self, name: str, text: str) -> None:
        record = prefixed(name, text)
        with self._lock:
            try:
                self._stream.write(record)
                self._stream.flush()
            except (OSError, ValueError):
                pass  # a closed or broken sink must not take the node down

    def child_bytes(self, name: str, raw: bytes) -> None:
        self.line(name, raw.decode("utf-8", errors="replace"))

    def supervisor(self, message: str) -> None:
        self.line(SUPERVISOR, message)


__all__ = ["MAX_LINE_BYTES", "SUPERVISOR", "LineSplitter", "LogSink", "prefixed"]

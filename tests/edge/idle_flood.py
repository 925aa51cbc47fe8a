"""Hostile clients of the connection tests: many TCP connections that send nothing, or that
trickle a request head a byte at a time, and a watch for the server closing them."""

from __future__ import annotations

import select
import socket
import time
from typing import Self


class Flood:
    """``n`` connections to ``127.0.0.1:port`` that never send a byte (closed on exit)."""

    def __init__(self, port: int, n: int) -> None:
        self.socks: list[socket.socket] = []
        self.closed: set[socket.socket] = set()
        """The connections the server has closed (EOF or reset seen)."""
        self.received = b""
        for _ in range(n):
            self.socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.socks = []

    def open_ones(self) -> list[socket.socket]:
        return [s for s in self.socks if s not in self.closed]

    def watch(self, timeout: float = 0.0) -> None:
        """Note every connection the server closed within ``timeout`` seconds."""
        readable, _, _ = select.select(self.open_ones(), [], [], timeout)
        for s in readable:
            try:
                data = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                data = b""
            if data:
                self.received += data  # an HTTP/2 server's SETTINGS, a 408: not a close yet
            else:
                self.closed.add(s)

    def wait_closed(self, count: int, timeout: float) -> float:
        """Wait until at least ``count`` connections are closed; the seconds it took."""
        start = time.monotonic()
        while len(self.closed) < count:
            left = start + timeout - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{len(self.closed)} closed of {len(self.socks)}, not {count}")
            self.watch(min(left, 0.2))
        return time.monotonic() - start


class Slowloris(Flood):
    """``n`` connections that each send a request head one byte per ``step`` and never end it."""

    HEAD = b"GET /v2/health/ready HTTP/1.1\r\nHost: h\r\n" + b"x-slow: " + b"a" * 4096

    def __init__(self, port: int, n: int) -> None:
        super().__init__(port, n)
        self.sent = 0

    def step(self) -> None:
        """One more byte on every connection the server has not closed."""
        byte = self.HEAD[self.sent % len(self.HEAD) : self.sent % len(self.HEAD) + 1]
        self.sent += 1
        for s in self.open_ones():
            try:
                s.send(byte)
            except OSError:
                self.closed.add(s)


__all__ = ["Flood", "Slowloris"]

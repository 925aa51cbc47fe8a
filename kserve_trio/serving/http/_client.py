"""The project's HTTP/1.1 client: keep-alive connections (``_connection``) pooled per host, on
anyio only, so it runs on asyncio, uvloop and trio alike (the gateway's REST forwarding and its
scrape of worker ``/metrics`` both use it).

The rules, per ``(host, port)``:

1. at most ``per_host`` connections are open (in use or idle); a request waits for a free one
   within its timeout, like a gRPC call for a stream slot;
2. an idle connection is reused most-recent first; one the server closed (or that sent bytes
   unasked) is found by a no-wait ``poll`` before the request is written, and one idle longer
   than ``IDLE_SECONDS`` (under the servers' default ``limits.idle_seconds``) is closed, not
   reused;
3. a reused connection that breaks while the request is written is retried once on a new
   connection; once the request was written nothing is retried (the server may have acted on
   it), the failure is ``HttpClientError``. (anyio's asyncio stream buffers a write into a
   connection reset after the ``poll`` and reports it at the read, so there that narrow race
   counts as written: an error, never a second delivery);
4. ``timeout`` bounds the whole request (the wait for a connection, connecting, TLS, writing,
   reading) as one cancel scope; past it the connection is closed and ``TimeoutError`` raised;
5. a connection is kept only after a complete response that allows it (``Connection: close``,
   a body framed by the end of the connection, bytes after the response all close it).
"""

from __future__ import annotations

import math
import ssl
from collections.abc import Iterable

import anyio

from kserve_trio.serving.http._connection import (
    Buffer,
    Connection,
    HttpClientError,
    HttpReply,
    NotSent,
    open_connection,
)

IDLE_SECONDS = 60.0
SWEEP_SECONDS = 30.0
"""How often, at most, a request also closes other hosts' expired idle connections (so a host
that is no longer asked does not hold sockets for ever)."""

_OWN_HEADERS = frozenset({"host", "content-length", "transfer-encoding"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def authority(host: str, port: int) -> str:
    """``host:port`` as a ``Host`` header writes it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def encode_request(
    method: str,
    target: str,
    host_header: str,
    headers: Iterable[tuple[str, str]],
    length: int | None,
) -> tuple[bytes, bool]:
    """The request line and headers, and whether the request asks to close the connection.
    ``host`` and the framing headers are the client's own (the caller's are dropped); a CR or
    LF in any name or value is a ``ValueError`` (it would split the head)."""
    lines = [f"{method} {target} HTTP/1.1", f"host: {host_header}"]
    if length is not None:
        lines.append(f"content-length: {length}")
    close = False
    for name, value in headers:
        key = name.lower()
        if key in _OWN_HEADERS:
            continue
        if key == "connection" and "close" in value.lower():
            close = True
        lines.append(f"{name}: {value}")
    if any(c in text for text in lines for c in "\r\n") or " " in target:
        raise ValueError(f"CR, LF or space where the request head cannot hold one: {target!r}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"), close


class _Host:
    """One host's pool: the connection slots and the idle connections."""

    __slots__ = ("authority", "host", "idle", "port", "slots")

    def __init__(self, host: str, port: int, per_host: int) -> None:
        self.host = host
        self.port = port
        self.authority = authority(host, port)
        self.slots = anyio.Semaphore(per_host)
        self.idle: list[Connection] = []

    def unused(self, per_host: int) -> bool:
        return not self.idle and self.slots.value == per_host


class HttpClient:
    """Keep-alive HTTP/1.1 connections per host (see the module docstring); ``aclose`` (or
    ``async with``) closes them."""

    def __init__(
        self,
        *,
        per_host: int = 8,
        ssl_context: ssl.SSLContext | None = None,
        max_body_bytes: int | None = None,
        idle_seconds: float = IDLE_SECONDS,
    ) -> None:
        if per_host < 1:
            raise ValueError(f"per_host must be at least 1, got {per_host}")
        self.per_host = per_host
        self.ssl_context = ssl_context
        self.max_body_bytes = max_body_bytes
        self.idle_seconds = idle_seconds
        self._hosts: dict[tuple[str, int], _Host] = {}
        self._next_sweep = -math.inf
        self._closed = False

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def open_connections(self, host: str, port: int) -> int:
        """Connections open to ``host:port`` now, in use or idle (for tests and metrics)."""
        pool = self._hosts.get((host, port))
        return 0 if pool is None else self.per_host - pool.slots.value + len(pool.idle)

    async def request(
        self,
        host: str,
        port: int,
        method: str,
        target: str,
        *,
        headers: Iterable[tuple[str, str]] = (),
        body: Buffer = b"",
        timeout: float | None = None,
    ) -> HttpReply:
        """``method target`` on ``host:port`` with ``headers`` and ``body``; the response, or
        ``HttpClientError`` (no answer) or ``TimeoutError`` (none within ``timeout`` s)."""
        if self._closed:
            raise HttpClientError("the HTTP client is closed")
        now = anyio.current_time()
        if now >= self._next_sweep:
            await self._sweep(now)
        pool = self._hosts.get((host, port))
        if pool is None:
            pool = self._hosts[(host, port)] = _Host(host, port, self.per_host)
        length = len(body) if body or method in _BODY_METHODS else None
        head, close = encode_request(method, target, pool.authority, headers, length)
        reply: HttpReply | None = None
        with anyio.CancelScope(deadline=math.inf if timeout is None else now + timeout):
            reply = await self._exchange(pool, head, body, head_only=method == "HEAD", close=close)
        if reply is None:
            raise TimeoutError(f"no answer from {pool.authority} within {timeout:g}s")
        return reply

    async def _exchange(
        self, pool: _Host, head: bytes, body: Buffer, *, head_only: bool, close: bool
    ) -> HttpReply:
        try:
            pool.slots.acquire_nowait()
        except anyio.WouldBlock:
            await pool.slots.acquire()
        try:
            connection = await self._idle(pool)
            retried = False
            while True:
                if connection is None:
                    connection = await open_connection(
                        pool.host, pool.port, pool.authority, self.ssl_context
                    )
                try:
                    reply, keep = await connection.exchange(
                        head, body, head_only=head_only, max_body=self.max_body_bytes
                    )
                except NotSent:
                    await connection.aclose()
                    if not connection.reused or retried:
                        raise
                    connection, retried = None, True
                    continue
                except BaseException:
                    await connection.aclose()
                    raise
                if keep and not close and not self._closed:
                    connection.reused = True
                    connection.idle_since = anyio.current_time()
                    pool.idle.append(connection)
                else:
                    await connection.aclose()
                return reply
        finally:
            pool.slots.release()

    async def _idle(self, pool: _Host) -> Connection | None:
        """The most recently used idle connection that can still carry a request."""
        oldest = anyio.current_time() - self.idle_seconds
        while pool.idle:
            connection = pool.idle.pop()
            if connection.idle_since > oldest and not connection.stale():
                return connection
            await connection.aclose()
        return None

    async def _sweep(self, now: float) -> None:
        """Close every idle connection past ``idle_seconds`` and forget unused hosts."""
        self._next_sweep = now + SWEEP_SECONDS
        oldest = now - self.idle_seconds
        for key, pool in list(self._hosts.items()):
            keep = [c for c in pool.idle if c.idle_since > oldest]
            for connection in pool.idle:
                if connection.idle_since <= oldest:
                    await connection.aclose()
            pool.idle = keep
            if pool.unused(self.per_host):
                del self._hosts[key]

    async def aclose(self) -> None:
        """Close the idle connections; those in use close when their request ends."""
        self._closed = True
        hosts, self._hosts = self._hosts, {}
        for pool in hosts.values():
            idle, pool.idle = pool.idle, []
            for connection in idle:
                await connection.aclose()


__all__ = ["IDLE_SECONDS", "HttpClient", "authority", "encode_request"]

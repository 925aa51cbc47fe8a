"""One client HTTP/1.1 connection: a request written as bytes, its response read back with
httptools (the parser library the server uses), on any anyio byte stream (TCP or TLS).

The connection is the unit ``_client.HttpClient`` pools. One request at a time (no
pipelining), so what the server sends after a complete response is a fault and makes the
connection not reusable. A response is framed by ``Content-Length``, by ``Transfer-Encoding:
chunked`` (de-chunked by the parser), by its status (1xx, 204, 304 have no body; informational
responses before the final one are skipped) or, when none of these frame it, by the end of the
connection. A failure to write the request is ``NotSent`` (the server cannot have acted on a
request it did not get whole: the pool may retry it); any failure after that is
``HttpClientError``.
"""

from __future__ import annotations

import select
import ssl
from dataclasses import dataclass

import anyio
import anyio.abc
import httptools

from kserve_trio.core.process import stream_attribute

READ_BYTES = 256 << 10
_JOIN_BYTES = 256 << 10
"""Up to this size the request head and body go out in one write (one syscall); a larger body
is written from its own buffer rather than copied."""

Buffer = bytes | bytearray | memoryview

_BROKEN = (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


class HttpClientError(Exception):
    """No answer: the server was unreachable, the connection broke, or what came back was not
    an HTTP response (or a body over the client's cap)."""


class NotSent(HttpClientError):
    """The connection failed while the request was written: it was not sent whole."""


@dataclass(frozen=True, slots=True)
class HttpReply:
    """A response as it came: the status, the raw headers in order, the (de-chunked) body."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (any case), ``None`` when absent."""
        key = name.lower().encode("latin-1")
        for k, v in self.headers:
            if k.lower() == key:
                return v.decode("latin-1")
        return None


class _Response:
    """httptools' callbacks for one response (the parser calls back from ``feed_data``)."""

    __slots__ = (
        "body",
        "complete",
        "extra",
        "framed",
        "head_done",
        "headers",
        "keep_alive",
        "max_body",
        "parser",
        "size",
        "status",
    )

    def __init__(self, max_body: int | None) -> None:
        self.max_body = max_body
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.size = 0
        self.status = 0
        self.head_done = self.complete = self.framed = self.keep_alive = self.extra = False
        self.parser: httptools.HttpResponseParser | None = None

    def on_message_begin(self) -> None:
        if self.complete:  # bytes after the response: nothing was asked for them
            self.extra = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.complete:
            self.headers.append((name, value))
            key = name.lower()
            if key == b"content-length" or (key == b"transfer-encoding" and b"chunked" in value):
                self.framed = True

    def on_headers_complete(self) -> None:
        if not self.complete:
            assert self.parser is not None
            self.status = self.parser.get_status_code()
            self.head_done = True

    def on_body(self, data: bytes) -> None:
        if self.complete:
            return
        self.size += len(data)
        if self.max_body is None or self.size <= self.max_body:
            self.body.append(data)

    def on_message_complete(self) -> None:
        if self.complete:
            return
        if 100 <= self.status < 200:  # informational: the final response follows
            self.headers, self.head_done, self.framed = [], False, False
            return
        assert self.parser is not None
        self.framed = True  # the parser found its end (a length, the last chunk, no body)
        self.keep_alive = self.parser.should_keep_alive()
        self.complete = True


class Connection:
    """One open connection to ``authority`` (see the module docstring)."""

    __slots__ = ("_fd", "authority", "idle_since", "reused", "stream")

    def __init__(self, stream: anyio.abc.ByteStream, authority: str) -> None:
        self.stream = stream
        self.authority = authority
        self.reused = False
        self.idle_since = 0.0
        raw = stream_attribute(stream, anyio.abc.SocketAttribute.raw_socket)
        self._fd = raw.fileno() if raw is not None else -1

    def stale(self) -> bool:
        """Whether an idle connection can no longer carry a request: it is readable (the
        server closed it, reset it, or sent bytes nobody asked for) or its socket is gone.
        One ``poll`` with no wait, so a closed keep-alive connection is found before a request
        is written to it, not after."""
        if self._fd < 0:  # not a socket (a test's memory stream): nothing to ask
            return False
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        return bool(poller.poll(0))

    async def exchange(
        self, head: bytes, body: Buffer, *, head_only: bool, max_body: int | None
    ) -> tuple[HttpReply, bool]:
        """Write one request (``head`` then ``body``) and read its response: the reply and
        whether the connection can carry another request."""
        try:
            if len(body) <= _JOIN_BYTES:
                await self.stream.send(b"".join((head, body)) if body else head)
            else:
                await self.stream.send(head)
                await self.stream.send(body)  # type: ignore[arg-type]  # any buffer is written as is
        except _BROKEN as exc:
            raise NotSent(f"{self.authority}: the connection broke sending: {_why(exc)}") from None
        response = _Response(max_body)
        parser = httptools.HttpResponseParser(response)
        response.parser = parser
        received = 0
        while not response.complete:
            try:
                data = await self.stream.receive(READ_BYTES)
            except anyio.EndOfStream:
                if response.head_done and not response.framed:  # the body ends with the stream
                    return self._reply(response), False
                where = "inside its response" if received else "before answering"
                raise HttpClientError(f"{self.authority} closed the connection {where}") from None
            except _BROKEN as exc:
                raise HttpClientError(
                    f"{self.authority}: the connection broke: {_why(exc)}"
                ) from None
            received += len(data)
            try:
                parser.feed_data(data)
            except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
                if not response.complete:
                    raise HttpClientError(
                        f"{self.authority} sent no valid HTTP response: {data[:80]!r} ({exc})"
                    ) from None
                response.extra = True
            if response.max_body is not None and response.size > response.max_body:
                raise HttpClientError(
                    f"{self.authority}: response body over {response.max_body} bytes"
                )
            if head_only and response.head_done:
                return self._reply(response), response.size == 0 and parser.should_keep_alive()
        return self._reply(response), response.keep_alive and not response.extra

    @staticmethod
    def _reply(response: _Response) -> HttpReply:
        body = response.body[0] if len(response.body) == 1 else b"".join(response.body)
        return HttpReply(response.status, tuple(response.headers), body)

    async def aclose(self) -> None:
        """Close now (a connection whose state is unknown is never reused)."""
        await anyio.aclose_forcefully(self.stream)


def _why(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


async def open_connection(
    host: str, port: int, authority: str, ssl_context: ssl.SSLContext | None
) -> Connection:
    """A new connection to ``host:port``, over TLS when ``ssl_context`` is given (the server's
    name checked against ``host``); ``HttpClientError`` when none can be made."""
    try:
        if ssl_context is not None:
            stream: anyio.abc.ByteStream = await anyio.connect_tcp(
                host, port, ssl_context=ssl_context, tls_standard_compatible=False
            )
        else:
            stream = await anyio.connect_tcp(host, port)
    except (OSError, anyio.BrokenResourceError, anyio.EndOfStream) as exc:
        raise HttpClientError(f"cannot connect to {authority}: {_why(exc)}") from None
    return Connection(stream, authority)


__all__ = ["Connection", "HttpClientError", "HttpReply", "NotSent", "open_connection"]

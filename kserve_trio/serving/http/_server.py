"""The project's HTTP/1.1 server: httptools' parser driven by one anyio task per connection.

Chosen by measurement (docs/benchmarks/history.md, "HTTP stack"): httptools (llhttp, the parser
uvicorn uses) on anyio streams cost the least CPU per request of the candidates, and it runs inside
the caller's own task tree: each connection is a child task of the listener, cancellation is the
shutdown path, TLS is anyio's, and nothing installs signal handlers or runs tasks of its own.

What the connection loop owns (the parser owns the syntax: request line, headers, chunked
bodies; ``_Parsed`` adds what the parser leaves open):

1. *Keep-alive*: requests on one connection are answered in order, one at a time (a pipelined
   request waits for the one before it); the connection closes when the request asks
   (``Connection: close``, HTTP/1.0 without keep-alive), after an error that leaves the stream
   unreadable, or at a deadline (``IdleReaper``): a request head that is not complete within
   ``limits.handshake_seconds`` of its first byte (of the accept, for a connection's first
   request, the TLS handshake included: slowloris), answered 408 when some of it came, and a
   connection that waited ``limits.idle_seconds`` for a byte;
2. *Caps*: the request head is at most ``MAX_HEAD_BYTES`` (else 431), counted on its fields as
   they are reported and on the bytes fed while it is still arriving (the parser holds a header
   line, and skips padding and empty lines, without a word: one that never ends is cut
   there); the body at most ``max_body_bytes``, checked on ``Content-Length`` before the body
   is read and on the bytes of a chunked body as they arrive (``_body``: else 413 ``received
   message larger than max (N vs. M)``, the gRPC message, and the connection closes, lingering
   a moment so the client reads the answer);
2a. *Bytes in flight* (``serve_app(inflight=...)``): a body is charged to the process's
   ``InflightBytes``, the budget gRPC messages count in, as its bytes arrive, never at the
   ``Content-Length`` its head announces (a client announcing a large body and sending a byte
   holds a byte), an inflated one also as it grows (``HttpRequest.charge``), and given back
   once its request is answered or refused, or the connection ends. A piece that does not fit
   is answered 429 with the gRPC refusal's message and the connection closes as in *caps*; one
   request alone is always admitted. While its body arrives it counts in the connection's share
   (``admission.ConnectionShare``, ``limits.max_inflight_bytes_per_connection``): at the share
   the connection is not read (backpressure) until it may take the lane;
2b. *Chunk framing*: the parser skips a chunk's extensions (``5;name=value``) and the zeros
   before its size without reporting them, so an endless extension would be read forever. What
   a chunked body's framing has beyond its least (the hex size and two CRLFs per chunk) is
   counted per piece fed: the bytes fed less what the callbacks report and the least framing
   around it. Past ``MAX_CHUNK_EXTENSION_BYTES`` in one request it is 400, and it counts
   toward the body cap (413). The count is exact for the pieces inside a body and an upper
   bound for the piece it begins or ends in (what shares that piece counts with it);
3. *100-continue*: ``Expect: 100-continue`` is answered ``100 Continue`` once the head passed the
   caps;
4. *HEAD*: ``HEAD`` is answered with the headers of ``GET`` and no body;
5. *Handler faults*: a handler exception that is not a ``ServingError`` becomes 500 with a JSON
   error body; the server keeps serving;
6. *Request forms* (RFC 9112 and 9110): an HTTP/1.1 request without a Host header, and any with two,
   is 400; an absolute-form target (``GET http://host:port/path``) is served by its path;
   ``Upgrade`` is ignored, as RFC 9110 lets a server do (``curl --http2`` asks for h2c on http://
   URLs): the request is parsed again without the upgrade (its head written anew, its body read as a
   body) and answered in HTTP/1.1; CONNECT is 501;
7. *Refusals*: a fault (a malformed request, a cap, a refusal) ends the parsing where it is found
   (``_Refusal``): the requests completed before it are answered first, then the refusal, and
   the connection closes; if one of those asked to close, the connection ends with its answer
   and nothing is refused (bytes after ``Connection: close`` are not a request).

Accepting is ``serving.accept``'s loop (a bind error is ``ListenError``; open connections are
capped, and at the cap the longest-idle one is closed for the new one: a keep-alive connection
with no request in progress, or one whose request head is not complete; out of descriptors it
backs off and goes on serving).
"""

from __future__ import annotations

import contextlib
import enum
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn

import anyio
import anyio.abc
import httptools
from anyio.streams.tls import TLSStream

from kserve_trio.core.errors import ResourceExhausted
from kserve_trio.core.logging import get_logger
from kserve_trio.core.process import EdgeLimits
from kserve_trio.serving.accept import ConnectionCap, Slot, accept_loop, bind, listening_sockets
from kserve_trio.serving.edge_stats import EdgeStats
from kserve_trio.serving.http._body import BodyBuffer, BodyCharges, read_ahead_bound, too_large
from kserve_trio.serving.http._status import JSON_TYPE, REASONS, error_body, error_of
from kserve_trio.serving.peer_ledger import PeerLedger

if TYPE_CHECKING:
    from kserve_trio.serving.admission import InflightBytes

log = get_logger("kserve_trio.serving.http")

MAX_HEAD_BYTES = 64 << 10
MAX_CHUNK_EXTENSION_BYTES = 16 << 10
"""*Chunk framing*: a chunked body's framing beyond its least (chunk extensions, zeros before a
size)."""
READ_BYTES = 256 << 10
LINGER_SECONDS = 2.0
LINGER_BYTES = 64 << 20
TIMEOUT_REPLY_SECONDS = 1.0
"""How long a 408 to a slow client may take to write before the connection just closes."""
_JOIN_BYTES = 256 << 10
"""Up to this size a reply is joined into one write; a larger payload is written from its own
buffer (the same trade-off as the gRPC adapter's replies)."""

Buffer = bytes | bytearray | memoryview


@dataclass
class HttpRequest:
    """One parsed request: ``path`` without the query (still percent-encoded), ``query`` the
    raw text after ``?``, header names lower-case."""

    method: str
    path: str
    query: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | bytearray = b""
    charged: int = 0
    """Bytes of this request charged to the process's bytes in flight (*bytes in flight*)."""
    charges: BodyCharges | None = field(default=None, repr=False, compare=False)
    """Where they are charged (None: a server that counts no bytes in flight)."""

    def charge(self, n: int) -> None:
        """Charge ``n`` more bytes this request holds (its body as it inflates) until it is
        answered; RESOURCE_EXHAUSTED (429) when they do not fit."""
        charges = self.charges
        if charges is not None and n:
            charges.charge(n, self.charged)
            self.charged += n


@dataclass
class HttpResponse:
    """One reply: ``body`` is one buffer or a list of pieces sent in order."""

    status: int = 200
    body: Buffer | Sequence[Buffer] = b""
    content_type: str = JSON_TYPE
    headers: Sequence[tuple[str, str]] = ()


App = Callable[[HttpRequest], Awaitable[HttpResponse]]
"""What a server serves: one request in, one reply out."""


def error_response(exc: BaseException) -> HttpResponse:
    """The JSON error reply for an exception (status from ``_status.error_of``)."""
    status, message = error_of(exc)
    return HttpResponse(status, error_body(message))


def _size(piece: Buffer) -> int:
    return len(piece) if piece.__class__ is bytes else memoryview(piece).nbytes


def encode_head(response: HttpResponse, length: int, *, close: bool) -> bytes:
    """The status line and headers of ``response`` with its ``content-length``."""
    lines = [
        f"HTTP/1.1 {response.status} {REASONS.get(response.status, '')}",
        f"content-type: {response.content_type}",
        f"content-length: {length}",
    ]
    lines.extend(f"{k}: {v}" for k, v in response.headers)
    if close:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _pieces_of(body: Buffer | Sequence[Buffer]) -> Sequence[Buffer]:
    # ``type(body) is memoryview``, not isinstance: isinstance would narrow the Sequence[Buffer]
    # side of the union to a memoryview of Buffers, which is no Buffer.
    if isinstance(body, bytes | bytearray) or type(body) is memoryview:
        return [body]
    return body


def segments(head: bytes, pieces: Sequence[Buffer], length: int) -> list[Buffer]:
    """``head`` and the body's ``pieces`` (``length`` bytes) regrouped for writing: joined
    into one write up to ``_JOIN_BYTES``, else runs of small pieces joined and each large piece
    kept as it is."""
    if length <= _JOIN_BYTES:
        return [b"".join([head, *pieces])]
    out: list[Buffer] = []
    run: list[Buffer] = [head]
    for piece in pieces:
        if _size(piece) < _JOIN_BYTES:
            run.append(piece)
            continue
        out.append(b"".join(run))
        run = []
        view = memoryview(piece)
        out.append(view if view.format == "B" and view.ndim == 1 else view.cast("B"))
    if run:
        out.append(b"".join(run))
    return out


@dataclass(frozen=True, slots=True)
class _Refusal:
    """What ends a connection's parsing: the answer sent once the requests completed before it
    are answered (*refusals*), and the ``refused_requests`` reason it is counted under ("" for
    none, or one counted where it was decided)."""

    status: int
    message: str
    reason: str = ""


class _Stop(Exception):
    """Raised in a parser callback once ``_Parsed.refusal`` is set: it stops httptools where it
    is (no byte after the fault is parsed)."""


class _Phase(enum.Enum):
    """Where the parser is in the connection's byte stream."""

    BETWEEN = "between requests"
    HEAD = "in a request head"
    BODY = "in a body framed by its Content-Length (or none)"
    CHUNKED = "in a chunked body"


_BETWEEN, _HEAD, _BODY, _CHUNKED = _Phase  # read on every callback: module names are cheaper
_HEAD_OR_BETWEEN = (_HEAD, _BETWEEN)


_HEAD_END = b"\r\n\r\n"
_HEAD_TOO_LARGE = f"request head larger than {MAX_HEAD_BYTES} bytes"
_REQUEST_LINE_FRAMING = 14
"""The least framing of a request line and head beside the method and the target: two spaces,
``HTTP/1.1``, its CRLF and the empty line's."""
_HEADER_FRAMING = 3
"""The least framing of a header line beside its name and value: ``:`` and CRLF (the usual
space after the colon counts as padding: one byte a header)."""
_CHUNK_FRAMING = 4
"""A chunk's framing beside its hex size: the size line's CRLF and the one after its data (the
last chunk: its CRLF and the empty line's)."""
_UPGRADE_TOKENS = frozenset({"upgrade", "http2-settings"})
"""The hop-by-hop headers of an upgrade request that ignoring the upgrade (*request forms*)
drops."""


def _origin_form(url: str) -> str:
    """An absolute-form target (``http://host:port/path?q``) as the origin form it names
    (``/path?q``); any other target as it is."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        return url
    cut = len(rest)
    for mark in ("/", "?"):
        at = rest.find(mark)
        if 0 <= at < cut:
            cut = at
    target = rest[cut:]
    return target if target[:1] == "/" else "/" + target


def _head_end(tail: bytes, data: bytes) -> int:
    """Where, in ``data``, a head being received ends (-1: not in it); ``tail`` is the end of
    the read before (its empty line may have begun there)."""
    for k in (1, 2, 3):
        if tail.endswith(_HEAD_END[: 4 - k]) and data.startswith(_HEAD_END[4 - k :]):
            return k
    at = data.find(_HEAD_END)
    return at + 4 if at >= 0 else -1


class _Parsed:
    """httptools' callbacks and what the parser leaves to us (*caps*, *bytes in flight*, *chunk
    framing*, *request forms* and *refusals*): the requests it completes, in order, in ``ready``;
    once a fault or a refusal is found, ``refusal``, and nothing after it is parsed. The parser
    calls back synchronously from ``feed_data``; ``feed`` is this connection's one way in."""

    def __init__(
        self, max_body: int, charges: BodyCharges | None = None, clock: _Clock | None = None
    ) -> None:
        self.max_body = max_body
        self.charges = charges
        self.clock = clock
        self.charged = 0
        """Bytes of the request being parsed charged so far (*bytes in flight*)."""
        self.share = charges.inflight.connection() if charges is not None else None
        """This connection's share of the bytes in flight: its body still arriving (*bytes in
        flight*)."""
        self.refusal: _Refusal | None = None
        self.ready: list[tuple[HttpRequest, bool]] = []
        self.method = b""
        self.url = b""
        self.headers: dict[str, str] = {}
        self.hosts = 0
        self.body = BodyBuffer(max_body)
        self.head_bytes = 0
        self.expect_continue = False
        self.phase = _BETWEEN
        self.messages = 0
        """Request heads begun on this connection (a piece that begins none continues one)."""
        self.credited = 0
        """Bytes the callbacks account for: what they reported plus the least framing around
        it (*chunk framing*)."""
        self.head_raw = 0
        """Bytes of the head being received fed after the piece it began in (*caps*)."""
        self.chunk_start = 0
        """Bytes of the body before the chunk being parsed."""
        self.body_seen = 0
        """Bytes of the chunked body being parsed in its completed chunks."""
        self.chunk_excess = 0
        """*Chunk framing*: framing of the chunked body being parsed beyond its least framing."""
        self.chunked_from: int | None = None
        """Where in ``ready`` the requests begin that the piece being fed counts chunk framing
        for (None: no chunked body in it yet)."""
        self.tail = b""
        """The last bytes of the previous read (a head's end may straddle two reads)."""
        self.parser = httptools.HttpRequestParser(self)

    # ---------------------------------------- feeding (*caps*, *chunk framing*, *request forms*)

    def feed(self, data: bytes) -> None:
        """Parse one read of the connection. A read that begins inside a head is fed in two
        pieces, split after the head's end, so that the fields of a head that came in earlier
        reads, reported now, never offset the count of the body after it (*chunk framing*)."""
        if self.phase is _HEAD and 0 < (end := _head_end(self.tail, data)) < len(data):
            view = memoryview(data)
            self._feed(view[:end])
            if self.refusal is None:
                self._feed(view[end:])
        else:
            self._feed(data)
        if self.phase is _HEAD:
            self.tail = data[-3:]

    def _feed(self, piece: bytes | memoryview) -> None:
        """Feed one piece to the parser and measure it (*caps* and *chunk framing*); after an
        upgrade request (*request forms*), its head without the upgrade and then the rest of the
        piece go to a parser that never saw the upgrade."""
        while self.refusal is None:
            phase, messages, credited = self.phase, self.messages, self.credited
            self.chunked_from = len(self.ready) if phase is _CHUNKED else None
            size = len(piece)
            upgraded = False
            try:
                self.parser.feed_data(piece)
            except httptools.HttpParserUpgrade as exc:
                size, upgraded = int(exc.args[0]), True
            except httptools.HttpParserError as exc:
                if self.refusal is None:
                    self.refusal = _Refusal(400, f"malformed HTTP request: {exc}")
                return
            if self.messages == messages and self.phase is phase and phase in _HEAD_OR_BETWEEN:
                self.head_raw += size  # all of it one head still arriving (or empty lines)
                if self.head_raw > MAX_HEAD_BYTES:
                    self.refusal = _Refusal(431, _HEAD_TOO_LARGE)
                    return
            else:
                self.head_raw = 0
            if self.chunked_from is not None:
                self._chunk_framing(size - (self.credited - credited), phase is _CHUNKED)
            if not upgraded or self.refusal is not None:
                return
            head = self._without_upgrade()
            if head is None:
                return
            self._feed(head)  # no upgrade left in it to stop at
            piece = piece[size:]
            if not piece:
                return

    def _chunk_framing(self, excess: int, continued: bool) -> None:
        """*Chunk framing* for a piece with ``excess`` bytes beyond what its callbacks account for,
        in which a chunked body was ``continued`` from an earlier piece, or began."""
        self.chunk_excess = max(0, excess + (self.chunk_excess if continued else 0))
        start = self.chunked_from
        assert start is not None
        if self.chunk_excess > MAX_CHUNK_EXTENSION_BYTES:
            self._drop_from(start)
            self.refusal = _Refusal(
                400,
                f"malformed HTTP request: more than {MAX_CHUNK_EXTENSION_BYTES} bytes of chunk "
                "extensions in one request body",
                "chunk_extensions",
            )
        elif self.body_seen + self.chunk_excess > self.max_body:
            self._drop_from(start)
            exc = too_large(self.body_seen + self.chunk_excess, self.max_body)
            self.refusal = _Refusal(413, exc.message, "body_too_large")

    def _drop_from(self, start: int) -> None:
        """Take back the requests completed from ``ready[start]`` on (they are refused) and
        give back what they hold."""
        for request, _ in self.ready[start:]:
            if request.charged and request.charges is not None:
                request.charges.release(request.charged)
                request.charged = 0
        del self.ready[start:]

    def _without_upgrade(self) -> bytes | None:
        """*Request forms*: the head of the upgrade request just completed, written again without
        its upgrade (its ``Upgrade`` and ``HTTP2-Settings`` headers and ``Connection`` tokens), to
        be parsed by a fresh parser with what follows it, its body included; None after a CONNECT
        (refused)."""
        request, _ = self.ready.pop()
        if request.charged and request.charges is not None:
            request.charges.release(request.charged)  # charged again as the head is parsed
        if request.method == "CONNECT":
            self.refusal = _Refusal(501, "the CONNECT method is not served")
            return None
        target = f"{request.path}?{request.query}" if request.query else request.path
        lines = [f"{request.method} {target} HTTP/{self.parser.get_http_version()}"]
        for name, value in request.headers.items():
            if name in _UPGRADE_TOKENS:
                continue
            if name == "connection":
                kept = [t for t in value.split(",") if t.strip().lower() not in _UPGRADE_TOKENS]
                value = ",".join(kept).strip()
                if not value:
                    continue
            lines.append(f"{name}: {value}")
        self.parser = httptools.HttpRequestParser(self)
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    # ------------------------------------------------------------------ refusing (*refusals*)

    def _refuse(self, status: int, message: str, reason: str = "") -> NoReturn:
        self.refusal = _Refusal(status, message, reason)
        raise _Stop

    def _refuse_too_large(self, size: int) -> NoReturn:
        self._drop_body()
        self._refuse(413, too_large(size, self.max_body).message, "body_too_large")

    def _drop_body(self) -> None:
        """*Bytes in flight*: a refused body goes now, and what it was charged with it (the
        connection lingers before it closes, and bytes no longer held must not keep others
        out)."""
        self.body.take()
        if self.charged:
            if self.share is not None:
                self.share.give(self.charged)
            assert self.charges is not None
            self.charges.release(self.charged)
            self.charged = 0

    # ------------------------------------------------------------------ the parser's callbacks

    def on_message_begin(self) -> None:
        if self.clock is not None:
            self.clock.head_began()
        self.url, self.headers, self.head_bytes, self.hosts = b"", {}, 0, 0
        self.body.take()
        self.phase = _HEAD
        self.messages += 1

    def on_url(self, url: bytes) -> None:
        self.url += url
        self.head_bytes += len(url)
        self.credited += len(url)
        if self.head_bytes > MAX_HEAD_BYTES:
            self._refuse(431, _HEAD_TOO_LARGE)

    def on_header(self, name: bytes, value: bytes) -> None:
        n = len(name) + len(value)
        self.head_bytes += n
        self.credited += n + _HEADER_FRAMING
        if self.head_bytes > MAX_HEAD_BYTES:
            self._refuse(431, _HEAD_TOO_LARGE)
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        if key == "host" and self.phase is _HEAD:  # not a trailer
            self.hosts += 1
        self.headers[key] = f"{self.headers[key]}, {text}" if key in self.headers else text

    def on_headers_complete(self) -> None:
        if self.clock is not None:
            self.clock.head_complete()
        parser = self.parser
        self.method = method = parser.get_method()
        self.credited += len(method) + _REQUEST_LINE_FRAMING
        if self.hosts != 1 and (self.hosts or parser.get_http_version() == "1.1"):
            what = "more than one Host header" if self.hosts else "no Host header"
            self._refuse(400, f"malformed HTTP request: {what} (RFC 9112 asks for exactly one)")
        headers = self.headers
        self.body_seen = 0
        if "transfer-encoding" in headers:  # the parser allows no other coding at the end
            self.phase = _CHUNKED
            if self.chunked_from is None:
                self.chunked_from = len(self.ready)
        else:
            self.phase = _BODY
        length = headers.get("content-length", "")
        if length.isdigit():
            size = int(length)
            if size > self.max_body:  # refused before a byte of it is read (or charged)
                self._refuse_too_large(size)
        if headers.get("expect", "").lower() == "100-continue":
            self.expect_continue = True

    def _charge(self, n: int) -> None:
        """*Bytes in flight*: ``n`` more bytes of this body charged, or the request refused."""
        assert self.charges is not None
        try:
            self.charges.charge(n, self.charged)
        except ResourceExhausted as exc:
            self._drop_body()
            self._refuse(*error_of(exc))  # counted by the charges
        self.charged += n

    def on_chunk_header(self) -> None:
        self.chunk_start = self.body.received

    def on_body(self, data: bytes) -> None:
        n = len(data)
        self.credited += n
        if not self.body.add(data):  # counted as it arrives: refused the moment it passes
            self._refuse_too_large(self.body.received)
        charges = self.charges
        if charges is not None:  # as it arrives, never as its Content-Length announces it
            inflight = charges.inflight
            if not inflight.cap or inflight.used + n <= inflight.cap:
                inflight.used += n  # within the budget: the hot path, inline
                self.charged += n
            else:
                self._charge(n)
            assert self.share is not None
            self.share.add(n)

    def on_chunk_complete(self) -> None:
        size = self.body.received - self.chunk_start
        self.body_seen += size
        self.credited += max(1, (size.bit_length() + 3) // 4) + _CHUNK_FRAMING

    def on_message_complete(self) -> None:
        url = self.url.decode("latin-1")
        path, _, query = (url if url[:1] == "/" else _origin_form(url)).partition("?")
        body = self.body.take()
        method = self.method.decode("latin-1")
        request = HttpRequest(method, path, query, self.headers, body, self.charged, self.charges)
        if self.share is not None and self.charged:
            self.share.give(self.charged)  # whole: no longer arriving
        self.charged = 0
        self.phase = _BETWEEN
        self.ready.append((request, self.parser.should_keep_alive()))

    def release_held(self) -> None:
        """*Bytes in flight* at the connection's end: give back what its unanswered requests
        hold."""
        charges = self.charges
        if charges is None:
            return
        held = self.charged + sum(request.charged for request, _ in self.ready)
        if self.share is not None and self.charged:
            self.share.give(self.charged)
        self.charged = 0
        for request, _ in self.ready:
            request.charged = 0
        charges.release(held)


async def _reply(
    stream: anyio.abc.ByteStream, response: HttpResponse, *, head_only: bool, close: bool
) -> None:
    pieces = _pieces_of(response.body)
    length = sum(_size(p) for p in pieces)
    head = encode_head(response, length, close=close)
    if head_only:
        await stream.send(head)
        return
    for segment in segments(head, pieces, length):
        await stream.send(segment)  # type: ignore[arg-type]  # any buffer is written as is


async def _answer(app: App, request: HttpRequest) -> HttpResponse:
    try:
        return await app(request)
    except Exception as exc:  # one bad request never stops the server
        if not isinstance(exc, ResourceExhausted | TimeoutError) and error_of(exc)[0] == 500:
            log.error("http_request_failed", path=request.path, error=repr(exc), exc_info=exc)
        return error_response(exc)


class _Clock:
    """One connection's deadlines as the reaper sees them: since when it has waited for a
    byte, since when its current request head has been arriving (``None``: no head in
    progress), and why the reaper closed it; and the requests in progress (a complete head
    not yet answered), which keep its ``slot`` under the port's cap from eviction."""

    __slots__ = (
        "head_bytes_seen",
        "head_since",
        "reason",
        "requests",
        "scope",
        "slot",
        "waiting_since",
    )

    def __init__(
        self, scope: anyio.CancelScope, head_since: float | None, slot: Slot | None = None
    ) -> None:
        self.scope = scope
        self.head_since = head_since
        self.head_bytes_seen = False
        self.waiting_since = 0.0
        self.reason = ""
        self.requests = 0
        self.slot = slot

    def head_complete(self) -> None:
        self.head_since = None
        self.head_bytes_seen = False
        self.requests += 1
        if self.slot is not None:
            self.slot.busy()

    def answered(self) -> None:
        self.requests -= 1
        if not self.requests and self.slot is not None:
            self.slot.idle()

    def head_began(self) -> None:
        """A request head's first byte was parsed: its deadline runs from now (from the
        accept, for the first)."""
        self.head_bytes_seen = True
        if self.head_since is None:
            self.head_since = anyio.current_time()


class IdleReaper:
    """Closes connections past a deadline of the module docstring (*keep-alive*): a request head
    not complete within ``limits.handshake_seconds`` (``reason="handshake_timeout"``), a wait
    for a byte longer than ``limits.idle_seconds`` (``reason="idle"``), both counted in
    ``stats.refused_connections``; 0 turns a deadline off.

    A connection registers its ``_Clock`` while it waits in ``receive`` and unregisters when
    bytes arrive, so a request being answered is never cut; one task (``run``) checks every
    quarter of the shorter deadline: a timeout scope around every receive cost far more per
    request than a dictionary entry does (docs/benchmarks/history.md, "HTTP stack").
    """

    def __init__(self, limits: EdgeLimits | None = None, stats: EdgeStats | None = None) -> None:
        limits = limits or EdgeLimits()
        self.idle_seconds = limits.idle_seconds
        self.head_seconds = limits.handshake_seconds
        self.stats = stats or EdgeStats()
        self.waiting: dict[_Clock, None] = {}

    async def run(self) -> None:
        deadlines = [d for d in (self.idle_seconds, self.head_seconds) if d > 0]
        if not deadlines:
            return
        tick = max(0.01, min(deadlines) / 4)
        while True:
            await anyio.sleep(tick)
            self.reap(anyio.current_time())

    def reap(self, now: float) -> None:
        """Cancel every waiting connection whose deadline has passed at ``now``."""
        for clock in list(self.waiting):
            head = clock.head_since
            if self.head_seconds > 0 and head is not None and now - head >= self.head_seconds:
                clock.reason = "handshake_timeout"
            elif self.idle_seconds > 0 and now - clock.waiting_since >= self.idle_seconds:
                clock.reason = "idle"
            else:
                continue
            del self.waiting[clock]
            clock.scope.cancel()


async def serve_connection(
    stream: anyio.abc.ByteStream,
    app: App,
    max_body_bytes: int,
    reaper: IdleReaper | None = None,
    accepted_at: float | None = None,
    charges: BodyCharges | None = None,
    slot: Slot | None = None,
) -> None:
    """Serve one connection until it closes (see the module docstring for the rules); with a
    ``reaper``, under its deadlines, the first head's counted from ``accepted_at`` (default:
    now); with ``charges``, its bodies count in the process's bytes in flight (*bytes in flight*);
    ``slot`` is told when a request is in progress and when none is (the port's cap)."""
    scope = anyio.CancelScope()
    clock = _Clock(scope, anyio.current_time() if accepted_at is None else accepted_at, slot)
    parsed = _Parsed(max_body_bytes, charges, clock)
    waiting = reaper.waiting if reaper is not None else {}
    async with stream:
        with scope:  # what the reaper cancels
            stats = reaper.stats if reaper is not None else None
            try:
                await _serve(stream, app, parsed, clock, waiting, stats)
            finally:
                parsed.release_held()
        if clock.reason and reaper is not None:
            reaper.stats.refuse_connection(clock.reason)
            if clock.reason == "handshake_timeout" and clock.head_bytes_seen:
                await _timed_out(stream)


async def _timed_out(stream: anyio.abc.ByteStream) -> None:
    """408 to a client whose head did not arrive in time, written briefly or not at all."""
    message = "the request head did not arrive in time"
    with anyio.CancelScope(shield=True), anyio.move_on_after(TIMEOUT_REPLY_SECONDS):
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await _reply(
                stream, HttpResponse(408, error_body(message)), head_only=False, close=True
            )


async def _serve(
    stream: anyio.abc.ByteStream,
    app: App,
    parsed: _Parsed,
    clock: _Clock,
    waiting: dict[_Clock, None],
    stats: EdgeStats | None = None,
) -> None:
    bound_read_ahead = read_ahead_bound(stream)
    share = parsed.share
    while True:
        if share is not None and not share.fits(1):  # *bytes in flight*: at its share, no reading
            await share.wait(1)
        clock.waiting_since = anyio.current_time()
        waiting[clock] = None
        try:
            data = await stream.receive(READ_BYTES)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            return
        finally:
            waiting.pop(clock, None)
        bound_read_ahead()
        parsed.feed(data)
        refusal = parsed.refusal
        if parsed.expect_continue:
            parsed.expect_continue = False
            if refusal is None:
                await stream.send(b"HTTP/1.1 100 Continue\r\n\r\n")
        while parsed.ready:
            request, keep_alive = parsed.ready.pop(0)
            close = not keep_alive
            try:
                response = await _answer(app, request)
                await _reply(stream, response, head_only=request.method == "HEAD", close=close)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                return
            finally:
                if request.charged:  # *bytes in flight*: answered (or never will be)
                    charged, request.charged = request.charged, 0
                    assert request.charges is not None
                    request.charges.release(charged)
            clock.answered()
            if close:  # *refusals*: what came after it is not answered, nor refused
                return
            if clock.head_since is not None:  # a pipelined head: its time starts now
                clock.head_since = anyio.current_time()
        if refusal is not None:  # *refusals*, once what came before it is answered
            if refusal.reason and stats is not None:
                stats.refuse_request(refusal.reason)
            await _close_with(stream, HttpResponse(refusal.status, error_body(refusal.message)))
            return


async def _close_with(stream: anyio.abc.ByteStream, response: HttpResponse) -> None:
    """Answer and close, lingering: what the client is still sending is read and dropped for
    a bounded time (``LINGER_SECONDS``, ``LINGER_BYTES``), so closing with unread bytes does not
    reset the connection before the client has read the answer."""
    try:
        await _reply(stream, response, head_only=False, close=True)
        with contextlib.suppress(NotImplementedError):
            await stream.send_eof()
        drained = 0
        with anyio.move_on_after(LINGER_SECONDS):
            while drained < LINGER_BYTES:
                drained += len(await stream.receive(READ_BYTES))
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream):
        pass


async def serve_app(
    host: str,
    port: int,
    app: App,
    *,
    max_body_bytes: int,
    ssl_context: ssl.SSLContext | None = None,
    name: str = "http",
    limits: EdgeLimits | None = None,
    stats: EdgeStats | None = None,
    connection_cap: int | None = None,
    reuse_port: bool = False,
    inflight: InflightBytes | None = None,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``host:port`` until cancelled; ``task_status.started(bound_port)``.

    With ``ssl_context`` every connection is TLS (a failed handshake drops that connection
    only; it must end within ``limits.handshake_seconds``). Each connection is a task of this
    call's own task group. ``limits`` gives the deadlines and ``max_connections``,
    ``connection_cap`` this listener's cap when the process's descriptor budget set one
    (``serving.fd_budget``); ``stats`` counts what the defences closed.
    ``reuse_port`` binds with SO_REUSEPORT (several processes share the port). ``inflight``:
    the process's bytes in flight (``Admission.bytes``) the request bodies are charged to
    (*bytes in flight*; a refusal counted in ``stats`` as ``inflight_bytes``); None charges nothing.
    """
    limits = limits or EdgeLimits()
    stats = stats or EdgeStats()
    cap = ConnectionCap(
        limits.max_connections if connection_cap is None else connection_cap,
        stats,
        name,
        PeerLedger(limits.max_connections_per_peer_per_second, limits.peer_probation_seconds),
    )
    reaper = IdleReaper(limits, stats)
    handshake = limits.handshake_seconds
    charges = BodyCharges(inflight, stats) if inflight is not None else None

    async def serve_socket(sock: socket.socket, slot: Slot) -> None:
        accepted_at = anyio.current_time()
        try:
            stream: anyio.abc.ByteStream = await anyio.abc.SocketStream.from_socket(sock)
        except BaseException:
            sock.close()
            raise
        if ssl_context is not None:
            try:
                with anyio.fail_after(handshake or None):
                    stream = await TLSStream.wrap(
                        stream, server_side=True, ssl_context=ssl_context, standard_compatible=False
                    )
            except BaseException as exc:
                if isinstance(exc, TimeoutError):
                    stats.refuse_connection("handshake_timeout")
                with anyio.CancelScope(shield=True):
                    await anyio.aclose_forcefully(stream)
                if not isinstance(exc, Exception):
                    raise
                log.info(f"{name}_tls_handshake_failed", error=repr(exc)[:200])
                return
        try:
            await serve_connection(stream, app, max_body_bytes, reaper, accepted_at, charges, slot)
        except Exception as exc:  # one broken connection never stops the endpoint
            log.warning(f"{name}_connection_failed", error=repr(exc))

    listener = await bind(host, port, reuse_port=reuse_port)
    sockets = listening_sockets(listener)
    bound = int(sockets[0].getsockname()[1])
    async with listener:
        log.info(
            f"{name}_endpoint_up",
            host=host,
            port=bound,
            tls=ssl_context is not None,
            max_connections=cap.cap or None,
        )
        task_status.started(bound)
        async with anyio.create_task_group() as tg:
            tg.start_soon(reaper.run)
            for raw in sockets:
                tg.start_soon(accept_loop, raw, cap, serve_socket, tg)


__all__ = [
    "App",
    "HttpRequest",
    "HttpResponse",
    "IdleReaper",
    "encode_head",
    "error_response",
    "segments",
    "serve_app",
    "serve_connection",
]

"""The project's HTTP/1.1 server: httptools' parser driven by one anyio task per connection.

Chosen by measurement (docs/benchmarks.md, "HTTP stack"): httptools (llhttp, the parser uvicorn
uses) on anyio streams cost the least CPU per request of the candidates, and it runs inside the
caller's own task tree: each connection is a child task of the listener, cancellation is the
shutdown path, TLS is anyio's, and nothing installs signal handlers or runs tasks of its own.

What the connection loop owns (the parser owns the syntax: request line, headers, chunked
bodies):

1. keep-alive: requests on one connection are answered in order, one at a time (a pipelined
   request waits for the one before it); the connection closes when the request asks
   (``Connection: close``, HTTP/1.0 without keep-alive), after an error that leaves the stream
   unreadable, or at a deadline (``IdleReaper``): a request head that is not complete within
   ``limits.handshake_seconds`` of its first byte (of the accept, for a connection's first
   request, the TLS handshake included: slowloris), answered 408 when some of it came, and a
   connection that waited ``limits.idle_seconds`` for a byte;
2. caps: the request head is at most ``MAX_HEAD_BYTES`` (else 431); the body at most
   ``max_body_bytes``, checked on ``Content-Length`` before the body is read and on the bytes
   of a chunked body as they arrive (``_body``: else 413 ``received message larger than max (N
   vs. M)``, the gRPC message, and the connection closes, lingering a moment so the client
   reads the answer);
2a. bytes in flight (``serve_app(inflight=...)``): a body is charged to the process's
   ``InflightBytes``, the budget gRPC messages count in, at its ``Content-Length`` once the head
   is parsed (a chunked body piece by piece, an inflated one as it grows: ``HttpRequest.charge``)
   and given back once its request is answered or the connection ends. A body that does not
   fit is answered 429 with the gRPC refusal's message (after the requests parsed before it)
   and the connection closes as in rule 2; one request alone is always admitted;
3. ``Expect: 100-continue`` is answered ``100 Continue`` once the head passed the caps;
4. ``HEAD`` is answered with the headers of ``GET`` and no body;
5. a handler exception that is not a ``ServingError`` becomes 500 with a JSON error body; the
   server keeps serving.

Accepting is ``serving.accept``'s loop (a bind error is ``ListenError``; open connections are
capped, and at the cap the longest-idle one is closed for the new one: a keep-alive connection
with no request in progress, or one whose request head is not complete; out of descriptors it
backs off and goes on serving).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import httptools
from anyio.streams.tls import TLSStream

from kserve_trio.core.config import EdgeLimits
from kserve_trio.core.errors import ResourceExhausted
from kserve_trio.core.logging import get_logger
from kserve_trio.serving.accept import ConnectionCap, Slot, accept_loop, bind, listening_sockets
from kserve_trio.serving.edge_stats import EdgeStats
from kserve_trio.serving.http._body import BodyBuffer, BodyCharges, read_ahead_bound, too_large
from kserve_trio.serving.http._status import JSON_TYPE, REASONS, error_body, error_of

if TYPE_CHECKING:
    from kserve_trio.serving.admission import InflightBytes

log = get_logger("kserve_trio.serving.http")

MAX_HEAD_BYTES = 64 << 10
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
    """Bytes of this request charged to the process's bytes in flight (rule 2a)."""
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


class _Parsed:
    """httptools' callbacks: collects requests as they complete (the parser calls back
    synchronously from ``feed_data``)."""

    def __init__(self, max_body: int, charges: BodyCharges | None = None) -> None:
        self.max_body = max_body
        self.charges = charges
        self.charged = 0
        """Bytes of the request being parsed charged so far (rule 2a)."""
        self.announced = False
        """Whether its ``Content-Length`` was charged (its pieces then are not)."""
        self.refused: ResourceExhausted | None = None
        """The refusal of a body that did not fit in the bytes in flight."""
        self.ready: list[tuple[HttpRequest, bool]] = []
        self.url = b""
        self.headers: dict[str, str] = {}
        self.body = BodyBuffer(max_body)
        self.head_bytes = 0
        self.too_large: int = 0  # the announced or received size past the cap (0 = within)
        self.expect_continue = False
        self.parser: httptools.HttpRequestParser | None = None

    def on_message_begin(self) -> None:
        self.url, self.headers, self.head_bytes = b"", {}, 0
        self.announced = False
        self.body.take()

    def on_url(self, url: bytes) -> None:
        self.url += url
        self.head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_bytes += len(name) + len(value)
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        self.headers[key] = f"{self.headers[key]}, {text}" if key in self.headers else text

    def on_headers_complete(self) -> None:
        if self.refused is not None:
            return
        length = self.headers.get("content-length", "")
        if length.isdigit():
            size = int(length)
            if size > self.max_body:
                self.too_large = size
                return
            if size and self.charges is not None:
                inflight = self.charges.inflight
                if not inflight.cap or inflight.used + size <= inflight.cap:
                    inflight.used += size  # within the budget: the hot path, inline
                    self.charged += size
                elif not self._charge(size):
                    return
                self.announced = True
        if self.headers.get("expect", "").lower() == "100-continue":
            self.expect_continue = True

    def _charge(self, n: int) -> bool:
        """Rule 2a: ``n`` more bytes of this body charged; False (refused) when they do not fit."""
        assert self.charges is not None
        try:
            self.charges.charge(n, self.charged)
        except ResourceExhausted as exc:
            self.refused = exc
            self.body.take()  # what was kept of it goes now
            return False
        self.charged += n
        return True

    def on_body(self, data: bytes) -> None:
        if self.too_large or self.refused is not None:  # refused: nothing of it is kept
            return
        if not self.body.add(data):  # counted as it arrives: refused the moment it passes
            self.too_large = self.body.received
        elif not self.announced and self.charges is not None:
            self._charge(len(data))

    def on_message_complete(self) -> None:
        assert self.parser is not None
        if self.refused is not None:  # neither it nor what follows it is answered
            return
        method = self.parser.get_method().decode("latin-1")
        url = self.url.decode("latin-1")
        path, _, query = url.partition("?")
        body = self.body.take()
        request = HttpRequest(method, path, query, self.headers, body, self.charged, self.charges)
        self.charged = 0
        self.ready.append((request, self.parser.should_keep_alive()))

    def release_held(self) -> None:
        """Rule 2a at the connection's end: give back what its unanswered requests hold."""
        charges = self.charges
        if charges is None:
            return
        held = self.charged + sum(request.charged for request, _ in self.ready)
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


class IdleReaper:
    """Closes connections past a deadline of the module docstring (rule 1): a request head
    not complete within ``limits.handshake_seconds`` (``reason="handshake_timeout"``), a wait
    for a byte longer than ``limits.idle_seconds`` (``reason="idle"``), both counted in
    ``stats.refused_connections``; 0 turns a deadline off.

    A connection registers its ``_Clock`` while it waits in ``receive`` and unregisters when
    bytes arrive, so a request being answered is never cut; one task (``run``) checks every
    quarter of the shorter deadline: a timeout scope around every receive cost far more per
    request than a dictionary entry does (docs/benchmarks.md).
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


class _HeadWatch:
    """The parser's protocol object: every callback is the request parser's (``_Parsed``);
    the start and the end of each request head also move the connection's head clock."""

    def __init__(self, parsed: _Parsed, clock: _Clock) -> None:
        self._parsed = parsed
        self._clock = clock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parsed, name)

    def on_message_begin(self) -> None:
        clock = self._clock
        clock.head_bytes_seen = True
        if clock.head_since is None:
            clock.head_since = anyio.current_time()
        self._parsed.on_message_begin()

    def on_headers_complete(self) -> None:
        self._clock.head_complete()
        self._parsed.on_headers_complete()


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
    now); with ``charges``, its bodies count in the process's bytes in flight (rule 2a);
    ``slot`` is told when a request is in progress and when none is (the port's cap)."""
    parsed = _Parsed(max_body_bytes, charges)
    scope = anyio.CancelScope()
    clock = _Clock(scope, anyio.current_time() if accepted_at is None else accepted_at, slot)
    parser = httptools.HttpRequestParser(_HeadWatch(parsed, clock))
    parsed.parser = parser
    waiting = reaper.waiting if reaper is not None else {}
    async with stream:
        with scope:  # what the reaper cancels
            stats = reaper.stats if reaper is not None else None
            try:
                await _serve(stream, app, max_body_bytes, parsed, parser, clock, waiting, stats)
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
    max_body_bytes: int,
    parsed: _Parsed,
    parser: httptools.HttpRequestParser,
    clock: _Clock,
    waiting: dict[_Clock, None],
    stats: EdgeStats | None = None,
) -> None:
    bound_read_ahead = read_ahead_bound(stream)
    while True:
        clock.waiting_since = anyio.current_time()
        waiting[clock] = None
        try:
            data = await stream.receive(READ_BYTES)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            return
        finally:
            waiting.pop(clock, None)
        bound_read_ahead()
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            await _close_with(stream, HttpResponse(501, error_body("upgrades are not served")))
            return
        except httptools.HttpParserError as exc:
            message = f"malformed HTTP request: {exc}"
            await _close_with(stream, HttpResponse(400, error_body(message)))
            return
        if parsed.head_bytes > MAX_HEAD_BYTES:
            message = f"request head larger than {MAX_HEAD_BYTES} bytes"
            await _close_with(stream, HttpResponse(431, error_body(message)))
            return
        if parsed.too_large:
            if stats is not None:
                stats.refuse_request("body_too_large")
            await _close_with(stream, error_response(too_large(parsed.too_large, max_body_bytes)))
            return
        if parsed.expect_continue:
            parsed.expect_continue = False
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
                if request.charged:  # rule 2a: answered (or never will be)
                    charged, request.charged = request.charged, 0
                    assert request.charges is not None
                    request.charges.release(charged)
            clock.answered()
            if close:
                return
            if clock.head_since is not None:  # a pipelined head: its time starts now
                clock.head_since = anyio.current_time()
        if parsed.refused is not None:  # rule 2a, once what came before it is answered
            await _close_with(stream, error_response(parsed.refused))
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
    (rule 2a; a refusal counted in ``stats`` as ``inflight_bytes``); None charges nothing.
    """
    limits = limits or EdgeLimits()
    stats = stats or EdgeStats()
    cap = ConnectionCap(
        limits.max_connections if connection_cap is None else connection_cap, stats, name
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

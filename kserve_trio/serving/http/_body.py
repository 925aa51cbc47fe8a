"""A request body as it arrives, held under the server's body cap.

The cap (``max_body_bytes``: the gRPC receive cap on the REST ports) is enforced while the body
is read, never after: a ``Content-Length`` over it is refused before a byte of the body is read,
a chunked body is counted as it arrives and refused the moment it passes the cap, and what was
kept of it is dropped then. A body that arrives in one piece is kept as that piece; a longer one
is appended to one ``bytearray`` (grown in place: no list of pieces joined at the end, so a
body costs about its own size, not twice). A compressed body has the same cap on its output
(``inflate_body``, called by ``serving.rest_routes.request_body``). The refusal is 413 Payload
Too Large with the gRPC message, ``received message larger than max (N vs. M)``, and the
connection closes.

A body's bytes are also charged to the process's bytes in flight (``BodyCharges``, the
admission's ``InflightBytes`` that the gRPC messages count in): each piece as it arrives (never
the ``Content-Length`` a head announces: an announcement costs the client nothing), and what it
inflates to as it grows; they
are given back once its request has been answered or its connection ends. A body that does not
fit is refused as a gRPC message is, RESOURCE_EXHAUSTED (HTTP 429) with the same message, and
one request alone is always admitted.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from kserve_trio.core.errors import InvalidArgument, ResourceExhausted, ServingError, StatusCode
from kserve_trio.core.process import asyncio_transport
from kserve_trio.core.protocol import DEFLATE, GZIP

if TYPE_CHECKING:
    from kserve_trio.serving.admission import InflightBytes
    from kserve_trio.serving.edge_stats import EdgeStats

INFLATE_STEP = 1 << 20
"""Bytes of output one inflate step may produce (and of input it is fed), so the body grows a
step at a time and never holds more than the cap plus one step."""


class PayloadTooLarge(ServingError):
    """A request body (as sent, or decompressed) over the body cap: HTTP 413, and
    RESOURCE_EXHAUSTED where a gRPC status is read from it."""

    status = StatusCode.RESOURCE_EXHAUSTED
    http_status = 413


def too_large(size: int | None, cap: int) -> PayloadTooLarge:
    """The refusal of a body of ``size`` bytes (``None``: more than the cap, size unknown)."""
    shown = f"{size}" if size is not None else f"more than {cap}"
    return PayloadTooLarge(f"received message larger than max ({shown} vs. {cap})")


def _inflate(view: memoryview, wbits: int, cap: int, grown: Callable[[int], None]) -> bytearray:
    inflater = zlib.decompressobj(wbits)
    out = bytearray()
    pos = 0
    while not inflater.eof:
        if inflater.unconsumed_tail:
            data: bytes | memoryview = inflater.unconsumed_tail
        elif pos < len(view):
            data, pos = view[pos : pos + INFLATE_STEP], pos + INFLATE_STEP
        else:
            break
        out += inflater.decompress(data, min(cap + 1 - len(out), INFLATE_STEP))
        if len(out) > cap:
            raise too_large(None, cap)
        grown(len(out))
    if not inflater.eof:
        out += inflater.flush()  # at most what zlib still holds of its window
        if len(out) > cap:
            raise too_large(None, cap)
        grown(len(out))
        if not inflater.eof:
            raise zlib.error("incomplete or truncated stream")
    return out


def inflate_body(
    body: bytes | bytearray,
    encoding: str,
    cap: int,
    charge: Callable[[int], None] | None = None,
) -> bytearray:
    """A ``Content-Encoding: gzip|deflate`` body decompressed a step at a time with the cap on
    the output: it stops as soon as the output passes ``cap`` (``PayloadTooLarge``), so a
    decompression bomb costs the cap, never what it would inflate to. ``deflate`` is the zlib
    format, or a raw deflate stream (some clients send one); a corrupt body is
    ``InvalidArgument``. ``charge(n)`` is told of each step's ``n`` new bytes of output (the
    request's bytes in flight: it raises to stop the inflation); a framing that is tried and
    fails charges nothing twice."""
    framings = (31,) if encoding == GZIP else (15, -15)
    assert encoding in (GZIP, DEFLATE)
    held = 0

    def grown(size: int) -> None:
        nonlocal held
        if charge is not None and size > held:
            charge(size - held)
            held = size

    last: zlib.error | None = None
    for wbits in framings:
        try:
            return _inflate(memoryview(body), wbits, cap, grown)
        except zlib.error as exc:
            last = exc
    raise InvalidArgument(f"cannot decompress the {encoding} request body: {last}")


READ_AHEAD_CHUNKS = 8
"""Received chunks an asyncio stream may queue ahead of the connection task (``read_ahead_bound``)."""


def read_ahead_bound(stream: object) -> Callable[[], None]:
    """A check to run after each ``receive``: on anyio's asyncio TCP stream it pauses the
    transport when more than ``READ_AHEAD_CHUNKS`` chunks wait in the stream's queue (anyio
    resumes it once the queue is empty). anyio pauses the transport itself after each wait,
    yet under uvloop a transport was seen to keep reading while the task was busy, queueing
    everything a fast client sent (hundreds of MiB for an endless chunked body) before the cap
    could be checked; this keeps what a connection holds near what it has parsed. A no-op on
    any other stream (trio's and TLS streams read only when asked)."""
    found = asyncio_transport(stream)
    queue = getattr(found[1], "read_queue", None) if found is not None else None
    if found is None or queue is None:
        return _nothing
    transport = found[0]

    def bound() -> None:
        if len(queue) > READ_AHEAD_CHUNKS:
            transport.pause_reading()

    return bound


def _nothing() -> None:
    return None


class BodyBuffer:
    """The bytes of one request body, up to ``cap`` (module docstring)."""

    __slots__ = ("_data", "cap", "received")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.received = 0
        self._data: bytes | bytearray = b""

    def add(self, piece: bytes) -> bool:
        """Keep ``piece``; False (and nothing kept) once the body has passed the cap."""
        self.received += len(piece)
        if self.received > self.cap:
            self._data = b""
            return False
        if not self._data:
            self._data = piece
        elif self._data.__class__ is bytes:
            grown = bytearray(self._data)
            grown += piece
            self._data = grown
        else:
            self._data += piece
        return True

    def take(self) -> bytes | bytearray:
        """The body, and the buffer emptied for the next request."""
        data, self._data, self.received = self._data, b"", 0
        return data


class BodyCharges:
    """The REST bodies' side of the process's bytes in flight (module docstring): one per
    server, shared by its connections; a refusal is counted in
    ``stats.refused_requests{reason="inflight_bytes"}``."""

    __slots__ = ("inflight", "stats")

    def __init__(self, inflight: InflightBytes, stats: EdgeStats) -> None:
        self.inflight = inflight
        self.stats = stats

    def charge(self, n: int, own: int) -> None:
        """Charge ``n`` bytes more of a request that holds ``own`` already, or
        RESOURCE_EXHAUSTED (the gRPC refusal's message) when they do not fit."""
        try:
            self.inflight.charge(n, own)
        except ResourceExhausted:
            self.stats.refuse_request("inflight_bytes")
            raise

    def release(self, n: int) -> None:
        """Give back ``n`` charged bytes (their request is answered or its connection ended)."""
        self.inflight.release(n)


__all__ = [
    "INFLATE_STEP",
    "READ_AHEAD_CHUNKS",
    "BodyBuffer",
    "BodyCharges",
    "PayloadTooLarge",
    "inflate_body",
    "read_ahead_bound",
    "too_large",
]

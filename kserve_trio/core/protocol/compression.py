"""gRPC message compression: ``grpc-encoding`` gzip and deflate, bounded by the message cap.

This module is pure (bytes in, bytes out) and owns the rules of the gRPC compression spec that
our servers and client follow; it lives in ``core`` so both share it:

1. *Named algorithm*: a request names its algorithm in the ``grpc-encoding`` header; each message's
   5-byte prefix says whether that message is compressed (flag 1) or not (flag 0). A compressed
   message without a usable ``grpc-encoding`` is an error, and so is an algorithm we do not know
   (``identity``, ``gzip`` and ``deflate`` are known; the status is UNIMPLEMENTED, as the spec asks,
   and the reply advertises what we accept).
2. *Formats*: ``gzip`` is RFC 1952; ``deflate`` is the zlib format (RFC 1950) that gRPC
   implementations send. A raw RFC 1951 stream under ``deflate`` is accepted too, since some peers
   send one.
3. *Bounded inflation*: caps apply to the decompressed size. A message inflates a bounded step at a
   time (``Inflater``: at most ``INFLATE_STEP_BYTES`` of output per step, the pieces joined once it
   is whole) and is refused as soon as its output passes the cap, so a "decompression bomb" costs at
   most ``cap`` plus one step of memory, never one allocation the size of the bomb, and answers
   RESOURCE_EXHAUSTED with the same message as an uncompressed message over the cap. Between steps
   the server yields to its other connections (``serving.grpc``).
4. *Reply encoding*: a reply is compressed only when its request was compressed with an algorithm
   the client also accepts (``grpc-accept-encoding``), or when the server is told to compress every
   reply (``grpc.compress_responses``) and the client accepts the algorithm. A client that accepts
   nothing we can produce gets identity.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

from kserve_trio.core.errors import InvalidArgument, ResourceExhausted, Unimplemented

IDENTITY = "identity"
GZIP = "gzip"
DEFLATE = "deflate"
ALGORITHMS = (GZIP, DEFLATE)
"""The compressing algorithms we implement, in our order of preference."""
ACCEPT_ENCODING = ",".join((IDENTITY, DEFLATE, GZIP))
"""What our servers and client advertise in ``grpc-accept-encoding``."""

_CHUNK = 1 << 20  # compressed bytes fed to the decompressor at a time
INFLATE_STEP_BYTES = 1 << 20
"""The most output one ``Inflater.step`` produces."""


def parse_encoding(header: str | None) -> str:
    """The algorithm a ``grpc-encoding`` header names (``identity`` when absent).

    Unknown algorithms are ``Unimplemented`` naming the accepted ones (*named algorithm*).
    """
    name = (header or IDENTITY).strip().lower() or IDENTITY
    if name != IDENTITY and name not in ALGORITHMS:
        raise Unimplemented(
            f"grpc-encoding '{name}' is not supported (supported: {ACCEPT_ENCODING})"
        )
    return name


def parse_accept_encoding(header: str | None) -> frozenset[str]:
    """The algorithms a ``grpc-accept-encoding`` header lists (lowercased; identity always)."""
    names = {p.strip().lower() for p in (header or "").split(",") if p.strip()}
    return frozenset(names | {IDENTITY})


def reply_encoding(request_encoding: str, accepted: Iterable[str], compress_all: bool) -> str:
    """The algorithm a reply is sent with (*reply encoding*)."""
    accepted = frozenset(accepted)
    if request_encoding in ALGORITHMS and request_encoding in accepted:
        return request_encoding
    if compress_all:
        for name in ALGORITHMS:
            if name in accepted:
                return name
    return IDENTITY


def _too_large(cap: int, size: int | None = None) -> ResourceExhausted:
    shown = f"{size}" if size is not None else f"more than {cap}"
    return ResourceExhausted(f"received message larger than max ({shown} vs. {cap})")


def _framings(algorithm: str) -> tuple[int, ...]:
    if algorithm == GZIP:
        return (31,)
    if algorithm == DEFLATE:
        return (15, -15)
    raise InvalidArgument(
        "a compressed message arrived without a grpc-encoding naming its algorithm"
    )


class Inflater:
    """One compressed message inflated a bounded step at a time (*formats* and *bounded inflation*).

    Each ``step`` produces at most ``INFLATE_STEP_BYTES`` of output, so the caller decides what
    happens between steps (the server yields to its other connections and charges the output
    to its bytes in flight); ``result`` joins the pieces once the stream has ended. What it
    holds is never more than ``cap`` plus one step, bomb or not: the output is refused
    (``ResourceExhausted``) as soon as it passes ``cap``. A corrupt stream is
    ``InvalidArgument``; under ``deflate`` a stream that is not zlib-framed is retried raw.
    """

    __slots__ = ("_cap", "_data", "_framings", "_pieces", "_pos", "_z", "algorithm", "size")

    def __init__(self, data: bytes | memoryview, algorithm: str, cap: int) -> None:
        self.algorithm = algorithm
        self._framings = list(_framings(algorithm))
        self._data = memoryview(data)
        self._cap = cap
        self._restart()

    def _restart(self) -> None:
        self._z = zlib.decompressobj(self._framings.pop(0))
        self._pieces: list[bytes] = []
        self._pos = 0
        self.size = 0
        """Bytes inflated so far."""

    @property
    def done(self) -> bool:
        return self._z.eof

    def step(self) -> int:
        """Inflate one bounded piece; its size (0 once the stream has ended)."""
        z = self._z
        if z.eof:
            return 0
        try:
            if z.unconsumed_tail:
                piece = z.decompress(z.unconsumed_tail, INFLATE_STEP_BYTES)
            elif self._pos < len(self._data):
                chunk = self._data[self._pos : self._pos + _CHUNK]
                self._pos += _CHUNK
                piece = z.decompress(chunk, INFLATE_STEP_BYTES)
            else:
                piece = z.flush(INFLATE_STEP_BYTES)
                if not z.eof:
                    raise zlib.error("incomplete or truncated stream")
        except zlib.error as exc:
            if self._framings and not self._pieces and not self.size:
                self._restart()  # deflate: try the raw framing
                return self.step()
            raise InvalidArgument(
                f"cannot decompress the {self.algorithm} message: {exc}"
            ) from None
        if piece:
            self._pieces.append(piece)
            self.size += len(piece)
            if self.size > self._cap:
                self._pieces = []
                raise _too_large(self._cap)
        elif not z.eof and not z.unconsumed_tail and self._pos >= len(self._data):
            return self.step()  # input spent: the next step flushes or fails
        return len(piece)

    def result(self) -> bytes:
        """The whole message (call once ``done``)."""
        pieces, self._pieces = self._pieces, []
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def decompress(data: bytes | memoryview, algorithm: str, cap: int) -> bytes:
    """The decompressed message, at most ``cap`` bytes (*formats* and *bounded inflation*), in one
    go.

    A corrupt payload is ``InvalidArgument``; one that inflates past ``cap`` is
    ``ResourceExhausted``; ``identity`` with the compressed flag set is ``InvalidArgument``.
    The server's receive path steps an ``Inflater`` itself, yielding between steps.
    """
    inflater = Inflater(data, algorithm, cap)
    while not inflater.done:
        inflater.step()
    return inflater.result()


def compress(data: bytes | memoryview, algorithm: str) -> bytes:
    """``data`` compressed with ``algorithm`` (``gzip`` or ``deflate``, zlib format)."""
    if algorithm == GZIP:
        c = zlib.compressobj(6, zlib.DEFLATED, 31)
    elif algorithm == DEFLATE:
        c = zlib.compressobj(6, zlib.DEFLATED, 15)
    else:
        raise ValueError(f"cannot compress with {algorithm!r}")
    return c.compress(data) + c.flush()


__all__ = [
    "ACCEPT_ENCODING",
    "ALGORITHMS",
    "DEFLATE",
    "GZIP",
    "IDENTITY",
    "INFLATE_STEP_BYTES",
    "Inflater",
    "compress",
    "decompress",
    "parse_accept_encoding",
    "parse_encoding",
    "reply_encoding",
]

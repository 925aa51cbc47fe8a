"""gRPC message compression: ``grpc-encoding`` gzip and deflate, bounded by the message cap.

This module is pure (bytes in, bytes out) and owns the rules of the gRPC compression spec that
our servers and client follow; it lives in ``core`` so both share it:

1. A request names its algorithm in the ``grpc-encoding`` header; each message's 5-byte prefix
   says whether that message is compressed (flag 1) or not (flag 0). A compressed message
   without a usable ``grpc-encoding`` is an error, and so is an algorithm we do not know
   (``identity``, ``gzip`` and ``deflate`` are known; the status is UNIMPLEMENTED, as the spec
   asks, and the reply advertises what we accept).
2. ``gzip`` is RFC 1952; ``deflate`` is the zlib format (RFC 1950) that gRPC implementations
   send. A raw RFC 1951 stream under ``deflate`` is accepted too, since some peers send one.
3. Caps apply to the decompressed size: decompression stops one byte past the cap, so a
   "decompression bomb" costs at most ``cap`` bytes of memory and answers RESOURCE_EXHAUSTED
   with the same message as an uncompressed message over the cap.
4. A reply is compressed only when its request was compressed with an algorithm the client
   also accepts (``grpc-accept-encoding``), or when the server is told to compress every reply
   (``grpc.compress_responses``) and the client accepts the algorithm. A client that accepts
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

_CHUNK = 1 << 20  # bytes fed to the decompressor per step


def parse_encoding(header: str | None) -> str:
    """The algorithm a ``grpc-encoding`` header names (``identity`` when absent).

    Unknown algorithms are ``Unimplemented`` naming the accepted ones (rule 1).
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
    """The algorithm a reply is sent with (rule 4)."""
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


def _inflate(data: bytes | memoryview, wbits: int, cap: int) -> bytearray:
    """Decompress ``data`` with zlib's ``wbits`` framing, never producing more than ``cap + 1``
    bytes; raises ``zlib.error`` on corrupt input and ``ResourceExhausted`` past the cap."""
    d = zlib.decompressobj(wbits)
    out = bytearray()
    view = memoryview(data)
    pos = 0
    while True:
        room = cap + 1 - len(out)
        if d.unconsumed_tail:
            piece = d.decompress(d.unconsumed_tail, room)
        elif pos < len(view):
            piece = d.decompress(view[pos : pos + _CHUNK], room)
            pos += _CHUNK
        else:
            break
        out += piece
        if len(out) > cap:
            raise _too_large(cap)
        if d.eof:
            break
    if not d.eof:
        out += d.flush()
        if len(out) > cap:
            raise _too_large(cap)
        if not d.eof:
            raise zlib.error("incomplete or truncated stream")
    return out  # no final copy: parsers take any bytes-like buffer


def decompress(data: bytes | memoryview, algorithm: str, cap: int) -> bytearray:
    """The decompressed message, at most ``cap`` bytes (rules 2 and 3).

    A corrupt payload is ``InvalidArgument``; one that inflates past ``cap`` is
    ``ResourceExhausted``; ``identity`` with the compressed flag set is ``InvalidArgument``.
    """
    if algorithm == GZIP:
        framings = (31,)
    elif algorithm == DEFLATE:
        framings = (15, -15)
    else:
        raise InvalidArgument(
            "a compressed message arrived without a grpc-encoding naming its algorithm"
        )
    last: zlib.error | None = None
    for wbits in framings:
        try:
            return _inflate(data, wbits, cap)
        except zlib.error as exc:
            last = exc
    raise InvalidArgument(f"cannot decompress the {algorithm} message: {last}")


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
    "compress",
    "decompress",
    "parse_accept_encoding",
    "parse_encoding",
    "reply_encoding",
]

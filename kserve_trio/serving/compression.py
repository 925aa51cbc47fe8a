"""gRPC message compression as the servers use it: the rules and functions of
``kserve_trio.core.compression`` (where they live so the client shares them), under the serving
layer's name."""

from __future__ import annotations

from kserve_trio.core.compression import (
    ACCEPT_ENCODING,
    ALGORITHMS,
    DEFLATE,
    GZIP,
    IDENTITY,
    compress,
    decompress,
    parse_accept_encoding,
    parse_encoding,
    reply_encoding,
)

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

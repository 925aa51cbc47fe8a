"""The one fix the ``h2`` engine keeps on h2's dependencies: a DATA frame's repr that does not
hexlify its payload.

h2 builds ``repr(frame)`` for every frame it receives, even with its logger off, and
hyperframe's repr of a DATA frame hex-encodes the whole payload before cutting the text to 20
characters (after copying the payload into a serialized body): a cost that grows with each
large frame (measured in docs/benchmarks/history.md, "The frame-repr fix").
``patch_frame_repr`` gives ``DataFrame`` a repr of its own that formats only the bytes it
shows, straight from the payload; it is idempotent, applied when the ``h2`` engine is imported,
and tested so an upgrade that changes the repr is caught.
"""

from __future__ import annotations

import binascii

import hyperframe.frame

_SHOWN_BYTES = 10


def short_hex(data: bytes | memoryview | None) -> str:
    """The first bytes of ``data`` in hex, as hyperframe's formatter shows them."""
    if not data:
        return "None"
    head = binascii.hexlify(bytes(data[:_SHOWN_BYTES])).decode("ascii")
    return f"<hex:{head}{'...' if len(data) > _SHOWN_BYTES else ''}>"


def _data_body_repr(self: hyperframe.frame.DataFrame) -> str:
    return f"data={short_hex(self.data)}"


def patch_frame_repr() -> None:
    """Give hyperframe's ``DataFrame`` the O(1) repr of this module."""
    hyperframe.frame.DataFrame._body_repr = _data_body_repr  # type: ignore[method-assign]


__all__ = ["patch_frame_repr", "short_hex"]

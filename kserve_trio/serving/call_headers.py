"""The request headers of a grpclib server call, as our handlers read them.

``grpc_server`` keeps each call's headers on grpclib's protocol stream (``request_headers``);
these helpers read them back from a grpclib server ``Stream`` or anything with its ``_stream``
(the fast path's call object). A module of its own so that the adapter, the raw handlers and
the fast path can read headers without importing the server module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Headers = Sequence[tuple[str, str]]


def request_headers(stream: Any) -> Headers:
    """The headers of the call a grpclib server ``Stream`` belongs to (empty if unknown)."""
    return getattr(stream._stream, "request_headers", ())


def header_value(stream: Any, name: str) -> str | None:
    """The first value of header ``name`` of the call, or None."""
    for key, value in request_headers(stream):
        if key == name:
            return value
    return None


__all__ = ["Headers", "header_value", "request_headers"]

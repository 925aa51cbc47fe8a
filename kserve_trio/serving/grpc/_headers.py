"""What a call's request headers say, read once when the call opens (pure functions).

- ``read_request``: the headers as text (latin-1, as HTTP/2 carries them) and the few the
  connection decides on: method, path, content type, ``te``, ``grpc-timeout`` values and
  ``grpc-encoding``.
- ``header_problem``: the headers a handler depends on, checked before any handler runs. A
  ``grpc-timeout`` that is not 1-8 digits and a unit is INVALID_ARGUMENT; a ``-bin`` value
  that is not base64 is INVALID_ARGUMENT; a ``grpc-encoding`` we cannot decode is
  UNIMPLEMENTED, answered with ``grpc-accept-encoding`` as the compression spec asks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kserve_trio.core.errors import StatusCode
from kserve_trio.core.protocol import (
    ACCEPT_ENCODING,
    IDENTITY,
    parse_encoding,
    valid_bin,
    valid_timeout,
)

Headers = Sequence[tuple[str, str]]


@dataclass(slots=True)
class RequestHead:
    """A request's headers as text and the values the connection decides on. ``checked``:
    whether any header ``header_problem`` judges is present (most requests have none but
    ``grpc-timeout``, which is judged here as it is read)."""

    headers: list[tuple[str, str]]
    method: str = ""
    path: str = ""
    content_type: str = ""
    te: str = ""
    timeouts: list[str] | None = None
    encoding: str = IDENTITY
    checked: bool = False


def read_request(raw: Sequence[tuple[bytes, bytes]]) -> RequestHead:
    """``raw`` (an engine's request headers) read once (module docstring)."""
    headers = []
    append = headers.append
    method = path = content_type = te = ""
    timeouts: list[str] | None = None
    encoding = IDENTITY
    checked = False
    for k, v in raw:
        key = k.decode("latin-1")
        value = v.decode("latin-1")
        append((key, value))
        if key[0] == ":":
            if key == ":method":
                method = value
            elif key == ":path":
                path = value
        elif key == "content-type":
            content_type = value
        elif key == "te":
            te = value
        elif key == "grpc-timeout":
            if timeouts is None:
                timeouts = []
            timeouts.append(value)
            checked = checked or not valid_timeout(value)
        elif key == "grpc-encoding":
            encoding = value
            checked = True
        elif key[-4:] == "-bin":
            checked = True
    return RequestHead(headers, method, path, content_type, te, timeouts, encoding, checked)


def header_problem(headers: Headers) -> tuple[StatusCode, str, Headers] | None:
    """What is wrong with a call's headers, as (status, message, extra trailers), or None."""
    for key, value in headers:
        if key == "grpc-timeout" and not valid_timeout(value):
            return (
                StatusCode.INVALID_ARGUMENT,
                f"malformed grpc-timeout header {value[:64]!r}: expected 1-8 digits and a unit "
                "(H, M, S, m, u, n)",
                (),
            )
        if key.endswith("-bin") and not valid_bin(value):
            return (StatusCode.INVALID_ARGUMENT, f"metadata {key[:64]} is not base64", ())
        if key == "grpc-encoding":
            try:
                parse_encoding(value)
            except Exception as exc:
                return (
                    StatusCode.UNIMPLEMENTED,
                    str(exc),
                    (("grpc-accept-encoding", ACCEPT_ENCODING),),
                )
    return None


def header_value(headers: Headers, name: str) -> str | None:
    """The first value of header ``name``, or None."""
    for key, value in headers:
        if key == name:
            return value
    return None


__all__ = ["Headers", "RequestHead", "header_problem", "header_value", "read_request"]

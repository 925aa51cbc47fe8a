"""What a call's request headers say, read once when the call opens (pure functions).

- ``header_problem``: the headers a handler depends on, checked before any handler runs. A
  ``grpc-timeout`` that is not 1-8 digits and a unit is INVALID_ARGUMENT; a ``-bin`` value
  that is not base64 is INVALID_ARGUMENT; a ``grpc-encoding`` we cannot decode is
  UNIMPLEMENTED, answered with ``grpc-accept-encoding`` as the compression spec asks.
- ``timeout_seconds``: a valid ``grpc-timeout`` as seconds.
- ``custom_metadata``: the caller's metadata as handlers see it: pseudo-headers, ``grpc-*``,
  ``te``, ``content-type`` and ``user-agent`` left out, ``-bin`` values base64-decoded to
  bytes, the first value of a repeated key kept.
"""

from __future__ import annotations

import binascii
import re
from collections.abc import Sequence

from kserve_trio.core import compression
from kserve_trio.core.errors import StatusCode

Headers = Sequence[tuple[str, str]]

_TIMEOUT_RE = re.compile(r"^[0-9]{1,8}[HMSmun]$")
_B64_RE = re.compile(r"^[A-Za-z0-9+/]*={0,2}$")
_UNIT_SECONDS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
_RESERVED = frozenset({"te", "content-type", "user-agent"})


def _b64decode(value: str) -> bytes:
    unpadded = value.rstrip("=")
    return binascii.a2b_base64(unpadded + "=" * (-len(unpadded) % 4))


def header_problem(headers: Headers) -> tuple[StatusCode, str, Headers] | None:
    """What is wrong with a call's headers, as (status, message, extra trailers), or None."""
    for key, value in headers:
        if key == "grpc-timeout" and not _TIMEOUT_RE.match(value):
            return (
                StatusCode.INVALID_ARGUMENT,
                f"malformed grpc-timeout header {value[:64]!r}: expected 1-8 digits and a unit "
                "(H, M, S, m, u, n)",
                (),
            )
        if key.endswith("-bin"):
            if not _B64_RE.match(value):
                return (StatusCode.INVALID_ARGUMENT, f"metadata {key[:64]} is not base64", ())
            try:
                _b64decode(value)
            except binascii.Error:
                return (StatusCode.INVALID_ARGUMENT, f"metadata {key[:64]} is not base64", ())
        if key == "grpc-encoding":
            try:
                compression.parse_encoding(value)
            except Exception as exc:
                return (
                    StatusCode.UNIMPLEMENTED,
                    str(exc),
                    (("grpc-accept-encoding", compression.ACCEPT_ENCODING),),
                )
    return None


def timeout_seconds(value: str) -> float:
    """A ``grpc-timeout`` value that ``header_problem`` accepted, in seconds."""
    return int(value[:-1]) * _UNIT_SECONDS[value[-1]]


def custom_metadata(headers: Headers) -> dict[str, str | bytes]:
    """The caller's custom metadata (module docstring)."""
    out: dict[str, str | bytes] = {}
    for key, value in headers:
        if key[0] == ":" or key.startswith("grpc-") or key in _RESERVED or key in out:
            continue
        out[key] = _b64decode(value) if key.endswith("-bin") else value
    return out


def header_value(headers: Headers, name: str) -> str | None:
    """The first value of header ``name``, or None."""
    for key, value in headers:
        if key == name:
            return value
    return None


__all__ = ["Headers", "custom_metadata", "header_problem", "header_value", "timeout_seconds"]

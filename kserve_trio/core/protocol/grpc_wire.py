"""The gRPC-over-HTTP/2 wire rules, written once for the server and the client.

Everything here is a pure function of header values or bytes:

- the message prefix: one flag byte (compressed or not) and a big-endian 4-byte length before
  every message (``PREFIX``, ``message_prefix``);
- ``grpc-timeout``: 1-8 digits and a unit (``H M S m u n``), parsed (``parse_timeout``) and
  written (``format_timeout``: the finest unit whose value fits, rounded up, so the server
  never gets less time than the caller gave) with one unit table;
- ``grpc-message``: UTF-8, percent-encoded outside printable ASCII, cut so a trailer block stays
  well under what clients accept (``encode_message``, ``decode_message``);
- ``-bin`` metadata: base64, sent unpadded, accepted padded or not (``encode_bin``,
  ``decode_bin``); what a handler sees of a caller's metadata (``custom_metadata``) and what a
  caller may send (``metadata_headers``);
- statuses: the trailers that end a call (``status_trailers``), and a status read from an HTTP
  status or an RST_STREAM code when a reply has no ``grpc-status`` (``status_from_http``,
  ``status_from_reset``).
"""

from __future__ import annotations

import base64
import binascii
import math
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import quote, unquote_to_bytes

from kserve_trio.core.errors import StatusCode

PREFIX = struct.Struct(">BI")
"""A message's compressed flag and length."""
PREFIX_BYTES = PREFIX.size


def message_prefix(compressed: bool, length: int) -> bytes:
    """The 5 bytes before a message of ``length`` bytes."""
    return PREFIX.pack(1 if compressed else 0, length)


# ---------------------------------------------------------------- grpc-timeout

_UNIT_SECONDS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
_FINEST_FIRST = ("n", "u", "m", "S", "M", "H")
_MAX_TIMEOUT_VALUE = 99_999_999


def valid_timeout(value: str) -> bool:
    """Whether ``value`` is a well-formed ``grpc-timeout`` (1-8 digits and a unit)."""
    return (
        2 <= len(value) <= 9
        and value[-1] in _UNIT_SECONDS
        and value[:-1].isdigit()
        and value.isascii()
    )


def parse_timeout(value: str) -> float:
    """A ``grpc-timeout`` value in seconds; ValueError when it is malformed."""
    if not valid_timeout(value):
        raise ValueError(
            f"malformed grpc-timeout header {value[:64]!r}: expected 1-8 digits and a unit "
            "(H, M, S, m, u, n)"
        )
    return int(value[:-1]) * _UNIT_SECONDS[value[-1]]


def format_timeout(seconds: float) -> str:
    """The ``grpc-timeout`` value for ``seconds`` (module docstring); ValueError unless
    positive."""
    if not seconds > 0:
        raise ValueError(f"a grpc-timeout must be positive, got {seconds!r}")
    for unit in _FINEST_FIRST:
        value = math.ceil(seconds / _UNIT_SECONDS[unit])
        if value <= _MAX_TIMEOUT_VALUE:
            return f"{value}{unit}"
    return f"{_MAX_TIMEOUT_VALUE}H"


# ---------------------------------------------------------------- grpc-message

# Printable ASCII except '%' goes unescaped in grpc-message (the gRPC HTTP/2 mapping's rule).
_UNESCAPED = "".join(chr(c) for c in range(0x20, 0x7F) if c != 0x25)

MAX_MESSAGE_CHARS = 1024
"""A status message longer than this is cut (with a note): a message may echo client input, and
an unbounded trailer costs the event loop time to encode and the client its header budget."""
MAX_MESSAGE_BYTES = 4096
"""The most a ``grpc-message`` value may take once percent-encoded: a character outside
printable ASCII takes up to 12 bytes, and grpc-core clients refuse a trailer block over 8 KiB
(tritonclient would see RESOURCE_EXHAUSTED instead of the status sent)."""


def encode_message(message: str) -> str:
    """``message`` as a ``grpc-message`` value: cut to ``MAX_MESSAGE_CHARS``, UTF-8,
    percent-encoded, and cut further until the encoding fits ``MAX_MESSAGE_BYTES``."""
    total = len(message)
    keep = min(total, MAX_MESSAGE_CHARS)
    while True:
        cut = message if keep == total else message[:keep] + f"... ({total} characters)"
        encoded = quote(cut, safe=_UNESCAPED, encoding="utf-8", errors="replace")
        if len(encoded) <= MAX_MESSAGE_BYTES:
            return encoded
        keep //= 2


def decode_message(value: str | bytes) -> str:
    """A ``grpc-message`` value back as text (invalid escapes kept, bad UTF-8 replaced)."""
    return unquote_to_bytes(value).decode("utf-8", "replace")


# ---------------------------------------------------------------- metadata

_B64_RE = re.compile(r"^[A-Za-z0-9+/]*={0,2}$")
_NOT_METADATA = frozenset({"te", "content-type", "user-agent"})
"""Request headers that are the protocol's, not the caller's metadata."""
_RESERVED_KEYS = frozenset({"content-type", "te", "host", "user-agent", "connection"})
"""Keys a caller may not send as metadata (besides pseudo-headers and ``grpc-*``)."""


def valid_bin(value: str) -> bool:
    """Whether a ``-bin`` header value is base64 (padded or not)."""
    if not _B64_RE.match(value):
        return False
    try:
        decode_bin(value)
    except binascii.Error:
        return False
    return True


def decode_bin(value: str | bytes) -> bytes:
    """A ``-bin`` header value's bytes (padding optional)."""
    text = value.decode("ascii") if isinstance(value, bytes) else value
    unpadded = text.rstrip("=")
    return binascii.a2b_base64(unpadded + "=" * (-len(unpadded) % 4))


def encode_bin(value: bytes) -> bytes:
    """Bytes as a ``-bin`` header value (unpadded base64)."""
    return base64.b64encode(value).rstrip(b"=")


def custom_metadata(headers: Sequence[tuple[str, str]]) -> dict[str, str | bytes]:
    """The caller's metadata as a handler sees it: pseudo-headers, ``grpc-*``, ``te``,
    ``content-type`` and ``user-agent`` left out, ``-bin`` values decoded to bytes, the first
    value of a repeated key kept."""
    out: dict[str, str | bytes] = {}
    for key, value in headers:
        if key[0] == ":" or key.startswith("grpc-") or key in _NOT_METADATA or key in out:
            continue
        out[key] = decode_bin(value) if key.endswith("-bin") else value
    return out


def metadata_headers(metadata: Mapping[str, Any]) -> list[tuple[bytes, bytes]]:
    """Caller metadata as header pairs: keys lowercased; ``-bin`` keys carry bytes (sent
    base64); other values must be printable ASCII. Reserved names raise ``ValueError``."""
    out = []
    for key, value in metadata.items():
        name = str(key).lower()
        if (
            not name
            or name.startswith((":", "grpc-"))
            or name in _RESERVED_KEYS
            or not all(c.isalnum() or c in "-_." for c in name)
            or not name.isascii()
        ):
            raise ValueError(f"invalid or reserved metadata key {key!r}")
        if name.endswith("-bin"):
            raw = value.encode() if isinstance(value, str) else bytes(value)
            encoded = encode_bin(raw)
        else:
            if not isinstance(value, str) or not all(" " <= c <= "~" for c in value):
                raise ValueError(f"metadata {key!r} needs a printable ASCII string value")
            encoded = value.encode("ascii")
        out.append((name.encode("ascii"), encoded))
    return out


# ---------------------------------------------------------------- statuses

CONTENT_TYPE = b"application/grpc+proto"
RESPONSE_HEADERS: list[tuple[bytes, bytes]] = [
    (b":status", b"200"),
    (b"content-type", CONTENT_TYPE),
]
OK_TRAILERS: list[tuple[bytes, bytes]] = [(b"grpc-status", b"0")]


def status_trailers(
    status: StatusCode | int,
    message: str = "",
    extra: Iterable[tuple[str, str]] = (),
    *,
    trailers_only: bool = False,
) -> list[tuple[bytes, bytes]]:
    """The header block that ends a call with ``status``: trailers after a reply's headers,
    or (``trailers_only``) a whole response when nothing was sent before it."""
    block = list(RESPONSE_HEADERS) if trailers_only else []
    block.append((b"grpc-status", str(int(status)).encode("ascii")))
    if message:
        block.append((b"grpc-message", encode_message(message).encode("ascii")))
    for key, value in extra:
        block.append((key.encode("latin-1"), value.encode("latin-1")))
    return block


_RESET_STATUS = {
    0x8: StatusCode.CANCELLED,
    0xB: StatusCode.RESOURCE_EXHAUSTED,
    0xC: StatusCode.PERMISSION_DENIED,
    0x7: StatusCode.UNAVAILABLE,
}
_HTTP_STATUS = {
    400: StatusCode.INTERNAL,
    401: StatusCode.UNAUTHENTICATED,
    403: StatusCode.PERMISSION_DENIED,
    404: StatusCode.UNIMPLEMENTED,
    429: StatusCode.UNAVAILABLE,
    502: StatusCode.UNAVAILABLE,
    503: StatusCode.UNAVAILABLE,
    504: StatusCode.UNAVAILABLE,
}


def status_from_http(code: int) -> StatusCode:
    """gRPC's mapping of an HTTP status to a status code, for replies without ``grpc-status``."""
    return _HTTP_STATUS.get(code, StatusCode.UNKNOWN)


def status_from_reset(error_code: int) -> StatusCode:
    """The status of a call whose stream the server reset (gRPC's HTTP/2 error mapping:
    CANCEL, ENHANCE_YOUR_CALM, INADEQUATE_SECURITY, REFUSED_STREAM; anything else INTERNAL)."""
    return _RESET_STATUS.get(error_code, StatusCode.INTERNAL)


__all__ = [
    "CONTENT_TYPE",
    "MAX_MESSAGE_BYTES",
    "MAX_MESSAGE_CHARS",
    "OK_TRAILERS",
    "PREFIX",
    "PREFIX_BYTES",
    "RESPONSE_HEADERS",
    "custom_metadata",
    "decode_bin",
    "decode_message",
    "encode_bin",
    "encode_message",
    "format_timeout",
    "message_prefix",
    "metadata_headers",
    "parse_timeout",
    "status_from_http",
    "status_from_reset",
    "status_trailers",
    "valid_bin",
    "valid_timeout",
]

"""The one mapping from exceptions to gRPC statuses, and how a status message travels.

Every call of every server ends through ``status_of``: our ``ServingError`` family carries its
status, ``GrpcError`` carries any status a handler wants to send (test servers, proxies passing
a worker's status through), ``TimeoutError`` is DEADLINE_EXCEEDED, an exception group holding
one exception is that exception, and anything else is a bug: INTERNAL, logged once with its
traceback as a field of the JSON event (never as plain text).
"""

from __future__ import annotations

from urllib.parse import quote, unquote

from kserve_trio.core.errors import ServingError, StatusCode
from kserve_trio.core.logging import get_logger

log = get_logger("kserve_trio.serving.grpc")

# Printable ASCII except '%' goes unescaped in grpc-message (the gRPC HTTP/2 mapping's rule).
_UNESCAPED = "".join(chr(c) for c in range(0x20, 0x7F) if c != 0x25)

MAX_MESSAGE_CHARS = 1024
"""A status message longer than this is cut (with a note): a message may echo client input, and
an unbounded trailer costs the event loop time to encode and the client its header budget."""
MAX_MESSAGE_BYTES = 4096
"""The most a ``grpc-message`` value may take once percent-encoded: a character outside
printable ASCII takes up to 12 bytes, and grpc-core clients refuse a trailer block over 8 KiB
(tritonclient would see RESOURCE_EXHAUSTED instead of the status sent)."""


class GrpcError(ServingError):
    """A call's end with an explicit status, for handlers that choose it themselves."""

    def __init__(self, status: StatusCode | int, message: str = "") -> None:
        super().__init__(message)
        self.status = StatusCode(int(status))


def _single(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def status_of(exc: BaseException, *, rpc: str = "", request_id: str = "") -> tuple[StatusCode, str]:
    """``(status, message)`` for an exception that ends a call (see the module docstring)."""
    exc = _single(exc)
    if isinstance(exc, ServingError):
        return exc.status, exc.message
    if isinstance(exc, TimeoutError):
        return StatusCode.DEADLINE_EXCEEDED, str(exc) or "deadline exceeded"
    log.error(
        "request_failed_unexpectedly", rpc=rpc, request_id=request_id, error=repr(exc), exc_info=exc
    )
    return StatusCode.INTERNAL, f"internal error: {exc!r}"


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


def decode_message(value: str) -> str:
    """A ``grpc-message`` value back as text (invalid escapes kept, bad UTF-8 replaced)."""
    return unquote(value, encoding="utf-8", errors="replace")


__all__ = [
    "MAX_MESSAGE_BYTES",
    "MAX_MESSAGE_CHARS",
    "GrpcError",
    "decode_message",
    "encode_message",
    "status_of",
]

"""A request body as it arrives, held under the server's body cap.

The cap (``max_body_bytes``: the gRPC receive cap on the REST ports) is enforced while the body
is read, never after: a ``Content-Length`` over it is refused before a byte of the body is read,
a chunked body is counted as it arrives and refused the moment it passes the cap, and what was
kept of it is dropped then. A body that arrives in one piece is kept as that piece; a longer one
is appended to one ``bytearray`` (grown in place: no list of pieces joined at the end, so a
body costs about its own size, not twice). A decompressed body has the same cap on its output
(``serving.rest_routes.request_body``). The refusal is 413 Payload Too Large with the gRPC
message, ``received message larger than max (N vs. M)``, and the connection closes.
"""

from __future__ import annotations

from kserve_trio.core.errors import ServingError, StatusCode


class PayloadTooLarge(ServingError):
    """A request body (as sent, or decompressed) over the body cap: HTTP 413, and
    RESOURCE_EXHAUSTED where a gRPC status is read from it."""

    status = StatusCode.RESOURCE_EXHAUSTED
    http_status = 413


def too_large(size: int | None, cap: int) -> PayloadTooLarge:
    """The refusal of a body of ``size`` bytes (``None``: more than the cap, size unknown)."""
    shown = f"{size}" if size is not None else f"more than {cap}"
    return PayloadTooLarge(f"received message larger than max ({shown} vs. {cap})")


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


__all__ = ["BodyBuffer", "PayloadTooLarge", "too_large"]

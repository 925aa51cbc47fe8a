"""HTTP statuses for the project's error family, and the JSON error body (pure).

One table maps a gRPC status to the HTTP status a REST client gets for the same fault, so a
fault has one message and one status family on both transports. The body is
``{"error": "<message>"}``: the message is the one the gRPC status would carry.
"""

from __future__ import annotations

import json

from kserve_trio.core.errors import ServingError, StatusCode

HTTP_STATUS: dict[StatusCode, int] = {
    StatusCode.INVALID_ARGUMENT: 400,
    StatusCode.FAILED_PRECONDITION: 400,
    StatusCode.OUT_OF_RANGE: 400,
    StatusCode.NOT_FOUND: 404,
    StatusCode.ALREADY_EXISTS: 409,
    StatusCode.PERMISSION_DENIED: 403,
    StatusCode.UNAUTHENTICATED: 401,
    StatusCode.RESOURCE_EXHAUSTED: 429,
    StatusCode.CANCELLED: 499,
    StatusCode.UNIMPLEMENTED: 501,
    StatusCode.UNAVAILABLE: 503,
    StatusCode.DEADLINE_EXCEEDED: 504,
}
"""gRPC status -> HTTP status; anything not listed (INTERNAL, UNKNOWN, ...) is 500."""

REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    413: "Payload Too Large",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    499: "Client Closed Request",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}

JSON_TYPE = "application/json"


def http_status(code: StatusCode) -> int:
    """The HTTP status for a gRPC status code (500 when the table has none)."""
    return HTTP_STATUS.get(code, 500)


def grpc_status(http: int) -> StatusCode:
    """The gRPC status a REST error status stands for (the table read backwards; 500 and
    anything unknown is INTERNAL; 400 is INVALID_ARGUMENT)."""
    if http == 400:
        return StatusCode.INVALID_ARGUMENT
    for code, status in HTTP_STATUS.items():
        if status == http:
            return code
    return StatusCode.INTERNAL


def error_body(message: str) -> bytes:
    """``{"error": message}`` as UTF-8 JSON."""
    return json.dumps({"error": message}).encode()


def error_of(exc: BaseException) -> tuple[int, str]:
    """(HTTP status, message) for an exception: a ``ServingError`` by its status, a
    ``TimeoutError`` as DEADLINE_EXCEEDED, anything else 500 ``internal error: ...``."""
    if isinstance(exc, ServingError):
        override = getattr(exc, "http_status", None)  # an HTTP-only fault (405)
        return override or http_status(exc.status), exc.message
    if isinstance(exc, TimeoutError):
        return 504, str(exc) or "deadline exceeded"
    return 500, f"internal error: {exc!r}"


__all__ = [
    "HTTP_STATUS",
    "JSON_TYPE",
    "REASONS",
    "error_body",
    "error_of",
    "grpc_status",
    "http_status",
]

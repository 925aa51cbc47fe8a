"""The one mapping from exceptions to gRPC statuses.

Every call of every server ends through ``status_of``: our ``ServingError`` family carries its
status, ``GrpcError`` carries any status a handler wants to send (test servers, proxies passing
a worker's status through), ``TimeoutError`` is DEADLINE_EXCEEDED, an exception group holding
one exception is that exception, and anything else is a bug: INTERNAL, logged once with its
traceback as a field of the JSON event (never as plain text).
"""

from __future__ import annotations

from kserve_trio.core.errors import ServingError, StatusCode
from kserve_trio.core.logging import get_logger

log = get_logger("kserve_trio.serving.grpc")


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


__all__ = ["GrpcError", "status_of"]

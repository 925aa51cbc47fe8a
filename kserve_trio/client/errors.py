"""The client's exceptions: what a call to a KServe V2 endpoint can fail with.

``RpcError`` is every failed RPC, local or remote, with its gRPC ``status``: the server's own
status and message when it answered, or the status the client assigns to a failure it saw itself
(``UNAVAILABLE`` when the connection could not be made or was lost, ``DEADLINE_EXCEEDED`` when the
budget ran out, ``RESOURCE_EXHAUSTED`` when a message is over the size cap). It subclasses the
core ``ServingError`` so one ``except`` covers both sides of the wire.

The shared-memory transport adds two failures of its own: ``SharedMemoryUnavailable``
(``shared_memory="on"`` against a server in another IPC namespace: a hard error, no fall-back)
and ``ShmUnrecoverableError`` (re-registering a stale region failed, or the region went stale
again: the endpoint is latched to inline transport). ``IOValidationError`` is what
``validate_io`` raises; its message names the tensor.
"""

from __future__ import annotations

from kserve_trio.core.errors import ServingError, StatusCode

STALE_REGION_PREFIX = "unregistered shared memory region"
"""The one message prefix that means "re-register your region"."""


class RpcError(ServingError):
    """A failed call: ``status`` (a ``StatusCode``), the server's or the client's ``message``,
    and the ``method`` that failed (e.g. ``"ModelInfer"``)."""

    def __init__(
        self, status: StatusCode, message: str, *, method: str = "", retryable: bool | None = None
    ) -> None:
        super().__init__(message)
        self.status = StatusCode(status)
        self.method = method
        self.retryable = retryable  # False: the client knows another attempt cannot succeed

    def __str__(self) -> str:
        where = f" ({self.method})" if self.method else ""
        return f"{self.status.name}{where}: {self.message}"

    def __reduce__(self):  # keep pickling (e.g. across processes) working with keyword args
        return (
            _rebuild_rpc_error,
            (int(self.status), self.message, self.method, self.retryable),
        )


def _rebuild_rpc_error(status: int, message: str, method: str, retryable: bool | None) -> RpcError:
    return RpcError(StatusCode(status), message, method=method, retryable=retryable)


def is_stale_registration(exc: BaseException) -> bool:
    """Whether ``exc`` says the server lost our shared-memory registration.

    Only a FAILED_PRECONDITION whose message starts with ``unregistered shared memory region`` is
    that signal; every other FAILED_PRECONDITION (``model 'm' is not
    resident``) means what it says and fails fast.
    """
    return (
        isinstance(exc, RpcError)
        and exc.status is StatusCode.FAILED_PRECONDITION
        and exc.message.startswith(STALE_REGION_PREFIX)
    )


class SharedMemoryUnavailable(RuntimeError):
    """``shared_memory="on"`` but the server cannot map this client's shared memory."""


class ShmUnrecoverableError(RuntimeError):
    """A stale registration could not be repaired; the endpoint falls back to inline."""


class IOValidationError(ValueError):
    """``validate_io`` found a mismatch between an ``InferenceIO`` and the model's I/O spec."""


__all__ = [
    "STALE_REGION_PREFIX",
    "IOValidationError",
    "RpcError",
    "SharedMemoryUnavailable",
    "ShmUnrecoverableError",
    "is_stale_registration",
]

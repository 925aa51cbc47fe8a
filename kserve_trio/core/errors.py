"""The status-carrying exception family.

Every error that can reach a client carries its gRPC status code, so the server layer maps
exceptions to statuses in one place (``serving.grpc.status_of``). ``StatusCode`` mirrors the gRPC code numbers without
importing any gRPC library, so this module stays importable by every layer.
"""

from __future__ import annotations

import enum


class StatusCode(enum.IntEnum):
    """gRPC status codes (the numbers of the gRPC spec and of ``grpc.StatusCode``)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class ServingError(Exception):
    """Base of every error that maps to a gRPC status; ``status`` says which."""

    status: StatusCode = StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(ServingError):
    """Malformed or mismatching request data (INVALID_ARGUMENT)."""

    status = StatusCode.INVALID_ARGUMENT


class NotFound(ServingError):
    """Unknown model, or a model that was unloaded (NOT_FOUND)."""

    status = StatusCode.NOT_FOUND


class FailedPrecondition(ServingError):
    """The request is well formed but the server state forbids it (FAILED_PRECONDITION).

    A message starting with ``unregistered shared memory region`` is the client's one signal to
    re-register its region; every other use means what it says.
    """

    status = StatusCode.FAILED_PRECONDITION


class UnregisteredRegionError(FailedPrecondition):
    """A request named a shared-memory region that is not (or no longer) registered."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unregistered shared memory region: {name}")
        self.region = name


class PermissionDenied(ServingError):
    """A restricted protocol called without its header (PERMISSION_DENIED; REST 403)."""

    status = StatusCode.PERMISSION_DENIED


class ResourceExhausted(ServingError):
    """Queue full, concurrency cap reached or message too large (RESOURCE_EXHAUSTED)."""

    status = StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(ServingError):
    """The request's deadline passed before work could start (DEADLINE_EXCEEDED).

    Raised at dispatch admission and before a meta model's sub-call; never interrupts a running
    execution.
    """

    status = StatusCode.DEADLINE_EXCEEDED

    def __init__(self, model_name: str, message: str | None = None) -> None:
        super().__init__(message or f"deadline exceeded before dispatch for model '{model_name}'")
        self.model_name = model_name


class Unavailable(ServingError):
    """Shutting down, or no replica can take the request (UNAVAILABLE)."""

    status = StatusCode.UNAVAILABLE


class Unimplemented(ServingError):
    """An RPC or feature this server does not provide (UNIMPLEMENTED)."""

    status = StatusCode.UNIMPLEMENTED


class Internal(ServingError):
    """An execution failure or a bug (INTERNAL)."""

    status = StatusCode.INTERNAL


class ConfigError(ValueError):
    """An invalid configuration; ``path`` is the YAML path of the offending key (may be empty)."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path
        self.message = message


class BundleError(ValueError):
    """A bundle that cannot be served; the message names the bundle directory and the rule."""


class ManifestError(BundleError):
    """A ``manifest.yaml`` that breaks a parsing or validation rule."""


class PoolAcquireTimeout(TimeoutError):
    """A deadline passed before ``span`` contiguous buffer-pool slots became free."""

    def __init__(self, span: int, waited_ns: int) -> None:
        super().__init__(
            f"buffer pool: no {span} contiguous free slot(s) within the deadline "
            f"(waited {waited_ns / 1e9:.3f}s)"
        )
        self.span = span
        self.waited_ns = waited_ns


__all__ = [
    "BundleError",
    "ConfigError",
    "DeadlineExceeded",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "ManifestError",
    "NotFound",
    "PermissionDenied",
    "PoolAcquireTimeout",
    "ResourceExhausted",
    "ServingError",
    "StatusCode",
    "Unavailable",
    "Unimplemented",
    "UnregisteredRegionError",
]

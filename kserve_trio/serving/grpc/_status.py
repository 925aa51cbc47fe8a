"""``GrpcError``: a call's end with a status its handler chose.

Every call of every server ends through ``rpc_codec.status_of``, the one mapping from
exceptions to statuses; ``GrpcError`` is the ``ServingError`` that carries any status (test
servers, proxies passing a worker's status through, a front end passing its device process's).
"""

from __future__ import annotations

from kserve_trio.core.errors import ServingError, StatusCode


class GrpcError(ServingError):
    """A call's end with an explicit status, for handlers that choose it themselves."""

    def __init__(self, status: StatusCode | int, message: str = "") -> None:
        super().__init__(message)
        self.status = StatusCode(int(status))


__all__ = ["GrpcError"]

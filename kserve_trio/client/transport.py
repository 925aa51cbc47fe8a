"""The interface every client transport implements, and the one we ship.

The ``Transport`` protocol is one unary call,
``await transport.unary(method, request, reply_type, timeout=..., metadata=...)``, that returns
the reply message or raises ``RpcError``. ``h2_transport`` (anyio streams + h2, on asyncio and
trio) implements it; ``default_transport_factory`` makes one for the running event loop. A
grpclib-based transport existed until it measured slower than the h2 one on every
configuration (docs/benchmarks/history.md, "Trio transport"), so there is one transport to
keep right.
Targets, caps and method paths live in ``endpoint`` and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

import sniffio

from kserve_trio.client.endpoint import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ENV_MAX_RECV,
    ENV_MAX_SEND,
    SERVICE,
    Endpoint,
    method_path,
    parse_url,
    resolve_message_cap,
)
from kserve_trio.client.h2_transport import H2Transport

R = TypeVar("R")


class Transport(Protocol):
    """One connection (or connection pool) to an endpoint, bound to one event loop.

    ``unary`` sends ``request`` (a betterproto2 message, or any object whose ``bytes()`` is the
    serialized message) to ``method`` (a full path, see
    ``method_path``) and returns the parsed ``reply_type`` message. Every failure is an
    ``RpcError``: the server's status, or UNAVAILABLE (connect failed, connection lost),
    DEADLINE_EXCEEDED (``timeout`` seconds passed; ``None`` = no limit) or RESOURCE_EXHAUSTED (a
    message over the endpoint's caps). ``timeout`` is also sent to the server as ``grpc-timeout``.
    """

    endpoint: Endpoint

    async def unary(
        self,
        method: str,
        request: Any,
        reply_type: type[R],
        *,
        timeout: float | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> R: ...

    async def aclose(self) -> None:
        """Close the connection from its own event loop."""
        ...

    def close(self) -> None:
        """Close from any thread, best effort (the loop may already be gone)."""
        ...


TransportFactory = Callable[[Endpoint], Transport]


def default_transport_factory(endpoint: Endpoint) -> Transport:
    """The transport for the running async library: the h2 transport, on asyncio and trio."""
    library = sniffio.current_async_library()
    if library in ("asyncio", "trio"):
        return H2Transport(endpoint)
    raise RuntimeError(
        f"no kserve_trio client transport for {library}: asyncio and trio are supported "
        "(pass transport_factory= to KServeModel to supply one)"
    )


__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "ENV_MAX_RECV",
    "ENV_MAX_SEND",
    "SERVICE",
    "Endpoint",
    "Transport",
    "TransportFactory",
    "default_transport_factory",
    "method_path",
    "parse_url",
    "resolve_message_cap",
]

"""Where a client talks to, and the interface every transport implements.

This module owns the pure pieces of reaching an endpoint: parsing a target (``host:port``,
``grpc://host:port``, ``("host", 8001)``) into an ``Endpoint``, the message-size caps and their
environment variables, the RPC method paths, and the ``Transport`` protocol: one unary call,
``await transport.unary(method, request, reply_type, timeout=..., metadata=...)``, that returns
the reply message or raises ``RpcError``. Two transports implement it: ``h2_transport`` (anyio
streams + h2, asyncio and trio) and ``grpclib_transport`` (asyncio only);
``default_transport_factory`` picks one for the running event loop.
"""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

DEFAULT_MAX_MESSAGE_BYTES = 512 << 20
"""Default cap on one gRPC message each way (matches the worker and gateway)."""

ENV_MAX_SEND = "KSERVE_TRIO_CLIENT_GRPC_MAX_SEND_MSG_BYTES"
ENV_MAX_RECV = "KSERVE_TRIO_CLIENT_GRPC_MAX_RECV_MSG_BYTES"
ENV_TRANSPORT = "KSERVE_TRIO_CLIENT_TRANSPORT"
"""``h2`` or ``grpclib``: the transport ``default_transport_factory`` uses on asyncio."""
ASYNCIO_TRANSPORT = "h2"
"""The asyncio default, the one that measured faster (docs/benchmarks.md, "Trio transport")."""

SERVICE = "/inference.GRPCInferenceService/"


def method_path(rpc: str) -> str:
    """The HTTP/2 path of an ``inference.GRPCInferenceService`` RPC, e.g. ``ModelInfer``."""
    return SERVICE + rpc


_URL_RE = re.compile(
    r"^(?:(?P<scheme>[a-z][a-z0-9+.-]*)://)?(?P<host>\[[^\]]*\]|[^:/\[\]]+):(?P<port>[0-9]+)/?$"
)
_SCHEMES = {"grpc": False, "http": False, "grpcs": True, "https": True}


def _bad_url(url: str) -> ValueError:
    return ValueError(f"invalid gRPC URL '{url}'; expected [grpc[s]|http[s]://]host:port")


def parse_url(url: str) -> tuple[str, int, bool]:
    """``(host, port, secure)`` of ``host:port`` or ``scheme://host:port``.

    Rules:
    1. The URL is stripped and lowercased.
    2. The scheme, when given, is one of ``grpc``, ``http`` (plain) or ``grpcs``, ``https``
       (TLS); no scheme means plain.
    3. The host is a name, an IPv4 address or a bracketed IPv6 address (brackets removed).
    4. The port parses as an integer in ``[1, 65535]``.
    Anything else raises ``ValueError("invalid gRPC URL '...'; expected
    [grpc[s]|http[s]://]host:port")``.
    """
    text = url.strip().lower() if isinstance(url, str) else ""
    m = _URL_RE.match(text)
    if not m:
        raise _bad_url(url)
    scheme = m.group("scheme")
    if scheme is not None and scheme not in _SCHEMES:
        raise _bad_url(url)
    host = m.group("host")
    if host.startswith("["):
        host = host[1:-1]
    port = int(m.group("port"))
    if not host or not 0 < port < 65536:
        raise _bad_url(url)
    return host, port, _SCHEMES.get(scheme or "grpc", False)


def resolve_message_cap(
    value: int | None, env_var: str, environ: Mapping[str, str] | None = None
) -> int:
    """A message cap: the keyword when given, else the environment variable, else 512 MiB.

    A cap must be a positive integer; a malformed environment value is a ``ValueError`` naming
    the variable rather than a silent default.
    """
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"message size cap must be a positive integer, got {value!r}")
        return value
    env = os.environ if environ is None else environ
    raw = env.get(env_var, "").strip()
    if not raw:
        return DEFAULT_MAX_MESSAGE_BYTES
    try:
        parsed = int(raw)
    except ValueError:
        raise ValueError(f"{env_var}={raw!r} is not an integer number of bytes") from None
    if parsed <= 0:
        raise ValueError(f"{env_var}={raw!r} must be a positive number of bytes")
    return parsed


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One server address and the per-connection options a transport needs; ``ssl_context``
    is how a secure endpoint is reached (``None``: the system's CAs, no client certificate)."""

    host: str
    port: int
    secure: bool = False
    max_send_message_length: int = DEFAULT_MAX_MESSAGE_BYTES
    max_receive_message_length: int = DEFAULT_MAX_MESSAGE_BYTES
    ssl_context: ssl.SSLContext | None = field(default=None, compare=False, repr=False)

    @property
    def key(self) -> tuple[str, int]:
        """What identifies the server (shared-memory registrations are per server)."""
        return (self.host, self.port)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


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


def asyncio_transport_name(environ: Mapping[str, str] | None = None) -> str:
    """``ASYNCIO_TRANSPORT`` unless ``KSERVE_TRIO_CLIENT_TRANSPORT`` says ``h2``/``grpclib``."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_TRANSPORT, "").strip().lower()
    if not raw:
        return ASYNCIO_TRANSPORT
    if raw not in ("h2", "grpclib"):
        raise ValueError(f"{ENV_TRANSPORT}={raw!r}: expected 'h2' or 'grpclib'")
    return raw


def default_transport_factory(endpoint: Endpoint) -> Transport:
    """The transport for the running async library: the h2 transport on trio; on asyncio
    ``asyncio_transport_name()`` (grpclib or h2)."""
    import sniffio

    library = sniffio.current_async_library()
    if library == "asyncio" and asyncio_transport_name() == "grpclib":
        from kserve_trio.client.grpclib_transport import GrpclibTransport

        return GrpclibTransport(endpoint)
    if library in ("asyncio", "trio"):
        from kserve_trio.client.h2_transport import H2Transport

        return H2Transport(endpoint)
    raise RuntimeError(
        f"no kserve_trio client transport for {library}: asyncio and trio are supported "
        "(pass transport_factory= to KServeModel to supply one)"
    )


__all__ = [
    "ASYNCIO_TRANSPORT",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "ENV_MAX_RECV",
    "ENV_MAX_SEND",
    "ENV_TRANSPORT",
    "SERVICE",
    "Endpoint",
    "Transport",
    "TransportFactory",
    "asyncio_transport_name",
    "default_transport_factory",
    "method_path",
    "parse_url",
    "resolve_message_cap",
]

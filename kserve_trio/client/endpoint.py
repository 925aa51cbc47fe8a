"""Where a client talks to: targets, message caps and RPC paths (pure, no I/O).

This module owns parsing a target (``host:port``, ``grpc://host:port``, ``("host", 8001)``) into
an ``Endpoint``, the message-size caps and their environment variables, the request compression
option, and the RPC method paths. The transport (``h2_transport``) and its face (``transport``) stand on it.
"""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field

from kserve_trio.core.process import with_upstream_aliases
from kserve_trio.http2 import DEFAULT_ENGINE, check_engine

DEFAULT_MAX_MESSAGE_BYTES = 512 << 20
"""Default cap on one gRPC message each way (matches the worker and gateway)."""

ENV_MAX_SEND = "KSERVE_TRIO_CLIENT_GRPC_MAX_SEND_MSG_BYTES"
ENV_MAX_RECV = "KSERVE_TRIO_CLIENT_GRPC_MAX_RECV_MSG_BYTES"
ENV_HTTP2_ENGINE = "KSERVE_TRIO_CLIENT_HTTP2_ENGINE"
"""The HTTP/2 engine of clients that do not name one (``ngh2`` when unset)."""

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
    """A message cap: the keyword when given, else the environment variable (or its upstream
    ``REACTANT_*`` alias, ``core.process.upstream_env``), else 512 MiB.

    A cap must be a positive integer; a malformed environment value is a ``ValueError`` naming
    the variable rather than a silent default.
    """
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"message size cap must be a positive integer, got {value!r}")
        return value
    env = with_upstream_aliases(os.environ if environ is None else environ)
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


COMPRESSIONS = ("gzip", "deflate")
"""The ``grpc-encoding`` algorithms a client may compress its requests with."""


def check_compression(value: str | None) -> str | None:
    """``None`` (no compression), ``"gzip"`` or ``"deflate"``; anything else is a
    ``ValueError`` listing them."""
    if value is None or value in COMPRESSIONS:
        return value
    raise ValueError(f"compression must be None, 'gzip' or 'deflate', got {value!r}")


def resolve_http2_engine(value: str | None) -> str:
    """The HTTP/2 engine a client runs: ``value``, else ``KSERVE_TRIO_CLIENT_HTTP2_ENGINE``,
    else the default (``kserve_trio.http2.DEFAULT_ENGINE``); ``ValueError`` for a name that is
    none of ``ENGINES``."""
    return check_engine(value or os.environ.get(ENV_HTTP2_ENGINE) or DEFAULT_ENGINE)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One server address and the per-connection options a transport needs; ``ssl_context``
    is how a secure endpoint is reached (``None``: the system's CAs, no client certificate);
    ``compression`` the ``grpc-encoding`` every request message is compressed with (``None``:
    none); ``http2_engine`` the HTTP/2 engine its connections run (``resolve_http2_engine``)."""

    host: str
    port: int
    secure: bool = False
    max_send_message_length: int = DEFAULT_MAX_MESSAGE_BYTES
    max_receive_message_length: int = DEFAULT_MAX_MESSAGE_BYTES
    ssl_context: ssl.SSLContext | None = field(default=None, compare=False, repr=False)
    compression: str | None = None
    http2_engine: str = field(default_factory=lambda: resolve_http2_engine(None))

    def __post_init__(self) -> None:
        check_compression(self.compression)
        check_engine(self.http2_engine)

    @property
    def key(self) -> tuple[str, int]:
        """What identifies the server (shared-memory registrations are per server)."""
        return (self.host, self.port)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


__all__ = [
    "COMPRESSIONS",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "ENV_HTTP2_ENGINE",
    "ENV_MAX_RECV",
    "ENV_MAX_SEND",
    "SERVICE",
    "Endpoint",
    "check_compression",
    "method_path",
    "parse_url",
    "resolve_http2_engine",
    "resolve_message_cap",
]

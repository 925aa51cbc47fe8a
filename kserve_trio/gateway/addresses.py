"""``host:port`` text: parsing, formatting and IP-literal checks for the gateway's addresses.

The configuration's ``listen.*``, ``endpoints`` and ``worker_metrics`` entries and the worker
labels all use the one form ``host:port`` (an IPv6 host in brackets), so the parser and the
formatter live here, below both the configuration and discovery.
"""

from __future__ import annotations

import ipaddress
import re

_NAME_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")


def is_ip_literal(host: str) -> bool:
    """Whether ``host`` is an IPv4 or IPv6 address (no brackets), not a name to resolve."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def parse_host_port(text: str, *, allow_port_zero: bool = False) -> tuple[str, int]:
    """``(host, port)`` of ``host:port`` / ``[v6]:port``; ``ValueError`` says what is wrong.

    Rules:
    1. Surrounding whitespace is ignored; there is no scheme (``grpc://`` is an error).
    2. An IPv6 host is written in brackets (``[::1]:8001``) and returned without them; it must
       be a valid IPv6 address.
    3. Any other host is an IPv4 address or a DNS name (letters, digits, ``-``, ``_``, ``.``).
    4. The port is decimal, in ``1..65535`` (``0..65535`` with ``allow_port_zero``: a listen
       address may ask for an ephemeral port).
    """
    if not isinstance(text, str):
        raise ValueError(f"expected 'host:port', got {text!r}")
    value = text.strip()
    if "://" in value:
        raise ValueError(f"expected 'host:port' without a scheme, got {text!r}")
    if value.startswith("["):
        close = value.find("]")
        if close < 0 or value[close + 1 : close + 2] != ":":
            raise ValueError(f"expected '[ipv6]:port', got {text!r}")
        host, port_text = value[1:close], value[close + 2 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"'{host}' is not an IPv6 address (in {text!r})") from None
    else:
        host, sep, port_text = value.rpartition(":")
        if not sep or not host:
            raise ValueError(f"expected 'host:port', got {text!r}")
        if ":" in host:
            raise ValueError(f"an IPv6 host must be in brackets ('[{host}]:{port_text}')")
        if not _NAME_RE.match(host):
            raise ValueError(f"'{host}' is not a host name or IPv4 address (in {text!r})")
    if not port_text.isdigit() or not port_text.isascii():
        raise ValueError(f"port must be a decimal number, got {port_text!r} (in {text!r})")
    port = int(port_text)
    low = 0 if allow_port_zero else 1
    if not low <= port <= 65535:
        raise ValueError(f"port must be in {low}..65535, got {port} (in {text!r})")
    return host, port


def format_host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets (the inverse of ``parse_host_port``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


__all__ = ["format_host_port", "is_ip_literal", "parse_host_port"]

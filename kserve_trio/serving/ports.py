"""Reserving the public ports in the parent: bound with SO_REUSEPORT, never listening.

The parent binds each public address first, so ``port 0`` resolves to one concrete port that
every child then binds too (SO_REUSEPORT, and they listen). The parent's sockets never listen,
so the kernel hands them no connection; they stay open for the parent's lifetime, so the port
stays reserved while a child restarts (no other program can take it in between).

Each address is first bound once alone, without SO_REUSEPORT (``_alone``), and only then with
it: SO_REUSEPORT would otherwise let the gateway share a port that another program of the same
user already listens on with SO_REUSEPORT (an older gateway still running; under a parallel
test run, another test's gateway), and the kernel would split the connections between the two
without a word. Alone, such a port is refused (EADDRINUSE) as any taken port is.

The addresses bound are those ``anyio.create_tcp_listener`` binds for the same host (every
stream address ``getaddrinfo`` gives for it), so the children's listeners and the parent's
reservation are the same set of (family, address, port).
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass, field

_BIND_ATTEMPTS = 10
"""Retries when port 0 resolved, for one family, to a port another family has taken."""


@dataclass
class ReservedPort:
    """The bound, non-listening sockets of one public address."""

    host: str
    port: int
    sockets: list[socket.socket] = field(default_factory=list)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()
        self.sockets.clear()


def _stream_socket(family: int) -> socket.socket:
    """A TCP socket for one address of the reservation: IPv6 only for AF_INET6 (the IPv4
    address is bound on its own), SO_REUSEADDR (a port in TIME_WAIT holds no one)."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    except BaseException:
        sock.close()
        raise
    return sock


def _bound(family: int, sockaddr: tuple) -> socket.socket:
    sock = _stream_socket(family)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(sockaddr)
    except BaseException:
        sock.close()
        raise
    return sock


def _alone(family: int, sockaddr: tuple) -> int:
    """Bind ``sockaddr`` without SO_REUSEPORT and let it go again: the port it got (``sockaddr``'s
    own, or a free one for port 0), or EADDRINUSE when any socket holds that port already."""
    with _stream_socket(family) as sock:
        sock.bind(sockaddr)
        return sock.getsockname()[1]


def reserve_port(host: str, port: int, what: str) -> ReservedPort:
    """Bind every stream address of ``host:port`` with SO_REUSEPORT (no listen); ``port`` 0
    takes one ephemeral port for all of them. Raises ``OSError`` naming ``what`` (the
    configuration key) when the address cannot be bound."""
    try:
        infos = socket.getaddrinfo(host, port, 0, 0, 0, socket.AI_PASSIVE | socket.AI_ADDRCONFIG)
    except OSError as exc:
        raise OSError(errno.EADDRNOTAVAIL, f"{what} {host}:{port}: {exc}") from None
    addrs = sorted({(fam, sa) for fam, kind, _, _, sa in infos if kind == socket.SOCK_STREAM})
    for _ in range(_BIND_ATTEMPTS):
        reserved = ReservedPort(host, port)
        try:
            for fam, sockaddr in addrs:
                alone = _alone(fam, (sockaddr[0], reserved.port, *sockaddr[2:]))
                sock = _bound(fam, (sockaddr[0], alone, *sockaddr[2:]))
                reserved.sockets.append(sock)
                reserved.port = sock.getsockname()[1]
        except OSError as exc:
            reserved.close()
            if exc.errno == errno.EADDRINUSE and port == 0 and len(addrs) > 1:
                addrs.append(addrs.pop(0))
                continue
            raise OSError(exc.errno, f"{what} {host}:{port}: {exc.strerror or exc}") from None
        return reserved
    raise OSError(errno.EADDRINUSE, f"{what} {host}:0: no port free on every address")


__all__ = ["ReservedPort", "reserve_port"]

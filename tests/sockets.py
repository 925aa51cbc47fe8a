"""A process's own TCP sockets, read from ``/proc`` (its descriptors matched with the kernel's
socket table): one owner for the tests that count a server's connections."""

from __future__ import annotations

import os
from dataclasses import dataclass

LISTEN = "0A"
"""The kernel's state code of a listening socket in ``/proc/net/tcp``."""


@dataclass(frozen=True)
class TcpSocket:
    local_port: int
    peer_port: int
    state: str

    @property
    def listening(self) -> bool:
        return self.state == LISTEN


def tcp_sockets(pid: int) -> list[TcpSocket]:
    """The TCP sockets (IPv4 and IPv6) process ``pid`` holds open now."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    local = int(fields[1].rsplit(":", 1)[1], 16)
                    peer = int(fields[2].rsplit(":", 1)[1], 16)
                    found.append(TcpSocket(local, peer, fields[3]))
    return found

"""Free TCP ports for the tests' servers: one owner for the probe every suite needs."""

from __future__ import annotations

import socket


def free_port(*hosts: str) -> int:
    """A port free on every one of ``hosts`` (127.0.0.1 by default) right now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((hosts[0] if hosts else "127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            for host in hosts[1:]:
                with socket.socket() as t:
                    t.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no port free on all of {hosts}")


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive ports that are free on 127.0.0.1 right now."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")

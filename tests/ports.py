"""Free TCP ports for the tests' servers: one owner for the probe every suite needs.

A port found free is handed to a server started later, so something else may take it in
between. Two things did, on a loaded machine with three test processes: another test
process's probe finding the same port, and an outgoing connection (the flood tests open
thousands) given it as its local port by the kernel, which picks those from the same
ephemeral range that binding port 0 draws from. So the ports handed out here lie *below* the
kernel's ephemeral range, where no outgoing connection and no port-0 server ever lands, and
each test process (pytest-xdist's ``PYTEST_XDIST_WORKER``) draws from its own slice of them,
walking it in order, so two test processes never hand out the same port and one process
hands out a port again only after it has used every other of its slice. Each port is still
probed (bound on every host asked for) before it is handed out: a server of an earlier test
may still hold it.
"""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Iterator

FIRST_PORT = 10000
"""The lowest port handed out: above the well-known and registered services a machine runs."""

_FALLBACK_EPHEMERAL_LOW = 32768


def _ephemeral_low() -> int:
    """The lowest port the kernel gives outgoing connections and port-0 binds."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_EPHEMERAL_LOW


def _worker_slice() -> range:
    """This test process's ports: its share of [FIRST_PORT, the ephemeral range)."""
    top = _ephemeral_low()
    if top - FIRST_PORT < 1000:  # a machine whose ephemeral range starts low: no room below it
        return range(0)
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(name[2:]) if name[2:].isdigit() else 0
    width = (top - FIRST_PORT) // workers
    start = FIRST_PORT + (index % workers) * width
    return range(start, start + width)


def _walk(ports: range) -> Iterator[int]:
    """The slice in order, from a place of its own per process (a test that starts a pytest
    of its own shares the slice's name with it, not its place)."""
    if not len(ports):
        return iter(())
    start = (os.getpid() * 7919) % len(ports)
    return itertools.cycle([*ports[start:], *ports[:start]])


_SLICE = _worker_slice()
_next_port: Iterator[int] = _walk(_SLICE)


def _bindable(port: int, hosts: tuple[str, ...]) -> bool:
    try:
        for host in hosts:
            with socket.socket() as s:
                s.bind((host, port))
    except OSError:
        return False
    return True


def _kernel_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port(*hosts: str) -> int:
    """A port free on every one of ``hosts`` (127.0.0.1 by default) right now."""
    hosts = hosts or ("127.0.0.1",)
    for port in itertools.islice(_next_port, len(_SLICE)):
        if _bindable(port, hosts):
            return port
    for _ in range(50):  # no slice below the ephemeral range: the kernel's choice
        port = _kernel_port(hosts[0])
        if _bindable(port, hosts[1:]):
            return port
    raise RuntimeError(f"no port free on all of {hosts}")


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive ports that are free on 127.0.0.1 right now."""
    for _ in range(max(1, len(_SLICE) // n)):
        base = next(_next_port, None)
        if base is None:
            break
        if base + n > _SLICE.stop:  # the run would leave the slice: start again at its front
            continue
        if all(_bindable(p, ("127.0.0.1",)) for p in range(base, base + n)):
            for _ in range(n - 1):  # the run's other ports are taken too
                next(_next_port)
            return base
    for _ in range(200):
        base = _kernel_port("127.0.0.1")
        if base + n <= 65535 and all(_bindable(p, ("127.0.0.1",)) for p in range(base, base + n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports")

"""The worker and gateway CLIs under a low open-file limit, with every public port open.

``RLIMIT_NOFILE`` is set to ``NOFILE`` (soft = hard, so the CLI's raise to the hard limit
changes nothing) by the launcher the CLI runs under (``tests.edge.nofile``); the worker serves
gRPC, REST and metrics, the gateway gRPC, REST and admin. ``counter`` reads one sample of a
Prometheus exposition.
"""

from __future__ import annotations

import http.client
import pathlib
import re
import sys

from kserve_trio.serving.fd_budget import FdBudget
from tests.gateway.procs import Gateway, Worker
from tests.ports import free_port

NOFILE = 256
"""The open-file limit the processes run under."""

_LOW_LIMIT = (sys.executable, "-m", "tests.edge.nofile", str(NOFILE))


def worker_cap(max_connections: int = 1000) -> int:
    """A worker's per-listener connection cap at ``NOFILE`` (the documented budget rule)."""
    return FdBudget.plan(NOFILE, listeners=3, worker=True).connection_cap(max_connections)


def gateway_cap(max_connections: int = 1000) -> int:
    """A gateway's per-listener connection cap at ``NOFILE``."""
    return FdBudget.plan(NOFILE, listeners=3, gateway=True).connection_cap(max_connections)


class LimitedWorker(Worker):
    """A CLI worker under ``NOFILE`` with REST (``http_port``) and metrics ports."""

    launcher = _LOW_LIMIT

    def __init__(self, repo: pathlib.Path, env: dict[str, str] | None = None) -> None:
        self.http_port = free_port()
        super().__init__(repo, "127.0.0.1", free_port(), metrics_port=free_port(), env=env)

    def _argv(self) -> list[str]:
        return [*super()._argv(), "--http-port", str(self.http_port)]


class LimitedGateway(Gateway):
    """A CLI gateway under ``NOFILE`` in front of ``worker``, with a REST port."""

    launcher = _LOW_LIMIT

    def __init__(self, workdir: pathlib.Path, worker: Worker, env: dict[str, str]) -> None:
        self.http_port = free_port()
        g = "KSERVE_TRIO_GATEWAY_"
        full = {g + "WORKERS": worker.url, g + "LISTEN_HTTP": f"127.0.0.1:{self.http_port}"}
        super().__init__(workdir, {**full, **env})


def get(conn: http.client.HTTPConnection, path: str) -> tuple[int, str]:
    """``GET path`` on ``conn`` (kept alive): the status and the body."""
    conn.request("GET", path)
    reply = conn.getresponse()
    return reply.status, reply.read().decode()


def fresh_get(port: int, path: str) -> tuple[int, str]:
    """``GET path`` on a new connection to ``port``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        return get(conn, path)
    finally:
        conn.close()


def counter(exposition: str, name: str, **labels: str) -> float:
    """The value of sample ``name{labels}`` in ``exposition`` (0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = re.escape(f"{name}{{{wanted}}}" if wanted else name) + r" ([0-9.e+]+)$"
    found = re.search(pattern, exposition, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


__all__ = [
    "NOFILE",
    "LimitedGateway",
    "LimitedWorker",
    "counter",
    "fresh_get",
    "gateway_cap",
    "get",
    "worker_cap",
]

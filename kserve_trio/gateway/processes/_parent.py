"""``serve_processes``: the parent of a gateway in several processes, as one task tree.

::

    serve_processes(config)                 runtime dir (stale ones removed); reserve the ports
    └─ task group (root)                    cancel = orderly shutdown
       ├─ admin HTTP                        listen.metrics: the merged endpoints (``_admin``)
       ├─ child 0 .. N-1                    start, watch, restart (``_children``)
       └─ up reporter                       logs ``gateway_up`` once every child serves

Shutdown (leaving the context: SIGTERM, SIGINT): ``/readyz`` turns 503, every child gets
SIGTERM at once and drains itself (``server.DRAIN_SECONDS``); one still running after
``CHILD_GRACE_SECONDS`` is killed. Then the reserved sockets close and the runtime directory is
removed, so nothing is left behind: no process, socket or file. A parent killed outright leaves
that to its children, which the kernel stops with it (``_layout``: the last one out removes the
directory, and the next parent removes one left by a gateway killed whole).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from kserve_trio.core.logging import get_logger
from kserve_trio.gateway.addresses import format_host_port
from kserve_trio.gateway.config import (
    ENV_PREFIX,
    PROBER_ENV_NAME,
    GatewayConfig,
    gateway_config_to_raw,
)
from kserve_trio.gateway.processes._admin import ProcessesAdmin
from kserve_trio.gateway.processes._children import LOOPBACK, ChildFailedToStart, GatewayChild
from kserve_trio.gateway.processes._layout import (
    CONFIG_FILE,
    create_runtime_dir,
    remove_runtime_dir,
    write_atomically,
)
from kserve_trio.serving.admin_http import serve_http
from kserve_trio.serving.ports import ReservedPort, reserve_port

CHILD_GRACE_SECONDS = 8.0
"""How long a stopping child may drain (its own drain is 5 s) before it is killed; under the
node supervisor's 10 s for the whole gateway."""
UPSTREAM_ENV_PREFIX = "REACTANT_GATEWAY_"

_log = get_logger("kserve_trio.gateway.processes")


@dataclass
class RunningProcesses:
    """A running gateway of several processes: its public ports, admin port, runtime
    directory and children."""

    config: GatewayConfig
    host: str
    port: int
    metrics_port: int
    runtime_dir: Path
    children: Sequence[GatewayChild] = field(default_factory=list)
    http_port: int = 0

    @property
    def address(self) -> str:
        return format_host_port(self.host, self.port)


def child_raw_config(
    config: GatewayConfig, grpc: ReservedPort, http: ReservedPort | None
) -> dict[str, object]:
    """What every child serves: ``config`` with the public ports as reserved (port 0
    resolved) and the admin port on loopback, ephemeral (the parent serves the public one)."""
    raw = gateway_config_to_raw(config)
    raw["listen"] = {
        "grpc": format_host_port(grpc.host, grpc.port),
        "metrics": f"{LOOPBACK}:0",
        "http": format_host_port(http.host, http.port) if http is not None else "",
    }
    return raw


def child_env(env: Mapping[str, str], config: GatewayConfig) -> dict[str, str]:
    """The parent's environment less every gateway variable (the configuration file holds
    what they said), plus the environment-only prober knobs as resolved."""
    out = {k: v for k, v in env.items() if not k.startswith((ENV_PREFIX, UPSTREAM_ENV_PREFIX))}
    prober = config.prober
    wait = prober.startup_wait_seconds
    out[PROBER_ENV_NAME["startup_wait_seconds"]] = "inf" if math.isinf(wait) else repr(wait)
    out[PROBER_ENV_NAME["health_interval_seconds"]] = repr(prober.health_interval_seconds)
    out[PROBER_ENV_NAME["wedge_exit_rounds"]] = str(prober.wedge_exit_rounds)
    if prober.hosts_file:
        out[PROBER_ENV_NAME["hosts_file"]] = prober.hosts_file
    return out


def child_command(config_file: Path, index: int, runtime_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "kserve_trio", "gateway", "--config", str(config_file),
        "--process-index", str(index), "--runtime-dir", str(runtime_dir),
    ]  # fmt: skip


async def _report_up(running: RunningProcesses) -> None:
    for child in running.children:
        await child.wait_up()
    _log.info(
        "gateway_up",
        address=running.address,
        metrics_port=running.metrics_port,
        http_port=running.http_port or None,
        processes=len(running.children),
        pids=[child.pid for child in running.children],
    )


@contextlib.asynccontextmanager
async def serve_processes(
    config: GatewayConfig, *, env: Mapping[str, str] = os.environ
) -> AsyncIterator[RunningProcesses]:
    """Run ``config.processes`` gateway processes for the duration of the ``async with``
    block. It is entered at once (the children start meanwhile); a child that fails its first
    start ends the block with ``ChildFailedToStart``."""
    runtime_dir, runtime_fd = create_runtime_dir()
    reserved: list[ReservedPort] = []
    try:
        grpc_host, grpc_port = config.listen.grpc_address
        grpc = reserve_port(grpc_host, grpc_port, "listen.grpc")
        reserved.append(grpc)
        http = None
        if config.listen.http_address is not None:
            http = reserve_port(*config.listen.http_address, "listen.http")
            reserved.append(http)
        config_file = runtime_dir / CONFIG_FILE
        raw = child_raw_config(config, grpc, http)
        write_atomically(config_file, json.dumps(raw, indent=1, allow_nan=False).encode())
        environment = child_env(env, config)
        children = [
            GatewayChild(
                i,
                child_command(config_file, i, runtime_dir),
                environment,
                runtime_dir,
                liveness_interval=config.process_liveness_interval_seconds,
                liveness_misses=config.process_liveness_misses,
            )
            for i in range(config.processes)
        ]
        stopping = anyio.Event()
        admin = ProcessesAdmin(children, draining=stopping.is_set)
        metrics_host, metrics_port = config.listen.metrics_address
        async with anyio.create_task_group() as tg:
            try:
                bound_metrics = await tg.start(
                    functools.partial(
                        serve_http,
                        metrics_host,
                        metrics_port,
                        exposition=admin.exposition,
                        ready=lambda: False,  # /readyz is the admin's own route
                        routes=admin.routes(),
                    )
                )
            except OSError as exc:
                raise OSError(
                    exc.errno,
                    f"listen.metrics {metrics_host}:{metrics_port}: {exc.strerror or exc}",
                ) from None
            for child in children:
                tg.start_soon(child.run, os.getpid())
            running = RunningProcesses(
                config=config,
                host=grpc.host,
                port=grpc.port,
                metrics_port=bound_metrics,
                runtime_dir=runtime_dir,
                children=children,
                http_port=http.port if http is not None else 0,
            )
            tg.start_soon(_report_up, running)
            _log.info(
                "gateway_processes_starting",
                processes=config.processes,
                address=running.address,
                runtime_dir=str(runtime_dir),
            )
            try:
                yield running
            finally:
                with anyio.CancelScope(shield=True):
                    stopping.set()
                    async with anyio.create_task_group() as stops:
                        for child in children:
                            stops.start_soon(child.stop, CHILD_GRACE_SECONDS)
                    tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        failed = group.subgroup(ChildFailedToStart)
        if failed is not None:
            raise _first_leaf(failed) from None
        leaves = _leaves(group)
        raise (leaves[0] if len(leaves) == 1 else group) from None
    finally:
        for port in reserved:
            port.close()
        remove_runtime_dir(runtime_dir, runtime_fd)
    _log.info("gateway_down", address=format_host_port(grpc_host, grpc_port))


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    return _leaves(group)[0]


__all__ = [
    "CHILD_GRACE_SECONDS",
    "RunningProcesses",
    "child_command",
    "child_env",
    "child_raw_config",
    "serve_processes",
]

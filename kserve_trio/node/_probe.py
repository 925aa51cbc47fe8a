"""Readiness of a node's servers, for a container healthcheck (``python -m kserve_trio probe``).

The probe plans the node exactly as the supervisor does (same file, same environment), so it
asks the address the server really binds, then calls KServe ``ServerReady`` on it through the
client's HTTP/2 transport. Which server:

1. ``worker`` given: that worker;
2. otherwise, roles ``all`` and ``gateway``: the node's public gRPC address (the single worker
   serving it directly, or the embedded gateway);
3. otherwise (role ``workers``): every worker, and the node is ready when all of them are.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import anyio

from kserve_trio.core.errors import ConfigError
from kserve_trio.node._files import prepare_node
from kserve_trio.node._plan import NodePlan, connect_host, format_address

PROBE_TIMEOUT_SECONDS = 5.0


def probe_targets(plan: NodePlan, worker: str | None) -> list[tuple[str, int]]:
    """The addresses the probe asks, by the module's rules (wildcards become loopback)."""
    if worker is not None:
        names = [c.name for c in plan.workers]
        if worker not in names:
            raise ConfigError(f"worker '{worker}' not defined in node (have: {', '.join(names)})")
        address = plan.child(worker).address
        targets = [address] if address else []
    elif plan.role in ("all", "gateway"):
        targets = [plan.public_grpc] if plan.public_grpc else []
    else:
        targets = [c.address for c in plan.workers if c.address]
    if not targets or any(port == 0 for _, port in targets):
        raise ConfigError("the server to probe binds an ephemeral port (0); give it a fixed port")
    return [(connect_host(host), port) for host, port in targets]


async def server_ready(host: str, port: int, timeout: float = PROBE_TIMEOUT_SECONDS) -> bool:
    """KServe ``ServerReady`` on ``host:port``; any failure (refused, timeout, error) is
    ``False``."""
    # The client package pulls numpy; importing it here keeps ``python -m kserve_trio`` (every
    # worker and gateway start) from paying for it when no probe runs.
    from kserve_trio.client.endpoint import Endpoint, method_path
    from kserve_trio.client.errors import RpcError
    from kserve_trio.client.h2_transport import H2Transport
    from kserve_trio.proto import inference as pb

    transport = H2Transport(Endpoint(host, port))
    try:
        with anyio.fail_after(timeout):
            reply = await transport.unary(
                method_path("ServerReady"),
                pb.ServerReadyRequest(),
                pb.ServerReadyResponse,
                timeout=timeout,
            )
        return bool(reply.ready)
    except (RpcError, OSError, TimeoutError):
        return False
    finally:
        with anyio.CancelScope(shield=True):
            await transport.aclose()


async def _all_ready(targets: Sequence[tuple[str, int]], timeout: float) -> bool:
    for host, port in targets:
        if not await server_ready(host, port, timeout):
            return False
    return True


def probe_worker_ready(
    node_path: str | os.PathLike[str] | None,
    worker: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = PROBE_TIMEOUT_SECONDS,
) -> bool:
    """Whether the node's server (see the module rules) reports ready.

    A node file that cannot be planned is a ``ConfigError`` (the healthcheck then fails with
    the reason); an unreachable or not-ready server is ``False``.
    """
    environ = dict(os.environ if env is None else env)
    plan, _ = prepare_node(node_path, role=None, gateway_path=None, env=environ, write=False)
    return probe_plan(plan, worker, timeout)


def probe_plan(plan: NodePlan, worker: str | None, timeout: float = PROBE_TIMEOUT_SECONDS) -> bool:
    """``probe_worker_ready`` for a node already planned."""
    return anyio.run(_all_ready, probe_targets(plan, worker), timeout, backend="asyncio")


def describe_targets(plan: NodePlan, worker: str | None) -> str:
    return ", ".join(format_address(h, p) for h, p in probe_targets(plan, worker))


__all__ = [
    "PROBE_TIMEOUT_SECONDS",
    "describe_targets",
    "probe_plan",
    "probe_targets",
    "probe_worker_ready",
    "server_ready",
]

"""The gateway: one KServe V2 gRPC endpoint in front of many workers.

Public surface: ``serve_gateway(path=None, blocking=True)`` (run one; non-blocking it returns
a ``RunningGateway``, which ``stop`` drains and shuts down), ``GatewayConfig`` and
``load_gateway_config`` (``gateway.yml``, the ``KSERVE_TRIO_GATEWAY_*`` environment),
``SchedulingMode`` and ``WorkBasis`` (how requests are routed), ``Resolver``,
``system_resolver`` and ``hosts_file_resolver`` (the discovery hook: any
``async resolve(host, port) -> [address, ...]``), and ``RoutingPolicy``, the interface every
routing mode implements. The operator's guide is ``docs/gateway.md``.

Inside: ``config`` (the configuration), ``addresses`` (``host:port``), ``discovery`` (endpoints
entries to workers), ``pool`` (worker connections and their health), ``prober`` (the rounds and
the route refresher), ``routing`` (the routing table and policies), ``routing_metadata``
(per-model costs from the workers' control plane), ``peek`` (routing fields of raw requests),
``forward`` (the ModelInfer request path), ``shm_fanout`` (shared-memory registration across the
workers), ``fanout`` and ``aggregate`` (the RPCs answered by every worker, and their pure
merges), ``stream`` (ModelStreamInfer), ``admission`` (the inbound cap and drain), ``service``
(the gRPC surface), ``admin`` (the admin HTTP endpoints), ``metrics`` and ``metrics_merge``
(``/metrics``), ``tls`` (the public and worker-side TLS contexts), ``watchdog`` (the wedge rule:
the event loop stalling), ``server`` (the task tree,
``serve_gateway``) and ``cli`` (``python -m kserve_trio gateway``). lpt_packing lives in the
``placement`` package, behind its one face (its docstring names the parts).

It never imports jax, ``kserve_trio.runtime`` or ``kserve_trio.worker``: it stands on ``core``,
``serving`` and the client transport only.
"""

from __future__ import annotations

from kserve_trio.gateway.config import (
    GatewayConfig,
    SchedulingMode,
    WorkBasis,
    load_gateway_config,
)
from kserve_trio.gateway.discovery import Resolver, hosts_file_resolver, system_resolver
from kserve_trio.gateway.routing import RoutingPolicy
from kserve_trio.gateway.server import RunningGateway, serve_gateway, stop

__all__ = [
    "GatewayConfig",
    "Resolver",
    "RoutingPolicy",
    "RunningGateway",
    "SchedulingMode",
    "WorkBasis",
    "hosts_file_resolver",
    "load_gateway_config",
    "serve_gateway",
    "stop",
    "system_resolver",
]

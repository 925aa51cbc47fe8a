"""The gateway: one KServe V2 gRPC endpoint in front of many workers.

Public surface: ``GatewayConfig`` and ``load_gateway_config`` (``gateway.yml``, the
``KSERVE_TRIO_GATEWAY_*`` environment), ``SchedulingMode`` and ``WorkBasis`` (how requests are
routed), ``Resolver`` and ``system_resolver`` (the discovery hook: any
``async resolve(host, port) -> [address, ...]``), and ``RoutingPolicy``, the interface every
routing mode implements.

Inside: ``config`` (the configuration), ``addresses`` (``host:port``), ``discovery`` (endpoints
entries to workers), ``pool`` (worker connections and their health), ``prober`` (the rounds and
the route refresher), ``routing`` (the routing table and policies), ``routing_metadata``
(per-model costs from the workers' control plane), ``peek`` (routing fields of raw requests),
``forward`` (the ModelInfer request path), ``shm_fanout`` (shared-memory registration across the
workers), ``metrics`` and ``metrics_merge`` (``/metrics``), ``tls`` (the public and worker-side
TLS contexts).

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
from kserve_trio.gateway.discovery import Resolver, system_resolver
from kserve_trio.gateway.routing import RoutingPolicy

__all__ = [
    "GatewayConfig",
    "Resolver",
    "RoutingPolicy",
    "SchedulingMode",
    "WorkBasis",
    "load_gateway_config",
    "system_resolver",
]

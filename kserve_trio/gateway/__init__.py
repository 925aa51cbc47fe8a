"""The gateway: one KServe V2 gRPC endpoint in front of many workers.

Public surface: ``serve_gateway(path=None, blocking=True)`` (run one; non-blocking it returns
a ``RunningGateway``, which ``stop`` drains and shuts down), ``GatewayConfig`` and
``load_gateway_config`` (``gateway.yml``, the ``KSERVE_TRIO_GATEWAY_*`` environment),
``SchedulingMode`` and ``WorkBasis`` (how requests are routed), ``Resolver``,
``system_resolver`` and ``hosts_file_resolver`` (the discovery hook: any
``async resolve(host, port) -> [address, ...]``), and ``RoutingPolicy``, the interface every
routing mode implements. The operator's guide is ``docs/gateway.md``.

Inside, in layers (each imports only those below it; the faced packages through their
``__init__``):

- the basics every part stands on: ``config`` (the configuration), ``addresses``
  (``host:port``, which the configuration parses with), ``tls`` (the public and worker-side TLS
  contexts), ``metrics`` (``/metrics``; the prober and the request path record into it) and
  ``caller_headers`` (what a worker call carries on a client's behalf: the request path sets
  it, the fleet's pool reads it);
- ``fleet/``: the workers (discovery, the pool of connections and their health, the prober
  and the route refresher, the routing table and policies, the per-model routing metadata);
- ``admin`` (the admin HTTP endpoints) and ``processes/`` (the parent of several gateway
  processes, and the layout they share: each child's role, the files written atomically),
  on the fleet;
- ``placement/`` (lpt_packing: packing models onto workers and routing to the placement; its
  multi-process part uses the processes' layout) and ``request_path/`` (peek, admission,
  forward, stream, the fan-outs, the shared-memory fan-out, the gRPC service and the REST
  surface), neither importing the other; each package's docstring names its parts;
- the top: ``shm_record`` (shared-memory registrations of several gateway processes, one
  file: the request path's registrations in the processes' layout), ``watchdog`` (the wedge
  rule: the event loop stalling; only the server uses it), ``server`` (the composition root:
  the task tree, ``serve_gateway``) and ``cli`` (``python -m kserve_trio gateway``).

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
from kserve_trio.gateway.fleet import Resolver, RoutingPolicy, hosts_file_resolver, system_resolver
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

"""The fleet: which workers there are, the connection to each, what each serves, and where a
request goes.

The rest of the gateway uses this package through the names below only. Its parts, by what
they decide:

- ``discovery``: which workers exist (``endpoints`` entries resolved to one worker per address
  and port, re-resolved each round; the ``Resolver`` hook);
- ``pool``: one connection per worker, its bound on in-flight calls, its probes and the health
  state machine (``WorkerClient``, ``WorkerPool``);
- ``routing_metadata``: per-model costs from the workers' ``ModelControlStatus`` (pure);
- ``routing``: the routing table and the routing policies behind ``RoutingPolicy``;
- ``prober``: the rounds that keep the pool, the routing table and the metadata current, and
  the ``RouteRefresher`` a request calls when it finds no route.

Why the pool and the routing policies live here rather than with the request path that uses
them: the prober probes through the pool and builds the routing table each round, and the pool
applies discovery's ``WorkerDiff``; the request path (``request_path``) and lpt_packing
(``placement``) stand on this package, never the reverse. ``addresses`` stays beside
``config`` at the gateway's top level, under both: the configuration parses ``host:port`` with
it. What a worker call carries on a caller's behalf (``caller_headers``) is also at the top:
the pool reads it, the request path sets it; so is ``metrics``, which the prober records into
(it names ``RoutingPolicy`` as a type only).
"""

from kserve_trio.gateway.fleet.discovery import (
    Discovery,
    Resolver,
    WorkerSpec,
    hosts_file_resolver,
    system_resolver,
)
from kserve_trio.gateway.fleet.pool import (
    PROBE_TIMEOUT_SECONDS,
    PoolSettings,
    RawReply,
    WorkerClient,
    WorkerPool,
    compact_timeout,
    forward_deadline,
)
from kserve_trio.gateway.fleet.prober import (
    MODEL_CONTROL_STATUS,
    WATCHDOG_SECONDS,
    Prober,
    RouteRefresher,
)
from kserve_trio.gateway.fleet.routing import (
    Failover,
    LeastOutstanding,
    Reservation,
    RoundRobin,
    RoutingPolicy,
    RoutingState,
    RoutingTable,
    Selection,
    failover_action,
    make_policy,
    no_ready_replica,
    quantize,
)
from kserve_trio.gateway.fleet.routing_metadata import (
    EMPTY_METADATA,
    FleetPoll,
    ModelCost,
    RoutingMetadata,
    aggregate_poll,
    ewma,
)

__all__ = [
    "EMPTY_METADATA",
    "MODEL_CONTROL_STATUS",
    "PROBE_TIMEOUT_SECONDS",
    "WATCHDOG_SECONDS",
    "Discovery",
    "Failover",
    "FleetPoll",
    "LeastOutstanding",
    "ModelCost",
    "PoolSettings",
    "Prober",
    "RawReply",
    "Reservation",
    "Resolver",
    "RoundRobin",
    "RouteRefresher",
    "RoutingMetadata",
    "RoutingPolicy",
    "RoutingState",
    "RoutingTable",
    "Selection",
    "WorkerClient",
    "WorkerPool",
    "WorkerSpec",
    "aggregate_poll",
    "compact_timeout",
    "ewma",
    "failover_action",
    "forward_deadline",
    "hosts_file_resolver",
    "make_policy",
    "no_ready_replica",
    "quantize",
    "system_resolver",
]

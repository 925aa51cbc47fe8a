"""lpt_packing: placing models on workers by measured load, and routing to the placement.

The rest of the gateway uses this package through the names below only (the composition root,
``gateway/server.py``, builds them under ``scheduling.mode: lpt_packing``). Its parts, by what
they decide:

- ``assignment``: which workers hold which models (longest-processing-time-first packing over
  compute and device memory; pure);
- ``fill``: which replica of a multi-replica model takes the next request (pure);
- ``policy``: ``LptPacking``, the routing policy that applies an assignment and the fill plans;
- ``scheduler``: ``LptScheduler``, when to repack (start-up, ticks, drift) and how a new
  assignment reaches the workers;
- ``compaction``: the ``CompactMemory`` fan-outs after a repack;
- ``control``: ``GatewayControl``, the GatewayControlService (status, overrides, repack);
- ``metrics``: the placement's Prometheus series;
- ``multiprocess``: one placement for several gateway processes (one places, the others follow).

It stands on the fleet (``gateway/fleet/``: the pool, the routing table, the prober's timeouts,
the routing metadata), beside the request path (``gateway/request_path/``), which it never
imports.
"""

from kserve_trio.gateway.placement.assignment import Assignment, Placement, compute_assignment
from kserve_trio.gateway.placement.compaction import Compactor
from kserve_trio.gateway.placement.control import GatewayControl
from kserve_trio.gateway.placement.metrics import LptCollector
from kserve_trio.gateway.placement.multiprocess import LptFollower, LptPlacer, shared_lpt
from kserve_trio.gateway.placement.policy import LptPacking
from kserve_trio.gateway.placement.scheduler import LptScheduler, RepackReport

__all__ = [
    "Assignment",
    "Compactor",
    "GatewayControl",
    "LptCollector",
    "LptFollower",
    "LptPacking",
    "LptPlacer",
    "LptScheduler",
    "Placement",
    "RepackReport",
    "compute_assignment",
    "shared_lpt",
]

"""lpt_packing's routing: requests follow the placement, and fill plans split multi-replica load.

``LptPacking`` is a ``RoutingPolicy`` (same interface as round_robin and least_outstanding). It
holds the current ``Assignment`` (from ``placement.compute_assignment``) and, for each model
placed on several workers, a ``fill.FillState``. The scheduler that measures utilizations and
decides when to repack calls ``repack``; requests call ``select``.

Rules (``select``):
1. *Unplaced*: a model without a placement is routed round robin over the workers that report it
   ready, with nothing reserved (new models, and models nobody has asked for yet).
2. *Placed on one worker*: a model placed on one worker goes there when it is ready (it is reserved:
   units in flight and the worker's load); the other ready replicas follow as failover.
3. *Placed on several*: a model placed on several workers asks its fill state for the replica
   (``choose``), over the placed replicas that are ready; failover follows the fill state's order,
   then any ready replica outside the placement as a last resort.
4. *Request weight*: the weight a request adds to its worker's load is its units under the ``items``
   basis, units times the model's item cost under ``compute``, and the model's per-request cost
   under ``requests`` (from the routing metadata: the model's own, else the fleet mean, else 1).
5. *Repack*: ``repack`` swaps the assignment: fill states keep the in-flight counts of the replicas
   that persist and their cursor, and end their runs; counters of workers that left are dropped.
6. *Refresh plans*: ``refresh_plans`` re-resolves every fill state's mode, policy and quantum from
   the current settings and batch sizes (the scheduler calls it each tick and after an operator
   change).

Every request counts as an arrival of its model (``take_arrivals`` hands the counts to the
scheduler and starts them again), and each (model, worker)'s items in flight and requests
routed are kept for GetSchedulingStatus and the metrics. ``on_metadata``, when set, is called
with each new routing-metadata snapshot (the lpt_packing scheduler's tick).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kserve_trio.gateway.config import FillMode, FillPolicy, WorkBasis
from kserve_trio.gateway.fleet import (
    EMPTY_METADATA,
    Reservation,
    RoutingMetadata,
    RoutingTable,
    Selection,
    quantize,
)
from kserve_trio.gateway.placement.assignment import Assignment
from kserve_trio.gateway.placement.fill import FillState, fill_quantum


@dataclass(frozen=True)
class FillSettings:
    """How one model's replicas are filled: mode, tie-break policy and the quantum factor."""

    mode: FillMode = FillMode.RUN
    policy: FillPolicy = FillPolicy.FILL_LEAST
    factor: float = 1.0


@dataclass
class _Counters:
    """What is in flight per worker: load on the policy's basis, and routed requests."""

    load: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    routed: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    outstanding: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))


class LptPacking:
    """``lpt_packing``: placement-driven routing (see the module docstring)."""

    mode = "lpt_packing"
    needs_metadata = True

    def __init__(
        self,
        basis: WorkBasis = WorkBasis.COMPUTE,
        *,
        fill: FillSettings = FillSettings(),
        overrides: Mapping[str, FillSettings] | None = None,
        metadata: RoutingMetadata = EMPTY_METADATA,
    ) -> None:
        self.basis = basis
        self.fill = fill
        self.overrides = dict(overrides or {})
        self.metadata = metadata
        self.assignment = Assignment()
        self.fills: dict[str, FillState] = {}
        self._rr: dict[str, int] = {}
        self._counters = _Counters()
        self.arrivals: dict[str, int] = defaultdict(int)
        self.on_metadata: Callable[[RoutingMetadata], None] | None = None

    # ---- the RoutingPolicy interface ------------------------------------------------------

    def batch_input(self, model: str) -> tuple[str, int] | None:
        return self.metadata.batch_input(model)

    def request_units(self, model: str, shape: tuple[int, ...] | None) -> int:
        return self.metadata.request_items(model, shape)

    def update_metadata(self, metadata: RoutingMetadata) -> None:
        self.metadata = metadata
        if self.on_metadata is not None:
            self.on_metadata(metadata)

    def take_arrivals(self) -> dict[str, int]:
        """Requests per model since the last call (the counters start again from zero)."""
        arrivals, self.arrivals = dict(self.arrivals), defaultdict(int)
        return arrivals

    def outstanding(self, model: str, worker: str) -> int:
        """Items of ``model`` in flight on ``worker`` (reserved, not yet released)."""
        return self._counters.outstanding.get((model, worker), 0)

    def inflight_work(self) -> Mapping[str, float]:
        return {w: v for w, v in self._counters.load.items() if quantize(v) != 0}

    def weight(self, model: str, units: int) -> float:
        """The load one request adds to its worker (*request weight*)."""
        if self.basis is WorkBasis.ITEMS:
            return float(units)
        if self.basis is WorkBasis.REQUESTS:
            return self._request_cost(model)
        return units * self.metadata.item_cost(model)

    def _request_cost(self, model: str) -> float:
        """Seconds per request: the model's own, else the fleet mean, else 1.0."""
        cost = self.metadata.models.get(model)
        if cost is not None and cost.cost_per_request > 0:
            return cost.cost_per_request
        measured = [c.cost_per_request for c in self.metadata.models.values()]
        measured = [c for c in measured if c > 0]
        return sum(measured) / len(measured) if measured else 1.0

    def select(self, model: str, units: int, table: RoutingTable) -> Selection:
        self.arrivals[model] += 1
        ready = table.replicas(model)
        placement = self.assignment.placements.get(model)
        if placement is None or not ready:
            return self._round_robin(model, ready)
        placed = [w for w in placement.workers if w in ready]
        if not placed:
            return self._round_robin(model, ready)
        weight = self.weight(model, units)
        state = self.fills.get(model)
        if state is None or len(placed) == 1:
            chosen = placed[0]
            order = [chosen, *(w for w in ready if w != chosen)]
            return Selection(tuple(order), self._reserve(model, chosen, weight, None, units))
        live = [i for i, w in enumerate(state.replicas) if w in ready]
        if len(live) < len(state.replicas):
            # a placed replica is not ready: route in placement order, untracked
            order = [*placed, *(w for w in ready if w not in placed)]
            return Selection(tuple(order))
        loads = [self._counters.load.get(w, 0.0) for w in state.replicas]
        index = state.choose(units, loads)
        chosen = state.replicas[index]
        order = state.order(index)
        order += [w for w in ready if w not in order]
        return Selection(tuple(order), self._reserve(model, chosen, weight, state, units))

    # ---- placement ------------------------------------------------------------------------

    def settings_for(self, model: str) -> FillSettings:
        return self.overrides.get(model, self.fill)

    def quantum(self, model: str) -> int:
        """The model's fill quantum ``Q`` under its current settings and batch size."""
        cost = self.metadata.models.get(model)
        max_batch = cost.max_batch_size if cost is not None else 0
        return fill_quantum(max_batch, self.settings_for(model).factor)

    def refresh_plans(self) -> None:
        """*Refresh plans*."""
        for model, state in self.fills.items():
            s = self.settings_for(model)
            state.mode, state.policy, state.quantum = s.mode, s.policy, self.quantum(model)

    def repack(self, assignment: Assignment) -> None:
        """Adopt a new assignment (*repack*)."""
        fills: dict[str, FillState] = {}
        for model, placement in assignment.placements.items():
            if len(placement.workers) < 2:
                continue
            s = self.settings_for(model)
            quantum = self.quantum(model)
            old = self.fills.get(model)
            if old is not None:
                fills[model] = old.carried(placement.workers, quantum)
            else:
                fills[model] = FillState(placement.workers, quantum, s.mode, s.policy)
        self.assignment = assignment
        self.fills = fills

    # ---- internals ------------------------------------------------------------------------

    def _round_robin(self, model: str, ready: tuple[str, ...]) -> Selection:
        if not ready:
            return Selection(())
        cursor = self._rr.get(model, 0)
        self._rr[model] = cursor + 1
        i = cursor % len(ready)
        return Selection(ready[i:] + ready[:i])

    def _reserve(
        self,
        model: str,
        worker: str,
        weight: float,
        state: FillState | None,
        units: int,
    ) -> Reservation:
        counters = self._counters
        counters.load[worker] += weight
        counters.routed[(model, worker)] += 1
        counters.outstanding[(model, worker)] += units

        def undo() -> None:
            value = counters.load.get(worker, 0.0) - weight
            counters.load[worker] = 0.0 if quantize(value) == 0 else value
            left = counters.outstanding.get((model, worker), 0) - units
            counters.outstanding[(model, worker)] = max(0, left)
            if state is None:
                return
            # a repack may have replaced the fill state: release on the one in force now
            current = self.fills.get(model)
            if current is not None and worker in current.replicas:
                current.release(current.replicas.index(worker), units)

        return Reservation(undo)

    def routed(self, model: str, worker: str) -> int:
        """Requests routed to ``worker`` for ``model`` so far (GetSchedulingStatus)."""
        return self._counters.routed.get((model, worker), 0)


__all__ = ["FillSettings", "LptPacking"]

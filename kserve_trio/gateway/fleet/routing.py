"""Where a request goes: the routing table and the routing policies behind one interface.

The routing table maps each model to the workers that report it ready (RepositoryIndex with
``ready=true``), as an immutable snapshot: the prober builds a new one each round and swaps it
in with one assignment, and a request reads the current snapshot once, so it never sees half a
swap. Everything here runs on the gateway's single event loop, so a policy's counters change
only between awaits and need no locks.

A ``RoutingPolicy`` turns (model, request units, table) into a ``Selection``: the workers to
try, in order (the first is the choice, the rest are failover), and a ``Reservation`` that the
forwarding code releases exactly once when the request is done, whatever happened. Policies
that route by work say which input to peek (``batch_input``) and how many units a request is
(``request_units``), and are fed the routing metadata each prober round (``update_metadata``).
``RoundRobin`` and ``LeastOutstanding`` implement it; a placement-driven policy (lpt_packing)
implements the same interface, with placements of its own behind ``select``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kserve_trio.core.errors import NotFound, ServingError, StatusCode, Unavailable
from kserve_trio.core.protocol import shown
from kserve_trio.gateway.config import SchedulingConfig, SchedulingMode, WorkBasis
from kserve_trio.gateway.fleet.routing_metadata import EMPTY_METADATA, RoutingMetadata
from kserve_trio.proto import inference as pb

QUANTUM = 1e-9
"""Load counters compare after rounding to this quantum (1 ns of device time under the compute
basis), so float residue never breaks a tie that is exact in intent."""


def quantize(load: float) -> int:
    """``load`` in whole quanta (the value loads are compared by)."""
    return round(load * 1e9)


# ---------------------------------------------------------------------------------------------
# The routing table


@dataclass(frozen=True)
class RoutingTable:
    """Model -> the labels of its ready replicas (sorted); ``workers`` are the workers whose
    repository index contributed (the ones that answered)."""

    models: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    workers: tuple[str, ...] = ()

    def replicas(self, model: str) -> tuple[str, ...]:
        return self.models.get(model, ())

    @property
    def size(self) -> int:
        """The number of routable models."""
        return len(self.models)

    def to_json(self, readiness: Mapping[str, bool]) -> dict[str, Any]:
        """The ``/routing`` document: ``models`` maps each model to its ready replicas' labels,
        ``workers`` lists every known worker (``readiness``: label -> ready) in label order."""
        return {
            "models": {name: list(labels) for name, labels in sorted(self.models.items())},
            "workers": [{"worker": w, "ready": bool(readiness[w])} for w in sorted(readiness)],
        }


EMPTY_TABLE = RoutingTable()


def ready_model_names(reply: pb.RepositoryIndexResponse) -> list[str]:
    """The model names a RepositoryIndex reply lists as READY (an empty state counts as ready:
    a server answering ``ready=true`` may omit it)."""
    return [m.name for m in reply.models if m.name and m.state in ("", "READY")]


def build_routing_table(ready: Mapping[str, Iterable[str]]) -> RoutingTable:
    """The table from each answering worker's ready models (label -> model names); a worker
    that did not answer is simply absent and contributes nothing."""
    models: dict[str, list[str]] = {}
    for worker, names in ready.items():
        for name in set(names):
            models.setdefault(name, []).append(worker)
    return RoutingTable(
        models={name: tuple(sorted(workers)) for name, workers in sorted(models.items())},
        workers=tuple(sorted(ready)),
    )


@dataclass(frozen=True)
class TableDiff:
    """Models that became routable, stopped being routable, or changed replicas."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.changed)


def diff_tables(old: RoutingTable, new: RoutingTable) -> TableDiff:
    return TableDiff(
        added=tuple(m for m in new.models if m not in old.models),
        removed=tuple(m for m in old.models if m not in new.models),
        changed=tuple(m for m in new.models if m in old.models and old.models[m] != new.models[m]),
    )


def no_ready_replica(model: str) -> Unavailable:
    """The one UNAVAILABLE for a model the fleet has but cannot serve now."""
    return Unavailable(
        f"model {shown(model)} has no ready replica now (its workers are not ready or not "
        "answering)"
    )


class RoutingState:
    """The current routing table, swapped atomically (one assignment on the event loop), and
    what each worker last listed, so that a model whose replicas are all unready now is told
    apart from a model no worker has.

    Rules (``missing``):
    1. *Last listing kept*: ``swap`` records, for each worker whose index built the new table, the
       models it listed (its last answer replaces the one before). A worker that did not answer this
       scan (not ready, frozen, unreachable) keeps its last listing.
    2. *Forget and rename*: ``forget`` drops a worker that discovery removed; ``rename`` carries a
       listing to a worker's new label.
    3. *Known or not found*: a model not in the table that some known worker last listed is *known*
       to the fleet: no replica is ready now, which is UNAVAILABLE (a client retries, or goes
       elsewhere). Any other model is NOT_FOUND. A worker that answers without the model (it was
       unloaded) makes it unknown again.
    """

    def __init__(self, table: RoutingTable = EMPTY_TABLE) -> None:
        self.table = table
        self._listed: dict[str, frozenset[str]] = {}

    def swap(
        self, new: RoutingTable, listed: Mapping[str, Iterable[str]] | None = None
    ) -> TableDiff:
        """*Last listing kept* (``listed``: worker -> the models it listed in this scan)."""
        old, self.table = self.table, new
        for worker, names in (listed or {}).items():
            self._listed[worker] = frozenset(names)
        return diff_tables(old, new)

    def forget(self, worker: str) -> None:
        """*Forget and rename*: a worker discovery removed."""
        self._listed.pop(worker, None)

    def rename(self, old: str, new: str) -> None:
        """*Forget and rename*: the same worker under a new label."""
        names = self._listed.pop(old, None)
        if names is not None:
            self._listed[new] = names

    def known(self, model: str) -> bool:
        """*Known or not found*: whether some known worker last listed ``model``."""
        return any(model in names for names in self._listed.values())

    def missing(self, model: str) -> ServingError:
        """*Known or not found*: the error for a request that found no replica of ``model``."""
        if self.known(model):
            return no_ready_replica(model)
        return NotFound(f"model {shown(model)} not found on any worker")


# ---------------------------------------------------------------------------------------------
# Selections and reservations


class Reservation:
    """What a selection holds on the workers it charged; ``release`` undoes it exactly once
    (later calls do nothing), so the forwarding code can release in a ``finally`` on every
    path. Also a context manager."""

    __slots__ = ("_undo",)

    def __init__(self, undo: Callable[[], None] | None = None) -> None:
        self._undo = undo

    @property
    def released(self) -> bool:
        return self._undo is None

    def release(self) -> None:
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(frozen=True)
class Selection:
    """The workers to try, in order (the first is the policy's choice), and the reservation
    to release when the request is done. An empty ``order`` means no replica is known."""

    order: tuple[str, ...]
    reservation: Reservation = field(default_factory=Reservation)


class RoutingPolicy(Protocol):
    """What every routing mode provides (see the module docstring)."""

    @property
    def mode(self) -> str:
        """The ``scheduling.mode`` value it implements."""
        ...

    @property
    def basis(self) -> WorkBasis | None:
        """What its load counters count (``None``: it keeps none)."""
        ...

    @property
    def needs_metadata(self) -> bool:
        """Whether the prober must poll ModelControlStatus for it each round."""
        ...

    def batch_input(self, model: str) -> tuple[str, int] | None:
        """``(input name, 1-based wire axis)`` whose shape to peek from a request, or ``None``
        when the policy does not count items."""
        ...

    def request_units(self, model: str, shape: tuple[int, ...] | None) -> int:
        """How many units (batch items) a request with that peeked shape is."""
        ...

    def select(self, model: str, units: int, table: RoutingTable) -> Selection:
        """The order to try workers in for one request, and its reservation."""
        ...

    def update_metadata(self, metadata: RoutingMetadata) -> None:
        """Adopt the latest routing metadata (called by the prober each round)."""
        ...

    def inflight_work(self) -> Mapping[str, float]:
        """Worker label -> its outstanding work on the policy's basis (empty if untracked)."""
        ...


class RoundRobin:
    """``round_robin``: each model's replicas in turn.

    Rules (``select``):
    1. A per-model cursor picks replica ``cursor mod n`` of the sorted replicas and advances by
       one; the cursor survives table swaps (the rotation continues as replicas change).
    2. The order is the replicas rotated to start at the pick, so the others follow as
       failover in their ring order.
    3. Nothing is reserved.
    """

    mode = SchedulingMode.ROUND_ROBIN.value
    basis = None
    needs_metadata = False

    def __init__(self) -> None:
        self._cursor: dict[str, int] = {}

    def batch_input(self, model: str) -> tuple[str, int] | None:
        return None

    def request_units(self, model: str, shape: tuple[int, ...] | None) -> int:
        return 1

    def select(self, model: str, units: int, table: RoutingTable) -> Selection:
        replicas = table.replicas(model)
        if not replicas:
            return Selection(())
        cursor = self._cursor.get(model, 0)
        self._cursor[model] = cursor + 1
        i = cursor % len(replicas)
        return Selection(replicas[i:] + replicas[:i])

    def update_metadata(self, metadata: RoutingMetadata) -> None:
        return None

    def inflight_work(self) -> Mapping[str, float]:
        return {}


class LeastOutstanding:
    """``least_outstanding``: the replica with the least work in flight, on a fixed basis.

    Rules (``select``):
    1. *Charge*: a request's charge is 1 under ``requests``, its units (batch items) under
       ``items``, and units times the model's item cost (seconds per item, from the routing
       metadata; never 0) under ``compute``.
    2. *Rank*: replicas are ranked by (quantized load, label): the least loaded first, exact ties
       (after quantization) to the smaller label. The rest follow in rank order as failover.
    3. *Release what was charged*: the charge is added to the first replica's load; releasing
       subtracts the same charge from the same worker (whatever the metadata says by then), and a
       load within one quantum of zero becomes exactly 0.0, so residue never accumulates.
    """

    mode = SchedulingMode.LEAST_OUTSTANDING.value

    def __init__(self, basis: WorkBasis, metadata: RoutingMetadata = EMPTY_METADATA) -> None:
        self.basis = basis
        self.needs_metadata = basis is not WorkBasis.REQUESTS
        self._metadata = metadata
        self._load: dict[str, float] = {}

    def batch_input(self, model: str) -> tuple[str, int] | None:
        if self.basis is WorkBasis.REQUESTS:
            return None
        return self._metadata.batch_input(model)

    def request_units(self, model: str, shape: tuple[int, ...] | None) -> int:
        if self.basis is WorkBasis.REQUESTS:
            return 1
        return self._metadata.request_items(model, shape)

    def charge(self, model: str, units: int) -> float:
        """The work one request of ``units`` adds to its worker (*charge*)."""
        if self.basis is WorkBasis.REQUESTS:
            return 1.0
        if self.basis is WorkBasis.ITEMS:
            return float(units)
        return units * self._metadata.item_cost(model)

    def select(self, model: str, units: int, table: RoutingTable) -> Selection:
        replicas = table.replicas(model)
        if not replicas:
            return Selection(())
        load = self._load
        order = tuple(sorted(replicas, key=lambda w: (quantize(load.get(w, 0.0)), w)))
        chosen = order[0]
        weight = self.charge(model, units)
        load[chosen] = load.get(chosen, 0.0) + weight
        return Selection(order, Reservation(lambda: self._release(chosen, weight)))

    def _release(self, worker: str, weight: float) -> None:
        left = self._load.get(worker, 0.0) - weight
        if abs(left) < QUANTUM:
            self._load.pop(worker, None)  # exactly zero: nothing in flight
        else:
            self._load[worker] = left

    def update_metadata(self, metadata: RoutingMetadata) -> None:
        self._metadata = metadata

    def inflight_work(self) -> Mapping[str, float]:
        return dict(sorted(self._load.items()))


def make_policy(scheduling: SchedulingConfig) -> RoutingPolicy:
    """The policy ``scheduling.mode`` names."""
    if scheduling.mode is SchedulingMode.LEAST_OUTSTANDING:
        return LeastOutstanding(scheduling.basis)
    return RoundRobin()


# ---------------------------------------------------------------------------------------------
# Failover


class Failover(enum.Enum):
    """What the forwarding code does after a worker's error."""

    RETURN = "return"
    """Give the error to the client unchanged."""
    NEXT = "next"
    """Try the next replica."""
    NEXT_AND_REFRESH = "next_and_refresh"
    """Try the next replica, and ask for a routing-table refresh (the table is stale)."""


def failover_action(status: StatusCode) -> Failover:
    """The next step after a worker call failed with ``status``.

    Rules:
    1. NOT_FOUND: the worker no longer serves the model; the table is stale: refresh it and
       try the next replica.
    2. UNAVAILABLE: the worker could not be reached or the connection failed (the transport
       reports these as UNAVAILABLE), or the worker itself says it cannot serve now (it is
       draining): try the next replica. If none is left the last error is returned as is.
    3. Every other status (INVALID_ARGUMENT, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED,
       FAILED_PRECONDITION, INTERNAL, ...) is the answer to this request and passes through
       unchanged.
    """
    if status is StatusCode.NOT_FOUND:
        return Failover.NEXT_AND_REFRESH
    if status is StatusCode.UNAVAILABLE:
        return Failover.NEXT
    return Failover.RETURN


__all__ = [
    "EMPTY_TABLE",
    "QUANTUM",
    "Failover",
    "LeastOutstanding",
    "Reservation",
    "RoundRobin",
    "RoutingPolicy",
    "RoutingState",
    "RoutingTable",
    "Selection",
    "TableDiff",
    "build_routing_table",
    "diff_tables",
    "failover_action",
    "make_policy",
    "quantize",
    "ready_model_names",
]

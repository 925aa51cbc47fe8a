"""The weight cache's pure half: the budget formula, the LRU bookkeeping, the residency floors
and the snapshot types, with no device, store or lock in sight.

``weight_budget`` solves how many bytes of on-demand weights fit the device arena, and
``plan_eviction`` which least-recently-used models make room for a load; ``CacheBook`` is the
state those two read and the driver (``kserve_trio.runtime.weight_cache.WeightCache``) mutates
under its lock. Everything here is tested with plain values.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kserve_trio.core.errors import InvalidArgument
from kserve_trio.core.process import ResidencyMode, ResidencyState


@dataclass(frozen=True, slots=True)
class WeightBudget:
    """The solved memory model (bytes)."""

    on_demand_budget: int
    weight_pool: int
    scratch_ceiling: int
    pinned_over_commit: bool


def weight_budget(
    *, arena: int, fraction: float, wiggle: float, max_scratch: int, pinned_bytes: int
) -> WeightBudget:
    """Solve the on-demand budget. The arena holds, at the worst instant, pinned weights +
    on-demand weights + one execution's scratch + a wiggle fraction of free slack:

    1. ``scratch_ceiling = floor((1 - wiggle) * arena)``;
    2. ``weight_pool = max(0, min(floor(fraction * arena), scratch_ceiling - max_scratch))``
       (pinned + on-demand weights together);
    3. ``on_demand_budget = clamp(weight_pool - pinned_bytes, 0, weight_pool)``;
    4. ``pinned_over_commit = pinned_bytes > weight_pool`` (no sizing can fix that).
    """
    scratch_ceiling = math.floor((1.0 - wiggle) * arena)
    weight_pool = max(0, min(math.floor(fraction * arena), scratch_ceiling - max_scratch))
    on_demand = min(max(weight_pool - pinned_bytes, 0), weight_pool)
    return WeightBudget(on_demand, weight_pool, scratch_ceiling, pinned_bytes > weight_pool)


@dataclass(frozen=True, slots=True)
class EvictionPlan:
    """Which LRU models to evict (least recent first) and whether the load then fits."""

    victims: tuple[str, ...]
    fits: bool


def plan_eviction(
    lru: Iterable[tuple[str, int]], resident_bytes: int, need: int, max_bytes: int
) -> EvictionPlan:
    """Walk the LRU from its least recently used end, collecting victims until
    ``resident_bytes - victims + need <= max_bytes``. When even evicting everything leaves it
    over, every model is a victim and ``fits`` is False (the caller loads anyway: a model larger
    than the whole budget must still run)."""
    victims: list[str] = []
    freed = 0
    for name, nbytes in lru:
        if resident_bytes - freed + need <= max_bytes:
            break
        victims.append(name)
        freed += nbytes
    return EvictionPlan(tuple(victims), resident_bytes - freed + need <= max_bytes)


@dataclass
class CacheBook:
    """Budget bookkeeping: the LRU of device-resident on-demand models and the counters.

    Only device-resident models that are *not* device-pinned are in ``lru``/``resident_bytes``;
    ``pinned_bytes`` counts the device-pinned ones.
    """

    max_bytes: int = 0
    lru: collections.OrderedDict[str, int] = field(default_factory=collections.OrderedDict)
    resident_bytes: int = 0
    pinned_bytes: int = 0
    loads: int = 0
    evicts: int = 0
    load_seconds: float = 0.0
    compactions: int = 0

    def touch(self, name: str) -> bool:
        """Move ``name`` to the most-recently-used end; False when it is not in the LRU."""
        if name not in self.lru:
            return False
        self.lru.move_to_end(name)
        return True

    def plan(self, need: int) -> EvictionPlan:
        return plan_eviction(self.lru.items(), self.resident_bytes, need, self.max_bytes)

    def add(self, name: str, nbytes: int) -> None:
        """Count ``name`` as resident at the MRU end (re-adding moves it)."""
        self.remove(name)
        self.lru[name] = nbytes
        self.resident_bytes += nbytes

    def remove(self, name: str) -> bool:
        nbytes = self.lru.pop(name, None)
        if nbytes is None:
            return False
        self.resident_bytes -= nbytes
        return True

    def rename(self, old: str, new: str) -> None:
        """Rekey in place, keeping the LRU position."""
        if old not in self.lru:
            return
        items = [(new if k == old else k, v) for k, v in self.lru.items()]
        self.lru = collections.OrderedDict(items)

    def clear(self) -> list[str]:
        names = list(self.lru)
        self.lru.clear()
        self.resident_bytes = 0
        return names


def resolve_floor(configured: ResidencyState | None, cache_enabled: bool) -> ResidencyState:
    """Unspecified residency: PINNED_SYSTEM with the cache on, else UNPINNED."""
    if configured is not None:
        return ResidencyState(configured)
    return ResidencyState.PINNED_SYSTEM if cache_enabled else ResidencyState.UNPINNED


def least_resident(states: Iterable[ResidencyState]) -> ResidencyState:
    """The weakest floor of a group (a meta's sub-models); UNPINNED for an empty group."""
    return min(states, default=ResidencyState.UNPINNED)


def residency_target(value: ResidencyState | int) -> ResidencyState:
    """A residency target from an enum member or its number; anything but UNPINNED,
    PINNED_SYSTEM or PINNED_DEVICE (e.g. the proto's RESIDENCY_UNSPECIFIED) is
    INVALID_ARGUMENT."""
    try:
        target = ResidencyState(int(value))
    except (ValueError, TypeError):
        target = None
    if target is None:
        raise InvalidArgument(
            "residency target must be UNPINNED, PINNED_SYSTEM or PINNED_DEVICE "
            f"(got {getattr(value, 'name', value)})"
        )
    return target


# ----------------------------------------------------------------------------------------------
# Snapshots
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelResidency:
    """One model's residency as reported to operators."""

    floor: ResidencyState
    device_resident: bool
    host_resident: bool
    weight_nbytes: int


@dataclass(frozen=True, slots=True)
class WeightCacheStats:
    """A snapshot of the cache counters (``weight_cache_stats``)."""

    enabled: bool
    mode: ResidencyMode
    arena_bytes: int
    max_bytes: int
    resident_bytes: int
    pinned_bytes: int
    max_scratch_bytes: int
    weight_pool_bytes: int
    loads: int
    evicts: int
    load_seconds: float
    compactions: int
    lru: tuple[str, ...]
    probed: bool


Program = tuple[Any, Sequence[np.ndarray], Callable[[Sequence[Any]], Any]]
"""One compiled program of a model for the probe: ``(label, zero inputs, run(inputs))``."""


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What the startup isolation probe measured and resolved."""

    budget: WeightBudget
    max_scratch: int
    max_weight: int
    costs: dict[str, dict[Any, float]]
    failures: dict[str, list[str]]

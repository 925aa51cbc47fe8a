"""The on-demand weight cache: residency floors, a host tier and an LRU device tier.

Each model's weights live in up to two tiers:

* the **host tier**: the weights materialised into RAM once, through a ``WeightStore``
  (``core/weight_store.py``: private arrays, or a region shared by the node's workers);
* the **device tier**: the weights as device buffers (``CompiledModel.load_weights`` /
  ``free_weights``), either pinned for the process lifetime or held in an LRU under a byte
  budget and evicted on demand.

A model's *floor* (``ResidencyState``) says what is guaranteed: ``UNPINNED`` nothing (an
on-demand load reads the weights file), ``PINNED_SYSTEM`` the host tier (an on-demand load is
a pure host-to-device copy), ``PINNED_DEVICE`` the device tier (exempt from the budget and from
eviction). Who moves floors is fixed at startup (``ResidencyMode``): a self-managed worker loads
and evicts by itself; an externally-managed one (explicit mode) never loads on its own and
refuses to run a model that is not resident (``NotResidentError``).

The module is split like the planners: the budget arithmetic
(``weight_budget``) and the LRU bookkeeping (``plan_eviction``, ``CacheBook``) are pure and
tested plainly; ``WeightCache`` drives them with the device operations. Every mutating call of
``WeightCache`` is made on the scheduler's device thread (the single residency mutator); an
internal lock still serialises them, and a second short lock guards the counters so that
``stats()`` (read at scrape time on the event loop) never waits for a transfer.

On the CPU the cache is active iff ``runtime.cpu_device_memory_bytes`` > 0: that figure stands
for the device arena and everything behaves as on a GPU.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kserve_trio.core.config import ResidencyMode, ResidencyState
from kserve_trio.core.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from kserve_trio.core.logging import get_logger
from kserve_trio.core.weight_store import (
    PrivateWeightStore,
    WeightStore,
    make_weight_store,
    weights_digest,
    weights_file_token,
)

log = get_logger("kserve_trio.runtime.weight_cache")

MIN_COST_SECONDS = 1e-6

NEEDS_CACHE = (
    "residency control requires the on-demand weight cache (runtime.weight_cache_fraction > 0 "
    "and a device memory arena; on the CPU set runtime.cpu_device_memory_bytes)"
)
SELF_MANAGED = "worker is self-managed; residency is not externally controllable"


class NotResidentError(FailedPrecondition):
    """Explicit mode: the model's weights are not on the device, and this worker never loads
    them on its own; the control plane must pin it (``RepositoryModelLoad`` /
    ``SetModelResidency``)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"model '{name}' is not resident")
        self.model_name = name


# ----------------------------------------------------------------------------------------------
# Pure: the budget formula and the LRU bookkeeping
# ----------------------------------------------------------------------------------------------


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


@dataclass(eq=False)
class _Record:
    """A model the cache manages; ``host`` is its host tier (None when not materialised)."""

    name: str
    entry: Any  # runtime.model.CompiledModel
    nbytes: int
    floor: ResidencyState
    host: list[np.ndarray] | None = None


# ----------------------------------------------------------------------------------------------
# The cache
# ----------------------------------------------------------------------------------------------


class WeightCache:
    """Residency of every compiled model of a worker (see the module docstring).

    ``arena`` is the device memory pool in bytes (``mem_fraction`` x device memory on a GPU,
    ``cpu_device_memory_bytes`` on the CPU); the cache is *enabled* iff ``arena > 0`` and
    ``fraction > 0``. Disabled, it only guarantees that every model is loaded (and never
    evicted); residency control then answers FAILED_PRECONDITION.
    """

    def __init__(
        self,
        backend: Any,
        *,
        store: WeightStore | None = None,
        mode: ResidencyMode = ResidencyMode.SELF_MANAGED,
        arena: int = 0,
        fraction: float = 1.0,
        wiggle: float = 0.1,
        compaction_interval: int = 0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.backend = backend
        self.store: WeightStore = store if store is not None else PrivateWeightStore()
        self.mode = ResidencyMode(mode)
        self.arena = max(int(arena), 0)
        self.fraction = float(fraction)
        self.wiggle = float(wiggle)
        self.enabled = self.arena > 0 and self.fraction > 0
        self.compaction_interval = int(compaction_interval)
        self._clock = clock
        self._records: dict[str, _Record] = {}
        self._op = threading.RLock()  # serialises residency operations (device work inside)
        self._book_lock = threading.Lock()  # short: counters and LRU, for stats()
        provisional = math.floor(self.fraction * self.arena) if self.enabled else 0
        self._book = CacheBook(max_bytes=provisional)
        self._weight_pool = provisional
        self._max_scratch = 0
        self._probed = False
        self._compact_mark = 0

    @classmethod
    def from_config(cls, backend: Any, config: Any) -> WeightCache:
        """Build from a ``ServerConfig``: arena from the backend's ``bytes_limit``."""
        rt = config.runtime
        try:
            arena = int(backend.memory_stats().get("bytes_limit", 0))
        except Exception:  # a backend that reports nothing has no arena
            arena = 0
        return cls(
            backend,
            store=make_weight_store(rt.shared_host_weights, rt.shared_host_weights_mode),
            mode=config.residency_mode,
            arena=arena,
            fraction=rt.weight_cache_fraction,
            wiggle=rt.weight_cache_wiggle_fraction,
            compaction_interval=config.scheduler.compaction_interval,
        )

    # -- queries ---------------------------------------------------------------------------

    @property
    def externally_managed(self) -> bool:
        return self.mode is ResidencyMode.EXTERNALLY_MANAGED

    @property
    def max_bytes(self) -> int:
        """The on-demand budget (0 when the cache is disabled)."""
        return self._book.max_bytes if self.enabled else 0

    def resolve_floor(self, configured: ResidencyState | None) -> ResidencyState:
        return resolve_floor(configured, self.enabled)

    def has(self, name: str) -> bool:
        return name in self._records

    def residency(self, name: str) -> ModelResidency:
        """The model's floor and tiers; NOT_FOUND for a model the cache does not manage."""
        rec = self._record(name)
        return ModelResidency(
            rec.floor, bool(rec.entry.weights_resident()), rec.host is not None, rec.nbytes
        )

    def is_servable(self, name: str) -> bool:
        """Whether a request may run now: always when self-managed (it loads on demand),
        only when device-resident in explicit mode."""
        rec = self._records.get(name)
        if rec is None:
            return False
        if not self.externally_managed or not self.enabled:
            return True
        return bool(rec.entry.weights_resident())

    def check_servable(self, name: str) -> None:
        """Raise ``NotResidentError`` for a request explicit mode cannot run (before queueing)."""
        rec = self._records.get(name)
        if rec is not None and not self.is_servable(name):
            raise NotResidentError(name)

    def stats(self) -> WeightCacheStats:
        """The counters under the (short) bookkeeping lock."""
        with self._book_lock:
            b = self._book
            return WeightCacheStats(
                enabled=self.enabled,
                mode=self.mode,
                arena_bytes=self.arena,
                max_bytes=self.max_bytes,
                resident_bytes=b.resident_bytes,
                pinned_bytes=b.pinned_bytes,
                max_scratch_bytes=self._max_scratch,
                weight_pool_bytes=self._weight_pool if self.enabled else 0,
                loads=b.loads,
                evicts=b.evicts,
                load_seconds=b.load_seconds,
                compactions=b.compactions,
                lru=tuple(b.lru),
                probed=self._probed,
            )

    # -- admission and removal -------------------------------------------------------------

    def admit(self, entry: Any, floor: ResidencyState | None = None) -> ResidencyState:
        """Manage a compiled model and apply its initial residency.

        Rules: ``floor`` None resolves per ``resolve_floor``. Cache disabled: load the weights
        (every model stays resident). Enabled: PINNED_DEVICE transfers from the weights file and
        keeps no host copy; PINNED_SYSTEM materialises the host tier; UNPINNED holds nothing.
        A name that is already managed raises FAILED_PRECONDITION. A failing host
        materialisation is logged and leaves the model loadable from its file.
        """
        with self._op:
            name = entry.name
            if name in self._records:
                raise FailedPrecondition(f"model '{name}' is already managed by the weight cache")
            target = self.resolve_floor(floor)
            rec = _Record(name, entry, int(entry.weight_nbytes), target)
            self._records[name] = rec
            if not self.enabled:
                if not entry.weights_resident():
                    self._load(rec)
                return target
            if target is ResidencyState.PINNED_DEVICE:
                self._load(rec)
                with self._book_lock:
                    self._book.pinned_bytes += rec.nbytes
                self._rebudget()
            else:
                if entry.weights_resident():  # compiled with its weights: they count now
                    with self._book_lock:
                        self._book.add(name, rec.nbytes)
                if target is ResidencyState.PINNED_SYSTEM:
                    try:
                        self._materialize(rec)
                    except Exception as exc:
                        log.error("host_weights_failed", model=name, error=repr(exc))
            log.debug("residency_initial", model=name, residency=target.name.lower())
            return target

    def replace(self, entry: Any) -> ResidencyState:
        """A reloaded model: release the old version's tiers, admit the new one at the floor
        the old one had (what the operator set survives a reload)."""
        with self._op:
            old = self._records.get(entry.name)
            floor = old.floor if old is not None else None
            if old is not None:
                self._release(old)
            return self.admit(entry, floor)

    def release(self, name: str, entry: Any = None) -> bool:
        """Drop a model (unload): out of the LRU, device buffers freed, host tier released.
        With ``entry``, only if the managed version is that one. Returns whether it was."""
        with self._op:
            rec = self._records.get(name)
            if rec is None or (entry is not None and rec.entry is not entry):
                return False
            self._release(rec)
            return True

    def rename(self, old: str, new: str) -> None:
        """Rekey a model (renamed bundle): LRU position and store attachment; no memory moves."""
        with self._op:
            rec = self._records.pop(old, None)
            if rec is None:
                return
            if new in self._records:
                self._records[old] = rec
                raise FailedPrecondition(f"cannot rename '{old}' to '{new}': '{new}' is managed")
            rec.name = new
            self._records[new] = rec
            with self._book_lock:
                self._book.rename(old, new)
            self.store.rename(old, new)

    def close(self) -> None:
        """Release every model and the store (shutdown)."""
        with self._op:
            for rec in list(self._records.values()):
                try:
                    self._release(rec)
                except Exception as exc:  # shutdown goes on
                    log.warning("residency_release_failed", model=rec.name, error=repr(exc))
            self.store.close()

    # -- the hot path ------------------------------------------------------------------------

    def acquire(self, entry: Any) -> None:
        """Guarantee ``entry``'s weights are on the device before it runs.

        Rules:
        1. device-pinned: nothing to do (defensively loaded if it lacks its buffers);
        2. already resident: move to the MRU end;
        3. explicit mode and not resident: ``NotResidentError``;
        4. otherwise collect LRU victims until it fits the budget; if it cannot fit even after
           evicting everything, warn and load anyway; evict the victims (``evicts``), transfer
           from the host tier (or the weights file), append at the MRU end (``loads``,
           ``load_seconds``).
        A version that is no longer the managed one (reloaded meanwhile) is UNAVAILABLE.
        """
        with self._op:
            rec = self._records.get(entry.name)
            if rec is None or rec.entry is not entry:  # renamed just now, or replaced
                rec = next((r for r in self._records.values() if r.entry is entry), None)
            if rec is None:
                if entry.weights_resident():
                    return
                raise Unavailable(f"model '{entry.name}' was reloaded; retry")
            if not self.enabled or rec.floor is ResidencyState.PINNED_DEVICE:
                if not entry.weights_resident():
                    self._load(rec)
                return
            if entry.weights_resident():
                with self._book_lock:
                    if not self._book.touch(rec.name):
                        self._book.add(rec.name, rec.nbytes)
                return
            if self.externally_managed:
                raise NotResidentError(rec.name)
            with self._book_lock:
                plan = self._book.plan(rec.nbytes)
                budget = self._book.max_bytes
            if not plan.fits:
                log.warning(
                    "model_exceeds_weight_budget",
                    model=rec.name,
                    weight_bytes=rec.nbytes,
                    budget_bytes=budget,
                    detail="loading anyway after evicting every on-demand model",
                )
            for victim in plan.victims:
                self._evict(self._records[victim])
            t0 = self._clock()
            self._load(rec)
            dt = self._clock() - t0
            with self._book_lock:
                self._book.add(rec.name, rec.nbytes)
                self._book.loads += 1
                self._book.load_seconds += dt
            log.debug(
                "weights_loaded",
                model=rec.name,
                bytes=rec.nbytes,
                source="host" if rec.host is not None else "file",
                evicted=list(plan.victims),
                duration_ms=round(dt * 1e3, 3),
            )

    def after_dispatch(self) -> None:
        """Worker auto-compaction: every ``compaction_interval`` loads, compact (eagerly, no
        reloads). Errors only warn."""
        n = self.compaction_interval
        if n <= 0 or not self.enabled:
            return
        with self._book_lock:
            due = self._book.loads - self._compact_mark >= n
            if due:
                self._compact_mark = self._book.loads
        if due:
            try:
                self.compact(())
            except Exception as exc:
                log.warning("auto_compaction_failed", error=repr(exc))

    # -- control -------------------------------------------------------------------------------

    def set_residency(self, name: str, target: ResidencyState | int) -> ResidencyState:
        """Move a model to ``target``; explicit mode with the cache only.

        Errors: a target outside UNPINNED/PINNED_SYSTEM/PINNED_DEVICE is INVALID_ARGUMENT; an
        unknown model NOT_FOUND ``unknown model: m``; no cache or a self-managed worker
        FAILED_PRECONDITION.
        """
        target = residency_target(target)
        with self._op:
            rec = self._record(name)
            if not self.enabled:
                raise FailedPrecondition(NEEDS_CACHE)
            if not self.externally_managed:
                raise FailedPrecondition(SELF_MANAGED)
            return self._transition(rec, target)

    def compact(self, reload: Sequence[str] = ()) -> int:
        """Free every resident on-demand (non-pinned) device buffer at once, then (self-managed
        only) reload each listed non-pinned model that is not resident.

        Device-pinned models and host tiers are untouched. A no-op returning 0 when the cache is
        disabled. An unknown name in ``reload`` is NOT_FOUND before anything is freed.
        Returns how many models were reloaded.
        """
        if not self.enabled:
            return 0
        with self._op:
            for name in reload:
                self._record(name)
            before = self._in_use()
            with self._book_lock:
                freed = self._book.clear()
                self._book.compactions += 1
            for name in freed:
                self._records[name].entry.free_weights()
            reloaded = 0
            if not self.externally_managed:
                for name in dict.fromkeys(reload):
                    rec = self._records[name]
                    if rec.floor is ResidencyState.PINNED_DEVICE or rec.entry.weights_resident():
                        continue
                    self.acquire(rec.entry)
                    reloaded += 1
            log.info(
                "memory_compacted",
                freed=freed,
                reloaded=reloaded,
                resident_bytes_after=self._book.resident_bytes,
                device_in_use_before=before,
                device_in_use_after=self._in_use(),
            )
            return reloaded

    def probe(self, programs: Callable[[str], Sequence[Program]]) -> ProbeResult:
        """The startup isolation probe: measure each model's peak scratch, then
        solve the budget.

        Rules:
        1. for each non-device-pinned model with programs, in ascending weight size: free every
           on-demand device buffer, load this model (whatever the mode: nothing is served yet,
           and explicit mode needs the measurement too), ``max_weight = max(max_weight, nbytes)``;
        2. run each program once on its zero inputs (timed: the costs seed the scheduler);
        3. scratch: with an allocator peak (GPU), ``peak_in_use - (pinned + max_weight)``; without
           one (CPU), the live bytes while the inputs and outputs exist minus those before the
           inputs were transferred; ``max_scratch`` is the largest, at least 0;
        4. free everything on-demand again; ``max_bytes`` becomes the solved on-demand budget.
        Failures of a program only warn. Loads here are not counted in ``loads``.
        """
        costs: dict[str, dict[Any, float]] = {}
        failures: dict[str, list[str]] = {}
        with self._op:
            if not self.enabled:
                budget = WeightBudget(0, 0, 0, False)
                return ProbeResult(budget, 0, 0, costs, failures)
            use_peak = "peak_bytes_in_use" in self._stats()
            max_weight = 0
            max_scratch = 0
            order = sorted(
                (r for r in self._records.values() if r.floor is not ResidencyState.PINNED_DEVICE),
                key=lambda r: (r.nbytes, r.name),
            )
            for rec in order:
                progs = list(programs(rec.name))
                if not progs:
                    continue
                self._free_on_demand()
                try:
                    self._load(rec)
                except Exception as exc:
                    failures.setdefault(rec.name, []).append(f"load: {exc!r}")
                    continue
                max_weight = max(max_weight, rec.nbytes)
                pinned = self._book.pinned_bytes
                for label, inputs, run in progs:
                    try:
                        base = self._in_use()
                        dev_inputs = self.backend.transfer_to_device(list(inputs))
                        t0 = self._clock()
                        outs = run(dev_inputs)
                        dt = self._clock() - t0
                        if use_peak:
                            peak = int(self._stats().get("peak_bytes_in_use", 0))
                            scratch = peak - (pinned + max_weight)
                        else:
                            scratch = self._in_use() - base
                        del outs, dev_inputs
                    except Exception as exc:
                        failures.setdefault(rec.name, []).append(f"{label}: {exc!r}")
                        continue
                    max_scratch = max(max_scratch, scratch)
                    costs.setdefault(rec.name, {})[label] = max(dt, MIN_COST_SECONDS)
            self._free_on_demand()
            max_scratch = max(max_scratch, 0)
            self._max_scratch = max_scratch
            self._probed = True
            budget = self._rebudget()
            self._log_budget(budget, max_weight)
            return ProbeResult(budget, max_scratch, max_weight, costs, failures)

    # -- internals ---------------------------------------------------------------------------

    def _record(self, name: str) -> _Record:
        rec = self._records.get(name)
        if rec is None:
            raise NotFound(f"unknown model: {name}")
        return rec

    def _stats(self) -> dict[str, int]:
        try:
            return dict(self.backend.memory_stats())
        except Exception:
            return {}

    def _in_use(self) -> int:
        try:
            return int(self.backend.memory_in_use())
        except Exception:
            return int(self._stats().get("bytes_in_use", 0))

    def _rebudget(self) -> WeightBudget:
        """Re-solve the budget after the pinned bytes changed (probe done) and apply it."""
        budget = weight_budget(
            arena=self.arena,
            fraction=self.fraction,
            wiggle=self.wiggle,
            max_scratch=self._max_scratch,
            pinned_bytes=self._book.pinned_bytes,
        )
        if self._probed:
            with self._book_lock:
                self._book.max_bytes = budget.on_demand_budget
            self._weight_pool = budget.weight_pool
        return budget

    def _log_budget(self, budget: WeightBudget, max_weight: int) -> None:
        on_demand = [
            r.name for r in self._records.values() if r.floor is not ResidencyState.PINNED_DEVICE
        ]
        log.info(
            "weight_budget_resolved",
            arena_bytes=self.arena,
            fraction=self.fraction,
            wiggle=self.wiggle,
            max_scratch_bytes=self._max_scratch,
            max_weight_bytes=max_weight,
            pinned_bytes=self._book.pinned_bytes,
            weight_pool_bytes=budget.weight_pool,
            on_demand_budget_bytes=budget.on_demand_budget,
            mode=self.mode.value,
        )
        if budget.pinned_over_commit:
            log.warning(
                "pinned_weights_over_commit",
                pinned_bytes=self._book.pinned_bytes,
                weight_pool_bytes=budget.weight_pool,
            )
        elif budget.on_demand_budget == 0 and on_demand:
            log.warning(
                "weight_budget_zero",
                models=sorted(on_demand),
                detail="non-pinned models reload on every dispatch",
            )

    def _file_arrays(self, rec: _Record) -> list[np.ndarray]:
        log.debug("weights_file_read", model=rec.name, path=str(rec.entry.weights.path))
        return rec.entry.weights.host_arrays()

    def _load(self, rec: _Record) -> None:
        """Device copy from the host tier, else from the weights file (no counters)."""
        hosts = rec.host if rec.host is not None else self._file_arrays(rec)
        rec.entry.load_weights(hosts)

    def _evict(self, rec: _Record) -> None:
        rec.entry.free_weights()
        with self._book_lock:
            self._book.remove(rec.name)
            self._book.evicts += 1
        log.debug("weights_evicted", model=rec.name, bytes=rec.nbytes)

    def _free_on_demand(self) -> None:
        """Free every device buffer that is not device-pinned (uncounted: probe only)."""
        with self._book_lock:
            self._book.clear()
        for rec in self._records.values():
            if rec.floor is not ResidencyState.PINNED_DEVICE and rec.entry.weights_resident():
                rec.entry.free_weights()

    def _materialize(self, rec: _Record) -> None:
        """Build the host tier through the store (reads the file only when this worker is
        the one that must fill it)."""
        entries = rec.entry.weights.entries
        specs = [(e.dtype.numpy, e.shape) for e in entries]
        digest = weights_digest(rec.name, specs, content=weights_file_token(rec.entry.weights.path))

        def fill(arrays: list[np.ndarray]) -> None:
            for dst, src in zip(arrays, self._file_arrays(rec), strict=True):
                np.copyto(dst, src)

        rec.host = self.store.materialize(rec.name, digest, specs, fill)

    def _drop_host(self, rec: _Record) -> None:
        rec.host = None
        self.store.release(rec.name)

    def _release(self, rec: _Record) -> None:
        with self._book_lock:
            self._book.remove(rec.name)
            if rec.floor is ResidencyState.PINNED_DEVICE and self.enabled:
                self._book.pinned_bytes -= rec.nbytes
        self._records.pop(rec.name, None)
        rec.entry.free_weights()
        if rec.host is not None:
            self._drop_host(rec)
        if rec.floor is ResidencyState.PINNED_DEVICE and self.enabled:
            self._rebudget()

    def _transition(self, rec: _Record, target: ResidencyState) -> ResidencyState:
        """Rules:
        1. to PINNED_SYSTEM without a host tier: materialise it;
        2. to UNPINNED with a host tier: release it;
        3. to PINNED_DEVICE without device buffers: transfer (host tier or file);
        4. leaving PINNED_DEVICE: explicit mode frees the device buffers (nothing would evict
           them); self-managed keeps them, now evictable;
        5. bookkeeping: out of the LRU; pinned bytes follow the floor; a device-resident model
           that is not device-pinned goes to the MRU end; the budget is re-solved.
        """
        entry = rec.entry
        before = rec.floor
        if target is ResidencyState.PINNED_SYSTEM and rec.host is None:
            self._materialize(rec)
        if target is ResidencyState.UNPINNED and rec.host is not None:
            self._drop_host(rec)
        if target is ResidencyState.PINNED_DEVICE and not entry.weights_resident():
            self._load(rec)
        leaving = before is ResidencyState.PINNED_DEVICE and target is not before
        if leaving and self.externally_managed:
            entry.free_weights()
        with self._book_lock:
            self._book.remove(rec.name)
            if before is ResidencyState.PINNED_DEVICE:
                self._book.pinned_bytes -= rec.nbytes
            if target is ResidencyState.PINNED_DEVICE:
                self._book.pinned_bytes += rec.nbytes
            rec.floor = target
            if target is not ResidencyState.PINNED_DEVICE and entry.weights_resident():
                self._book.add(rec.name, rec.nbytes)
        self._rebudget()
        log.debug(
            "residency_changed",
            model=rec.name,
            before=before.name.lower(),
            after=target.name.lower(),
            device_resident=bool(entry.weights_resident()),
            host_resident=rec.host is not None,
        )
        return target


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


def weight_cache_stats(cache: WeightCache) -> WeightCacheStats:
    """Function spelling of ``cache.stats()``."""
    return cache.stats()


__all__ = [
    "NEEDS_CACHE",
    "SELF_MANAGED",
    "CacheBook",
    "EvictionPlan",
    "ModelResidency",
    "NotResidentError",
    "ProbeResult",
    "Program",
    "WeightBudget",
    "WeightCache",
    "WeightCacheStats",
    "least_resident",
    "plan_eviction",
    "residency_target",
    "resolve_floor",
    "weight_budget",
    "weight_cache_stats",
]

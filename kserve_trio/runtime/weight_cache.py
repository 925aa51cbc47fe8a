"""The on-demand weight cache: residency floors, a host tier and an LRU device tier.

Each model's weights live in up to two tiers:

* the **host tier**: the weights materialised into RAM once, through a ``WeightStore``
  (``runtime/weight_store.py``: private arrays, or a region shared by the node's workers);
* the **device tier**: the weights as device buffers (``CompiledModel.load_weights`` /
  ``free_weights``), either pinned for the process lifetime or held in an LRU under a byte
  budget and evicted on demand.

A model's *floor* (``ResidencyState``) says what is guaranteed: ``UNPINNED`` nothing (an
on-demand load reads the weights file), ``PINNED_SYSTEM`` the host tier (an on-demand load is
a pure host-to-device copy), ``PINNED_DEVICE`` the device tier (exempt from the budget and from
eviction). Who moves floors is fixed at startup (``ResidencyMode``): a self-managed worker loads
and evicts by itself; an externally-managed one (explicit mode) never loads on its own and
refuses to run a model that is not resident (``NotResidentError``).

The module is split like the planners: the budget arithmetic (``weight_budget``) and the LRU
bookkeeping (``plan_eviction``, ``CacheBook``) are pure and tested plainly
(``runtime/_budget.py``); the moves of weights between file, host and device are
``runtime/_tiers.py``; ``WeightCache`` here drives both. Every mutating call of
``WeightCache`` is made on the scheduler's device thread (the single residency mutator); an
internal lock still serialises them, and a second short lock guards the counters so that
``stats()`` (read at scrape time on the event loop) never waits for a transfer.

On the CPU the cache is active iff ``runtime.cpu_device_memory_bytes`` > 0: that figure stands
for the device arena and everything behaves as on a GPU.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence

from kserve_trio.core.errors import FailedPrecondition, NotFound, Unavailable
from kserve_trio.core.logging import get_logger
from kserve_trio.core.process import ResidencyMode, ResidencyState, ServerConfig
from kserve_trio.runtime._budget import (
    CacheBook,
    EvictionPlan,
    ModelResidency,
    ProbeResult,
    Program,
    WeightBudget,
    WeightCacheStats,
    least_resident,
    plan_eviction,
    residency_target,
    resolve_floor,
    weight_budget,
)
from kserve_trio.runtime._probe import MIN_COST_SECONDS, measure_scratch
from kserve_trio.runtime._tiers import DeviceMemory, ManagedModel, Record, Tiers
from kserve_trio.runtime.weight_store import PrivateWeightStore, WeightStore, make_weight_store

log = get_logger("kserve_trio.runtime.weight_cache")

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
        backend: DeviceMemory,
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
        self._tiers = Tiers(backend, self.store)
        self.mode = ResidencyMode(mode)
        self.arena = max(int(arena), 0)
        self.fraction = float(fraction)
        self.wiggle = float(wiggle)
        self.enabled = self.arena > 0 and self.fraction > 0
        self.compaction_interval = int(compaction_interval)
        self._clock = clock
        self._records: dict[str, Record] = {}
        self._op = threading.RLock()  # serialises residency operations (device work inside)
        self._book_lock = threading.Lock()  # short: counters and LRU, for stats()
        provisional = math.floor(self.fraction * self.arena) if self.enabled else 0
        self._book = CacheBook(max_bytes=provisional)
        self._weight_pool = provisional
        self._max_scratch = 0
        self._probed = False
        self._compact_mark = 0

    @classmethod
    def from_config(cls, backend: DeviceMemory, config: ServerConfig) -> WeightCache:
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

    @property
    def loads(self) -> int:
        """Weight loads so far (one counter read: a traced execution compares it before and
        after itself to say whether it loaded its model's weights)."""
        return self._book.loads

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

    def admit(self, entry: ManagedModel, floor: ResidencyState | None = None) -> ResidencyState:
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
            rec = Record(name, entry, int(entry.weight_nbytes), target)
            self._records[name] = rec
            if not self.enabled:
                if not entry.weights_resident():
                    self._tiers.load(rec)
                return target
            if target is ResidencyState.PINNED_DEVICE:
                self._tiers.load(rec)
                with self._book_lock:
                    self._book.pinned_bytes += rec.nbytes
                self._rebudget()
            else:
                if entry.weights_resident():  # compiled with its weights: they count now
                    with self._book_lock:
                        self._book.add(name, rec.nbytes)
                if target is ResidencyState.PINNED_SYSTEM:
                    try:
                        self._tiers.materialize(rec)
                    except Exception as exc:
                        log.error("host_weights_failed", model=name, error=repr(exc))
            log.debug("residency_initial", model=name, residency=target.name.lower())
            return target

    def replace(self, entry: ManagedModel) -> ResidencyState:
        """A reloaded model: release the old version's tiers, admit the new one at the floor
        the old one had (what the operator set survives a reload)."""
        with self._op:
            old = self._records.get(entry.name)
            floor = old.floor if old is not None else None
            if old is not None:
                self._release(old)
            return self.admit(entry, floor)

    def release(self, name: str, entry: ManagedModel | None = None) -> bool:
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

    def acquire(self, entry: ManagedModel) -> None:
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
                    self._tiers.load(rec)
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
            self._tiers.load(rec)
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
            before = self._tiers.in_use()
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
                device_in_use_after=self._tiers.in_use(),
            )
            return reloaded

    def probe(self, programs: Callable[[str], Sequence[Program]]) -> ProbeResult:
        """The startup isolation probe: measure each model's peak scratch, then
        solve the budget.

        Rules:
        1. every non-device-pinned model, in ascending weight size, is measured alone on the
           device whatever the mode (nothing is served yet, and explicit mode needs the
           measurement too): ``_probe.measure_scratch``'s rules;
        2. free everything on-demand again; ``max_bytes`` becomes the solved on-demand budget.
        Failures of a program only warn. Loads here are not counted in ``loads``.
        """
        with self._op:
            if not self.enabled:
                return ProbeResult(WeightBudget(0, 0, 0, False), 0, 0, {}, {})
            order = sorted(
                (r for r in self._records.values() if r.floor is not ResidencyState.PINNED_DEVICE),
                key=lambda r: (r.nbytes, r.name),
            )
            m = measure_scratch(
                order,
                programs,
                self._tiers,
                pinned_bytes=self._book.pinned_bytes,
                free_on_demand=self._free_on_demand,
                clock=self._clock,
            )
            self._free_on_demand()
            self._max_scratch = m.max_scratch
            self._probed = True
            budget = self._rebudget()
            self._log_budget(budget, m.max_weight)
            return ProbeResult(budget, m.max_scratch, m.max_weight, m.costs, m.failures)

    # -- internals ---------------------------------------------------------------------------

    def _record(self, name: str) -> Record:
        rec = self._records.get(name)
        if rec is None:
            raise NotFound(f"unknown model: {name}")
        return rec

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

    def _evict(self, rec: Record) -> None:
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

    def _release(self, rec: Record) -> None:
        with self._book_lock:
            self._book.remove(rec.name)
            if rec.floor is ResidencyState.PINNED_DEVICE and self.enabled:
                self._book.pinned_bytes -= rec.nbytes
        self._records.pop(rec.name, None)
        rec.entry.free_weights()
        if rec.host is not None:
            self._tiers.drop_host(rec)
        if rec.floor is ResidencyState.PINNED_DEVICE and self.enabled:
            self._rebudget()

    def _transition(self, rec: Record, target: ResidencyState) -> ResidencyState:
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
            self._tiers.materialize(rec)
        if target is ResidencyState.UNPINNED and rec.host is not None:
            self._tiers.drop_host(rec)
        if target is ResidencyState.PINNED_DEVICE and not entry.weights_resident():
            self._tiers.load(rec)
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


def weight_cache_stats(cache: WeightCache) -> WeightCacheStats:
    """Function spelling of ``cache.stats()``."""
    return cache.stats()


__all__ = [
    "MIN_COST_SECONDS",
    "NEEDS_CACHE",
    "SELF_MANAGED",
    "CacheBook",
    "EvictionPlan",
    "ManagedModel",
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

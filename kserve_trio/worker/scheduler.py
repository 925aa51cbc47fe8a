"""The worker's dispatch engine: per-model queues, one dispatch loop, one device thread.

This module owns the async shell around ``worker/planner.py``: requests are preprocessed on their
own task (hooks in worker threads), queued per model, coalesced by the single dispatch loop into
batches at compiled sizes, executed one at a time on a dedicated device thread, sliced back and
postprocessed on their own task again. Everything that touches the queues or the per-model state
runs on the event loop thread, so no lock is needed; the device thread only sees the arrays and the
model entry of the unit it runs.

A *unit* of device work is either a planned batch of one model or an arbitrary callable
(``run_on_device``: meta models, control operations); callables are served before the
discipline picks the next batch, like upstream's control commands.

With a ``WeightCache`` (``runtime/weight_cache.py``) every batch first *acquires* its model's
weights on the device thread (not part of the timed compute), and every residency
change -- admission, reload, unload, ``set_residency``, ``compact``, the startup probe -- runs as
a unit there too, so the device thread is the single residency mutator.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import numpy as np

from kserve_trio.core.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServingError,
    Unavailable,
)
from kserve_trio.core.logging import get_logger
from kserve_trio.core.manifest import Manifest
from kserve_trio.core.tensor import NamedTensor
from kserve_trio.runtime.weight_cache import NEEDS_CACHE, ProbeResult
from kserve_trio.worker.device import DeviceThread, execute_plan, warm_model
from kserve_trio.worker.planner import (
    BatchPlan,
    Candidate,
    ModelLayout,
    deadline_expired,
    decay_ema,
    effective_cost,
    laxity_margin_ns,
    plan_batch,
    select_edf,
    select_fair,
    select_fifo,
    update_cost,
    wait_percentiles,
)

if TYPE_CHECKING:
    from kserve_trio.core.config import ResidencyState, SchedulerConfig
    from kserve_trio.runtime.weight_cache import WeightCache

log = get_logger("kserve_trio.worker.scheduler")

Hook = Callable[[list[NamedTensor]], list[NamedTensor]]

SHUTTING_DOWN = "server is shutting down"
WAIT_SAMPLES = 1024
"""Queue-wait samples kept per model for the percentiles (a ring)."""


class ModelEntry(Protocol):
    """What the scheduler runs: ``runtime.CompiledModel`` (or the test-only mock)."""

    name: str
    manifest: Manifest
    variants: tuple[int | None, ...]

    def batch_keys(self, variant: int | None) -> tuple[int, ...]: ...

    def execute(
        self, variant: int | None, batch_key: int, inputs: Sequence[np.ndarray]
    ) -> list[np.ndarray]: ...


@dataclass(frozen=True, slots=True)
class ModelMetrics:
    """Observability snapshot of one model; times in seconds.

    Residency: ``state`` is the floor (``unpinned``/``pinned_system``/``pinned_device``),
    ``pinned`` whether it is device-pinned, ``resident`` whether the weights are on the device,
    ``host_resident`` whether a host copy is materialised, ``weight_nbytes`` the footprint.
    """

    dispatch_count: int
    requests_served: int
    rows_served: int
    total_compute: float
    recent_compute_ema: float
    queue_depth: int
    wait_p50: float
    wait_p99: float
    batch_size_hist: dict[int, int]
    max_batch_size: int
    weight: float
    queue_seconds_total: float = 0.0
    request_compute_seconds_total: float = 0.0
    batch_compute_seconds: dict[int, float] = field(default_factory=dict)
    state: str = "unpinned"
    pinned: bool = False
    resident: bool = True
    host_resident: bool = False
    weight_nbytes: int = 0


class _Phase(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class _State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    ABANDONED = "abandoned"


@dataclass(eq=False, slots=True)
class _Request:
    """One queued inference request; ``done`` is its one-shot result channel."""

    arrays: list[np.ndarray]
    variant: int | None
    rows: int
    enqueued_ns: int
    deadline_ns: int
    request_id: str
    state: _State = _State.QUEUED
    done: anyio.Event = field(default_factory=anyio.Event)
    outputs: list[np.ndarray] | None = None
    error: BaseException | None = None
    queue_ns: int = 0
    compute_ns: int = 0
    batch_size: int = 0


@dataclass(slots=True)
class RequestTrace:
    """What one request went through, filled by ``Scheduler.infer`` (for logs and statistics)."""

    queue_ns: int = 0
    compute_ns: int = 0
    batch_size: int = 0
    preprocess_ns: int = 0
    postprocess_ns: int = 0


@dataclass(eq=False, slots=True)
class _Unit:
    """A callable queued for the device thread; ``model`` is set for a model's warmup."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    model: _ModelState | None = None
    state: _State = _State.QUEUED
    done: anyio.Event = field(default_factory=anyio.Event)
    result: Any = None
    error: BaseException | None = None


def _same_io(a: _ModelState, b: _ModelState) -> bool:
    """Whether requests prepared for ``a`` can run unchanged on ``b``."""
    ma, mb = a.entry.manifest, b.entry.manifest
    return (
        ma.executable_inputs == mb.executable_inputs
        and ma.executable_outputs == mb.executable_outputs
        and ma.wire_inputs == mb.wire_inputs
        and ma.wire_outputs == mb.wire_outputs
        and a.layout.keys == b.layout.keys
    )


def _finish(item: _Request | _Unit, *, error: BaseException | None = None) -> None:
    """Deliver an outcome to a waiter exactly once."""
    if item.state is _State.DONE:
        return
    if error is not None:
        item.error = error
    item.state = _State.DONE
    item.done.set()


@dataclass(eq=False)
class _ModelState:
    """Everything the loop keeps per model: queue, policy, learned costs and counters."""

    name: str
    entry: ModelEntry
    layout: ModelLayout
    weight: float
    max_batch_size: int | None
    preprocess: Hook | None
    postprocess: Hook | None
    ema_ns: int
    queue: collections.deque[_Request] = field(default_factory=collections.deque)
    ema: float = 0.0
    cost: dict[tuple[int | None, int], float] = field(default_factory=dict)
    dispatch_count: int = 0
    requests_served: int = 0
    rows_served: int = 0
    total_compute: float = 0.0
    batch_hist: collections.Counter[int] = field(default_factory=collections.Counter)
    waits: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=WAIT_SAMPLES)
    )
    removed: bool = False
    replaced_by: _ModelState | None = None
    queue_ns_total: int = 0
    request_compute_ns_total: int = 0
    batch_compute_ns: collections.Counter[int] = field(default_factory=collections.Counter)


# --------------------------------------------------------------------------------------------
# The scheduler


class Scheduler:
    """Per-model queues drained by one dispatch loop onto one device thread.

    Start the loop with ``await tg.start(scheduler.run)``; ``stop()`` ends it. ``infer`` is
    called from each request's own task. All times given to it (``deadline_ns``) are absolute
    on ``clock`` (``time.monotonic_ns`` by default).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        warmup: bool = True,
        clock: Callable[[], int] = time.monotonic_ns,
        hook_threads: int = 16,
        cache: WeightCache | None = None,
    ) -> None:
        self._config = config
        self._cache = cache
        self._discipline = getattr(config.discipline, "value", config.discipline)
        self._warmup = warmup and self._discipline == "fair"
        self._clock = clock
        self._hook_threads = hook_threads
        self._hook_limiter: anyio.CapacityLimiter | None = None
        self._timeout_ns = int(config.dispatch_timeout_seconds * 1e9)
        self._phase = _Phase.NEW
        self._models: dict[str, _ModelState] = {}
        self._units: collections.deque[_Unit] = collections.deque()
        self._pending_warmups: list[_ModelState] = []
        self._wake: anyio.Event | None = None
        self._stopped: anyio.Event | None = None
        self._device: DeviceThread | None = None
        self._inflight: _ModelState | None = None
        self._inflight_done: anyio.Event | None = None
        self._looping = False

    # ---------------------------------------------------------------- lifecycle

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """The dispatch loop. Warms models added before it started, then serves until stop()."""
        if self._phase is _Phase.STOPPED:  # stopped before it ever ran
            task_status.started()
            return
        if self._phase is not _Phase.NEW:
            raise RuntimeError("Scheduler.run() can only be started once")
        self._stopped = self._stopped or anyio.Event()
        self._wake = anyio.Event()
        self._device = DeviceThread(anyio.lowlevel.current_token())
        self._phase = _Phase.RUNNING
        try:
            for state in self._pending_warmups:
                await self._warm(state)
            self._pending_warmups.clear()
            task_status.started()
            await self._loop()
        finally:
            with anyio.CancelScope(shield=True):
                self._phase = _Phase.STOPPED
                self._reject_everything()
                await self._device.close()
                self._stopped.set()

    async def stop(self) -> None:
        """Refuse new work, answer everything queued UNAVAILABLE, let the running unit finish.

        Returns once ``run()`` has returned (at once if it never started).
        """
        if self._stopped is None:
            self._stopped = anyio.Event()
        if self._phase is _Phase.NEW:
            self._phase = _Phase.STOPPED
            self._reject_everything()
            self._stopped.set()
            return
        if self._phase is _Phase.RUNNING:
            self._phase = _Phase.STOPPING
            self._reject_everything()
            self._wake_loop()
        await self._stopped.wait()

    def _reject_everything(self) -> None:
        for state in self._models.values():
            while state.queue:
                _finish(state.queue.popleft(), error=Unavailable(SHUTTING_DOWN))
        while self._units:
            _finish(self._units.popleft(), error=Unavailable(SHUTTING_DOWN))

    def _require_running(self) -> None:
        if self._phase is _Phase.RUNNING:
            return
        if self._phase is _Phase.NEW:
            raise Unavailable("scheduler is not running yet")
        raise Unavailable(SHUTTING_DOWN)

    def _wake_loop(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # ---------------------------------------------------------------- models

    async def add_model(
        self,
        entry: ModelEntry,
        *,
        preprocess: Hook | None = None,
        postprocess: Hook | None = None,
        warm: bool = True,
    ) -> None:
        """Admit a compiled model; under fair, warm each compiled (variant, size) once first.

        The warmup runs on the device thread as one unit and seeds the learned costs; its
        failures are logged, never raised. Added before ``run()``, the warmup runs when the
        loop starts. ``warm=False`` skips it (the weight cache's startup probe seeds the costs
        instead). With a weight cache the model is admitted there first, at the residency
        floor its ``scheduler.models`` block sets, as a device unit.
        """
        if self._phase in (_Phase.STOPPING, _Phase.STOPPED):
            raise Unavailable(SHUTTING_DOWN)
        name = entry.name
        if name in self._models:
            raise FailedPrecondition(f"model '{name}' is already loaded")
        overrides = self._config.models.get(name)
        state = _ModelState(
            name=name,
            entry=entry,
            layout=ModelLayout.build(
                name, entry.manifest, {v: entry.batch_keys(v) for v in entry.variants}
            ),
            weight=overrides.weight if overrides is not None else 1.0,
            max_batch_size=overrides.max_batch_size if overrides is not None else None,
            preprocess=preprocess,
            postprocess=postprocess,
            ema_ns=self._clock(),
        )
        self._models[name] = state
        if self._cache is not None:
            floor = overrides.residency if overrides is not None else None
            try:
                await self._cache_op(self._cache.admit, entry, floor)
            except BaseException:
                if self._models.get(name) is state:
                    del self._models[name]
                raise
        if not self._warmup or not warm:
            return
        if self._phase is _Phase.NEW:
            self._pending_warmups.append(state)
        else:
            await self._warm(state)

    async def _warm(self, state: _ModelState) -> None:
        args = (state, self._clock, self._cache)
        if self._looping:
            costs, failures = await self._submit(_Unit(warm_model, args, model=state))
        else:  # from run(), before the loop serves anything
            costs, failures = await self._device_call(state, warm_model, *args)
        for key, cost in costs.items():
            state.cost.setdefault(key, cost)
        for failure in failures:
            log.warning("warmup_failed", model=state.name, detail=failure)
        log.debug("model_warmed", model=state.name, programs=len(costs))

    async def remove_model(self, name: str) -> None:
        """Unload: queued requests get NOT_FOUND; returns once no execution of it is running."""
        state = self._models.pop(name, None)
        if state is None:
            raise NotFound(f"unknown model: {name}")
        state.removed = True
        while state.queue:
            _finish(state.queue.popleft(), error=NotFound(f"model '{name}' was unloaded"))
        if state in self._pending_warmups:
            self._pending_warmups.remove(state)
        while self._inflight is state:
            if self._inflight_done is None:
                self._inflight_done = anyio.Event()
            await self._inflight_done.wait()
        if self._cache is not None:  # device buffers freed, host copy released
            await self._cache_op(self._cache.release, name, state.entry)

    async def _cache_op(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a residency operation on the device thread (a unit while the loop serves; a
        direct call before the loop started or once it stopped)."""
        if self._phase is _Phase.RUNNING:
            if self._looping:
                try:
                    return await self._submit(_Unit(fn, args))
                except Unavailable:
                    if self._phase is _Phase.RUNNING:
                        raise
                    return fn(*args)  # rejected by a stop: the loop no longer runs units
            if self._device is not None:
                return await self._device_call(None, fn, *args)
        return fn(*args)

    async def replace_model(
        self, entry: ModelEntry, *, preprocess: Hook | None = None, postprocess: Hook | None = None
    ) -> None:
        """Swap in a new version of a loaded model (or add it): the only loop-side part of a
        reload, so every other model keeps serving while the new version compiles elsewhere.

        Rules:
        1. An execution of the old version that is running finishes on the old version.
        2. Requests queued on the old version move to the new one when the I/O spec (executable
           and client tensors, compiled sizes per variant) is unchanged; otherwise they are
           answered UNAVAILABLE ``model 'm' was reloaded; retry``.
        3. The live fair weight carries over; learned costs start afresh (the new version is
           warmed like a new model).
        """
        name = entry.name
        old = self._models.get(name)
        if old is None:
            await self.add_model(entry, preprocess=preprocess, postprocess=postprocess)
            return
        if self._phase in (_Phase.STOPPING, _Phase.STOPPED):
            raise Unavailable(SHUTTING_DOWN)
        overrides = self._config.models.get(name)
        new = _ModelState(
            name=name,
            entry=entry,
            layout=ModelLayout.build(
                name, entry.manifest, {v: entry.batch_keys(v) for v in entry.variants}
            ),
            weight=old.weight,
            max_batch_size=overrides.max_batch_size if overrides is not None else None,
            preprocess=preprocess,
            postprocess=postprocess,
            ema_ns=self._clock(),
        )
        if self._warmup and self._phase is _Phase.RUNNING and self._cache is None:
            await self._warm(new)
        while self._inflight is old:
            if self._inflight_done is None:
                self._inflight_done = anyio.Event()
            await self._inflight_done.wait()
        old.removed = True
        old.replaced_by = new
        if _same_io(old, new):
            new.queue, old.queue = old.queue, collections.deque()
        else:
            while old.queue:
                _finish(
                    old.queue.popleft(), error=Unavailable(f"model '{name}' was reloaded; retry")
                )
        self._models[name] = new
        self._wake_loop()
        if self._cache is not None:
            # Queued before any batch of the new version can run (units go first): the old
            # version's tiers are released and the new one admitted at the old floor.
            await self._cache_op(self._cache.replace, entry)
            if self._warmup and self._phase is _Phase.RUNNING:
                await self._warm(new)

    def rename_model(self, old: str, new: str) -> None:
        """Rekey a loaded model (a renamed bundle directory): no recompilation, queued requests
        keep their place. The new name's configured policy applies when it has one."""
        if new in self._models:
            raise FailedPrecondition(f"cannot rename '{old}' to '{new}': '{new}' is loaded")
        state = self._models.pop(old, None)
        if state is None:
            raise NotFound(f"unknown model: {old}")
        if self._cache is not None:
            try:
                self._cache.rename(old, new)
            except BaseException:
                self._models[old] = state
                raise
        state.name = new
        with contextlib.suppress(AttributeError):
            state.entry.name = new
        state.layout = ModelLayout.build(new, state.entry.manifest, state.layout.keys)
        overrides = self._config.models.get(new)
        if overrides is not None:
            state.weight = overrides.weight
            state.max_batch_size = overrides.max_batch_size
        self._models[new] = state

    def has_model(self, name: str) -> bool:
        return name in self._models

    def model_names(self) -> list[str]:
        return sorted(self._models)

    def _model(self, name: str) -> _ModelState:
        state = self._models.get(name)
        if state is None:
            raise NotFound(f"unknown model: {name}")
        return state

    def set_policy(self, name: str, *, weight: float | None = None) -> None:
        """Change a model's live policy; ``weight`` (> 0) is consulted by the fair discipline."""
        state = self._model(name)
        if weight is not None:
            if not (isinstance(weight, int | float) and math.isfinite(weight) and weight > 0):
                raise InvalidArgument(
                    f"weight for model '{name}' must be a positive number (got {weight})"
                )
            state.weight = float(weight)

    def cost_estimates(self, name: str) -> dict[tuple[int | None, int], float]:
        """Learned seconds per (variant, batch key) of a model (warmup-seeded under fair)."""
        return dict(self._model(name).cost)

    def scheduler_metrics(self) -> dict[str, ModelMetrics]:
        """Per-model observability snapshot."""
        now = self._clock()
        halflife = self._config.ema_halflife_seconds
        out: dict[str, ModelMetrics] = {}
        for name, s in sorted(self._models.items()):
            p50, p99 = wait_percentiles(s.waits)
            out[name] = ModelMetrics(
                dispatch_count=s.dispatch_count,
                requests_served=s.requests_served,
                rows_served=s.rows_served,
                total_compute=s.total_compute,
                recent_compute_ema=decay_ema(s.ema, (now - s.ema_ns) / 1e9, halflife),
                queue_depth=len(s.queue),
                wait_p50=p50,
                wait_p99=p99,
                batch_size_hist=dict(sorted(s.batch_hist.items())),
                max_batch_size=s.layout.max_batch_size(s.max_batch_size),
                weight=s.weight,
                **self._residency_fields(s),
            )
        return out

    def _residency_fields(self, s: _ModelState) -> dict[str, Any]:
        entry = s.entry
        if self._cache is not None and self._cache.has(s.name):
            r = self._cache.residency(s.name)
            return {
                "state": r.floor.name.lower(),
                "pinned": r.floor.name == "PINNED_DEVICE",
                "resident": r.device_resident,
                "host_resident": r.host_resident,
                "weight_nbytes": r.weight_nbytes,
            }
        resident = getattr(entry, "weights_resident", None)
        return {
            "resident": bool(resident()) if callable(resident) else True,
            "weight_nbytes": int(getattr(entry, "weight_nbytes", 0) or 0),
        }

    # ---------------------------------------------------------------- residency

    @property
    def cache(self) -> WeightCache | None:
        """The weight cache this scheduler acquires through (None: every model stays put)."""
        return self._cache

    async def set_residency(self, name: str, target: ResidencyState | int) -> ResidencyState:
        """Move a model's residency floor (explicit mode), on the device thread."""
        self._require_running()
        if self._cache is None:
            raise FailedPrecondition(NEEDS_CACHE)
        return await self.run_on_device(self._cache.set_residency, name, target)

    async def compact(self, reload_models: Sequence[str] = ()) -> int:
        """Free the on-demand device weights, then reload ``reload_models``."""
        self._require_running()
        if self._cache is None:
            return 0
        return await self.run_on_device(self._cache.compact, list(reload_models))

    async def probe_weights(self) -> ProbeResult | None:
        """The cache's startup isolation probe over every model's compiled programs;
        the measured times seed the learned costs like a warmup. None without a cache."""
        if self._cache is None or not self._cache.enabled:
            return None
        states = dict(self._models)

        def programs(name: str) -> list[tuple[Any, list[np.ndarray], Callable[..., Any]]]:
            state = states.get(name)
            if state is None:
                return []
            entry = state.entry
            return [
                (
                    (variant, key),
                    state.layout.zero_inputs(variant, key),
                    lambda inputs, v=variant, k=key: entry.execute(v, k, inputs),
                )
                for variant, keys in state.layout.keys.items()
                for key in keys
            ]

        result: ProbeResult = await self._cache_op(self._cache.probe, programs)
        for name, costs in result.costs.items():
            state = self._models.get(name)
            if state is not None:
                for key, cost in costs.items():
                    state.cost.setdefault(key, cost)
        for name, failures in result.failures.items():
            for failure in failures:
                log.warning("probe_failed", model=name, detail=failure)
        return result

    # ---------------------------------------------------------------- requests

    def check_admissible(self, name: str, inputs: Sequence[NamedTensor]) -> None:
        """Refuse, before anything is queued, a request no compiled program can serve.

        NOT_FOUND ``unknown model: m``; INVALID_ARGUMENT ``model 'm' accepts at most N rows per
        request (got R)`` or an unknown shape variant. Inputs are the client-facing tensors.
        """
        self._model(name).layout.check_wire(inputs)

    async def infer(
        self,
        name: str,
        inputs: list[NamedTensor],
        *,
        deadline_ns: int = 0,
        request_id: str = "",
        trace: RequestTrace | None = None,
        validated_for: Manifest | None = None,
    ) -> list[NamedTensor]:
        """Serve one request: preprocess -> queue -> (coalesced) execution -> postprocess.

        ``validated_for`` is the manifest whose wire specs the caller has already checked
        ``inputs`` against (names, dtype, rank, fixed dims: ``core.validation.validate_inputs``).
        When it is the manifest of the version serving the request and those inputs are the
        executable ones (no preprocess hook, no ``client_inputs``), the dtype and shape checks
        are not repeated; the admission (rows, variant) always runs. A request validated
        against a version that a reload has just replaced is checked in full.

        ``deadline_ns`` is absolute on the scheduler's clock (0 = none). The wait for the result
        is bounded by the deadline and by ``dispatch_timeout_seconds`` from enqueue: expiring
        while queued removes the request (DEADLINE_EXCEEDED); expiring while it runs lets the
        execution finish and drops its slice. A cancelled caller's queued request is removed
        and never executed. ``infer`` never returns while the device may still read the
        caller's input arrays (they may be views of shared memory the caller releases).
        """
        self._require_running()
        state = self._model(name)
        if self._cache is not None:
            self._cache.check_servable(name)  # explicit mode: FAILED_PRECONDITION, not queued
        if deadline_ns and self._clock() >= deadline_ns:
            raise DeadlineExceeded(name)
        if state.preprocess is not None:
            # Refuse before a hook runs; without one, ``prepare`` below checks the exact
            # admission (rows, variant) on the same tensors, still before anything is queued.
            state.layout.check_wire(inputs)
        self._check_depth(state)
        prepared = inputs
        if state.preprocess is not None:
            t0 = self._clock()
            prepared = await self._hook("preprocess", state, state.preprocess, inputs)
            if trace is not None:
                trace.preprocess_ns = self._clock() - t0
        arrays, variant, rows = state.layout.prepare(
            prepared,
            validated=validated_for is state.entry.manifest
            and state.preprocess is None
            and state.layout.wire_is_executable,
        )
        self._require_running()
        state = self._current(name, state)
        self._check_depth(state)
        now = self._clock()
        if deadline_ns and now >= deadline_ns:
            raise DeadlineExceeded(name)
        req = _Request(arrays, variant, rows, now, deadline_ns, request_id)
        state.queue.append(req)
        self._wake_loop()
        await self._await_result(state, req)
        assert req.outputs is not None
        if trace is not None:
            trace.queue_ns, trace.compute_ns, trace.batch_size = (
                req.queue_ns,
                req.compute_ns,
                req.batch_size,
            )
        outputs = [
            NamedTensor.from_array(state.layout.output_name(k), arr)
            for k, arr in enumerate(req.outputs)
        ]
        if state.postprocess is not None:
            t0 = self._clock()
            outputs = await self._hook("postprocess", state, state.postprocess, outputs)
            if trace is not None:
                trace.postprocess_ns = self._clock() - t0
        return outputs

    def _current(self, name: str, state: _ModelState) -> _ModelState:
        """The live state for a request prepared against ``state`` (which may have been swapped).

        A reload with an unchanged I/O spec hands the request to the new version; any other
        reload answers UNAVAILABLE (retry); an unload answers NOT_FOUND.
        """
        live = self._models.get(name)
        if live is state:
            return state
        nxt = state.replaced_by
        while nxt is not None and nxt is not live:
            nxt = nxt.replaced_by
        if live is not None and nxt is live:
            if _same_io(state, live):
                return live
            raise Unavailable(f"model '{name}' was reloaded; retry")
        raise NotFound(f"model '{name}' was unloaded")

    def _check_depth(self, state: _ModelState) -> None:
        depth = self._config.max_queue_depth
        if len(state.queue) >= depth:
            raise ResourceExhausted(
                f"queue for model '{state.name}' is full ({depth}); request rejected"
            )

    async def _await_result(self, state: _ModelState, req: _Request) -> None:
        timeout_at = req.enqueued_ns + self._timeout_ns if self._timeout_ns > 0 else 0
        limits = [t for t in (req.deadline_ns, timeout_at) if t]
        wait_until = min(limits) if limits else 0
        timed_out = False
        try:
            if wait_until:
                budget = (wait_until - self._clock()) / 1e9
                with anyio.CancelScope(deadline=anyio.current_time() + budget) as scope:
                    await req.done.wait()
                timed_out = scope.cancelled_caught
            else:
                await req.done.wait()
        finally:
            ran = req.state is not _State.QUEUED
            if req.state is _State.QUEUED:
                state.queue.remove(req)
                req.state = _State.ABANDONED
            elif req.state is _State.RUNNING:
                with anyio.CancelScope(shield=True):
                    await req.done.wait()
        if timed_out:
            if req.deadline_ns and (not timeout_at or req.deadline_ns <= timeout_at):
                what = "deadline"
            else:
                what = f"dispatch timeout ({self._timeout_ns / 1e9:g}s)"
            if ran:
                msg = f"{what} exceeded while model '{state.name}' was executing; result dropped"
            else:
                msg = f"{what} exceeded while queued for model '{state.name}'"
            raise DeadlineExceeded(state.name, msg)
        if req.error is not None:
            raise req.error

    async def _hook(
        self, kind: str, state: _ModelState, hook: Hook, tensors: list[NamedTensor]
    ) -> list[NamedTensor]:
        """Run a model.py hook in a worker thread; its failure is the model's (INTERNAL)."""
        if self._hook_limiter is None:
            self._hook_limiter = anyio.CapacityLimiter(self._hook_threads)
        try:
            out = await anyio.to_thread.run_sync(hook, tensors, limiter=self._hook_limiter)
        except ServingError:
            raise
        except Exception as exc:
            raise Internal(
                f"{kind} of model '{state.name}' failed: {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(out, list | tuple) or not all(isinstance(t, NamedTensor) for t in out):
            raise Internal(
                f"{kind} of model '{state.name}' must return a list of NamedTensor "
                f"(got {type(out).__name__})"
            )
        return list(out)

    async def run_on_device(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the device thread as one scheduled unit and return its result.

        Units are served before the discipline picks the next batch. A caller cancelled while
        the unit waits removes it (it never runs); once running it completes.
        """
        self._require_running()
        return await self._submit(_Unit(fn, args))

    async def _submit(self, unit: _Unit) -> Any:
        self._units.append(unit)
        self._wake_loop()
        try:
            await unit.done.wait()
        finally:
            if unit.state is _State.QUEUED:
                self._units.remove(unit)
                unit.state = _State.ABANDONED
            elif unit.state is _State.RUNNING:
                with anyio.CancelScope(shield=True):
                    await unit.done.wait()
        if unit.error is not None:
            raise unit.error
        return unit.result

    # ---------------------------------------------------------------- the dispatch loop

    async def _loop(self) -> None:
        self._looping = True
        try:
            while self._phase is _Phase.RUNNING:
                if self._units:
                    await self._run_unit(self._units.popleft())
                    continue
                picked = self._select()
                if picked is None:
                    self._wake = anyio.Event()
                    await self._wake.wait()
                    continue
                await self._dispatch(*picked)
        finally:
            self._looping = False

    async def _device_call(
        self, state: _ModelState | None, fn: Callable[..., Any], *args: Any
    ) -> Any:
        assert self._device is not None
        self._inflight = state
        try:
            return await self._device.call(fn, *args)
        finally:
            self._inflight = None
            if self._inflight_done is not None:  # someone waits for this unit (remove_model)
                self._inflight_done.set()
                self._inflight_done = None

    async def _run_unit(self, unit: _Unit) -> None:
        unit.state = _State.RUNNING
        try:
            unit.result = await self._device_call(unit.model, unit.fn, *unit.args)
        except Exception as exc:
            unit.error = exc
        except BaseException:  # still answer the waiter, then let it propagate
            unit.error = Internal("a device unit was interrupted")
            raise
        finally:
            _finish(unit)

    def _plan(self, state: _ModelState) -> BatchPlan | None:
        try:
            return plan_batch(
                state.queue,
                state.layout.keys.__getitem__,
                batched=state.layout.batched,
                max_batch_size=state.max_batch_size,
            )
        except Exception as exc:  # a bug: fail the front request rather than the loop
            log.exception("plan_failed", model=state.name)
            _finish(
                state.queue.popleft(), error=Internal(f"cannot plan model '{state.name}': {exc}")
            )
            return None

    def _select(self) -> tuple[_ModelState, BatchPlan] | None:
        """Pick the next (model, plan) under the configured discipline."""
        ready = [s for s in self._models.values() if s.queue]
        if not ready:
            return None
        if len(ready) == 1:
            plan = self._plan(ready[0])
            return None if plan is None else (ready[0], plan)
        if self._discipline == "fair":
            return self._select_fair(ready)
        if self._discipline == "edf":
            cands = [
                Candidate(
                    s.name,
                    s.queue[0].enqueued_ns,
                    earliest_deadline_ns=min(
                        (r.deadline_ns for r in s.queue if r.deadline_ns), default=0
                    ),
                )
                for s in ready
            ]
            chosen = self._models[select_edf(cands).name]
        else:
            chosen = self._models[
                select_fifo([Candidate(s.name, s.queue[0].enqueued_ns) for s in ready]).name
            ]
        plan = self._plan(chosen)
        return None if plan is None else (chosen, plan)

    def _select_fair(self, ready: list[_ModelState]) -> tuple[_ModelState, BatchPlan] | None:
        now = self._clock()
        cfg = self._config
        for s in self._models.values():
            self._decay(s, now)
        total_ema = sum(s.ema for s in self._models.values())
        total_weight = sum(s.weight for s in self._models.values())
        plans: dict[str, BatchPlan] = {}
        cands: list[Candidate] = []
        for s in ready:
            plan = self._plan(s)
            if plan is None:
                continue
            plans[s.name] = plan
            cost = effective_cost(
                s.cost.get((plan.variant, plan.batch_key)),
                coalescing_discount=cfg.coalescing_discount,
                coalesced_requests=plan.take,
            )
            cands.append(Candidate(s.name, s.queue[0].enqueued_ns, s.weight, s.ema, cost))
        if not cands:
            return None
        chosen = select_fair(
            cands, total_weight=total_weight, total_ema=total_ema, cap=cfg.recency_penalty_cap
        )
        return self._models[chosen.name], plans[chosen.name]

    def _decay(self, state: _ModelState, now: int) -> None:
        state.ema = decay_ema(
            state.ema, (now - state.ema_ns) / 1e9, self._config.ema_halflife_seconds
        )
        state.ema_ns = now

    async def _dispatch(self, state: _ModelState, plan: BatchPlan) -> None:
        """Admit (deadlines, edf laxity), execute on the device thread, record, deliver."""
        now = self._clock()
        taken = [state.queue[i] for i in range(plan.take)]
        margin = 0
        if self._discipline == "edf":
            margin = laxity_margin_ns(state.cost.get((plan.variant, plan.batch_key)))
        expired = [r for r in taken if deadline_expired(r.deadline_ns, now, margin)]
        if expired:
            # Refuse them and re-plan from the queue as it now stands.
            for r in expired:
                state.queue.remove(r)
                if now >= r.deadline_ns:
                    err = DeadlineExceeded(state.name)
                else:
                    err = DeadlineExceeded(
                        state.name,
                        f"deadline for model '{state.name}' cannot be met "
                        f"(estimated compute {margin / 1e9:.6f}s)",
                    )
                _finish(r, error=err)
            return
        for _ in range(plan.take):
            state.queue.popleft()
        for r in taken:
            r.state = _State.RUNNING
        try:
            await self._execute(state, plan, taken, now)
        finally:  # whatever happened, no waiter is left hanging on a RUNNING request
            for r in taken:
                _finish(r, error=Internal(f"execution of model '{state.name}' was interrupted"))

    async def _execute(
        self, state: _ModelState, plan: BatchPlan, taken: list[_Request], now: int
    ) -> None:
        try:
            elapsed_ns, slices = await self._device_call(
                state,
                execute_plan,
                state.entry,
                state.layout,
                plan,
                [r.arrays for r in taken],
                [r.rows for r in taken],
                self._clock,
                self._cache,
            )
        except Exception as exc:
            if not isinstance(exc, ServingError):
                log.error(
                    "execution_failed",
                    model=state.name,
                    batch_size=plan.batch_key,
                    error=f"{type(exc).__name__}: {exc}",
                    request_ids=[r.request_id for r in taken],
                )
                exc = Internal(f"execution of model '{state.name}' failed: {exc}")
            for r in taken:
                _finish(r, error=exc)
            return
        self._record(state, plan, taken, now, elapsed_ns)
        for r, outs in zip(taken, slices, strict=True):
            r.outputs = outs
            _finish(r)

    def _record(
        self,
        state: _ModelState,
        plan: BatchPlan,
        taken: list[_Request],
        started: int,
        elapsed_ns: int,
    ) -> None:
        t = max(elapsed_ns, 0) / 1e9
        self._decay(state, self._clock())
        state.ema += t
        key = (plan.variant, plan.batch_key)
        state.cost[key] = update_cost(state.cost.get(key), t, self._config.cost_ema_alpha)
        state.dispatch_count += 1
        state.requests_served += len(taken)
        state.rows_served += plan.rows
        state.total_compute += t
        state.batch_hist[plan.batch_key] += 1
        state.waits.extend((started - r.enqueued_ns) / 1e9 for r in taken)
        state.batch_compute_ns[plan.batch_key] += max(elapsed_ns, 0)
        for r in taken:
            r.queue_ns = started - r.enqueued_ns
            r.compute_ns = max(elapsed_ns, 0)
            r.batch_size = plan.batch_key
            state.queue_ns_total += r.queue_ns
            state.request_compute_ns_total += r.compute_ns


__all__ = ["ModelEntry", "ModelMetrics", "RequestTrace", "Scheduler"]

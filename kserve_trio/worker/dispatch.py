"""The dispatch loop: its lifecycle, the device units, and the choice of the next batch.

``DispatchLoop`` owns the live model table, the queue of device units and the one device
thread. Its loop serves units first (meta models, control and residency operations, warmups),
then asks the configured discipline (fifo, edf, fair) for the next (model, batch plan), admits
the batch against deadlines, executes it on the device thread and delivers each request's slice.
Its model table changes only through its own methods (add, replace, remove, rename, probe). The
request path and the model admin (``worker/scheduler.py``) queue work here and wait on it; everything runs on the event loop thread, so nothing is locked.
"""

from __future__ import annotations

import collections
import contextlib
import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.lowlevel
import numpy as np

from kserve_trio.core.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    NotFound,
    ServingError,
    Unavailable,
)
from kserve_trio.core.logging import get_logger
from kserve_trio.runtime.weight_cache import ProbeResult, Program
from kserve_trio.worker.device import DeviceThread, execute_plan, warm_model
from kserve_trio.worker.disciplines import (
    Candidate,
    deadline_expired,
    effective_cost,
    laxity_margin_ns,
    select_edf,
    select_fair,
    select_fifo,
)
from kserve_trio.worker.hooks import Hook
from kserve_trio.worker.layout import ModelLayout
from kserve_trio.worker.model_state import (
    DeviceUnit,
    ItemState,
    ModelEntry,
    ModelState,
    QueuedRequest,
    decay,
    finish,
    record_batch,
    same_io,
)
from kserve_trio.worker.planner import BatchPlan, plan_batch
from kserve_trio.worker.switches import HotPathSwitches

if TYPE_CHECKING:
    from kserve_trio.core.config import SchedulerConfig
    from kserve_trio.runtime.weight_cache import WeightCache
    from kserve_trio.serving.tracing import Tracing

log = get_logger("kserve_trio.worker.scheduler")

SHUTTING_DOWN = "server is shutting down"

DIRECT_LANE_MAX_BYTES = 64 * 1024
"""The largest request (its input arrays) the direct lane takes. Measured: [1,16] FP32 requests
(64 B) gained 12-25% CPU per request at c=1; [1,3,224,224] (602 KB) taking the lane had a p99
of 1.3 s at c=32 against 0.25 s without (docs/benchmarks.md). The bound between is a choice."""


class Phase(enum.Enum):
    """The loop's lifecycle: built, serving, refusing new work, returned."""

    NEW = "new"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class DispatchLoop:
    """The model table, the unit queue and the loop that drains both onto the device thread.

    ``run`` is the task (started once), ``stop`` ends it. ``models`` is the live table the
    admin mutates and the request path reads; ``submit`` queues a device unit and waits for it.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        warmup: bool,
        clock: Callable[[], int],
        cache: WeightCache | None,
        switches: HotPathSwitches | None = None,
    ) -> None:
        self.config = config
        self.cache = cache
        self.clock = clock
        self.discipline: str = config.discipline.value
        self.warmup = warmup and self.discipline == "fair"
        self.phase = Phase.NEW
        self.models: dict[str, ModelState] = {}
        self.pending_warmups: list[ModelState] = []
        self._units: collections.deque[DeviceUnit] = collections.deque()
        self._wake: anyio.Event | None = None
        self._stopped: anyio.Event | None = None
        self._device: DeviceThread | None = None
        self._inflight: ModelState | None = None
        self._inflight_done: anyio.Event | None = None
        self._looping = False
        self._parked = False  # the loop waits for work: nothing queued, no unit, no batch
        self.direct_batches = 0  # batches the direct lane ran (``serve_directly``)
        self.switches = switches or HotPathSwitches.from_environment()
        self.tracing: Tracing | None = None
        """Set when the worker traces: an execution serving a traced request is a span."""

    # ---------------------------------------------------------------- lifecycle

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """The dispatch loop. Warms models added before it started, then serves until stop()."""
        if self.phase is Phase.STOPPED:  # stopped before it ever ran
            task_status.started()
            return
        if self.phase is not Phase.NEW:
            raise RuntimeError("Scheduler.run() can only be started once")
        stopped = self._stopped = self._stopped or anyio.Event()
        self._wake = anyio.Event()
        device = self._device = DeviceThread(self.switches.handback)
        self.phase = Phase.RUNNING
        try:
            for state in self.pending_warmups:
                await self.warm(state)
            self.pending_warmups.clear()
            task_status.started()
            await self._loop()
        finally:
            with anyio.CancelScope(shield=True):
                self.phase = Phase.STOPPED
                self._reject_everything()
                await device.close()
                stopped.set()

    async def stop(self) -> None:
        """Refuse new work, answer everything queued UNAVAILABLE, let the running unit finish.

        Returns once ``run()`` has returned (at once if it never started).
        """
        if self._stopped is None:
            self._stopped = anyio.Event()
        if self.phase is Phase.NEW:
            self.phase = Phase.STOPPED
            self._reject_everything()
            self._stopped.set()
            return
        if self.phase is Phase.RUNNING:
            self.phase = Phase.STOPPING
            self._reject_everything()
            self.wake()
        await self._stopped.wait()

    def _reject_everything(self) -> None:
        for state in self.models.values():
            while state.queue:
                finish(state.queue.popleft(), error=Unavailable(SHUTTING_DOWN))
        while self._units:
            finish(self._units.popleft(), error=Unavailable(SHUTTING_DOWN))

    def require_running(self) -> None:
        """UNAVAILABLE unless the loop serves (not started yet, or shutting down)."""
        if self.phase is Phase.RUNNING:
            return
        if self.phase is Phase.NEW:
            raise Unavailable("scheduler is not running yet")
        raise Unavailable(SHUTTING_DOWN)

    def refuse_if_stopping(self) -> None:
        """UNAVAILABLE once a stop began; a loop not started yet still takes models."""
        if self.phase in (Phase.STOPPING, Phase.STOPPED):
            raise Unavailable(SHUTTING_DOWN)

    def wake(self) -> None:
        """Tell an idle loop that a request or a unit was queued."""
        self._parked = False  # what was queued goes first: no direct lane past it
        if self._wake is not None:
            self._wake.set()

    def serve_directly(self, state: ModelState, req: QueuedRequest) -> bool:
        """The direct lane: while the loop is parked (nothing queued anywhere, no unit, no
        device work in flight), a request of at most ``DIRECT_LANE_MAX_BYTES`` whose batch may
        run on the loop's thread (``_runs_inline``) runs now, in its caller's task, as the loop
        would run it next: the same plan, deadline check, execution and record, without the
        hand-over to the loop and back (two task switches and two events per request). True
        once ``req`` is finished (result or error); False leaves it to the caller to queue.
        Synchronous from start to finish, so no other task sees the request half-served."""
        if not (
            self._parked
            and self.switches.inline_seconds
            and self.phase is Phase.RUNNING
            and self._inflight is None
            and not self._units
            and not state.queue
            and sum(a.nbytes for a in req.arrays) <= DIRECT_LANE_MAX_BYTES
        ):
            return False
        state.queue.append(req)
        plan = self._plan(state)
        if plan is None:  # the planner failed and answered the request
            return True
        if plan.take != 1 or not self._runs_inline(state, plan):
            state.queue.pop()
            return False
        now = self.clock()
        taken = self._take(state, plan, now)
        if taken is None:  # expired: answered DEADLINE_EXCEEDED
            return True
        self.direct_batches += 1
        self._run_batch_inline(state, plan, taken, now)
        return True

    # ---------------------------------------------------------------- the model table
    # The only changes to ``models``. Each keeps the table consistent with the weight cache
    # (every residency change runs on the device thread, through ``cache_op``) and with the
    # requests in flight: a running execution finishes on the version it started on, queued
    # requests move to a replacement or are answered.

    async def add_model(
        self,
        entry: ModelEntry,
        *,
        preprocess: Hook | None,
        postprocess: Hook | None,
        warm: bool,
    ) -> None:
        """Admit ``entry`` (see ``Scheduler.add_model``)."""
        self.refuse_if_stopping()
        name = entry.name
        if name in self.models:
            raise FailedPrecondition(f"model '{name}' is already loaded")
        overrides = self.config.models.get(name)
        state = ModelState.build(
            entry,
            weight=overrides.weight if overrides is not None else 1.0,
            max_batch_size=overrides.max_batch_size if overrides is not None else None,
            preprocess=preprocess,
            postprocess=postprocess,
            now_ns=self.clock(),
            cached=self.cache is not None,
        )
        self.models[name] = state
        if self.cache is not None:
            floor = overrides.residency if overrides is not None else None
            try:
                await self.cache_op(self.cache.admit, state.managed_entry, floor)
            except BaseException:
                if self.models.get(name) is state:
                    del self.models[name]
                raise
        if not self.warmup or not warm:
            return
        if self.phase is Phase.NEW:
            self.pending_warmups.append(state)
        else:
            await self.warm(state)

    async def remove_model(self, name: str) -> None:
        """Unload ``name`` (see ``Scheduler.remove_model``)."""
        state = self.models.pop(name, None)
        if state is None:
            raise NotFound(f"unknown model: {name}")
        state.removed = True
        while state.queue:
            finish(state.queue.popleft(), error=NotFound(f"model '{name}' was unloaded"))
        if state in self.pending_warmups:
            self.pending_warmups.remove(state)
        await self.wait_idle(state)
        if self.cache is not None:  # device buffers freed, host copy released
            await self.cache_op(self.cache.release, name, state.managed_entry)

    async def replace_model(
        self, entry: ModelEntry, *, preprocess: Hook | None, postprocess: Hook | None
    ) -> None:
        """Swap in a new version of a loaded model, or add it (see ``Scheduler.replace_model``)."""
        name = entry.name
        old = self.models.get(name)
        if old is None:
            await self.add_model(entry, preprocess=preprocess, postprocess=postprocess, warm=True)
            return
        self.refuse_if_stopping()
        overrides = self.config.models.get(name)
        new = ModelState.build(
            entry,
            weight=old.weight,
            max_batch_size=overrides.max_batch_size if overrides is not None else None,
            preprocess=preprocess,
            postprocess=postprocess,
            now_ns=self.clock(),
            cached=self.cache is not None,
        )
        if self.warmup and self.phase is Phase.RUNNING and self.cache is None:
            await self.warm(new)
        await self.wait_idle(old)
        old.removed = True
        old.replaced_by = new
        if same_io(old, new):
            new.queue, old.queue = old.queue, collections.deque()
        else:
            while old.queue:
                finish(
                    old.queue.popleft(), error=Unavailable(f"model '{name}' was reloaded; retry")
                )
        self.models[name] = new
        self.wake()
        if self.cache is not None:
            # Queued before any batch of the new version can run (units go first): the old
            # version's tiers are released and the new one admitted at the old floor.
            await self.cache_op(self.cache.replace, new.managed_entry)
            if self.warmup and self.phase is Phase.RUNNING:
                await self.warm(new)

    def rename_model(self, old: str, new: str) -> None:
        """Rekey a loaded model (see ``Scheduler.rename_model``)."""
        if new in self.models:
            raise FailedPrecondition(f"cannot rename '{old}' to '{new}': '{new}' is loaded")
        state = self.models.pop(old, None)
        if state is None:
            raise NotFound(f"unknown model: {old}")
        if self.cache is not None:
            try:
                self.cache.rename(old, new)
            except BaseException:
                self.models[old] = state
                raise
        state.name = new
        with contextlib.suppress(AttributeError):
            state.entry.name = new
        state.layout = ModelLayout.build(new, state.entry.manifest, state.layout.keys)
        overrides = self.config.models.get(new)
        if overrides is not None:
            state.weight = overrides.weight
            state.max_batch_size = overrides.max_batch_size
        self.models[new] = state

    async def probe_weights(self) -> ProbeResult | None:
        """The cache's startup probe (see ``Scheduler.probe_weights``)."""
        if self.cache is None or not self.cache.enabled:
            return None
        result: ProbeResult = await self.cache_op(self.cache.probe, _programs(dict(self.models)))
        for name, costs in result.costs.items():
            state = self.models.get(name)
            if state is not None:
                for key, cost in costs.items():
                    state.cost.setdefault(key, cost)
        for name, failures in result.failures.items():
            for failure in failures:
                log.warning("probe_failed", model=name, detail=failure)
        return result

    # ---------------------------------------------------------------- device work

    async def submit(self, unit: DeviceUnit) -> Any:
        """Queue ``unit`` and return its result. A caller cancelled while the unit waits
        removes it (it never runs); once running it completes before the caller returns."""
        self._units.append(unit)
        self.wake()
        try:
            await unit.done.wait()
        finally:
            if unit.state is ItemState.QUEUED:
                self._units.remove(unit)
                unit.state = ItemState.ABANDONED
            elif unit.state is ItemState.RUNNING:
                with anyio.CancelScope(shield=True):
                    await unit.done.wait()
        if unit.error is not None:
            raise unit.error
        return unit.result

    async def cache_op(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a residency operation on the device thread (a unit while the loop serves; a
        direct call before the loop started or once it stopped)."""
        if self.phase is Phase.RUNNING:
            if self._looping:
                try:
                    return await self.submit(DeviceUnit(fn, args))
                except Unavailable:
                    if self.phase is Phase.RUNNING:
                        raise
                    return fn(*args)  # rejected by a stop: the loop no longer runs units
            if self._device is not None:
                return await self._device_call(None, fn, *args)
        return fn(*args)

    async def warm(self, state: ModelState) -> None:
        """Run each compiled program of ``state`` once; seed its learned costs, log failures."""
        args = (state, self.clock, self.cache)
        if self._looping:
            costs, failures = await self.submit(DeviceUnit(warm_model, args, model=state))
        else:  # from run(), before the loop serves anything
            costs, failures = await self._device_call(state, warm_model, *args)
        for key, cost in costs.items():
            state.cost.setdefault(key, cost)
        for failure in failures:
            log.warning("warmup_failed", model=state.name, detail=failure)
        log.debug("model_warmed", model=state.name, programs=len(costs))

    async def wait_idle(self, state: ModelState) -> None:
        """Return once no device work of ``state`` (a batch, its warmup) is running."""
        while self._inflight is state:
            if self._inflight_done is None:
                self._inflight_done = anyio.Event()
            await self._inflight_done.wait()

    async def _device_call(
        self, state: ModelState | None, fn: Callable[..., Any], *args: Any
    ) -> Any:
        device = self._device
        assert device is not None, "device work before run() started the device thread"
        self._inflight = state
        try:
            return await device.call(fn, *args)
        finally:
            self._inflight = None
            if self._inflight_done is not None:  # someone waits for this unit (wait_idle)
                self._inflight_done.set()
                self._inflight_done = None

    # ---------------------------------------------------------------- the loop

    async def _loop(self) -> None:
        self._looping = True
        try:
            while self.phase is Phase.RUNNING:
                if self._units:
                    await self._run_unit(self._units.popleft())
                    continue
                picked = self._select()
                if picked is None:
                    self._wake = anyio.Event()
                    self._parked = True
                    try:
                        await self._wake.wait()
                    finally:
                        self._parked = False
                    continue
                chosen, plan = picked
                if (
                    self.switches.coalesce_yields
                    and chosen.layout.batched
                    and plan.take == len(chosen.queue)
                ):
                    # Let requests that are already being decoded reach the queue first.
                    for _ in range(self.switches.coalesce_yields):
                        await anyio.lowlevel.cancel_shielded_checkpoint()
                    picked = self._select()
                    if picked is None:
                        continue
                await self._dispatch(*picked)
        finally:
            self._looping = False

    async def _run_unit(self, unit: DeviceUnit) -> None:
        unit.state = ItemState.RUNNING
        try:
            unit.result = await self._device_call(unit.model, unit.fn, *unit.args)
        except Exception as exc:
            unit.error = exc
        except BaseException:  # still answer the waiter, then let it propagate
            unit.error = Internal("a device unit was interrupted")
            raise
        finally:
            finish(unit)

    def _plan(self, state: ModelState) -> BatchPlan | None:
        try:
            return plan_batch(
                state.queue,
                state.layout.keys.__getitem__,
                batched=state.layout.batched,
                max_batch_size=state.max_batch_size,
            )
        except Exception as exc:  # a bug: fail the front request rather than the loop
            log.exception("plan_failed", model=state.name)
            finish(
                state.queue.popleft(), error=Internal(f"cannot plan model '{state.name}': {exc}")
            )
            return None

    def _select(self) -> tuple[ModelState, BatchPlan] | None:
        """Pick the next (model, plan) under the configured discipline."""
        ready = [s for s in self.models.values() if s.queue]
        if not ready:
            return None
        if len(ready) == 1:
            plan = self._plan(ready[0])
            return None if plan is None else (ready[0], plan)
        if self.discipline == "fair":
            return self._select_fair(ready)
        if self.discipline == "edf":
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
            chosen = self.models[select_edf(cands).name]
        else:
            chosen = self.models[
                select_fifo([Candidate(s.name, s.queue[0].enqueued_ns) for s in ready]).name
            ]
        plan = self._plan(chosen)
        return None if plan is None else (chosen, plan)

    def _select_fair(self, ready: list[ModelState]) -> tuple[ModelState, BatchPlan] | None:
        now = self.clock()
        cfg = self.config
        for s in self.models.values():
            decay(s, now, cfg.ema_halflife_seconds)
        total_ema = sum(s.ema for s in self.models.values())
        total_weight = sum(s.weight for s in self.models.values())
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
        return self.models[chosen.name], plans[chosen.name]

    async def _dispatch(self, state: ModelState, plan: BatchPlan) -> None:
        """Admit (deadlines, edf laxity), execute on the device thread, record, deliver."""
        now = self.clock()
        taken = self._take(state, plan, now)
        if taken is None:
            return
        try:
            await self._execute(state, plan, taken, now)
        finally:  # whatever happened, no waiter is left hanging on a RUNNING request
            for r in taken:
                finish(r, error=Internal(f"execution of model '{state.name}' was interrupted"))

    def _take(self, state: ModelState, plan: BatchPlan, now: int) -> list[QueuedRequest] | None:
        """The plan's requests off the queue, marked RUNNING; None when some had expired (they
        are answered DEADLINE_EXCEEDED and the rest stay queued, to be planned again)."""
        taken = [state.queue[i] for i in range(plan.take)]
        margin = 0
        if self.discipline == "edf":
            margin = laxity_margin_ns(state.cost.get((plan.variant, plan.batch_key)))
        expired = [r for r in taken if deadline_expired(r.deadline_ns, now, margin)]
        if expired:
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
                finish(r, error=err)
            return None
        for _ in range(plan.take):
            state.queue.popleft()
        for r in taken:
            r.state = ItemState.RUNNING
        return taken

    def _runs_inline(self, state: ModelState, plan: BatchPlan) -> bool:
        """Whether a batch may run on the loop's thread (the direct lane's test): it is known
        to take at most the switches' ``inline_seconds`` and its weights are on the device. Batches the loop
        itself dispatches always go to the device thread: under load its execution (XLA
        releases the GIL) overlaps the network work on another core, and the loop running
        them itself measured more CPU per request at c=32 and a p99 of seconds on 0.6 MB
        requests (docs/benchmarks.md)."""
        bound = self.switches.inline_seconds
        if not bound:
            return False
        key = (plan.variant, plan.batch_key)
        cost = state.fastest.get(key)
        if cost is None:
            cost = state.cost.get(key)  # the warmup's figure, until a batch has run
        if cost is None or cost > bound:
            return False
        resident = getattr(state.entry, "weights_resident", None)
        return resident is None or bool(resident())

    async def _execute(
        self, state: ModelState, plan: BatchPlan, taken: list[QueuedRequest], now: int
    ) -> None:
        args = (state, plan, [r.arrays for r in taken], [r.rows for r in taken], self.clock)
        loads = self.cache.loads if self.cache is not None and self.tracing is not None else 0
        try:
            elapsed_ns, slices = await self._device_call(state, execute_plan, *args, self.cache)
        except Exception as exc:
            self._fail_batch(state, plan, taken, exc)
            return
        finally:
            if self.tracing is not None:
                self._trace_execution(self.tracing, state, plan, taken, now, "device", loads)
        self._deliver(state, plan, taken, now, elapsed_ns, slices)

    def _run_batch_inline(
        self, state: ModelState, plan: BatchPlan, taken: list[QueuedRequest], now: int
    ) -> None:
        """Execute a batch on the calling (loop) thread, then deliver or fail it."""
        try:
            arrays, rows = [r.arrays for r in taken], [r.rows for r in taken]
            elapsed_ns, slices = execute_plan(state, plan, arrays, rows, self.clock, self.cache)
        except Exception as exc:
            self._fail_batch(state, plan, taken, exc)
            return
        finally:
            if self.tracing is not None:
                self._trace_execution(self.tracing, state, plan, taken, now, "inline", -1)
        self._deliver(state, plan, taken, now, elapsed_ns, slices)

    def _trace_execution(
        self,
        tracing: Tracing,
        state: ModelState,
        plan: BatchPlan,
        taken: list[QueuedRequest],
        started_ns: int,
        thread: str,
        loads_before: int,
    ) -> None:
        """The execution's span when it served a traced request (``Tracing.batch``), its
        context handed to each traced request for its ``execute`` span's link. The device
        thread runs one unit at a time, so the cache's load count moving across the execution
        (``loads_before``; -1: inline, whose weights are resident) is this execution's load."""
        members = [r.span for r in taken if r.span is not None]
        if not members:
            return
        cache = self.cache
        loaded = cache is not None and loads_before >= 0 and cache.loads > loads_before
        context = tracing.batch(
            state.name,
            started_ns,
            self.clock(),
            members,
            len(taken),
            {
                "kserve_trio.batch_size": plan.batch_key,
                "kserve_trio.rows": plan.rows,
                "kserve_trio.padding": plan.padding,
                "kserve_trio.thread": thread,
                "kserve_trio.weight_load": loaded,
            },
        )
        for r in taken:
            if r.span is not None:
                r.batch_span = context

    def _fail_batch(
        self, state: ModelState, plan: BatchPlan, taken: list[QueuedRequest], exc: Exception
    ) -> None:
        """A batch's execution raised: every request in it gets the error (a model's own
        failure is logged and answered INTERNAL)."""
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
            finish(r, error=exc)

    def _deliver(
        self,
        state: ModelState,
        plan: BatchPlan,
        taken: list[QueuedRequest],
        now: int,
        elapsed_ns: int,
        slices: list[list[np.ndarray]],
    ) -> None:
        """Record a finished batch (costs, EMA, statistics) and hand each request its slice."""
        key = (plan.variant, plan.batch_key)
        seconds = elapsed_ns / 1e9
        if seconds < state.fastest.get(key, float("inf")):
            state.fastest[key] = seconds
        cfg = self.config
        record_batch(
            state,
            plan,
            taken,
            now,
            elapsed_ns,
            now_ns=self.clock(),
            halflife_seconds=cfg.ema_halflife_seconds,
            cost_alpha=cfg.cost_ema_alpha,
        )
        for r, outs in zip(taken, slices, strict=True):
            r.outputs = outs
            finish(r)


def _programs(states: dict[str, ModelState]) -> Callable[[str], Sequence[Program]]:
    """The probe's view of the models: every compiled (variant, key) with zero inputs."""

    def programs(name: str) -> list[Program]:
        state = states.get(name)
        if state is None:
            return []
        entry = state.entry

        def run(
            variant: int | None, key: int
        ) -> Callable[[Sequence[np.ndarray]], list[np.ndarray]]:
            return lambda inputs: entry.execute(variant, key, inputs)

        return [
            ((variant, key), state.layout.zero_inputs(variant, key), run(variant, key))
            for variant, keys in state.layout.keys.items()
            for key in keys
        ]

    return programs


__all__ = ["SHUTTING_DOWN", "DispatchLoop", "Phase"]

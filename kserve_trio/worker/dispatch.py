"""The dispatch loop: its lifecycle, the device units, and the batches it runs.

``DispatchLoop`` owns the queue of device units and the one device thread. Its loop serves
units first (meta models, control and residency operations, warmups), then asks the
discipline (``worker/disciplines.py``, chosen once) for the next (model, batch plan) among the
models of the table (``worker/model_table.py``) with queued requests, admits the batch against
deadlines and runs it: one rule (``_run_batch``) for a batch on the device thread and for one
the direct lane runs inline. The request path and the model admin (``worker/scheduler.py``)
queue work here and wait on it; everything runs on the event loop thread, so nothing is locked.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.lowlevel
import numpy as np

from kserve_trio.core.errors import DeadlineExceeded, Internal, ServingError, Unavailable
from kserve_trio.core.logging import get_logger
from kserve_trio.worker.admission import SHUTTING_DOWN
from kserve_trio.worker.device import DeviceThread, execute_plan, warm_model
from kserve_trio.worker.disciplines import Pick, deadline_expired
from kserve_trio.worker.model_state import (
    DeviceUnit,
    ItemState,
    ModelState,
    QueuedRequest,
    finish,
    record_batch,
)
from kserve_trio.worker.planner import BatchPlan, plan_batch
from kserve_trio.worker.switches import HotPathSwitches

if TYPE_CHECKING:
    from kserve_trio.core.process import SchedulerConfig
    from kserve_trio.runtime.weight_cache import WeightCache
    from kserve_trio.serving.tracing import Tracing
    from kserve_trio.worker.disciplines import Discipline
    from kserve_trio.worker.model_table import ModelTable

log = get_logger("kserve_trio.worker.scheduler")

Executed = tuple[int, list[list[np.ndarray]]]
"""A batch's execution: its device time (ns) and each request's output slice."""

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
    """The unit queue and the loop that drains it and the models' queues onto the device thread.

    ``run`` is the task (started once), ``stop`` ends it. ``models`` is the table the admin
    changes and the loop reads; ``submit`` queues a device unit and waits for it.
    """

    def __init__(
        self,
        models: ModelTable,
        discipline: Discipline,
        config: SchedulerConfig,
        *,
        clock: Callable[[], int],
        cache: WeightCache | None,
        switches: HotPathSwitches | None = None,
    ) -> None:
        self.models = models
        self.discipline = discipline
        self.config = config
        self.cache = cache
        self.clock = clock
        self.phase = Phase.NEW
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
        for state in self.models.states():
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
        self._run_batch(state, plan, taken, now, inline=True)
        return True

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

    async def warm_when_running(self, state: ModelState) -> None:
        """Warm ``state`` now, or as ``run()`` starts when the loop has not started yet."""
        if self.phase is Phase.NEW:
            self.pending_warmups.append(state)
        else:
            await self.warm(state)

    def drop_warmup(self, state: ModelState) -> None:
        """A removed model's warmup that waits for ``run()`` never runs."""
        if state in self.pending_warmups:
            self.pending_warmups.remove(state)

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

    def _select(self) -> Pick | None:
        """The next (model, plan): with one model queued, its batch; with more, the
        discipline's choice."""
        ready = self.models.ready()
        if not ready:
            return None
        if len(ready) == 1:
            plan = self._plan(ready[0])
            return None if plan is None else (ready[0], plan)
        return self.discipline.select(ready, self.models, self._plan)

    async def _dispatch(self, state: ModelState, plan: BatchPlan) -> None:
        """Admit (deadlines, the discipline's margin), execute on the device thread, then
        settle the batch (``_run_batch``)."""
        now = self.clock()
        taken = self._take(state, plan, now)
        if taken is None:
            return
        try:
            loads = self.cache.loads if self.cache is not None and self.tracing is not None else 0
            args = (state, plan, [r.arrays for r in taken], [r.rows for r in taken], self.clock)
            try:
                executed = await self._device_call(state, execute_plan, *args, self.cache)
            except BaseException as exc:  # the device thread's; ``_run_batch`` raises it again
                executed = exc
            self._run_batch(state, plan, taken, now, inline=False, executed=executed, loads=loads)
        finally:  # whatever happened, no waiter is left hanging on a RUNNING request
            for r in taken:
                finish(r, error=Internal(f"execution of model '{state.name}' was interrupted"))

    def _take(self, state: ModelState, plan: BatchPlan, now: int) -> list[QueuedRequest] | None:
        """The plan's requests off the queue, marked RUNNING; None when some had expired (they
        are answered DEADLINE_EXCEEDED and the rest stay queued, to be planned again)."""
        taken = [state.queue[i] for i in range(plan.take)]
        margin = self.discipline.admission_margin_ns(state, plan)
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

    # ---------------------------------------------------------------- the batch runner

    def _run_batch(
        self,
        state: ModelState,
        plan: BatchPlan,
        taken: list[QueuedRequest],
        now: int,
        *,
        inline: bool,
        executed: Executed | BaseException | None = None,
        loads: int = -1,
    ) -> None:
        """The one rule for an admitted batch, wherever it executed.

        Rules:
        1. ``inline``: execute it here, on the loop's thread (the direct lane); otherwise
           ``executed`` is what the device thread returned or raised.
        2. An execution that raised answers every request in it (``_fail_batch``); one that
           returned is recorded and each request gets its slice (``_deliver``).
        3. Either way a batch that served a traced request is a span (``_trace_execution``;
           ``loads``: the cache's load count before a device execution, -1 inline).
        """
        try:
            if inline:
                arrays, rows = [r.arrays for r in taken], [r.rows for r in taken]
                elapsed_ns, slices = execute_plan(state, plan, arrays, rows, self.clock, self.cache)
            elif isinstance(executed, BaseException):
                raise executed
            else:
                assert executed is not None, "a device batch settled without its execution"
                elapsed_ns, slices = executed
        except Exception as exc:
            self._fail_batch(state, plan, taken, exc)
            return
        finally:
            if self.tracing is not None:
                thread = "inline" if inline else "device"
                self._trace_execution(self.tracing, state, plan, taken, now, thread, loads)
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


__all__ = ["DIRECT_LANE_MAX_BYTES", "DispatchLoop", "Executed", "Phase"]

"""The worker's dispatch engine: per-model queues, one dispatch loop, one device thread.

``Scheduler`` is the engine's face: the request path (``infer``), the model admin (add, replace,
remove, rename, policy), residency control and the observability snapshot. Requests are
preprocessed on their own task (hooks in worker threads), queued per model, coalesced by the
single dispatch loop into batches at compiled sizes, executed one at a time on a dedicated
device thread, sliced back and postprocessed on their own task again. Everything that touches
the queues or the per-model state runs on the event loop thread, so no lock is needed; the
device thread only sees the arrays and the model entry of the unit it runs.

The pieces: ``worker/model_state.py`` (what is kept per model, the queued items, the metrics
snapshot), ``worker/model_table.py`` (which state serves each name; this class is its only
writer), ``worker/dispatch.py`` (the loop, its lifecycle, the device units and the batch
runner), ``worker/disciplines.py`` (the discipline, chosen once here, and its pure rules),
``worker/planner.py`` (the batch plan) and ``worker/layout.py`` (what a request is to the plan),
and ``worker/device.py`` (what runs on the device thread).

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
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.to_thread
import numpy as np

from kserve_trio.core.bundles import Manifest
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
from kserve_trio.core.tensors import NamedTensor
from kserve_trio.runtime.weight_cache import NEEDS_CACHE, ProbeResult, Program
from kserve_trio.worker.disciplines import discipline_for
from kserve_trio.worker.dispatch import DispatchLoop, Phase
from kserve_trio.worker.hooks import Hook
from kserve_trio.worker.layout import ModelLayout
from kserve_trio.worker.model_state import (
    CostKey,
    DeviceUnit,
    ItemState,
    ModelEntry,
    ModelMetrics,
    ModelState,
    QueuedRequest,
    RequestTrace,
    finish,
    model_metrics,
    same_io,
)
from kserve_trio.worker.model_table import ModelTable

if TYPE_CHECKING:
    from kserve_trio.core.process import ResidencyState, SchedulerConfig
    from kserve_trio.runtime.weight_cache import WeightCache
    from kserve_trio.serving.tracing import Tracing

log = get_logger("kserve_trio.worker.scheduler")


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
        self._clock = clock
        self._hook_threads = hook_threads
        self._hook_limiter: anyio.CapacityLimiter | None = None
        self._timeout_ns = int(config.dispatch_timeout_seconds * 1e9)
        self._models = ModelTable()
        discipline = discipline_for(config, clock)
        self._warmup = warmup and discipline.warms_models
        self._loop = DispatchLoop(self._models, discipline, config, clock=clock, cache=cache)

    def trace_executions(self, tracing: Tracing) -> None:
        """Make each execution that serves a traced request a span (``Tracing.batch``)."""
        self._loop.tracing = tracing

    # ---------------------------------------------------------------- lifecycle

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """The dispatch loop. Warms models added before it started, then serves until stop()."""
        await self._loop.run(task_status=task_status)

    async def stop(self) -> None:
        """Refuse new work, answer everything queued UNAVAILABLE, let the running unit finish.

        Returns once ``run()`` has returned (at once if it never started).
        """
        await self._loop.stop()

    # ---------------------------------------------------------------- models
    # The only changes to the model table. Each keeps it consistent with the weight cache
    # (every residency change runs on the device thread, through ``DispatchLoop.cache_op``)
    # and with the requests in flight: a running execution finishes on the version it started
    # on, queued requests move to a replacement or are answered.

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
        self._loop.refuse_if_stopping()
        name = entry.name
        if name in self._models:
            raise FailedPrecondition(f"model '{name}' is already loaded")
        overrides = self._config.models.get(name)
        state = ModelState.build(
            entry,
            weight=overrides.weight if overrides is not None else 1.0,
            max_batch_size=overrides.max_batch_size if overrides is not None else None,
            preprocess=preprocess,
            postprocess=postprocess,
            now_ns=self._clock(),
            cached=self._cache is not None,
        )
        self._models.put(state)
        if self._cache is not None:
            floor = overrides.residency if overrides is not None else None
            try:
                await self._loop.cache_op(self._cache.admit, state.managed_entry, floor)
            except BaseException:
                self._models.discard(name, state)
                raise
        if self._warmup and warm:
            await self._loop.warm_when_running(state)

    async def remove_model(self, name: str) -> None:
        """Unload: queued requests get NOT_FOUND; returns once no execution of it is running."""
        state = self._models.pop(name)
        if state is None:
            raise NotFound(f"unknown model: {name}")
        state.removed = True
        while state.queue:
            finish(state.queue.popleft(), error=NotFound(f"model '{name}' was unloaded"))
        self._loop.drop_warmup(state)
        await self._loop.wait_idle(state)
        if self._cache is not None:  # device buffers freed, host copy released
            await self._loop.cache_op(self._cache.release, name, state.managed_entry)

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
            await self.add_model(entry, preprocess=preprocess, postprocess=postprocess, warm=True)
            return
        self._loop.refuse_if_stopping()
        overrides = self._config.models.get(name)
        new = ModelState.build(
            entry,
            weight=old.weight,
            max_batch_size=overrides.max_batch_size if overrides is not None else None,
            preprocess=preprocess,
            postprocess=postprocess,
            now_ns=self._clock(),
            cached=self._cache is not None,
        )
        if self._warmup and self._loop.phase is Phase.RUNNING and self._cache is None:
            await self._loop.warm(new)
        await self._loop.wait_idle(old)
        old.removed = True
        old.replaced_by = new
        if same_io(old, new):
            new.queue, old.queue = old.queue, collections.deque()
        else:
            while old.queue:
                finish(
                    old.queue.popleft(), error=Unavailable(f"model '{name}' was reloaded; retry")
                )
        self._models.put(new)
        self._loop.wake()
        if self._cache is not None:
            # Queued before any batch of the new version can run (units go first): the old
            # version's tiers are released and the new one admitted at the old floor.
            await self._loop.cache_op(self._cache.replace, new.managed_entry)
            if self._warmup and self._loop.phase is Phase.RUNNING:
                await self._loop.warm(new)

    def rename_model(self, old: str, new: str) -> None:
        """Rekey a loaded model (a renamed bundle directory): no recompilation, queued requests
        keep their place. The new name's configured policy applies when it has one."""
        if new in self._models:
            raise FailedPrecondition(f"cannot rename '{old}' to '{new}': '{new}' is loaded")
        state = self._models.pop(old)
        if state is None:
            raise NotFound(f"unknown model: {old}")
        if self._cache is not None:
            try:
                self._cache.rename(old, new)
            except BaseException:
                self._models.put(state)
                raise
        state.name = new
        with contextlib.suppress(AttributeError):
            state.entry.name = new
        state.layout = ModelLayout.build(new, state.entry.manifest, state.layout.keys)
        overrides = self._config.models.get(new)
        if overrides is not None:
            state.weight = overrides.weight
            state.max_batch_size = overrides.max_batch_size
        self._models.put(state)

    def has_model(self, name: str) -> bool:
        return name in self._models

    def model_names(self) -> list[str]:
        return self._models.names()

    def set_policy(self, name: str, *, weight: float | None = None) -> None:
        """Change a model's live policy; ``weight`` (> 0) is consulted by the fair discipline."""
        state = self._models.require(name)
        if weight is not None:
            if not (isinstance(weight, int | float) and math.isfinite(weight) and weight > 0):
                raise InvalidArgument(
                    f"weight for model '{name}' must be a positive number (got {weight})"
                )
            state.weight = float(weight)

    def cost_estimates(self, name: str) -> dict[CostKey, float]:
        """Learned seconds per (variant, batch key) of a model (warmup-seeded under fair)."""
        return dict(self._models.require(name).cost)

    def scheduler_metrics(self) -> dict[str, ModelMetrics]:
        """Per-model observability snapshot."""
        now = self._clock()
        halflife = self._config.ema_halflife_seconds
        return {
            name: model_metrics(s, now, halflife, self._cache) for name, s in self._models.by_name()
        }

    # ---------------------------------------------------------------- residency

    @property
    def cache(self) -> WeightCache | None:
        """The weight cache this scheduler acquires through (None: every model stays put)."""
        return self._cache

    async def set_residency(self, name: str, target: ResidencyState | int) -> ResidencyState:
        """Move a model's residency floor (explicit mode), on the device thread."""
        self._loop.require_running()
        if self._cache is None:
            raise FailedPrecondition(NEEDS_CACHE)
        return await self.run_on_device(self._cache.set_residency, name, target)

    async def compact(self, reload_models: Sequence[str] = ()) -> int:
        """Free the on-demand device weights, then reload ``reload_models``."""
        self._loop.require_running()
        if self._cache is None:
            return 0
        return await self.run_on_device(self._cache.compact, list(reload_models))

    async def probe_weights(self) -> ProbeResult | None:
        """The cache's startup isolation probe over every model's compiled programs;
        the measured times seed the learned costs like a warmup. None without a cache."""
        cache = self._cache
        if cache is None or not cache.enabled:
            return None
        programs = _programs(self._models.snapshot())
        result: ProbeResult = await self._loop.cache_op(cache.probe, programs)
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
        self._models.require(name).layout.check_wire(inputs)

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
        ``inputs`` against (names, dtype, rank, fixed dims: ``worker.validation.validate_inputs``).
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
        self._loop.require_running()
        state = self._models.require(name)
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
                trace.preprocess_at_ns, trace.preprocess_ns = t0, self._clock() - t0
        arrays, variant, rows = state.layout.prepare(
            prepared,
            validated=validated_for is state.entry.manifest
            and state.preprocess is None
            and state.layout.wire_is_executable,
        )
        self._loop.require_running()
        state = self._models.current(name, state)
        self._check_depth(state)
        now = self._clock()
        if deadline_ns and now >= deadline_ns:
            raise DeadlineExceeded(name)
        req = QueuedRequest(arrays, variant, rows, now, deadline_ns, request_id)
        if trace is not None:
            req.span = trace.span
        if self._loop.serve_directly(state, req):
            if req.error is not None:
                raise req.error
        else:
            state.queue.append(req)
            self._loop.wake()
            await self._await_result(state, req)
        assert req.outputs is not None
        if trace is not None:
            trace.queue_ns, trace.compute_ns, trace.batch_size, trace.enqueued_at_ns = (
                req.queue_ns,
                req.compute_ns,
                req.batch_size,
                req.enqueued_ns,
            )
            trace.batch_span = req.batch_span
        outputs = [
            NamedTensor.from_array(state.layout.output_name(k), arr)
            for k, arr in enumerate(req.outputs)
        ]
        if state.postprocess is not None:
            t0 = self._clock()
            outputs = await self._hook("postprocess", state, state.postprocess, outputs)
            if trace is not None:
                trace.postprocess_at_ns, trace.postprocess_ns = t0, self._clock() - t0
        return outputs

    def _check_depth(self, state: ModelState) -> None:
        depth = self._config.max_queue_depth
        if len(state.queue) >= depth:
            raise ResourceExhausted(
                f"queue for model '{state.name}' is full ({depth}); request rejected"
            )

    async def _await_result(self, state: ModelState, req: QueuedRequest) -> None:
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
            ran = req.state is not ItemState.QUEUED
            if req.state is ItemState.QUEUED:
                state.queue.remove(req)
                req.state = ItemState.ABANDONED
            elif req.state is ItemState.RUNNING:
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
        self, kind: str, state: ModelState, hook: Hook, tensors: list[NamedTensor]
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
        self._loop.require_running()
        return await self._loop.submit(DeviceUnit(fn, args))


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


__all__ = ["ModelEntry", "ModelMetrics", "RequestTrace", "Scheduler"]

"""The worker's dispatch engine: per-model queues, one dispatch loop, one device thread.

``Scheduler`` is the engine's face: the request path (``infer``), the model admin (add, replace,
remove, rename, policy), residency control and the observability snapshot. Requests are
preprocessed on their own task (hooks in worker threads), queued per model, coalesced by the
single dispatch loop into batches at compiled sizes, executed one at a time on a dedicated
device thread, sliced back and postprocessed on their own task again. Everything that touches
the queues or the per-model state runs on the event loop thread, so no lock is needed; the
device thread only sees the arrays and the model entry of the unit it runs.

The pieces: ``worker/model_state.py`` (what is kept per model, the queued items, the metrics
snapshot), ``worker/dispatch.py`` (the loop, its lifecycle and the discipline's choice of the
next batch, and the changes to the model table), the pure rules in ``worker/disciplines.py``
(the disciplines' arithmetic), ``worker/planner.py`` (the batch plan) and ``worker/layout.py``
(what a request is to the plan), and ``worker/device.py`` (what runs on the device thread).

A *unit* of device work is either a planned batch of one model or an arbitrary callable
(``run_on_device``: meta models, control operations); callables are served before the
discipline picks the next batch, like upstream's control commands.

With a ``WeightCache`` (``runtime/weight_cache.py``) every batch first *acquires* its model's
weights on the device thread (not part of the timed compute), and every residency
change -- admission, reload, unload, ``set_residency``, ``compact``, the startup probe -- runs as
a unit there too, so the device thread is the single residency mutator.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.to_thread

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
from kserve_trio.core.manifest import Manifest
from kserve_trio.core.tensor import NamedTensor
from kserve_trio.runtime.weight_cache import NEEDS_CACHE, ProbeResult
from kserve_trio.worker.dispatch import DispatchLoop
from kserve_trio.worker.hooks import Hook
from kserve_trio.worker.model_state import (
    CostKey,
    DeviceUnit,
    ItemState,
    ModelEntry,
    ModelMetrics,
    ModelState,
    QueuedRequest,
    RequestTrace,
    model_metrics,
    same_io,
)

if TYPE_CHECKING:
    from kserve_trio.core.config import ResidencyState, SchedulerConfig
    from kserve_trio.runtime.weight_cache import WeightCache
    from kserve_trio.serving.tracing import Tracing


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
        self._loop = DispatchLoop(config, warmup=warmup, clock=clock, cache=cache)

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
        await self._loop.add_model(entry, preprocess=preprocess, postprocess=postprocess, warm=warm)

    async def remove_model(self, name: str) -> None:
        """Unload: queued requests get NOT_FOUND; returns once no execution of it is running."""
        await self._loop.remove_model(name)

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
        await self._loop.replace_model(entry, preprocess=preprocess, postprocess=postprocess)

    def rename_model(self, old: str, new: str) -> None:
        """Rekey a loaded model (a renamed bundle directory): no recompilation, queued requests
        keep their place. The new name's configured policy applies when it has one."""
        self._loop.rename_model(old, new)

    def has_model(self, name: str) -> bool:
        return name in self._loop.models

    def model_names(self) -> list[str]:
        return sorted(self._loop.models)

    def _model(self, name: str) -> ModelState:
        state = self._loop.models.get(name)
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

    def cost_estimates(self, name: str) -> dict[CostKey, float]:
        """Learned seconds per (variant, batch key) of a model (warmup-seeded under fair)."""
        return dict(self._model(name).cost)

    def scheduler_metrics(self) -> dict[str, ModelMetrics]:
        """Per-model observability snapshot."""
        now = self._clock()
        halflife = self._config.ema_halflife_seconds
        return {
            name: model_metrics(s, now, halflife, self._cache)
            for name, s in sorted(self._loop.models.items())
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
        return await self._loop.probe_weights()

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
        self._loop.require_running()
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
                trace.preprocess_at_ns, trace.preprocess_ns = t0, self._clock() - t0
        arrays, variant, rows = state.layout.prepare(
            prepared,
            validated=validated_for is state.entry.manifest
            and state.preprocess is None
            and state.layout.wire_is_executable,
        )
        self._loop.require_running()
        state = self._current(name, state)
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

    def _current(self, name: str, state: ModelState) -> ModelState:
        """The live state for a request prepared against ``state`` (which may have been swapped).

        A reload with an unchanged I/O spec hands the request to the new version; any other
        reload answers UNAVAILABLE (retry); an unload answers NOT_FOUND.
        """
        live = self._loop.models.get(name)
        if live is state:
            return state
        nxt = state.replaced_by
        while nxt is not None and nxt is not live:
            nxt = nxt.replaced_by
        if live is not None and nxt is live:
            if same_io(state, live):
                return live
            raise Unavailable(f"model '{name}' was reloaded; retry")
        raise NotFound(f"model '{name}' was unloaded")

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


__all__ = ["ModelEntry", "ModelMetrics", "RequestTrace", "Scheduler"]

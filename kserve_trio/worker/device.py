"""The device thread: the one thread that runs device work, and what it runs.

``DeviceThread`` executes callables handed to it one at a time (exactly one device execution at
a time); ``execute_plan`` is the body of one coalesced batch (weights
acquired, inputs coalesced and padded, the execution timed, outputs sliced per request) and
``warm_model`` the body of a warmup. The dispatch loop (``worker/dispatch.py``) decides what runs.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import numpy as np

from kserve_trio.core.errors import Internal
from kserve_trio.core.process import LoopClosed, thread_poster
from kserve_trio.runtime.weight_cache import NotResidentError
from kserve_trio.worker.disciplines import MIN_COST_SECONDS
from kserve_trio.worker.layout import ModelLayout
from kserve_trio.worker.model_state import ModelEntry, ModelState
from kserve_trio.worker.planner import BatchPlan, coalesce_inputs, slice_outputs

if TYPE_CHECKING:
    from kserve_trio.runtime.weight_cache import WeightCache


# --------------------------------------------------------------------------------------------
# The device thread


class _Job:
    __slots__ = ("args", "error", "event", "fn", "result")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args
        self.event = anyio.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class DeviceThread:
    """The one thread that runs device work, fed through a queue, started on (and answering
    to) the event loop that builds it.

    A dedicated thread rather than ``to_thread.run_sync(limiter=CapacityLimiter(1))``: its round
    trip is cheaper than anyio's worker pool, whose limiter, cancel-scope and context bookkeeping
    is paid per call (docs/benchmarks.md). It also gives meta models and control operations one
    stable thread.

    The hand-back (``handback``, see ``worker/switches.py``): with ``post`` a finished job joins
    ``_finished`` and, unless a wake-up is already pending, one is posted to the loop
    (``core.process.event_loops.thread_poster``); the thread goes on to its next job at once, and the
    loop's wake-up sets the events of every job finished by then. With ``block`` the thread
    waits until the loop has run each job's wake-up.
    """

    def __init__(self, handback: str = "post") -> None:
        self._handback = handback
        self._token = anyio.lowlevel.current_token()
        self._post = thread_poster()
        self._finished: collections.deque[_Job] = collections.deque()
        self._wake_pending = False  # a _wake_waiters is posted and has not started yet
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name="kserve-trio-device", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        hand_back = self._hand_back_blocking if self._handback == "block" else self._hand_back
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job.result = job.fn(*job.args)
            except BaseException as exc:
                job.error = exc
            hand_back(job)
            # Drop this thread's references now: a job's arguments may be views of a
            # shared-memory mapping that can only be unmapped once no view is alive.
            job = None

    def _hand_back(self, job: _Job) -> None:
        # The order matters (the loop clears the flag before it empties the deque): a job
        # appended while a wake-up runs is either taken by it or posts the next one.
        self._finished.append(job)
        if self._wake_pending:
            return
        self._wake_pending = True
        try:
            self._post(self._wake_waiters)
        except LoopClosed:  # the event loop is gone: nobody is waiting any more
            self._finished.clear()

    def _wake_waiters(self) -> None:
        """On the loop: set the event of every job finished so far."""
        self._wake_pending = False
        finished = self._finished
        while finished:
            finished.popleft().event.set()

    def _hand_back_blocking(self, job: _Job) -> None:
        try:
            anyio.from_thread.run_sync(job.event.set, token=self._token)
        except Exception:  # the event loop is gone: nobody is waiting any more
            pass

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the device thread; never abandoned once handed over (a
        cancelled caller still waits for the job, so one execution at a time holds)."""
        job = _Job(fn, args)
        self._jobs.put(job)
        with anyio.CancelScope(shield=True):
            await job.event.wait()
        if job.error is not None:
            raise job.error
        return job.result

    async def close(self) -> None:
        """Stop after the jobs already queued; returns once the thread has ended."""
        self._jobs.put(None)
        await anyio.to_thread.run_sync(self._thread.join)


def execute_plan(
    state: ModelState,
    plan: BatchPlan,
    arrays: list[list[np.ndarray]],
    rows: list[int],
    clock: Callable[[], int],
    cache: WeightCache | None = None,
) -> tuple[int, list[list[np.ndarray]]]:
    """Device-thread body of one batch: acquire the weights (untimed), coalesce, execute
    (timed), slice per request, then give the cache its auto-compaction turn."""
    if cache is not None:
        cache.acquire(state.managed_entry)
    try:
        return _run_plan(state.entry, state.layout, plan, arrays, rows, clock)
    finally:
        if cache is not None:
            cache.after_dispatch()


def _run_plan(
    entry: ModelEntry,
    layout: ModelLayout,
    plan: BatchPlan,
    arrays: list[list[np.ndarray]],
    rows: list[int],
    clock: Callable[[], int],
) -> tuple[int, list[list[np.ndarray]]]:
    inputs = (
        coalesce_inputs(arrays, layout.input_axes, plan.batch_key) if plan.coalesced else arrays[0]
    )
    t0 = clock()
    outputs = entry.execute(plan.variant, plan.batch_key, inputs)
    elapsed = clock() - t0
    if len(outputs) < len(layout.output_names):
        raise Internal(
            f"model '{entry.name}' returned {len(outputs)} outputs, "
            f"expected {len(layout.output_names)}"
        )
    if not plan.coalesced:
        return elapsed, [list(outputs)]
    for k, axis in enumerate(layout.output_axes):
        if axis is not None and outputs[k].shape[axis] != plan.batch_key:
            raise Internal(
                f"model '{entry.name}' returned output '{layout.output_names[k]}' with "
                f"{outputs[k].shape[axis]} rows at dim {axis} for a batch of {plan.batch_key}"
            )
    return elapsed, slice_outputs(outputs, layout.output_axes, rows)


def warm_model(
    state: ModelState, clock: Callable[[], int], cache: WeightCache | None = None
) -> tuple[dict[tuple[int | None, int], float], list[str]]:
    """Device-thread body of a warmup: run each compiled (variant, key) of ``state`` once on
    zeros; it stops early once the model is removed.

    With a weight cache the model is acquired first; a model explicit mode may not load is
    simply not warmed."""
    costs: dict[tuple[int | None, int], float] = {}
    failures: list[str] = []
    if cache is not None:
        try:
            cache.acquire(state.managed_entry)
        except NotResidentError:
            return costs, failures
        except Exception as exc:
            return costs, [f"acquire: {type(exc).__name__}: {exc}"]
    for variant, keys in state.layout.keys.items():
        for key in keys:
            if state.removed:
                return costs, failures
            try:
                inputs = state.layout.zero_inputs(variant, key)
                t0 = clock()
                state.entry.execute(variant, key, inputs)
                costs[(variant, key)] = max((clock() - t0) / 1e9, MIN_COST_SECONDS)
            except Exception as exc:
                failures.append(f"variant {variant} batch {key}: {type(exc).__name__}: {exc}")
    return costs, failures


__all__ = ["DeviceThread", "execute_plan", "warm_model"]

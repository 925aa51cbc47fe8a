"""What the scheduler keeps per model, the items it queues, and the snapshots it gives out.

This module owns the scheduler's data: ``ModelEntry`` (what it runs), ``ModelState`` (one
model's queue, policy, learned costs and counters), the queued items (``QueuedRequest``,
``DeviceUnit``) with their one-shot outcome (``finish``), and the bookkeeping on them that needs
no event loop: recording a batch (``record_batch``) and the observability snapshot
(``model_metrics``). The model admin (``worker/scheduler.py``) and the dispatch loop
(``worker/dispatch.py``) mutate these; nothing here does I/O.
"""

from __future__ import annotations

import collections
import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import numpy as np

from kserve_trio.core.bundles import Manifest
from kserve_trio.core.errors import Internal
from kserve_trio.runtime.weight_cache import ManagedModel
from kserve_trio.worker.disciplines import decay, decay_ema, update_cost
from kserve_trio.worker.hooks import Hook
from kserve_trio.worker.layout import ModelLayout
from kserve_trio.worker.planner import BatchPlan

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext

    from kserve_trio.runtime.weight_cache import WeightCache

WAIT_SAMPLES = 1024
"""Queue-wait samples kept per model for the percentiles (a ring)."""

CostKey = tuple[int | None, int]
"""A compiled program of a model: (shape variant, batch key)."""


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


@dataclass(slots=True)
class RequestTrace:
    """What one request went through, filled by ``Scheduler.infer`` (for logs, statistics and
    the spans of a traced request). The ``*_at_ns`` marks are the scheduler's clock
    (``time.monotonic_ns``); 0: the step did not happen."""

    queue_ns: int = 0
    compute_ns: int = 0
    batch_size: int = 0
    preprocess_ns: int = 0
    postprocess_ns: int = 0
    enqueued_at_ns: int = 0
    preprocess_at_ns: int = 0
    postprocess_at_ns: int = 0
    span: SpanContext | None = None
    """The request's server span when it is traced (the coalesced execution links it)."""
    batch_span: SpanContext | None = None
    """The span of the coalesced execution that served it, when it is traced."""
    subcalls: list[MetaSubcall] | None = None
    """A traced meta model request's sub-calls, in order (None: not recorded)."""


@dataclass(frozen=True, slots=True)
class MetaSubcall:
    """One ``call(name, inputs)`` of a meta model's ``run``, between two
    ``time.monotonic_ns()`` marks (a traced request's span of it)."""

    model: str
    start_ns: int
    end_ns: int


class ItemState(enum.Enum):
    """Where a queued item is: waiting, on the device, answered, or withdrawn by its caller."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    ABANDONED = "abandoned"


@dataclass(eq=False, slots=True)
class QueuedRequest:
    """One queued inference request; ``done`` is its one-shot result channel."""

    arrays: list[np.ndarray]
    variant: int | None
    rows: int
    enqueued_ns: int
    deadline_ns: int
    request_id: str
    state: ItemState = ItemState.QUEUED
    done: anyio.Event = field(default_factory=anyio.Event)
    outputs: list[np.ndarray] | None = None
    error: BaseException | None = None
    queue_ns: int = 0
    compute_ns: int = 0
    batch_size: int = 0
    span: SpanContext | None = None
    """The request's server span when it is traced (``RequestTrace.span``)."""
    batch_span: SpanContext | None = None
    """Set by the dispatch loop: the traced coalesced execution that served it."""


@dataclass(eq=False, slots=True)
class DeviceUnit:
    """A callable queued for the device thread; ``model`` is set for a model's warmup."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    model: ModelState | None = None
    state: ItemState = ItemState.QUEUED
    done: anyio.Event = field(default_factory=anyio.Event)
    result: Any = None
    error: BaseException | None = None


@dataclass(eq=False)
class ModelState:
    """Everything the loop keeps per model: queue, policy, learned costs and counters."""

    name: str
    entry: ModelEntry
    layout: ModelLayout
    weight: float
    max_batch_size: int | None
    preprocess: Hook | None
    postprocess: Hook | None
    ema_ns: int
    queue: collections.deque[QueuedRequest] = field(default_factory=collections.deque)
    ema: float = 0.0
    cost: dict[CostKey, float] = field(default_factory=dict)
    fastest: dict[CostKey, float] = field(default_factory=dict)
    """The shortest execution seen per program (s): what decides inline execution, because a
    device-thread timing includes waits for the GIL that the learned cost then carries."""
    dispatch_count: int = 0
    requests_served: int = 0
    rows_served: int = 0
    total_compute: float = 0.0
    batch_hist: collections.Counter[int] = field(default_factory=collections.Counter)
    waits: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=WAIT_SAMPLES)
    )
    removed: bool = False
    replaced_by: ModelState | None = None
    queue_ns_total: int = 0
    request_compute_ns_total: int = 0
    batch_compute_ns: collections.Counter[int] = field(default_factory=collections.Counter)
    managed: ManagedModel | None = None
    """The entry's residency surface; set at admission whenever a weight cache is in use."""

    @property
    def managed_entry(self) -> ManagedModel:
        """The entry as the weight cache manages it (asked only when there is a cache)."""
        if self.managed is None:
            raise Internal(f"model '{self.name}' is not managed by the weight cache")
        return self.managed

    @classmethod
    def build(
        cls,
        entry: ModelEntry,
        *,
        weight: float,
        max_batch_size: int | None,
        preprocess: Hook | None,
        postprocess: Hook | None,
        now_ns: int,
        cached: bool,
    ) -> ModelState:
        """A fresh state for ``entry``: its layout from the manifest and the compiled sizes.
        ``cached``: a weight cache will manage it, so it must have weights (``ManagedModel``);
        an entry that has none is refused here rather than on the device thread."""
        managed = None
        if cached:
            if not isinstance(entry, ManagedModel):
                raise TypeError(
                    f"model '{entry.name}' ({type(entry).__name__}) has no weights the weight "
                    "cache can manage"
                )
            managed = entry
        return cls(
            name=entry.name,
            entry=entry,
            layout=ModelLayout.build(
                entry.name, entry.manifest, {v: entry.batch_keys(v) for v in entry.variants}
            ),
            weight=weight,
            max_batch_size=max_batch_size,
            preprocess=preprocess,
            postprocess=postprocess,
            ema_ns=now_ns,
            managed=managed,
        )


def same_io(a: ModelState, b: ModelState) -> bool:
    """Whether requests prepared for ``a`` can run unchanged on ``b``."""
    ma, mb = a.entry.manifest, b.entry.manifest
    return (
        ma.executable_inputs == mb.executable_inputs
        and ma.executable_outputs == mb.executable_outputs
        and ma.wire_inputs == mb.wire_inputs
        and ma.wire_outputs == mb.wire_outputs
        and a.layout.keys == b.layout.keys
    )


def finish(item: QueuedRequest | DeviceUnit, *, error: BaseException | None = None) -> None:
    """Deliver an outcome to a waiter exactly once."""
    if item.state is ItemState.DONE:
        return
    if error is not None:
        item.error = error
    item.state = ItemState.DONE
    item.done.set()


def record_batch(
    state: ModelState,
    plan: BatchPlan,
    taken: Sequence[QueuedRequest],
    started_ns: int,
    elapsed_ns: int,
    *,
    now_ns: int,
    halflife_seconds: float,
    cost_alpha: float,
) -> None:
    """Account one executed batch: the EMA and the learned cost of its program, the counters,
    and each request's queue and compute time (read back by ``RequestTrace``)."""
    t = max(elapsed_ns, 0) / 1e9
    decay(state, now_ns, halflife_seconds)
    state.ema += t
    key = (plan.variant, plan.batch_key)
    state.cost[key] = update_cost(state.cost.get(key), t, cost_alpha)
    state.dispatch_count += 1
    state.requests_served += len(taken)
    state.rows_served += plan.rows
    state.total_compute += t
    state.batch_hist[plan.batch_key] += 1
    state.waits.extend((started_ns - r.enqueued_ns) / 1e9 for r in taken)
    state.batch_compute_ns[plan.batch_key] += max(elapsed_ns, 0)
    for r in taken:
        r.queue_ns = started_ns - r.enqueued_ns
        r.compute_ns = max(elapsed_ns, 0)
        r.batch_size = plan.batch_key
        state.queue_ns_total += r.queue_ns
        state.request_compute_ns_total += r.compute_ns


def model_metrics(
    s: ModelState, now_ns: int, halflife_seconds: float, cache: WeightCache | None
) -> ModelMetrics:
    """The observability snapshot of one model; residency from the cache when it manages the
    model, else from the entry itself (an entry without weights counts as resident)."""
    p50, p99 = wait_percentiles(s.waits)
    if cache is not None and cache.has(s.name):
        r = cache.residency(s.name)
        floor, pinned = r.floor.name.lower(), r.floor.name == "PINNED_DEVICE"
        resident, host_resident, nbytes = r.device_resident, r.host_resident, r.weight_nbytes
    else:
        probe = getattr(s.entry, "weights_resident", None)
        floor, pinned, host_resident = "unpinned", False, False
        resident = bool(probe()) if callable(probe) else True
        nbytes = int(getattr(s.entry, "weight_nbytes", 0) or 0)
    return ModelMetrics(
        dispatch_count=s.dispatch_count,
        requests_served=s.requests_served,
        rows_served=s.rows_served,
        total_compute=s.total_compute,
        recent_compute_ema=decay_ema(s.ema, (now_ns - s.ema_ns) / 1e9, halflife_seconds),
        queue_depth=len(s.queue),
        wait_p50=p50,
        wait_p99=p99,
        batch_size_hist=dict(sorted(s.batch_hist.items())),
        max_batch_size=s.layout.max_batch_size(s.max_batch_size),
        weight=s.weight,
        queue_seconds_total=s.queue_ns_total / 1e9,
        request_compute_seconds_total=s.request_compute_ns_total / 1e9,
        batch_compute_seconds={k: ns / 1e9 for k, ns in sorted(s.batch_compute_ns.items())},
        state=floor,
        pinned=pinned,
        resident=resident,
        host_resident=host_resident,
        weight_nbytes=nbytes,
    )


def nearest_rank(sorted_samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: ``sorted[clamp(ceil(q*n), 1, n)]`` (1-based); 0 when empty."""
    n = len(sorted_samples)
    if n == 0:
        return 0.0
    rank = min(max(math.ceil(q * n), 1), n)
    return float(sorted_samples[rank - 1])


def wait_percentiles(samples: Sequence[float]) -> tuple[float, float]:
    """(p50, p99) of queue-wait samples by nearest rank."""
    ordered = sorted(samples)
    return nearest_rank(ordered, 0.5), nearest_rank(ordered, 0.99)


__all__ = [
    "WAIT_SAMPLES",
    "CostKey",
    "DeviceUnit",
    "ItemState",
    "ModelEntry",
    "ModelMetrics",
    "ModelState",
    "QueuedRequest",
    "RequestTrace",
    "finish",
    "model_metrics",
    "nearest_rank",
    "record_batch",
    "same_io",
    "wait_percentiles",
]

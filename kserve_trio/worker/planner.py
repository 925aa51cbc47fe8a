"""The scheduler's pure decision logic: batch plans, the disciplines, cost and wait statistics.

Everything here is a plain function of plain values: no clocks, no locks, no
I/O, so every scheduling rule is pinned by a plain test. That includes what a
request is to the planner (``ModelLayout``: admission rows, executable inputs, variant, warmup
inputs), derived once per model from its manifest and compiled keys. The dispatch loop
(``worker/dispatch.py``) is the async shell that feeds these functions the state of its queues
and applies their answers.

Conventions: times are seconds (float) for compute costs and EMAs, nanoseconds (int) for
enqueue stamps and deadlines; a deadline of 0 means none. Shapes and batch axes are row-major.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kserve_trio.core.errors import InvalidArgument
from kserve_trio.core.manifest import DimKind, Manifest, TensorSpec, request_rows
from kserve_trio.core.tensor import NamedTensor

DEFAULT_COST_SECONDS = 0.01
"""Cost assumed for a (variant, batch size) that has never been measured."""

MIN_COST_SECONDS = 1e-9
"""Floor for a measured cost, so a priority never divides by zero."""


# --------------------------------------------------------------------------------------------
# Fair discipline arithmetic


def decay_ema(ema: float, dt_seconds: float, halflife_seconds: float) -> float:
    """Decay a recent-compute EMA by ``dt_seconds``: it halves every ``halflife_seconds``.

    A negative ``dt`` (clock skew between stamps) decays nothing rather than growing the EMA.
    """
    if dt_seconds <= 0.0 or ema == 0.0:
        return ema
    return ema * math.exp(-dt_seconds * math.log(2.0) / halflife_seconds)


def fair_priority(share: float, nema: float, cap: float, eff_cost: float) -> float:
    """Priority of a model under the fair discipline; the highest wins.

    ``share`` is the model's weight over the total weight, ``nema`` its recent compute over the
    total recent compute, ``cap`` the recency penalty cap and ``eff_cost`` the (discounted)
    estimated seconds of the dispatch it would make. A model that used less than its share
    gets a positive priority, and a cheap dispatch ranks above an expensive one with the same
    deficit: ``clamp(share - nema, -cap, +cap) / eff_cost``.
    """
    deficit = min(max(share - nema, -cap), cap)
    return deficit / max(eff_cost, MIN_COST_SECONDS)


def effective_cost(
    estimate: float | None, *, coalescing_discount: float, coalesced_requests: int
) -> float:
    """Estimated cost of a dispatch as the fair discipline weighs it.

    ``estimate`` is the learned cost of the plan's (variant, batch size), ``None`` when never
    measured (then 0.01 s). The coalescing discount rewards only a plan that
    actually coalesces more than one request (upstream discounted every candidate, which changes
    nothing in the ranking).
    """
    cost = DEFAULT_COST_SECONDS if estimate is None else estimate
    if coalesced_requests > 1:
        cost *= 1.0 - coalescing_discount
    return cost


def update_cost(old: float | None, measured: float, alpha: float) -> float:
    """Fold one measured execution time into a learned cost: ``alpha*t + (1-alpha)*old``.

    The first measurement (``old is None``) seeds the estimate exactly.
    """
    measured = max(measured, MIN_COST_SECONDS)
    if old is None:
        return measured
    return alpha * measured + (1.0 - alpha) * old


# --------------------------------------------------------------------------------------------
# Discipline selection


@dataclass(frozen=True, slots=True)
class Candidate:
    """One schedulable model as the disciplines see it at one decision.

    ``front_enqueued_ns`` stamps the oldest queued request; ``earliest_deadline_ns`` is the
    smallest non-zero deadline among all its queued requests (0 = none queued has one);
    ``ema`` is the recent compute already decayed to now; ``cost`` the effective cost of the
    dispatch its plan would make.
    """

    name: str
    front_enqueued_ns: int
    weight: float = 1.0
    ema: float = 0.0
    cost: float = DEFAULT_COST_SECONDS
    earliest_deadline_ns: int = 0


def select_fair(
    candidates: Sequence[Candidate], *, total_weight: float, total_ema: float, cap: float
) -> Candidate:
    """Pick the next model under the fair discipline.

    Rules:
    1. ``share = weight / total_weight`` (0 when the total is 0) and ``nema = ema / total_ema``
       (0 when the total is 0); the totals cover every registered model, queued or not.
    2. ``priority = fair_priority(share, nema, cap, cost)``; the highest priority wins.
    3. Ties go to the older front request, then to the lexicographically smaller name.
    """

    def key(c: Candidate) -> tuple[float, int, str]:
        share = c.weight / total_weight if total_weight > 0 else 0.0
        nema = c.ema / total_ema if total_ema > 0 else 0.0
        return (-fair_priority(share, nema, cap, c.cost), c.front_enqueued_ns, c.name)

    return min(candidates, key=key)


def select_fifo(candidates: Sequence[Candidate]) -> Candidate:
    """Pick the model whose front request is the oldest; ties go to the smaller name."""
    return min(candidates, key=lambda c: (c.front_enqueued_ns, c.name))


def select_edf(candidates: Sequence[Candidate]) -> Candidate:
    """Pick the model holding the most urgent deadline (earliest-deadline-first).

    Rules:
    1. A model's urgency is the smallest non-zero deadline among all its queued requests; a model
       with no deadline queued is least urgent (+inf).
    2. Ties (equal deadlines, or none) fall back to fifo: older front request, then smaller name.
       So uniform deadlines make edf exactly fifo.
    """

    def key(c: Candidate) -> tuple[float, int, str]:
        urgency = c.earliest_deadline_ns if c.earliest_deadline_ns > 0 else math.inf
        return (urgency, c.front_enqueued_ns, c.name)

    return min(candidates, key=key)


def deadline_expired(deadline_ns: int, now_ns: int, margin_ns: int = 0) -> bool:
    """Whether a request must be refused at dispatch admission.

    A request with a deadline (non-zero) is refused when ``now + margin >= deadline``: under edf
    the margin is the plan's learned cost (laxity shedding: work that cannot finish in time is
    not started), otherwise 0.
    """
    return deadline_ns != 0 and now_ns + margin_ns >= deadline_ns


def laxity_margin_ns(cost_estimate: float | None) -> int:
    """The edf admission margin for a plan: its learned cost (0.01 s if unmeasured) in ns."""
    cost = DEFAULT_COST_SECONDS if cost_estimate is None else cost_estimate
    return int(cost * 1e9)


# --------------------------------------------------------------------------------------------
# The coalescing plan


class Plannable(Protocol):
    """What the planner reads from a queued request."""

    @property
    def variant(self) -> int | None: ...

    @property
    def rows(self) -> int: ...


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """One dispatch: take ``take`` requests from the queue front and run ``batch_key``.

    ``rows`` is the number of real rows taken; ``batch_key`` is the compiled size executed (0 =
    the unbatched module, which runs the front request at its own size). ``coalesced`` says
    whether the inputs must be concatenated/padded (False: passed through untouched).
    """

    variant: int | None
    batch_key: int
    take: int
    rows: int
    coalesced: bool

    @property
    def padding(self) -> int:
        """Zero rows appended to reach ``batch_key`` (0 for a pass-through plan)."""
        return self.batch_key - self.rows if self.coalesced else 0


def smallest_key_at_least(keys: Sequence[int], rows: int) -> int:
    """The smallest compiled size >= ``rows``, else the largest (``keys`` sorted, non-empty)."""
    for k in keys:
        if k >= rows:
            return k
    return keys[-1]


def plan_batch(
    queue: Sequence[Plannable],
    batch_keys: Callable[[int | None], Sequence[int]],
    *,
    batched: bool,
    max_batch_size: int | None = None,
) -> BatchPlan:
    """Decide the next dispatch of one model from its queue (pure; the queue is not changed).

    ``batch_keys(variant)`` gives the sorted compiled sizes of a variant (0 = unbatched module);
    ``batched`` says whether every executable input and output has a batch axis;
    ``max_batch_size`` caps the rows coalesced into one dispatch (None = uncapped).

    Rules:
    1. The variant is the front request's. The plan is not coalescable when the model is not
       ``batched`` or the variant has the unbatched module (key 0): then it takes the front
       request alone, with key 0 if present, else the smallest compiled size >= its rows, else
       the largest.
    2. Coalescable: the window is the leading run of requests sharing the front's variant.
       ``cap = max_batch_size or inf``; ``R = min(sum of window rows, cap)``.
    3. ``B`` = the largest compiled size <= ``min(R, maxB)`` if ``R >= minB``, else ``minB``
       (partial fill, padded). If ``B`` < the front's rows, ``B`` = the smallest size >= the
       front's rows, else ``maxB``.
    4. Take requests from the window front while ``taken rows + rows <= min(B, cap)``. If nothing
       fits, take the front alone (forward progress; a request is never split).
    5. A lone request that already has exactly ``B`` rows is passed through uncoalesced.
    """
    if not queue:
        raise ValueError("plan_batch needs a non-empty queue")
    front = queue[0]
    variant = front.variant
    keys = batch_keys(variant)
    if not keys:
        raise ValueError(f"no compiled batch sizes for variant {variant}")
    if not batched or keys[0] == 0:
        key = 0 if keys[0] == 0 else smallest_key_at_least(keys, front.rows)
        return BatchPlan(variant, key, 1, front.rows, coalesced=False)

    min_b, max_b = keys[0], keys[-1]
    cap = max_batch_size if max_batch_size is not None else math.inf
    # Rule 2-3 only need R up to min(cap, maxB): stop summing there (queues can be long).
    limit = min(cap, max_b)
    total = 0
    for req in queue:
        if req.variant != variant:
            break
        total += req.rows
        if total >= limit:
            break
    r = min(total, cap)
    if r >= min_b:
        bound = min(r, max_b)
        b = min_b
        for k in keys:
            if k <= bound:
                b = k
    else:
        b = min_b
    if b < front.rows:
        b = smallest_key_at_least(keys, front.rows)

    fit = min(b, cap)
    take = 0
    acc = 0
    for req in queue:
        if req.variant != variant or acc + req.rows > fit:
            break
        acc += req.rows
        take += 1
    if take == 0:
        take, acc = 1, front.rows
    coalesced = not (take == 1 and acc == b)
    return BatchPlan(variant, b, take, acc, coalesced=coalesced)


# --------------------------------------------------------------------------------------------
# Tensor coalescing, padding and slicing; run on the device thread


def coalesce_inputs(
    per_request: Sequence[Sequence[np.ndarray]],
    batch_axes: Sequence[int | None],
    batch_size: int,
) -> list[np.ndarray]:
    """Concatenate each executable input of several requests along its own batch axis.

    ``per_request[i][j]`` is input ``j`` of request ``i`` (manifest order); ``batch_axes[j]`` its
    row-major batch axis. The result has ``batch_size`` rows on that axis: real rows first, then
    zero padding. One allocation per input; only the padding is zeroed. An input without a batch
    axis (only possible for a non-coalesced plan) is taken from the first request.
    """
    out: list[np.ndarray] = []
    for j, axis in enumerate(batch_axes):
        parts = [req[j] for req in per_request]
        if axis is None:
            out.append(parts[0])
            continue
        first = parts[0]
        total = sum(part.shape[axis] for part in parts)
        if total > batch_size:
            raise ValueError(f"coalesced {total} rows into a batch of {batch_size}")
        shape = list(first.shape)
        shape[axis] = batch_size
        buf = np.empty(shape, dtype=first.dtype)
        index: list[slice] = [slice(None)] * len(shape)
        offset = 0
        for part in parts:
            n = part.shape[axis]
            index[axis] = slice(offset, offset + n)
            buf[tuple(index)] = part
            offset += n
        if offset < batch_size:
            index[axis] = slice(offset, batch_size)
            buf[tuple(index)] = 0
        out.append(buf)
    return out


def slice_outputs(
    outputs: Sequence[np.ndarray],
    batch_axes: Sequence[int | None],
    rows: Sequence[int],
) -> list[list[np.ndarray]]:
    """Split batched outputs back into per-request slices (views; padding rows dropped).

    ``batch_axes[k]`` is output ``k``'s row-major batch axis; outputs beyond ``batch_axes`` or
    without a batch axis are handed whole to every request. Returns ``result[i][k]`` = output
    ``k`` for request ``i``.
    """
    result: list[list[np.ndarray]] = [[] for _ in rows]
    for k, out in enumerate(outputs):
        axis = batch_axes[k] if k < len(batch_axes) else None
        if axis is None:
            for per in result:
                per.append(out)
            continue
        index: list[slice] = [slice(None)] * out.ndim
        offset = 0
        for i, n in enumerate(rows):
            index[axis] = slice(offset, offset + n)
            result[i].append(out[tuple(index)])
            offset += n
    return result


# --------------------------------------------------------------------------------------------
# Wait statistics


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


# --------------------------------------------------------------------------------------------
# Request shaping: what a model accepts and what a request is to the plan


def check_executable_input(
    model: str, spec: TensorSpec, tensor: NamedTensor, arr: np.ndarray
) -> None:
    """Refuse an executable input whose array does not have its spec's dtype and shape.

    This is the check on tensors no validation pass has seen: what a preprocess hook returned,
    or wire inputs that are not the executable ones. Messages: ``input 'x' of model 'm' has
    dtype f64, expected f32`` and ``input 'x' of model 'm' has 3 dims, expected 2`` (or the
    axis whose extent differs, ``TensorSpec.matches``).
    """
    if arr.dtype != spec.dtype.numpy:
        raise InvalidArgument(
            f"input '{spec.name}' of model '{model}' has dtype "
            f"{tensor.dtype.token}, expected {spec.dtype.token}"
        )
    reason = spec.matches(arr.shape)
    if reason is not None:
        raise InvalidArgument(f"input '{spec.name}' of model '{model}' {reason}")


@dataclass(frozen=True)
class ModelLayout:
    """The manifest facts the scheduler needs on every request, derived once per model.

    ``keys`` maps each variant (``None`` for a single-shape model) to its sorted compiled batch
    keys (0 = the unbatched module). ``batched`` (every executable input and output has a batch
    axis) is what makes a model coalescable; ``inputs_batched`` says whether requests have rows;
    ``wire_is_executable`` whether a client sends the executable inputs themselves (no
    ``client_inputs``).
    """

    name: str
    manifest: Manifest
    keys: dict[int | None, tuple[int, ...]] = field(hash=False)
    input_axes: tuple[int | None, ...]
    output_names: tuple[str, ...]
    output_axes: tuple[int | None, ...]
    inputs_batched: bool
    batched: bool
    wire_is_executable: bool

    @classmethod
    def build(
        cls, name: str, manifest: Manifest, keys: Mapping[int | None, Sequence[int]]
    ) -> ModelLayout:
        """Derive the layout; a variant without any compiled program is refused."""
        sorted_keys = {v: tuple(sorted(k)) for v, k in keys.items()}
        if not sorted_keys or any(not k for k in sorted_keys.values()):
            raise InvalidArgument(f"model '{name}' has no compiled program")
        in_axes = tuple(s.batch_axis for s in manifest.executable_inputs)
        out_axes = tuple(s.batch_axis for s in manifest.executable_outputs)
        inputs_batched = bool(in_axes) and all(a is not None for a in in_axes)
        return cls(
            name,
            manifest,
            sorted_keys,
            in_axes,
            tuple(s.name for s in manifest.executable_outputs),
            out_axes,
            inputs_batched,
            inputs_batched and all(a is not None for a in out_axes),
            manifest.client_inputs is None,
        )

    def output_name(self, k: int) -> str:
        """Name of executable output ``k``; outputs beyond the manifest are ``output_{k}``."""
        return self.output_names[k] if k < len(self.output_names) else f"output_{k}"

    def max_batch_size(self, cap: int | None) -> int:
        """Most rows one dispatch coalesces (the effective ``max_batch_size``); 0 if it never does."""
        if not self.batched:
            return 0
        sizes = [ks[-1] for ks in self.keys.values() if ks[0] != 0]
        if not sizes:
            return 0
        return min(max(sizes), cap) if cap else max(sizes)

    def check_rows(self, variant: int | None, rows: int) -> None:
        """Refuse rows that no compiled program of ``variant`` can serve.

        Rules: the unbatched module (key 0) takes any size; otherwise more rows than the largest
        compiled size is refused (a request is never split), and a model that cannot coalesce
        (some output unbatched) needs exactly a compiled size (it cannot be padded).
        """
        keys = self.keys[variant]
        if keys[0] == 0:
            return
        if rows > keys[-1]:
            raise InvalidArgument(
                f"model '{self.name}' accepts at most {keys[-1]} rows per request (got {rows})"
            )
        if not self.batched and rows not in keys:
            raise InvalidArgument(
                f"model '{self.name}' has no compiled program for batch size {rows} "
                f"(have {list(keys)})"
            )

    def check_wire(self, inputs: Sequence[NamedTensor]) -> None:
        """Admission on client-facing inputs: rows, and the variant when wire = executable.

        With a model.py that transforms the inputs (``client_inputs``), only the loosest bound
        (the largest size of any variant) holds before preprocess; ``prepare`` checks the exact
        one on the executable inputs.
        """
        if not self.inputs_batched:
            return
        shapes = {t.name: t.shape for t in inputs}
        rows = request_rows(self.manifest, shapes)
        if self.manifest.client_inputs is None:
            self.check_rows(self.manifest.variant_index(shapes), rows)
            return
        if any(ks[0] == 0 for ks in self.keys.values()):
            return
        most = max(ks[-1] for ks in self.keys.values())
        if rows > most:
            raise InvalidArgument(
                f"model '{self.name}' accepts at most {most} rows per request (got {rows})"
            )

    def prepare(
        self, tensors: Sequence[NamedTensor], *, validated: bool = False
    ) -> tuple[list[np.ndarray], int | None, int]:
        """The executable input arrays (manifest order), the request's variant and its rows.

        Rules:
        1. every executable input is present with the executable dtype and a matching shape
           (``check_executable_input``), unless ``validated``;
        2. all batched inputs agree on their batch extent (the request's rows; 1 when nothing
           is batched);
        3. the variant exists, and ``check_rows`` holds.

        ``validated=True`` is for tensors that are exactly the wire inputs already checked
        against these same specs (names, completeness, dtype, rank, fixed dims) by the
        request's one validation pass: the caller passes it only when no preprocess hook ran
        and ``wire_is_executable``. Rules 2 and 3 are admission, not validation, and always run.
        """
        by_name = {t.name: t for t in tensors}
        arrays: list[np.ndarray] = []
        rows: int | None = None
        first = ""
        for spec, axis in zip(self.manifest.executable_inputs, self.input_axes, strict=True):
            if validated:
                t = by_name[spec.name]
            else:
                t = by_name.get(spec.name)
                if t is None:
                    raise InvalidArgument(
                        f"model '{self.name}' is missing required input '{spec.name}'"
                    )
            arr = t.data if tuple(t.data.shape) == tuple(t.shape) else t.data.reshape(t.shape)
            if not validated:
                check_executable_input(self.name, spec, t, arr)
            if axis is not None:
                extent = int(arr.shape[axis])
                if rows is None:
                    rows, first = extent, spec.name
                elif extent != rows:
                    raise InvalidArgument(
                        f"inputs of model '{self.name}' disagree on the batch extent "
                        f"('{first}': {rows}, '{spec.name}': {extent})"
                    )
            arrays.append(arr)
        variant = self.manifest.variant_index(
            {s.name: a.shape for s, a in zip(self.manifest.executable_inputs, arrays, strict=True)}
        )
        if variant not in self.keys:
            raise InvalidArgument(
                f"model '{self.name}' has no compiled program for variant {variant}"
            )
        rows = 1 if rows is None else rows
        if self.inputs_batched:
            self.check_rows(variant, rows)
        return arrays, variant, rows

    def zero_inputs(self, variant: int | None, batch_key: int) -> list[np.ndarray]:
        """Warmup inputs: zeros with batch axis = the key (1 for key 0) and the
        variable axes sized from the variant key."""
        sizes: dict[tuple[str, int], int] = {}
        if variant is not None:
            vkey = self.manifest.variant_keys[variant]
            for va, size in zip(self.manifest.variable_axes, vkey, strict=True):
                sizes[(va.input_name, va.axis)] = size
        arrays = []
        for spec in self.manifest.executable_inputs:
            shape = []
            for axis, d in enumerate(spec.dims):
                if d.kind is DimKind.FIXED:
                    shape.append(d.size)
                elif d.kind is DimKind.BATCH:
                    shape.append(batch_key or 1)
                else:
                    shape.append(sizes.get((spec.name, axis), 1))
            arrays.append(np.zeros(shape, dtype=spec.dtype.numpy))
        return arrays


__all__ = [
    "DEFAULT_COST_SECONDS",
    "MIN_COST_SECONDS",
    "BatchPlan",
    "Candidate",
    "ModelLayout",
    "Plannable",
    "check_executable_input",
    "coalesce_inputs",
    "deadline_expired",
    "decay_ema",
    "effective_cost",
    "fair_priority",
    "laxity_margin_ns",
    "nearest_rank",
    "plan_batch",
    "select_edf",
    "select_fair",
    "select_fifo",
    "slice_outputs",
    "smallest_key_at_least",
    "update_cost",
    "wait_percentiles",
]

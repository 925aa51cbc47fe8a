"""The batch plan: which queued requests one execution takes, at which compiled batch key, and
the coalescing, padding and slicing of their tensors (run on the device thread).

Plain functions of plain values (no clocks, no locks, no I/O), so every rule is pinned by a
plain test; the dispatch loop (``worker/dispatch.py``) is the async shell around them.

Conventions: times are seconds (float) for compute costs and EMAs, nanoseconds (int) for
enqueue stamps and deadlines; a deadline of 0 means none. Shapes and batch axes are row-major.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

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
    1. *Front variant*: the variant is the front request's. The plan is not coalescable when the
       model is not ``batched`` or the variant has the unbatched module (key 0): then it takes the
       front request alone, with key 0 if present, else the smallest compiled size >= its rows, else
       the largest.
    2. *Coalescable*: the window is the leading run of requests sharing the front's variant.
       ``cap = max_batch_size or inf``; ``R = min(sum of window rows, cap)``.
    3. *Batch size*: ``B`` = the largest compiled size <= ``min(R, maxB)`` if ``R >= minB``, else
       ``minB`` (partial fill, padded). If ``B`` < the front's rows, ``B`` = the smallest size >=
       the front's rows, else ``maxB``.
    4. *Take*: take requests from the window front while ``taken rows + rows <= min(B, cap)``. If
       nothing fits, take the front alone (forward progress; a request is never split).
    5. *Pass-through*: a lone request that already has exactly ``B`` rows is passed through
       uncoalesced.
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
    # *Coalescable* and *batch size* only need R up to min(cap, maxB): stop summing there (queues
    # can be long).
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


__all__ = [
    "BatchPlan",
    "Plannable",
    "coalesce_inputs",
    "plan_batch",
    "slice_outputs",
    "smallest_key_at_least",
]

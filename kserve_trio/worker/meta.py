"""Meta models: a ``model.py`` orchestration over other models, run as one scheduled unit.

A meta's ``run(inputs, call)`` executes on the device
thread as one unit; ``call(name, inputs)`` runs a declared sub-model's preprocess, its
executable at the smallest compiled size >= the request's rows (zero-padded, sliced back) and
its postprocess, synchronously, with no queue re-entry. The request's deadline applies to every
sub-call: once it has passed, the next ``call`` raises ``DeadlineExceeded``.
``call.scratch(...)`` hands out buffers carved from a heap-backed ``BufferPool`` at most once per
request; they are released when ``run`` returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np
from numpy.typing import DTypeLike

from kserve_trio.core.bundles import Manifest, TensorSpec, request_rows
from kserve_trio.core.errors import DeadlineExceeded, Internal, InvalidArgument, ServingError
from kserve_trio.core.memory import BufferPool, PoolSlot, pool_view
from kserve_trio.core.memory import scratch as carve
from kserve_trio.core.tensors import NamedTensor
from kserve_trio.worker.hooks import Hook
from kserve_trio.worker.model_state import MetaSubcall
from kserve_trio.worker.planner import coalesce_inputs, slice_outputs, smallest_key_at_least

Shape = int | Sequence[int]
ScratchSpec = tuple[str, Shape, DTypeLike]
"""One scratch buffer a meta asks for: (name, shape or a bare row count, dtype)."""


class SubModel(Protocol):
    """What a meta's ``call`` runs: a compiled model (``runtime.CompiledModel``), or one that
    acquires its weights from the cache before each execution."""

    manifest: Manifest

    def batch_keys(self, variant: int | None) -> tuple[int, ...]: ...

    def execute(
        self, variant: int | None, batch_key: int, inputs: Sequence[np.ndarray]
    ) -> list[np.ndarray]: ...


SubModelResolver = Callable[[str], tuple[SubModel, Hook | None, Hook | None]]
"""A declared sub-model's name -> (the model, its preprocess hook, its postprocess hook)."""


def run_model_direct(
    name: str,
    model: SubModel,
    inputs: Sequence[NamedTensor],
    *,
    preprocess: Hook | None = None,
    postprocess: Hook | None = None,
) -> list[NamedTensor]:
    """Run one request through ``model`` synchronously, outside the scheduler's queues.

    Used by meta sub-calls (already on the device thread). Pads the request to the smallest
    compiled size >= its rows and slices the padding back off.
    """
    manifest = model.manifest
    tensors = list(preprocess(list(inputs)) if preprocess else inputs)
    by_name = {t.name: t for t in tensors}
    arrays = []
    for spec in manifest.executable_inputs:
        t = by_name.get(spec.name)
        if t is None:
            raise InvalidArgument(f"model '{name}' requires input '{spec.name}'")
        arrays.append(np.ascontiguousarray(t.data, dtype=spec.dtype.numpy))
    shapes = {
        spec.name: a.shape for spec, a in zip(manifest.executable_inputs, arrays, strict=True)
    }
    variant = manifest.variant_index(shapes)
    keys = model.batch_keys(variant)
    in_axes = [spec.batch_axis for spec in manifest.executable_inputs]
    batched = all(a is not None for a in in_axes) and all(
        spec.batch_axis is not None for spec in manifest.executable_outputs
    )
    if not batched or keys[0] == 0:
        key = 0 if keys[0] == 0 else smallest_key_at_least(keys, _exec_rows(arrays, in_axes))
        outputs = model.execute(variant, key, arrays)
    else:
        rows = _exec_rows(arrays, in_axes)
        if rows > keys[-1]:
            raise InvalidArgument(
                f"model '{name}' accepts at most {keys[-1]} rows per request (got {rows})"
            )
        key = smallest_key_at_least(keys, rows)
        padded = coalesce_inputs([arrays], in_axes, key) if key != rows else arrays
        raw = model.execute(variant, key, padded)
        out_axes = [spec.batch_axis for spec in manifest.executable_outputs]
        outputs = slice_outputs(raw, out_axes, [rows])[0]
    named = [
        NamedTensor.from_array(_output_name(manifest, k), np.asarray(arr))
        for k, arr in enumerate(outputs)
    ]
    return list(postprocess(named)) if postprocess else named


def _exec_rows(arrays: Sequence[np.ndarray], axes: Sequence[int | None]) -> int:
    for arr, axis in zip(arrays, axes, strict=True):
        if axis is not None:
            return int(arr.shape[axis])
    return 1


def _output_name(manifest: Manifest, k: int) -> str:
    outs = manifest.executable_outputs
    return outs[k].name if k < len(outs) else f"output_{k}"


class MetaCall:
    """The ``call`` object handed to a meta's ``run``: sub-calls plus ``scratch``."""

    def __init__(
        self,
        meta_name: str,
        calls: Sequence[str],
        resolve: SubModelResolver,
        *,
        deadline_ns: int = 0,
        pool: BufferPool | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.meta_name = meta_name
        self.calls = frozenset(calls)
        self._resolve = resolve
        self.deadline_ns = deadline_ns
        self._pool = pool
        self._clock = clock
        self._scratch_slot: PoolSlot | None = None
        self._scratch_used = False
        self.subcall_seconds = 0.0
        self.subcalls: list[MetaSubcall] | None = None
        """Set for a traced request: each sub-call is recorded (``MetaSubcall``)."""

    def __call__(self, name: str, inputs: Sequence[NamedTensor]) -> list[NamedTensor]:
        if name not in self.calls:
            raise InvalidArgument(
                f"meta model '{self.meta_name}' called undeclared model '{name}'; add it to meta.calls"
            )
        if self.deadline_ns and self._clock() >= self.deadline_ns:
            raise DeadlineExceeded(
                self.meta_name,
                f"deadline exceeded in meta model '{self.meta_name}' before its call to '{name}'",
            )
        model, pre, post = self._resolve(name)
        started = time.perf_counter()
        marked = time.monotonic_ns() if self.subcalls is not None else 0
        try:
            return run_model_direct(name, model, inputs, preprocess=pre, postprocess=post)
        finally:
            self.subcall_seconds += time.perf_counter() - started
            if self.subcalls is not None:
                self.subcalls.append(MetaSubcall(name, marked, time.monotonic_ns()))

    def scratch(
        self,
        specs: str | Sequence[ScratchSpec],
        shape: Shape | None = None,
        dtype: DTypeLike = np.float64,
    ) -> np.ndarray | list[np.ndarray]:
        """Carve buffers once per request: ``scratch(name, shape, dtype)`` or ``scratch([(name,
        shape, dtype), ...])``; returns numpy arrays (one, or a list)."""
        if self._scratch_used:
            raise RuntimeError(
                f"meta model '{self.meta_name}': call.scratch may be used once per request"
            )
        self._scratch_used = True
        single = isinstance(specs, str)
        if isinstance(specs, str):
            if shape is None:
                raise TypeError(f"meta model '{self.meta_name}': call.scratch(name) needs a shape")
            requested: list[ScratchSpec] = [(specs, shape, dtype)]
        else:
            requested = list(specs)
        items = [
            (n, (s,) if isinstance(s, int) else tuple(s), np.dtype(np.float64 if d is None else d))
            for n, s, d in requested
        ]
        if self._pool is None:
            arrays = [np.zeros(s, dtype=d) for _, s, d in items]
            return arrays[0] if single else arrays
        total = sum(int(np.prod(s, dtype=np.int64)) * d.itemsize + 64 for _, s, d in items)
        span = max(1, -(-total // self._pool.slot_bytes))
        try:
            slot = self._pool.acquire_blocking(span, deadline_ns=self.deadline_ns)
        except TimeoutError as exc:
            raise DeadlineExceeded(self.meta_name, f"meta model '{self.meta_name}': {exc}") from exc
        self._scratch_slot = slot
        descs = carve(slot, items)
        views = pool_view(*descs)
        arrays = [views] if isinstance(views, np.ndarray) else list(views)
        return arrays[0] if single else arrays

    def release(self) -> None:
        """Return scratch buffers to the pool (called when ``run`` returns)."""
        if self._scratch_slot is not None:
            self._scratch_slot.release()
            self._scratch_slot = None


def run_meta(
    meta_name: str,
    run: Callable[[list[NamedTensor], MetaCall], object],
    inputs: list[NamedTensor],
    call: MetaCall,
    client_outputs: Sequence[TensorSpec],
) -> list[NamedTensor]:
    """Execute a meta's ``run`` (on the device thread) and check what it returns."""
    try:
        result = run(inputs, call)
    except ServingError:
        raise
    except Exception as exc:
        raise Internal(f"meta model '{meta_name}' failed: {exc!r}") from exc
    finally:
        call.release()
    if not isinstance(result, (list, tuple)) or not all(isinstance(t, NamedTensor) for t in result):
        raise Internal(f"meta model '{meta_name}': run must return a list of NamedTensor")
    return list(result)


def meta_rows(manifest: Manifest, inputs: Mapping[str, Sequence[int]]) -> int:
    """Rows of a meta request (for counters): the batched client input's extent, else 1."""
    return request_rows(manifest, inputs)


__all__ = ["MetaCall", "meta_rows", "run_meta", "run_model_direct"]

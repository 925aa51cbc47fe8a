"""A numpy stand-in for ``runtime.CompiledModel``, for the scheduler's unit tests only.

It has the exact surface the scheduler drives (``name``, ``manifest``, ``variants``,
``batch_keys``, ``execute``) and checks what the real runtime checks (a compiled key exists, each
input has the executable dtype and, for a batched key, exactly that many rows), so a scheduler
bug that would fail on a device fails here too. It also records every execution (thread, shapes,
timing) and can be slowed down, held on a gate or made to fail, which is how the tests observe
coalescing, cancellation and overlap. Nothing in the server imports this module.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kserve_trio.core.bundles import Manifest, parse_manifest


@dataclass(frozen=True, slots=True)
class MockCall:
    """One recorded execution."""

    variant: int | None
    batch_key: int
    shapes: tuple[tuple[int, ...], ...]
    thread: str
    started: float
    ended: float


class MockModel:
    """A model whose "executable" is a numpy function ``fn(*inputs) -> array | list[array]``.

    ``keys`` maps each variant (``None`` for a single-shape model) to its compiled batch keys
    (0 = the unbatched module); by default every variant gets the manifest's
    ``compiled_batch_sizes`` (or ``(0,)`` when there are none). ``delay`` seconds are slept inside
    every execution; when ``gate`` is given each execution waits for it to be set; ``fail``
    makes executions raise it.
    """

    def __init__(
        self,
        manifest: Manifest,
        fn: Callable[..., Any],
        *,
        keys: Mapping[int | None, Sequence[int]] | None = None,
        delay: float = 0.0,
        gate: threading.Event | None = None,
        fail: BaseException | None = None,
    ) -> None:
        self.name = manifest.name
        self.manifest = manifest
        self.fn = fn
        if keys is None:
            sizes = tuple(sorted(manifest.batching.compiled_batch_sizes)) or (0,)
            variants: tuple[int | None, ...] = (
                tuple(range(len(manifest.variant_keys))) if manifest.variant_keys else (None,)
            )
            keys = {v: sizes for v in variants}
        self._keys = {v: tuple(sorted(k)) for v, k in keys.items()}
        self.variants = tuple(self._keys)
        self.delay = delay
        self.gate = gate
        self.fail = fail
        self.calls: list[MockCall] = []
        self.started = threading.Event()  # set when an execution begins (tests wait on it)
        self.weight_nbytes = 0
        self.closed = False
        self._lock = threading.Lock()

    @property
    def executions(self) -> int:
        """How many executions have run (warmup included)."""
        with self._lock:
            return len(self.calls)

    def batch_keys(self, variant: int | None) -> tuple[int, ...]:
        return self._keys[variant]

    def execute(
        self, variant: int | None, batch_key: int, inputs: Sequence[np.ndarray]
    ) -> list[np.ndarray]:
        if variant not in self._keys:
            raise RuntimeError(f"no compiled program for variant {variant}")
        have = self._keys[variant]
        if batch_key not in have:
            raise RuntimeError(
                f"no compiled executable for batch size {batch_key} "
                f"(variant {variant}; have {list(have)})"
            )
        specs = self.manifest.executable_inputs
        if len(inputs) != len(specs):
            raise RuntimeError(f"expected {len(specs)} inputs, got {len(inputs)}")
        for spec, arr in zip(specs, inputs, strict=True):
            if arr.dtype != spec.dtype.numpy:
                raise RuntimeError(f"input '{spec.name}' has dtype {arr.dtype}")
            if batch_key != 0 and spec.batch_axis is not None:
                extent = arr.shape[spec.batch_axis]
                if extent != batch_key:
                    raise RuntimeError(
                        f"input '{spec.name}' has {extent} rows for compiled size {batch_key}"
                    )
        started = time.monotonic()
        self.started.set()
        if self.gate is not None:
            self.gate.wait()
        if self.delay:
            time.sleep(self.delay)
        ended = time.monotonic()
        with self._lock:
            self.calls.append(
                MockCall(
                    variant,
                    batch_key,
                    tuple(tuple(a.shape) for a in inputs),
                    threading.current_thread().name,
                    started,
                    ended,
                )
            )
        if self.fail is not None:
            raise self.fail
        out = self.fn(*inputs)
        if isinstance(out, np.ndarray):
            return [out]
        return [np.asarray(o) for o in out]

    def close(self) -> None:
        self.closed = True


def tensor(name: str, dtype: str, letters: str, **dims: int) -> dict[str, Any]:
    """A manifest tensor entry; ``letters`` are column-major as in ``manifest.yaml``."""
    return {"name": name, "dtype": dtype, "shape": letters, "dims": dict(dims)}


def mock_manifest(
    name: str,
    inputs: Sequence[Mapping[str, Any]],
    outputs: Sequence[Mapping[str, Any]],
    *,
    batch_sizes: Sequence[int] = (),
    input_shapes: Sequence[Mapping[str, int]] | None = None,
) -> Manifest:
    """Parse a manifest built from ``tensor(...)`` entries (the real parser, so the rules hold)."""
    raw: dict[str, Any] = {
        "format_version": "2.0",
        "name": name,
        "executable_inputs": list(inputs),
        "executable_outputs": list(outputs),
        "batching": {"compiled_batch_sizes": list(batch_sizes)},
    }
    if input_shapes is not None:
        raw["input_shapes"] = [dict(s) for s in input_shapes]
    return parse_manifest(raw, name)


def scale_model(
    name: str = "double",
    *,
    batch_sizes: Sequence[int] = (1, 4, 8),
    features: int = 4,
    factor: float = 2.0,
    batched: bool = True,
    **kwargs: Any,
) -> MockModel:
    """``y = x * factor`` with ``x``/``y`` f32 ``[n, features]`` (``[features]`` if unbatched).

    ``batched=False`` declares no batch axis and serves through the unbatched module (key 0).
    """
    letters = "cn" if batched else "c"
    manifest = mock_manifest(
        name,
        [tensor("x", "f32", letters, c=features)],
        [tensor("y", "f32", letters, c=features)],
        batch_sizes=batch_sizes if batched else (),
    )
    return MockModel(manifest, lambda x: x * np.float32(factor), **kwargs)


__all__ = ["MockCall", "MockModel", "mock_manifest", "scale_model", "tensor"]

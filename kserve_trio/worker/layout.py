"""What a request is to the scheduler, derived once per model from its manifest and compiled keys
(``ModelLayout``: admission rows, executable inputs, variant, warmup inputs), and the check on
executable inputs no validation pass has seen.

Pure: no clocks, no locks, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kserve_trio.core.bundles import DimKind, Manifest, TensorSpec, request_rows
from kserve_trio.core.errors import InvalidArgument
from kserve_trio.core.tensors import NamedTensor


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
        1. *Executable inputs*: every executable input is present with the executable dtype and a
           matching shape (``check_executable_input``), unless ``validated``;
        2. *One batch extent*: all batched inputs agree on their batch extent (the request's rows; 1
           when nothing is batched);
        3. *Known variant*: the variant exists, and ``check_rows`` holds.

        ``validated=True`` is for tensors that are exactly the wire inputs already checked
        against these same specs (names, completeness, dtype, rank, fixed dims) by the
        request's one validation pass: the caller passes it only when no preprocess hook ran
        and ``wire_is_executable``. *One batch extent* and *known variant* are admission, not
        validation, and always run.
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
    "ModelLayout",
    "check_executable_input",
]

"""The in-memory form of a bundle's manifest: ``Manifest``, ``TensorSpec``, ``Dim`` and the small
derived questions every layer asks of a manifest (which tensor carries the batch axis, how many
rows a request has, which shape variant a prepared request selects).

Every shape-bearing field is row-major (numpy C order = wire order); ``TensorSpec.letters`` alone
keeps the manifest's column-major letter string, so a spec can be written back unchanged.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kserve_trio.core.errors import InvalidArgument
from kserve_trio.core.tensors import DType


class DimKind(enum.Enum):
    """What an axis is: a fixed size, the batch axis (``n``/``b``), or a dynamic non-batch axis."""

    FIXED = "fixed"
    BATCH = "batch"
    VARIABLE = "variable"


@dataclass(frozen=True, slots=True)
class Dim:
    """One axis of a tensor. ``size`` is meaningful only for ``FIXED`` (it is 0 otherwise);
    ``letter`` is the manifest letter naming the axis, kept for messages and variant lookup."""

    kind: DimKind
    size: int = 0
    letter: str = ""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of a manifest section, in row-major (wire) axis order.

    ``batch_axis`` is the 0-based row-major index of the batch dim, or ``None``. ``letters`` is the
    letter string exactly as the manifest wrote it (column-major), kept so a spec can be written
    back unchanged; ``row_letters`` is the same string in the order of ``dims``.
    """

    name: str
    dtype: DType
    dims: tuple[Dim, ...]
    batch_axis: int | None
    letters: str

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def row_letters(self) -> str:
        """The axis letters in row-major order (one per entry of ``dims``)."""
        return self.letters[::-1]

    @property
    def is_batched(self) -> bool:
        return self.batch_axis is not None

    def wire_shape(self, rows: int | None = None) -> list[int]:
        """The KServe metadata shape: fixed sizes, ``-1`` for batch and variable axes.

        With ``rows`` the batch axis carries that count instead of ``-1`` (a concrete request
        shape for a model whose other axes are all fixed).
        """
        out: list[int] = []
        for d in self.dims:
            if d.kind is DimKind.FIXED:
                out.append(d.size)
            elif d.kind is DimKind.BATCH and rows is not None:
                out.append(rows)
            else:
                out.append(-1)
        return out

    def matches(self, shape: Sequence[int]) -> str | None:
        """Why ``shape`` (row-major) does not fit this spec, or ``None`` when it does.

        The reason reads after the tensor's name, e.g. ``"input 'x' " + reason``:
        ``has 3 dims, expected 4`` or ``dim 1 has extent 5, expected 3`` (0-based wire axis).
        Batch and variable axes accept any non-negative extent.
        """
        if len(shape) != len(self.dims):
            return f"has {len(shape)} dims, expected {len(self.dims)}"
        for axis, (extent, d) in enumerate(zip(shape, self.dims, strict=True)):
            if extent < 0:
                return f"dim {axis} has negative extent {extent}"
            if d.kind is DimKind.FIXED and extent != d.size:
                return f"dim {axis} has extent {extent}, expected {d.size}"
        return None


@dataclass(frozen=True, slots=True)
class BatchingSpec:
    """The batch sizes the bundle was compiled for, as written (possibly empty)."""

    compiled_batch_sizes: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class VariableAxis:
    """A variable (``-1``) axis of an executable input: one component of the variant key."""

    input_name: str
    axis: int
    letter: str


@dataclass(frozen=True)
class Manifest:
    """A parsed and validated ``manifest.yaml``; every shape-bearing field is row-major.

    ``name`` is the serving name (the bundle directory's basename), not the manifest's own
    ``name`` key. ``variable_axes`` lists the variable axes of the executable inputs in (input
    order, row-major axis order); that order defines the variant key, and ``variant_keys[i]`` is
    the key of ``input_shapes[i]`` (compiled as ``model.v{i}.*``).
    """

    format_version: str
    name: str
    description: str
    kind: str
    executable_inputs: tuple[TensorSpec, ...]
    executable_outputs: tuple[TensorSpec, ...]
    client_inputs: tuple[TensorSpec, ...] | None
    client_outputs: tuple[TensorSpec, ...] | None
    batching: BatchingSpec
    input_shapes: tuple[dict[str, int], ...] = field(hash=False)
    variable_axes: tuple[VariableAxis, ...]
    variant_keys: tuple[tuple[int, ...], ...]
    meta_calls: tuple[str, ...]
    provenance: dict[str, Any] = field(hash=False)
    input_batch_dim: int | None
    serve_without_hooks: bool = False
    """The bundle's opt-in to be served although its hooks are only in ``model.jl`` (the Julia
    server's), which this server does not run (``core.bundles.bundle.validate_manifest``)."""

    @property
    def is_meta(self) -> bool:
        return self.kind == "meta"

    @property
    def wire_inputs(self) -> tuple[TensorSpec, ...]:
        """What a client sends: ``client_inputs`` when a model.py transforms them, else the
        executable inputs."""
        return self.client_inputs if self.client_inputs is not None else self.executable_inputs

    @property
    def wire_outputs(self) -> tuple[TensorSpec, ...]:
        """What a client receives: ``client_outputs`` if present, else the executable outputs."""
        return self.client_outputs if self.client_outputs is not None else self.executable_outputs

    def variant_index(self, shapes: Mapping[str, Sequence[int]]) -> int | None:
        """The ``input_shapes`` index matching prepared executable inputs' (row-major) shapes.

        ``None`` when the model has a single shape. A shape with no compiled variant is the
        request's fault: ``InvalidArgument`` naming the key and the keys that exist.
        """
        if not self.variant_keys:
            return None
        key: list[int] = []
        for va in self.variable_axes:
            shape = shapes.get(va.input_name)
            if shape is None:
                raise InvalidArgument(
                    f"model '{self.name}': input '{va.input_name}' is missing; "
                    "cannot select an input shape variant"
                )
            if va.axis >= len(shape):
                raise InvalidArgument(
                    f"model '{self.name}': input '{va.input_name}' has {len(shape)} dims; "
                    f"variable axis '{va.letter}' is dim {va.axis}"
                )
            key.append(int(shape[va.axis]))
        for i, vk in enumerate(self.variant_keys):
            if tuple(key) == vk:
                return i
        have = [list(vk) for vk in self.variant_keys]
        raise InvalidArgument(
            f"no compiled program for input shape variant {key} (have {have}) "
            f"in model '{self.name}'"
        )


# --------------------------------------------------------------------------------------------
# Derived questions
# --------------------------------------------------------------------------------------------


def is_meta(m: Manifest) -> bool:
    """True for a meta model (a model.py orchestration over other models)."""
    return m.is_meta


def _first_batched(specs: Sequence[TensorSpec]) -> tuple[str, int] | None:
    for t in specs:
        if t.batch_axis is not None:
            return t.name, t.batch_axis
    return None


def wire_batch_spec(m: Manifest) -> tuple[str, int] | None:
    """``(name, row-major axis)`` of the first wire-facing input with a batch axis, or ``None``.

    The gateway counts a request's rows from this without decoding it; the first input need not
    be batched (a cross-encoder's query is not), so the name is what it matches on.
    """
    return _first_batched(m.wire_inputs)


def executable_batch_spec(m: Manifest) -> tuple[str, int] | None:
    """``(name, row-major axis)`` of the first executable input with a batch axis, or ``None``."""
    return _first_batched(m.executable_inputs)


def request_rows(m: Manifest, inputs: Mapping[str, Sequence[int]]) -> int:
    """Rows of a request: the extent of the first wire-facing batched input at its
    batch axis, read from ``inputs`` (name -> row-major shape); 1 when nothing is batched."""
    spec = wire_batch_spec(m)
    if spec is None:
        return 1
    tensor, axis = spec
    shape = inputs.get(tensor)
    if shape is None:
        raise InvalidArgument(f"model '{m.name}': required input '{tensor}' is missing")
    if axis >= len(shape):
        raise InvalidArgument(
            f"model '{m.name}': input '{tensor}' has {len(shape)} dims; its batch axis is dim {axis}"
        )
    return int(shape[axis])

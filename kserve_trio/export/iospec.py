"""``IOSpec``: a tensor as an exporter describes it, and its manifest encoding.

An ``IOSpec`` is row-major like every Python API: ``shape`` is the numpy/wire
shape (``-1`` marks a variable, non-batch axis; the batch axis holds any example extent), and
``batch_axis`` is the 0-based row-major axis carrying the batch, or ``None``. ``to_manifest``
writes the upstream encoding: a letter string in column-major order (batch letter ``n``, last
for a batch-first tensor) and a ``dims`` map of letter -> size. This is the one place the
export side reverses axis order.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from kserve_trio.core.tensors import DType, dtype_from_token, dtype_of

AXIS_LETTERS = "acdefghijklmopqrstuvwxyz"
"""Auto-allocated non-batch letters (``b`` and ``n`` are the reserved batch markers)."""
BATCH_LETTER = "n"
_RESERVED = frozenset("nb")


def as_dtype(value: Any) -> DType:
    """A ``DType`` from a DType, a manifest token (``"f32"``) or anything numpy reads as a dtype
    (``np.float32``, ``"float32"``, a jax dtype)."""
    if isinstance(value, DType):
        return value
    if isinstance(value, str):
        try:
            return dtype_from_token(value)
        except ValueError:
            pass
    try:
        return dtype_of(np.dtype(value))
    except (TypeError, ValueError):
        raise ValueError(f"unknown dtype {value!r}") from None


@dataclass(frozen=True, init=False)
class IOSpec:
    """One executable or client tensor: ``name``, ``dtype``, row-major ``shape``, ``batch_axis``.

    ``letters`` optionally names the non-batch axes, one per non-batch axis in ``shape`` order
    (e.g. ``("h", "w")`` for an ``[n, h, w]`` image); by default they are allocated from
    ``AXIS_LETTERS`` in manifest (column-major) order and carry no meaning across tensors. Two
    inputs whose variable (``-1``) axes share a letter share that axis's size in every
    ``input_shapes`` variant.
    """

    name: str
    dtype: DType
    shape: tuple[int, ...]
    batch_axis: int | None = None
    letters: tuple[str, ...] | None = None

    def __init__(
        self,
        name: str,
        dtype: DType | DTypeLike,
        shape: Sequence[int],
        batch_axis: int | None = None,
        letters: Sequence[str] | None = None,
    ) -> None:
        """Written out (not generated) because it takes more than it stores: ``dtype`` may be
        a ``DType``, a manifest token (``"f32"``) or a numpy dtype-like, ``shape`` and
        ``letters`` any sequence; the fields hold a ``DType`` and tuples."""
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "batch_axis", batch_axis)
        object.__setattr__(self, "letters", letters)
        self.__post_init__()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"IOSpec name must be a non-empty string, got {self.name!r}")
        object.__setattr__(self, "dtype", as_dtype(self.dtype))
        shape = tuple(int(d) for d in self.shape)
        object.__setattr__(self, "shape", shape)
        ax = self.batch_axis
        if ax is not None:
            if (
                isinstance(ax, bool)
                or not isinstance(ax, int | np.integer)
                or not 0 <= ax < len(shape)
            ):
                raise ValueError(
                    f"IOSpec '{self.name}': batch_axis {ax!r} is not an axis of shape {list(shape)}"
                )
            object.__setattr__(self, "batch_axis", int(ax))
        for i, d in enumerate(shape):
            if i != self.batch_axis and not (d > 0 or d == -1):
                raise ValueError(
                    f"IOSpec '{self.name}': axis {i} has size {d}; sizes must be > 0 or -1 "
                    "(variable)"
                )
        if self.letters is not None:
            letters = tuple(self.letters)
            n_free = len(shape) - (0 if self.batch_axis is None else 1)
            if len(letters) != n_free:
                raise ValueError(
                    f"IOSpec '{self.name}': {len(letters)} letter(s) given for {n_free} non-batch "
                    "axes"
                )
            for c in letters:
                if not (isinstance(c, str) and len(c) == 1 and c in string.ascii_letters):
                    raise ValueError(f"IOSpec '{self.name}': letter {c!r} is not one ASCII letter")
                if c in _RESERVED:
                    raise ValueError(
                        f"IOSpec '{self.name}': letter '{c}' is reserved for the batch axis"
                    )
            if len(set(letters)) != len(letters):
                raise ValueError(f"IOSpec '{self.name}': duplicate letters {list(letters)}")
            object.__setattr__(self, "letters", letters)

    @classmethod
    def from_array(
        cls,
        name: str,
        array: Any,
        *,
        batch_axis: int | None = None,
        letters: Sequence[str] | None = None,
    ) -> IOSpec:
        """The spec of an example array (its shape and dtype)."""
        return cls(
            name,
            as_dtype(array.dtype),
            tuple(array.shape),
            batch_axis,
            tuple(letters) if letters else None,
        )

    def row_letters(self) -> tuple[str, ...]:
        """One letter per axis in row-major order (``n`` at the batch axis)."""
        free = [i for i in range(len(self.shape)) if i != self.batch_axis]
        if self.letters is not None:
            named = dict(zip(free, self.letters, strict=True))
        else:
            # allocate in manifest order (last row-major axis first) so the string reads a, c, d...
            named = dict(zip(reversed(free), AXIS_LETTERS, strict=False))
        return tuple(
            BATCH_LETTER if i == self.batch_axis else named[i] for i in range(len(self.shape))
        )

    def variable_axes(self) -> list[tuple[int, str]]:
        """``(row-major axis, letter)`` of every variable (``-1``) axis, in axis order."""
        letters = self.row_letters()
        return [
            (i, letters[i]) for i, d in enumerate(self.shape) if d == -1 and i != self.batch_axis
        ]

    def to_manifest(self) -> dict[str, Any]:
        """The manifest entry: ``{name, dtype, shape, dims}`` with column-major letters."""
        letters = self.row_letters()
        dims = {
            letters[i]: d for i, d in reversed(list(enumerate(self.shape))) if i != self.batch_axis
        }
        return {
            "name": self.name,
            "dtype": self.dtype.token,
            "shape": "".join(reversed(letters)),
            "dims": dims,
        }


__all__ = ["AXIS_LETTERS", "BATCH_LETTER", "IOSpec", "as_dtype"]

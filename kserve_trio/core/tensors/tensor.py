"""``NamedTensor``: how tensors cross module boundaries.

Shapes are row-major (numpy C order, the wire order). ``data`` is a numpy array whose shape
equals ``shape``; decode paths build it with ``np.frombuffer`` so no payload is copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kserve_trio.core.tensors.dtypes import DType, dtype_of


@dataclass(frozen=True, slots=True)
class NamedTensor:
    """A named host tensor: ``name``, ``dtype``, row-major ``shape`` and its ``data`` array."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    data: np.ndarray

    @classmethod
    def from_array(cls, name: str, data: np.ndarray) -> NamedTensor:
        """Build from a typed numpy array; dtype and shape are taken from it."""
        arr = np.asarray(data)
        return cls(name, dtype_of(arr.dtype), tuple(arr.shape), arr)

    @property
    def nbytes(self) -> int:
        """Payload size in bytes."""
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    def __repr__(self) -> str:
        dims = ",".join(str(d) for d in self.shape)
        return f"NamedTensor({self.name!r}, {self.dtype.token}[{dims}])"


__all__ = ["NamedTensor"]

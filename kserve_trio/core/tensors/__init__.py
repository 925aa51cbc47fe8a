"""Tensors: the data model every domain of core and every layer above shares.

- ``dtypes``: the one ``DType`` enum and its maps (manifest token, numpy dtype, wire name);
- ``tensor``: ``NamedTensor``, how tensors cross module boundaries (row-major shapes).

Imports nothing of core's but its leaves. Code outside the domain imports the names below from
this face.
"""

from kserve_trio.core.tensors.dtypes import DType, dtype_from_token, dtype_from_wire, dtype_of
from kserve_trio.core.tensors.tensor import NamedTensor

__all__ = [
    "DType",
    "NamedTensor",
    "dtype_from_token",
    "dtype_from_wire",
    "dtype_of",
]

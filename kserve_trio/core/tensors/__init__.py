"""Tensors: the data model every domain of core and every layer above shares.

- ``dtypes``: the one ``DType`` enum and its maps (manifest token, numpy dtype, wire name);
- ``tensor``: ``NamedTensor``, how tensors cross module boundaries (row-major shapes).

Imports nothing of core's but its leaves. The face loads nothing: import from the modules.
"""

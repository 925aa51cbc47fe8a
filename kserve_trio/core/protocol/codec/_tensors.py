"""Tensors on the wire, both directions: checked sizes and wire dtypes, zero-copy array views
of received buffers, and the bytes of arrays to send."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kserve_trio.core.errors import Internal, InvalidArgument
from kserve_trio.core.protocol.bytes_tensor import (
    bytes_tensor_from_values,
    decode_bytes_tensor,
    encode_bytes_tensor,
)
from kserve_trio.core.protocol.wire import CONTENTS_FIELDS
from kserve_trio.core.tensors import DType, NamedTensor, dtype_from_wire

MAX_TENSOR_BYTES = 2**62
"""Largest payload a tensor may declare; larger shapes are rejected before any allocation."""

MAX_RANK = 64
"""Most dimensions a tensor may have (numpy's own limit); more is malformed input."""


def shape_str(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def checked_nbytes(what: str, shape: Sequence[int], dtype: DType) -> tuple[int, int]:
    """``(elements, bytes)`` of a wire shape; a rank above ``MAX_RANK``, a negative dimension or
    an oversized shape raises before any allocation (Python ints: the product cannot overflow).

    The size limit counts a zero dimension as one, so an empty tensor with huge other dimensions
    is refused too: numpy itself cannot even describe its shape. For ``BYTES`` the bytes are the
    least its encoding can take (a 4-byte length per element): a bound, not the payload size.
    """
    if len(shape) > MAX_RANK:
        raise InvalidArgument(
            f"{what} has rank {len(shape)}, more than the limit of {MAX_RANK} dimensions"
        )
    for d in shape:
        if d < 0:
            raise InvalidArgument(f"{what} has a negative dimension in shape {shape_str(shape)}")
    count = math.prod(shape)
    itemsize = 4 if dtype.is_bytes else dtype.itemsize
    nbytes = count * itemsize
    extent = nbytes if count else math.prod(d for d in shape if d) * itemsize
    if extent > MAX_TENSOR_BYTES:
        needs = (
            f"needs {nbytes} bytes" if nbytes else f"spans {extent} bytes (zero dimensions aside)"
        )
        raise InvalidArgument(
            f"{what} shape {shape_str(shape)} {needs}, more than the limit of "
            f"{MAX_TENSOR_BYTES} bytes"
        )
    return count, nbytes


def wire_dtype(what: str, datatype: str) -> DType:
    try:
        return dtype_from_wire(datatype)
    except ValueError as exc:
        raise InvalidArgument(f"{what}: {exc}") from None


def from_buffer(
    buf: bytes | bytearray | memoryview, dtype: DType, shape: Sequence[int], what: str = "tensor"
) -> np.ndarray:
    """A read-only array viewing ``buf`` (no copy); a ``BYTES`` tensor is decoded from its
    length-prefixed encoding instead (``InvalidArgument`` naming ``what`` if malformed)."""
    if dtype.is_bytes:
        return decode_bytes_tensor(buf, shape, what)
    arr = np.frombuffer(buf, dtype=dtype.numpy).reshape(tuple(shape))
    if arr.flags.writeable:
        arr.flags.writeable = False
    return arr


def from_typed(
    what: str, contents: Any, dtype: DType, shape: Sequence[int], count: int
) -> np.ndarray:
    """Typed ``contents`` -> an array of exactly ``dtype`` (this path copies by nature)."""
    expected = dtype.contents_field
    if expected is None:
        raise InvalidArgument(
            f"{what} has datatype {dtype.wire}, which has no typed contents field; "
            "send it in raw_input_contents or shared memory"
        )
    for name in CONTENTS_FIELDS:
        if name != expected and getattr(contents, name):
            raise InvalidArgument(
                f"{what} has datatype {dtype.wire} but carries data in {name}; expected {expected}"
            )
    values = getattr(contents, expected)
    if dtype.is_bytes:
        return bytes_tensor_from_values(values, shape, what)
    if len(values) != count:
        raise InvalidArgument(
            f"{what} has {len(values)} elements in {expected}, expected {count} "
            f"(shape {shape_str(shape)})"
        )
    try:
        arr = np.array(values, dtype=dtype.numpy)
    except (OverflowError, ValueError):
        raise InvalidArgument(
            f"{what} has a value in {expected} out of range for {dtype.wire}"
        ) from None
    return arr.reshape(tuple(shape))


def payload(arr: np.ndarray) -> bytes:
    """The C-order bytes of ``arr`` as a ``bytes`` object of their own.

    When ``arr`` is exactly a whole ``bytes`` object viewed in place (an echoed input, a
    pass-through output) that object is returned as is; otherwise one copy (``tobytes``).
    """
    base = arr.base
    while isinstance(base, np.ndarray):
        base = base.base
    if (
        isinstance(base, bytes)
        and arr.flags.c_contiguous
        and arr.nbytes == len(base)
        and (len(base) == 0 or arr.ctypes.data == np.frombuffer(base, np.uint8).ctypes.data)
    ):
        return base
    return arr.tobytes()


def checked_array(model_name: str, tensor: NamedTensor, kind: str = "output") -> np.ndarray:
    """The tensor's array after checking it is what the tensor claims (a mismatch is a bug)."""
    what = f"{kind} '{tensor.name}' of model '{model_name}'"
    if not tensor.dtype.has_wire:
        raise Internal(f"{what} has dtype {tensor.dtype.token}, which has no KServe wire datatype")
    arr = np.asarray(tensor.data)
    if arr.dtype != tensor.dtype.numpy or tuple(arr.shape) != tuple(tensor.shape):
        raise Internal(
            f"{what} declares {tensor.dtype.token}{shape_str(tensor.shape)} but its data is "
            f"{arr.dtype}{shape_str(arr.shape)}"
        )
    return arr


def encoded_bytes(model_name: str, tensor: NamedTensor, arr: np.ndarray) -> bytes:
    """A ``BYTES`` output's length-prefixed payload; an element that is neither ``bytes`` nor
    ``str`` is the model's bug (``Internal`` naming the output)."""
    try:
        return encode_bytes_tensor(arr)
    except (TypeError, ValueError) as exc:
        raise Internal(f"output '{tensor.name}' of model '{model_name}': {exc}") from None

"""BYTES tensors: Triton's length-prefixed encoding <-> numpy ``object`` arrays of ``bytes``.

A BYTES tensor's payload (a ``raw_input_contents`` / ``raw_output_contents`` entry, or the bytes
of a shared-memory range) is its elements in row-major order, each a 4-byte little-endian length
followed by that many bytes. Typed ``bytes_contents`` carries one ``bytes`` value per element
instead. Pure: buffers in, arrays out, and back.

Rules:
1. *Exact count*: decoding needs exactly the tensor's element count: a length prefix cut short, an
   element running past the end, bytes left over after the last element, or fewer elements than the
   shape holds are ``InvalidArgument`` naming the tensor and the offset.
2. *Own copies*: decoded elements are ``bytes`` of their own (copies: an element outlives the
   request buffer).
3. *Accepted elements*: encoding accepts ``bytes``, ``bytearray``, ``memoryview`` and ``str``
   (UTF-8) elements, as Triton's own clients do; anything else is a ``TypeError`` naming the
   element's type.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from kserve_trio.core.errors import InvalidArgument

_LENGTH = struct.Struct("<I")
MAX_ELEMENT_BYTES = 2**32 - 1
"""The largest element the 4-byte length prefix can describe."""


def decode_bytes_tensor(
    buf: bytes | bytearray | memoryview, shape: Sequence[int], what: str = "BYTES tensor"
) -> np.ndarray:
    """The ``object`` array of shape ``shape`` that ``buf`` encodes (*exact count*); read-only."""
    count = 1
    for d in shape:
        count *= int(d)
    view = memoryview(buf).cast("B") if not isinstance(buf, bytes) else buf
    end = len(view)
    out = np.empty(count, dtype=object)
    pos = 0
    for i in range(count):
        if pos + 4 > end:
            raise InvalidArgument(
                f"{what}: BYTES data ends at byte {end} inside the length prefix of element {i} "
                f"(the shape holds {count} elements)"
            )
        (size,) = _LENGTH.unpack_from(view, pos)
        pos += 4
        if pos + size > end:
            raise InvalidArgument(
                f"{what}: BYTES element {i} announces {size} bytes at byte {pos - 4} but only "
                f"{end - pos} remain"
            )
        out[i] = bytes(view[pos : pos + size])
        pos += size
    if pos != end:
        raise InvalidArgument(
            f"{what}: {end - pos} bytes of BYTES data left after the {count} elements of its shape"
        )
    arr = out.reshape(tuple(int(d) for d in shape))
    arr.flags.writeable = False
    return arr


def bytes_tensor_from_values(
    values: Sequence[bytes], shape: Sequence[int], what: str = "BYTES tensor"
) -> np.ndarray:
    """Typed ``bytes_contents`` values as an ``object`` array of ``shape`` (one per element)."""
    count = 1
    for d in shape:
        count *= int(d)
    if len(values) != count:
        raise InvalidArgument(
            f"{what} has {len(values)} elements in bytes_contents, expected {count}"
        )
    out = np.empty(count, dtype=object)
    for i, value in enumerate(values):
        out[i] = bytes(value)
    return out.reshape(tuple(int(d) for d in shape))


def _element_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bytearray | memoryview | np.bytes_):
        return bytes(value)
    raise TypeError(
        f"a BYTES element must be bytes or str, got {type(value).__name__} ({value!r:.40})"
    )


def bytes_elements(arr: np.ndarray) -> list[bytes]:
    """Every element of ``arr`` as ``bytes``, in row-major order (*accepted elements*)."""
    return [_element_bytes(v) for v in np.asarray(arr, dtype=object).reshape(-1)]


def encode_bytes_tensor(arr: np.ndarray) -> bytes:
    """``arr``'s elements in the length-prefixed encoding (*accepted elements*)."""
    parts: list[bytes] = []
    for element in bytes_elements(arr):
        if len(element) > MAX_ELEMENT_BYTES:
            raise ValueError(f"a BYTES element of {len(element)} bytes does not fit its prefix")
        parts.append(_LENGTH.pack(len(element)))
        parts.append(element)
    return b"".join(parts)


__all__ = [
    "MAX_ELEMENT_BYTES",
    "bytes_elements",
    "bytes_tensor_from_values",
    "decode_bytes_tensor",
    "encode_bytes_tensor",
]

"""What every part of the KServe V2 codec shares (the face is ``kserve_trio.core.codec``).

The boundary types (``ShmRef``, ``RequestedOutput``, the ``ShmRegistryLike`` interface), the
request parameters the codec knows (deadlines, shared memory) with their typed accessors, and
the pure helpers both directions need: checked tensor sizes, wire dtypes, zero-copy array views
of received buffers and byte views of arrays to send.

Parameter maps hold plain values (``core.wire.ParamValue``); the accessors also read a
betterproto2 ``InferParameter`` (a message built by hand), so a caller may hand either.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kserve_trio.core.bytes_tensor import (
    bytes_tensor_from_values,
    decode_bytes_tensor,
    encode_bytes_tensor,
)
from kserve_trio.core.dtypes import DType, dtype_from_wire
from kserve_trio.core.errors import Internal, InvalidArgument
from kserve_trio.core.tensor import NamedTensor
from kserve_trio.core.wire import CONTENTS_FIELDS, Params, plain_param

TIMEOUT_NS_PARAM = "reactant_timeout_ns"
"""Request parameter (``int64_param``): the caller's REMAINING budget in nanoseconds."""

TRITON_TIMEOUT_PARAM = "timeout"
"""Triton's request parameter (``int64_param``): a timeout in microseconds."""

SHM_REGION_PARAM = "shared_memory_region"
SHM_OFFSET_PARAM = "shared_memory_offset"
SHM_BYTE_SIZE_PARAM = "shared_memory_byte_size"

INT64_MAX = 2**63 - 1
MAX_TENSOR_BYTES = 2**62
"""Largest payload a tensor may declare; larger shapes are rejected before any allocation."""

MAX_RANK = 64
"""Most dimensions a tensor may have (numpy's own limit); more is malformed input."""

BUNDLE_VERSION = "1"
"""The one version every bundle is served as: requests may name it or leave the version empty."""


# --------------------------------------------------------------------------------------------
# Boundary types


@dataclass(frozen=True, slots=True)
class ShmRef:
    """A byte range of a registered shared-memory region (offset relative to the region)."""

    region: str
    offset: int
    byte_size: int


@dataclass(frozen=True, slots=True)
class RequestedOutput:
    """An output the caller asked for; ``shm`` says where to write it instead of inline."""

    name: str
    shm: ShmRef | None = None


class ShmRegistryLike(Protocol):
    """What the codec needs from a shared-memory registry (implemented by ``core/shm.py``)."""

    def read_view(
        self, region: str, offset: int, byte_size: int
    ) -> tuple[memoryview, Callable[[], None]]:
        """A zero-copy view of ``byte_size`` bytes at ``offset`` and the callback that releases
        the lease on it. Raises ``UnregisteredRegionError`` or ``InvalidArgument``."""
        ...

    def write(self, region: str, offset: int, data: memoryview | bytes | np.ndarray) -> None:
        """Copy ``data`` into the region at ``offset``. Raises ``UnregisteredRegionError``; the
        caller has already checked the size against what the client asked for."""
        ...


# --------------------------------------------------------------------------------------------
# Parameters and deadlines


def int64_param(params: Mapping[str, Any], key: str) -> int | None:
    """The ``int64_param`` value of ``params[key]``; absent or another kind (``bool``,
    ``Uint64``, ``float``, ``str``) -> None."""
    value = params.get(key)
    if type(value) is int or value is None:
        return value
    value = plain_param(value)
    return value if type(value) is int else None


def string_param(params: Mapping[str, Any], key: str) -> str | None:
    """The ``string_param`` value of ``params[key]``; absent or another kind -> None."""
    value = params.get(key)
    if type(value) is str or value is None:
        return value
    value = plain_param(value)
    return value if type(value) is str else None


def _saturating_deadline(now_ns: int, budget_ns: int) -> int:
    return min(now_ns + budget_ns, INT64_MAX)


def combine_deadlines(*deadlines_ns: int) -> int:
    """The effective deadline: the smallest non-zero absolute deadline, 0 when all are 0."""
    live = [d for d in deadlines_ns if d > 0]
    return min(live) if live else 0


def deadline_from_parameters(params: Mapping[str, Any], now_ns: int | None = None) -> int:
    """Absolute monotonic deadline from a request's parameters (0 = none).

    Rules:
    1. ``reactant_timeout_ns`` (``int64_param``, remaining ns) -> ``now + budget``.
    2. Triton's ``timeout`` (``int64_param``, microseconds) -> ``now + timeout * 1000``.
    3. Absent, another kind of value, or ``<= 0`` -> no deadline from that source.
    4. Sums saturate at int64 max; the smaller of the non-zero results wins.
    """
    if not params:
        return 0
    budget = int64_param(params, TIMEOUT_NS_PARAM)
    micros = int64_param(params, TRITON_TIMEOUT_PARAM)
    has_budget = budget is not None and budget > 0
    has_micros = micros is not None and micros > 0
    if not (has_budget or has_micros):
        return 0
    now = time.monotonic_ns() if now_ns is None else now_ns
    a = _saturating_deadline(now, budget) if has_budget else INT64_MAX  # type: ignore[operator]
    b = _saturating_deadline(now, micros * 1000) if has_micros else INT64_MAX  # type: ignore[operator]
    return a if a < b else b


def deadline_params(budget_ns: int) -> Params:
    """Request parameters carrying a remaining budget of ``budget_ns`` (empty for <= 0)."""
    if budget_ns <= 0:
        return {}
    return {TIMEOUT_NS_PARAM: min(int(budget_ns), INT64_MAX)}


def shm_ref(what: str, params: Mapping[str, Any]) -> ShmRef | None:
    """The three shm parameters of a tensor (values of another kind count as absent)."""
    if not params:
        return None
    region = string_param(params, SHM_REGION_PARAM)
    if region is None:
        return None
    offset = int64_param(params, SHM_OFFSET_PARAM)
    offset = 0 if offset is None else offset
    byte_size = int64_param(params, SHM_BYTE_SIZE_PARAM)
    if byte_size is None:
        raise InvalidArgument(
            f"{what} names shared memory region '{region}' but has no {SHM_BYTE_SIZE_PARAM}"
        )
    if offset < 0:
        raise InvalidArgument(f"{what} has a negative {SHM_OFFSET_PARAM} {offset}")
    if byte_size < 0:
        raise InvalidArgument(f"{what} has a negative {SHM_BYTE_SIZE_PARAM} {byte_size}")
    return ShmRef(region, offset, byte_size)


def shm_params(ref: ShmRef) -> Params:
    """The three shm parameters naming ``ref``."""
    return {
        SHM_REGION_PARAM: ref.region,
        SHM_OFFSET_PARAM: int(ref.offset),
        SHM_BYTE_SIZE_PARAM: int(ref.byte_size),
    }


def in_shared_memory(out: Any) -> bool:
    """Whether the server wrote ``out`` (an output tensor) to shared memory (its region
    parameter is set)."""
    return bool(out.parameters) and string_param(out.parameters, SHM_REGION_PARAM) is not None


# --------------------------------------------------------------------------------------------
# Tensors


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

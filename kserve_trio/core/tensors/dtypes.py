"""Element types: the one ``DType`` enum and its three maps.

Each member knows its manifest token (``f32``), its numpy dtype (``ml_dtypes`` for bf16 and
fp8), its KServe wire string (``FP32``; ``None`` for fp8, which is executable-internal only) and
the typed ``InferTensorContents`` field a client may use for it (``None`` for raw/shm-only types).

``BYTES`` (token ``bytes``) is the one variable-length type: each element is a byte string, held
in a numpy ``object`` array, and travels in Triton's length-prefixed encoding
(``core.protocol.bytes_tensor``). It exists only on client-facing tensors (a bundle's ``model.py`` turns
text into tensors and back); no executable takes or returns it. Its ``itemsize`` is numpy's
object pointer size, not a payload size: code that sizes payloads asks ``is_bytes`` first.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class _DTypeInfo:
    token: str
    numpy: np.dtype
    wire: str | None
    contents_field: str | None


class DType(enum.Enum):
    """Canonical element type shared by manifests, the codec, the runtime and the client."""

    BOOL = _DTypeInfo("bool", np.dtype(np.bool_), "BOOL", "bool_contents")
    U8 = _DTypeInfo("u8", np.dtype(np.uint8), "UINT8", "uint_contents")
    U16 = _DTypeInfo("u16", np.dtype(np.uint16), "UINT16", "uint_contents")
    U32 = _DTypeInfo("u32", np.dtype(np.uint32), "UINT32", "uint_contents")
    U64 = _DTypeInfo("u64", np.dtype(np.uint64), "UINT64", "uint64_contents")
    I8 = _DTypeInfo("i8", np.dtype(np.int8), "INT8", "int_contents")
    I16 = _DTypeInfo("i16", np.dtype(np.int16), "INT16", "int_contents")
    I32 = _DTypeInfo("i32", np.dtype(np.int32), "INT32", "int_contents")
    I64 = _DTypeInfo("i64", np.dtype(np.int64), "INT64", "int64_contents")
    F16 = _DTypeInfo("f16", np.dtype(np.float16), "FP16", None)
    BF16 = _DTypeInfo("bf16", np.dtype(ml_dtypes.bfloat16), "BF16", None)
    F32 = _DTypeInfo("f32", np.dtype(np.float32), "FP32", "fp32_contents")
    F64 = _DTypeInfo("f64", np.dtype(np.float64), "FP64", "fp64_contents")
    F8_E5M2 = _DTypeInfo("f8_e5m2", np.dtype(ml_dtypes.float8_e5m2), None, None)
    F8_E4M3 = _DTypeInfo("f8_e4m3", np.dtype(ml_dtypes.float8_e4m3fn), None, None)
    BYTES = _DTypeInfo("bytes", np.dtype(object), "BYTES", "bytes_contents")

    # Properties read ``_value_`` (a plain attribute) rather than ``value`` (an enum descriptor):
    # these are consulted per tensor on the request path.

    @property
    def token(self) -> str:
        """Manifest token, e.g. ``"f32"``."""
        return self._value_.token

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype (``ml_dtypes`` extension types for bf16/fp8)."""
        return self._value_.numpy

    @property
    def itemsize(self) -> int:
        """Bytes per element (for ``BYTES``, numpy's object pointer size: see ``is_bytes``)."""
        return self._value_.numpy.itemsize

    @property
    def is_bytes(self) -> bool:
        """Whether elements are variable-length byte strings (``BYTES``), so a tensor's payload
        size does not follow from its shape."""
        return self is DType.BYTES

    @property
    def has_wire(self) -> bool:
        """Whether the type may appear on a client-facing tensor."""
        return self._value_.wire is not None

    @property
    def wire(self) -> str:
        """KServe V2 wire datatype string; raises ``ValueError`` for fp8."""
        if self._value_.wire is None:
            raise ValueError(f"dtype '{self.token}' has no KServe wire datatype mapping")
        return self._value_.wire

    @property
    def contents_field(self) -> str | None:
        """Name of the typed ``InferTensorContents`` field for this type, if any."""
        return self._value_.contents_field

    def __repr__(self) -> str:
        return f"DType.{self.name}"


_BY_TOKEN = {d.token: d for d in DType}
_BY_WIRE = {d.value.wire: d for d in DType if d.value.wire is not None}
_BY_NUMPY = {d.numpy: d for d in DType}


def dtype_from_token(token: str) -> DType:
    """Manifest token -> DType; unknown tokens raise ``ValueError``."""
    try:
        return _BY_TOKEN[token]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown dtype token '{token}'; expected one of {', '.join(_BY_TOKEN)}"
        ) from None


def dtype_from_wire(wire: str) -> DType:
    """KServe wire string -> DType; anything unknown raises ``ValueError``."""
    try:
        return _BY_WIRE[wire]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown KServe datatype '{wire}'; expected one of {', '.join(_BY_WIRE)}"
        ) from None


def dtype_of(dtype: np.dtype | type | str) -> DType:
    """numpy dtype (or anything ``np.dtype`` accepts) -> DType (``object`` -> ``BYTES``)."""
    try:
        return _BY_NUMPY[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise ValueError(f"numpy dtype '{dtype}' has no kserve_trio DType") from None


def kserve_string(dtype: DType) -> str:
    """DType -> KServe wire string (fp8 raises)."""
    return dtype.wire


__all__ = ["DType", "dtype_from_token", "dtype_from_wire", "dtype_of", "kserve_string"]

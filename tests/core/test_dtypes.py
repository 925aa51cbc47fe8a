"""DType maps: token <-> numpy <-> wire round trips and the errors for what has no mapping."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kserve_trio.core.tensors.dtypes import (
    DType,
    dtype_from_token,
    dtype_from_wire,
    dtype_of,
    kserve_string,
)
from kserve_trio.core.tensors.tensor import NamedTensor

EXPECTED = [
    ("bool", np.bool_, "BOOL", 1),
    ("u8", np.uint8, "UINT8", 1),
    ("u16", np.uint16, "UINT16", 2),
    ("u32", np.uint32, "UINT32", 4),
    ("u64", np.uint64, "UINT64", 8),
    ("i8", np.int8, "INT8", 1),
    ("i16", np.int16, "INT16", 2),
    ("i32", np.int32, "INT32", 4),
    ("i64", np.int64, "INT64", 8),
    ("f16", np.float16, "FP16", 2),
    ("bf16", ml_dtypes.bfloat16, "BF16", 2),
    ("f32", np.float32, "FP32", 4),
    ("f64", np.float64, "FP64", 8),
]


@pytest.mark.parametrize(("token", "np_type", "wire", "size"), EXPECTED)
def test_every_wire_dtype_round_trips_through_all_three_maps(token, np_type, wire, size):
    d = dtype_from_token(token)
    assert d.token == token
    assert d.numpy == np.dtype(np_type)
    assert d.wire == wire == kserve_string(d)
    assert d.itemsize == size
    assert dtype_from_wire(wire) is d
    assert dtype_of(np_type) is d


@pytest.mark.parametrize(
    ("token", "np_type"), [("f8_e5m2", ml_dtypes.float8_e5m2), ("f8_e4m3", ml_dtypes.float8_e4m3fn)]
)
def test_fp8_is_executable_only_and_has_no_wire_string(token, np_type):
    d = dtype_from_token(token)
    assert dtype_of(np_type) is d
    assert not d.has_wire
    with pytest.raises(ValueError, match="has no KServe wire datatype mapping"):
        _ = d.wire


def test_unknown_token_is_rejected_with_the_valid_tokens_listed():
    with pytest.raises(ValueError, match=r"unknown dtype token 'float32'.*f32"):
        dtype_from_token("float32")


def test_bytes_is_the_one_variable_length_wire_type():
    d = dtype_from_wire("BYTES")
    assert d is DType.BYTES is dtype_from_token("bytes") is dtype_of(object)
    assert d.token == "bytes" and d.wire == "BYTES" and d.has_wire
    assert d.numpy == np.dtype(object) and d.contents_field == "bytes_contents"
    assert [t for t in DType if t.is_bytes] == [DType.BYTES]
    t = NamedTensor.from_array("s", np.array([b"a", b"bc"], dtype=object))
    assert t.dtype is DType.BYTES and t.shape == (2,)


def test_unknown_wire_types_are_rejected_clearly():
    with pytest.raises(ValueError, match="unknown KServe datatype 'FLOAT'; expected one of BOOL"):
        dtype_from_wire("FLOAT")


def test_numpy_types_without_a_dtype_are_rejected():
    with pytest.raises(ValueError, match="has no kserve_trio DType"):
        dtype_of(np.complex64)


def test_typed_contents_fields_follow_the_kserve_table():
    assert DType.U8.contents_field == "uint_contents"
    assert DType.U64.contents_field == "uint64_contents"
    assert DType.I16.contents_field == "int_contents"
    assert DType.I64.contents_field == "int64_contents"
    assert DType.F32.contents_field == "fp32_contents"
    assert DType.F64.contents_field == "fp64_contents"
    assert DType.BOOL.contents_field == "bool_contents"
    assert DType.F16.contents_field is None and DType.BF16.contents_field is None
    assert DType.BYTES.contents_field == "bytes_contents"


def test_named_tensor_from_array_takes_dtype_and_row_major_shape():
    arr = np.zeros((2, 3, 4), dtype=ml_dtypes.bfloat16)
    t = NamedTensor.from_array("x", arr)
    assert t.dtype is DType.BF16
    assert t.shape == (2, 3, 4)
    assert t.nbytes == 2 * 3 * 4 * 2
    assert t.data is arr
    assert repr(t) == "NamedTensor('x', bf16[2,3,4])"

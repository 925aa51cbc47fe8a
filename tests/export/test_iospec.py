"""IOSpec: validation and the manifest encoding (row-major in, column-major letters out)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kserve_trio.core.bundles.manifest import DimKind, parse_tensor_spec
from kserve_trio.core.tensors.dtypes import DType
from kserve_trio.export.iospec import IOSpec, as_dtype


def test_batch_first_image_reads_alphabetically_in_the_manifest():
    spec = IOSpec("image", "f32", (8, 3, 32, 32), batch_axis=0)
    assert spec.row_letters() == ("n", "d", "c", "a")
    assert spec.to_manifest() == {
        "name": "image",
        "dtype": "f32",
        "shape": "acdn",
        "dims": {"a": 32, "c": 32, "d": 3},
    }


def test_manifest_entry_parses_back_to_the_same_row_major_spec():
    spec = IOSpec("x", DType.BF16, (5, 7, 2), batch_axis=1)
    parsed = parse_tensor_spec(spec.to_manifest())
    assert parsed.batch_axis == 1
    assert parsed.dtype is DType.BF16
    assert [d.kind for d in parsed.dims] == [DimKind.FIXED, DimKind.BATCH, DimKind.FIXED]
    assert [d.size for d in parsed.dims if d.kind is DimKind.FIXED] == [5, 2]


def test_explicit_letters_name_axes_in_shape_order():
    spec = IOSpec("img", "u8", (1, 224, 224), batch_axis=0, letters=("h", "w"))
    assert spec.to_manifest()["shape"] == "whn"
    assert spec.to_manifest()["dims"] == {"w": 224, "h": 224}


def test_variable_axes_are_minus_one():
    spec = IOSpec("tokens", "i32", (1, -1), batch_axis=0)
    assert spec.variable_axes() == [(1, "a")]
    assert spec.to_manifest()["dims"] == {"a": -1}
    assert parse_tensor_spec(spec.to_manifest()).dims[1].kind is DimKind.VARIABLE


def test_unbatched_scalar_and_vector():
    assert IOSpec("s", "f32", ()).to_manifest() == {
        "name": "s",
        "dtype": "f32",
        "shape": "",
        "dims": {},
    }
    assert IOSpec("v", np.float64, (4,)).to_manifest()["shape"] == "a"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"letters": ("a",)}, "1 letter(s) given for 2 non-batch axes"),
        ({"letters": ("a", "n")}, "letter 'n' is reserved for the batch axis"),
        ({"letters": ("a", "a")}, "duplicate letters ['a', 'a']"),
        ({"letters": ("a", "ab")}, "letter 'ab' is not one ASCII letter"),
        ({"batch_axis": 3}, "batch_axis 3 is not an axis of shape [2, 3, 4]"),
        ({"batch_axis": True}, "batch_axis True is not an axis"),
    ],
)
def test_invalid_specs_are_refused(kwargs, message):
    base = {"batch_axis": 0} if "letters" in kwargs else {}
    with pytest.raises(ValueError) as info:
        IOSpec("t", "f32", (2, 3, 4), **{**base, **kwargs})
    assert message in str(info.value)


def test_sizes_must_be_positive_or_variable():
    with pytest.raises(ValueError, match=r"axis 1 has size 0; sizes must be > 0 or -1"):
        IOSpec("t", "f32", (2, 0))
    IOSpec("t", "f32", (0, 3), batch_axis=0)  # the batch extent is only an example


def test_dtypes_from_tokens_numpy_and_enum():
    assert as_dtype("f16") is DType.F16
    assert as_dtype("float32") is DType.F32
    assert as_dtype(np.int8) is DType.I8
    assert as_dtype(ml_dtypes.bfloat16) is DType.BF16
    assert as_dtype(DType.U64) is DType.U64
    with pytest.raises(ValueError, match=r"unknown dtype 'quux'"):
        as_dtype("quux")
    with pytest.raises(ValueError, match=r"IOSpec name must be a non-empty string"):
        IOSpec("", "f32", (1,))

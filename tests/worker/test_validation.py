"""The worker's validation of decoded inputs against a model's client-facing specs
(``worker/validation.py``): every rule with its message."""

from __future__ import annotations

import numpy as np
import pytest

from kserve_trio.core.bundles.manifest import parse_tensor_spec
from kserve_trio.core.errors import InvalidArgument
from kserve_trio.core.tensors.tensor import NamedTensor
from kserve_trio.worker.validation import validate_inputs

SPECS = [
    parse_tensor_spec({"name": "x", "dtype": "f32", "shape": "whn", "dims": {"w": 4, "h": 3}}),
    parse_tensor_spec({"name": "y", "dtype": "i32", "shape": "l", "dims": {"l": -1}}),
]


def nt(name: str, shape, dtype=np.float32) -> NamedTensor:
    return NamedTensor.from_array(name, np.zeros(shape, dtype))


def validation_error(inputs) -> str:
    with pytest.raises(InvalidArgument) as info:
        validate_inputs("m", SPECS, inputs)
    return str(info.value)


def test_validate_accepts_any_batch_and_variable_extent():
    validate_inputs("m", SPECS, [nt("x", (1, 3, 4)), nt("y", (0,), np.int32)])
    validate_inputs("m", SPECS, [nt("y", (9,), np.int32), nt("x", (17, 3, 4))])


def test_validate_undeclared_input():
    assert validation_error([nt("x", (1, 3, 4)), nt("z", (1,))]) == (
        "input 'z' is not declared by model 'm'"
    )


def test_validate_missing_input():
    assert validation_error([nt("x", (1, 3, 4))]) == "model 'm' requires input 'y'"


def test_duplicate_inputs_are_the_decode_rule_only():
    """One owner per rule: the decode refuses a repeated input name (its test above);
    validation, which only ever sees decoded inputs, does not check it a second time."""
    validate_inputs("m", SPECS, [nt("x", (1, 3, 4)), nt("x", (1, 3, 4)), nt("y", (1,), np.int32)])


def test_validate_dtype_mismatch():
    assert validation_error([nt("x", (1, 3, 4), np.float64), nt("y", (2,), np.int32)]) == (
        "input 'x' of model 'm' has datatype FP64, expected FP32"
    )


def test_validate_rank_mismatch():
    assert validation_error([nt("x", (3, 4)), nt("y", (2,), np.int32)]) == (
        "input 'x' of model 'm' has rank 2, expected 3"
    )


def test_validate_fixed_extent_mismatch_uses_row_major_index():
    assert validation_error([nt("x", (2, 3, 5)), nt("y", (2,), np.int32)]) == (
        "input 'x' dim 2 has extent 5, expected 4"
    )
    assert validation_error([nt("x", (2, 4, 4)), nt("y", (2,), np.int32)]) == (
        "input 'x' dim 1 has extent 4, expected 3"
    )

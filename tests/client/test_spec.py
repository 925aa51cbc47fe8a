"""``manifest_io_spec`` offline and ``validate_io``'s dry run: success and each failure path."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from kserve_trio.client import (
    InferInput,
    InferOutput,
    IOValidationError,
    ModelIOSpec,
    OutputSpec,
    TensorMeta,
    manifest_io_spec,
    pool_view,
    scratch,
    validate_io,
)
from kserve_trio.client.spec import synthetic_response
from kserve_trio.core.protocol.infer_wire import InferResponseMessage

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"

MLP = ModelIOSpec(
    [TensorMeta("input_0", "FP32", (-1, 16))], [TensorMeta("output", "FP32", (-1, 8))], "mlp"
)


class MlpIO:
    """A correct IO for ``mlp``; subclasses break one thing each."""

    name = "input_0"
    dtype = np.float32
    per_item = 64
    declared: list = []

    def __init__(self, n: int = 4) -> None:
        self.x = np.ones((n, 16), np.float32)
        self.y = np.full((n, 8), np.nan, np.float32)
        self.encoded: list[range] = []
        self.decoded: list[range] = []

    def __len__(self):
        return len(self.x)

    def item_input_bytes(self):
        return self.per_item

    def shape(self, n):
        return (n, 16)

    def encode_chunk(self, items, slot):
        self.encoded.append(items)
        d = scratch(slot, self.name, self.shape(len(items)), self.dtype)
        view = pool_view(d)
        for j, i in enumerate(items):
            self.write(view, j, i)
        return [d]

    def write(self, view, j, i):
        view[j] = self.x[i]

    def decode_chunk(self, items, response):
        self.decoded.append(items)
        out = self.read(response)
        for j, i in enumerate(items):
            self.y[i] = out[j]

    def read(self, response):
        return InferOutput("output", response)

    def output_specs(self):
        return self.declared


def check_fails(io, message, spec=MLP, items=1):
    with pytest.raises(IOValidationError) as info:
        validate_io(spec, io, items)
    assert str(info.value) == message


def test_a_correct_io_validates_and_really_runs_the_user_methods():
    io = MlpIO()
    assert validate_io(MLP, io, items=3) is None
    assert io.encoded == [range(3)] and io.decoded == [range(3)]
    np.testing.assert_array_equal(io.y[:3], 0)  # zeros from the synthetic response
    assert np.isnan(io.y[3]).all()


def test_items_are_clamped_to_the_io_length_and_must_be_positive():
    io = MlpIO(2)
    validate_io(MLP, io, items=10)
    assert io.encoded == [range(2)]
    with pytest.raises(ValueError, match="validate_io needs items >= 1, got 0"):
        validate_io(MLP, MlpIO(), items=0)


def test_an_empty_io_validates_nothing():
    io = MlpIO(0)
    validate_io(MLP, io)
    assert io.encoded == [] and io.decoded == []


def test_wrong_input_name():
    class IO(MlpIO):
        name = "input"

    check_fails(
        IO(),
        "encode_chunk returned input 'input', which model 'mlp' does not have (inputs: input_0)",
    )


def test_wrong_input_dtype():
    class IO(MlpIO):
        dtype = np.float64
        per_item = 128

    check_fails(IO(), "input 'input_0' is FP64 (float64), but model 'mlp' expects FP32")


def test_out_of_range_write_names_the_tensor():
    class IO(MlpIO):
        def write(self, view, j, i):
            view[j + 1] = self.x[i]  # off by one

    check_fails(
        IO(),
        "encode_chunk(range(0, 1)) failed during validate_io: IndexError: index 1 is out of "
        "range for axis 0 of tensor 'input_0' (extent 1)",
    )


def test_slice_overrun_that_numpy_would_clip_is_caught():
    class IO(MlpIO):
        def write(self, view, j, i):
            view[j : j + 2] = 0.0

    check_fails(
        IO(),
        "encode_chunk(range(0, 2)) failed during validate_io: IndexError: slice 1:3 reaches "
        "outside axis 0 of tensor 'input_0' (extent 2)",
        items=2,
    )


def test_a_reversed_shape_gets_an_axis_order_hint():
    class IO(MlpIO):
        def shape(self, n):
            return (16, n)

        def write(self, view, j, i):
            view[:, j] = self.x[i]

    check_fails(
        IO(),
        "input 'input_0' has shape [16, 1] but model 'mlp' expects [-1, 16] (the reversed shape "
        "would match: check the axis order: shapes are row-major, batch axis first)",
    )


def test_a_missing_input_and_a_duplicate_input():
    class Missing(MlpIO):
        def encode_chunk(self, items, slot):
            return []

    check_fails(Missing(), "encode_chunk returned no input 'input_0' (model 'mlp' expects input_0)")

    class Twice(MlpIO):
        def encode_chunk(self, items, slot):
            return [InferInput("input_0", np.zeros((1, 16), np.float32))] * 2

    check_fails(Twice(), "encode_chunk returned input 'input_0' twice")


@pytest.mark.parametrize("declared", [100, 16])
def test_item_input_bytes_must_match_what_encode_carves(declared):
    class IO(MlpIO):
        per_item = declared

    check_fails(
        IO(),
        f"item_input_bytes() is {declared} bytes per item, but encode_chunk carved 64 bytes of "
        "slot for 1 item(s); they must agree (the driver sizes each chunk's slot from "
        "item_input_bytes())",
    )


def test_decode_errors_name_the_output():
    class WrongName(MlpIO):
        def read(self, response):
            return InferOutput("out", response)

    check_fails(
        WrongName(),
        'decode_chunk(range(0, 1)) failed during validate_io: KeyError: "response from model '
        "'mlp' has no output 'out' (outputs: output)\"",
    )

    class WrongDtype(MlpIO):
        def read(self, response):
            return InferOutput("output", response, np.float16)

    check_fails(
        WrongDtype(),
        "decode_chunk(range(0, 1)) failed during validate_io: TypeError: output 'output' of "
        "model 'mlp' is FP32 (float32), not FP16 (float16)",
    )

    class OutOfRange(MlpIO):
        def decode_chunk(self, items, response):
            out = InferOutput("output", response)
            self.y[0] = out[len(items)]

    check_fails(
        OutOfRange(),
        "decode_chunk(range(0, 1)) failed during validate_io: IndexError: index 1 is out of "
        "range for axis 0 of tensor 'output' (extent 1)",
    )


@pytest.mark.parametrize(
    ("declared", "message"),
    [
        (
            [OutputSpec("out", np.float32, 8)],
            "output_specs() declares output 'out', which model 'mlp' does not have (outputs: output)",
        ),
        (
            [OutputSpec("output", np.float16, 8)],
            "output_specs() declares output 'output' as FP16, but model 'mlp' produces FP32",
        ),
        (
            [OutputSpec("output", np.float32, 9)],
            "output_specs() declares output 'output' with per-item dims [9], but model 'mlp' "
            "produces [8] per item",
        ),
        (
            [OutputSpec("output", np.float32, 8)] * 2,
            "output_specs() declares output 'output' twice",
        ),
    ],
)
def test_declared_output_errors(declared, message):
    class IO(MlpIO):
        pass

    IO.declared = declared
    check_fails(IO(), message)


def test_declared_output_dims_reversed_and_unbatched_outputs():
    spec = ModelIOSpec(
        [TensorMeta("input_0", "FP32", (-1, 16))],
        [TensorMeta("output", "FP32", (-1, 2, 3)), TensorMeta("total", "FP32", (1,))],
        "m",
    )

    class Reversed(MlpIO):
        declared = [OutputSpec("output", np.float32, (3, 2))]

    check_fails(
        Reversed(),
        "output_specs() declares output 'output' with per-item dims [3, 2], but model 'm' "
        "produces [2, 3] per item (the reversed dims would match: check the axis order: shapes "
        "are row-major, batch axis first)",
        spec,
    )

    class Unbatched(MlpIO):
        declared = [OutputSpec("total", np.float32, ())]

    check_fails(
        Unbatched(),
        "output 'total' of model 'm' has no leading batch axis (shape [1]); it cannot be read "
        "back per item: leave it out of output_specs()",
        spec,
    )


def test_synthetic_response_shapes():
    spec = ModelIOSpec(
        [],
        [
            TensorMeta("a", "FP32", (-1, -1, 3)),
            TensorMeta("b", "INT64", (2, -1)),
            TensorMeta("s", "BYTES", (-1,)),
        ],
        "m",
    )
    r = synthetic_response(spec, [], 5)
    assert type(r) is InferResponseMessage  # what a real call hands decode_chunk
    assert [(o.name, list(o.shape)) for o in r.outputs] == [
        ("a", [5, 1, 3]),
        ("b", [2, 1]),
        ("s", [5]),
    ]
    assert [len(b) for b in r.raw_output_contents] == [60, 16, 20]  # five empty BYTES elements
    assert list(InferOutput("s", r)) == [b""] * 5
    r = synthetic_response(spec, [OutputSpec("a", np.float32, (7, 3))], 2)
    assert [(o.name, list(o.shape)) for o in r.outputs] == [("a", [2, 7, 3])]


def test_manifest_io_spec_from_a_file_or_a_bundle_directory():
    spec = manifest_io_spec(FIXTURES / "scale4")
    assert spec == manifest_io_spec(FIXTURES / "scale4" / "manifest.yaml")
    assert spec.name == "scale4"
    assert spec.inputs == [TensorMeta("x", "FP32", (4,))]
    assert spec.outputs == [TensorMeta("y", "FP32", (4,))]
    assert spec.input("x").dtype.wire == "FP32"
    with pytest.raises(KeyError, match=r"model 'scale4' has no output 'z' \(outputs: y\)"):
        spec.output("z")


def test_manifest_io_spec_of_the_demo_models(demo_repo):
    mlp = manifest_io_spec(demo_repo / "mlp")
    assert mlp == MLP
    cnn = manifest_io_spec(demo_repo / "cnn")
    assert cnn.inputs == [TensorMeta("input_0", "FP32", (-1, 3, 32, 32))]
    assert cnn.outputs == [TensorMeta("output", "FP32", (-1, 10))]

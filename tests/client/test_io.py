"""The I/O vocabulary: ``InferInput``, ``InferOutput``, ``OutputSpec``, ``pool_view`` and the
bounds-checked views of ``with_bounds_checks``."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest

from kserve_trio.client import (
    BufferPool,
    CheckedArray,
    InferInput,
    InferOutput,
    OutputSpec,
    pool_view,
    scratch,
    with_bounds_checks,
)
from kserve_trio.client.driver import _shm_params as shm_params
from kserve_trio.client.io import as_descriptors, bounds_checks_enabled, checked, output_specs
from kserve_trio.core.protocol import codec
from kserve_trio.core.protocol.infer_wire import (
    InferOutputTensor,
    InferResponseMessage,
    parse_infer_request,
    parse_infer_response,
)
from kserve_trio.core.protocol.wire import TensorContents
from kserve_trio.core.tensors.dtypes import DType

WIRE_DTYPES = [d for d in DType if d.has_wire]


def response_of(**arrays) -> InferResponseMessage:
    """What the client reads back when a server answers with ``arrays``."""
    tensors = [InferInput(n, a).to_tensor() for n, a in arrays.items()]
    return parse_infer_response(bytes(codec.encode_infer_response("m", "", tensors)))


@pytest.mark.parametrize("dtype", WIRE_DTYPES, ids=lambda d: d.wire)
def test_every_wire_dtype_round_trips_through_a_request_and_a_response(dtype):
    if dtype.is_bytes:  # elements of their own lengths
        x = np.array([str(v).encode() * v for v in range(12)], dtype=object).reshape(3, 4)
    else:
        x = (np.arange(12) % 2).astype(dtype.numpy).reshape(3, 4)
    inp = InferInput("x", x)
    assert inp.dtype is dtype and inp.datatype == dtype.wire and inp.shape == (3, 4)
    request = codec.encode_infer_request("m", [inp.to_tensor()])
    assert request.inputs[0].datatype == dtype.wire
    assert list(request.inputs[0].shape) == [3, 4]
    decoded = codec.decode_infer_request(parse_infer_request(bytes(request)))
    np.testing.assert_array_equal(decoded.inputs[0].data, x)
    out = InferOutput("x", response_of(x=x))
    assert out.dtype == dtype.numpy and out.shape == (3, 4)
    np.testing.assert_array_equal(out, x)


def test_bf16_and_f16_inputs_are_sent_raw():
    for arr in (np.ones((2, 2), ml_dtypes.bfloat16), np.ones((2, 2), np.float16)):
        request = codec.encode_infer_request("m", [InferInput("x", arr).to_tensor()])
        assert request.inputs[0].contents is None
        assert request.raw_input_contents == [arr.tobytes()]


def test_infer_input_refuses_types_without_a_wire_datatype():
    with pytest.raises(TypeError, match="input 'x' has dtype f8_e4m3, which has no KServe wire"):
        InferInput("x", np.zeros(2, ml_dtypes.float8_e4m3fn))
    with pytest.raises(
        TypeError, match="input 'x' has dtype complex64, which kserve_trio cannot send"
    ):
        InferInput("x", np.zeros(2, np.complex64))
    with pytest.raises(ValueError, match="InferInput needs a non-empty name"):
        InferInput("", np.zeros(2))


def test_infer_output_views_the_received_bytes_without_copying():
    response = response_of(y=np.arange(6, dtype=np.int32))
    out = InferOutput("y", response)
    assert out.base is not None
    buf = response.raw_output_contents[0]
    assert np.shares_memory(out, np.frombuffer(buf, np.uint8))
    assert not out.flags.writeable


def test_infer_output_picks_the_right_raw_entry_past_typed_contents():
    response = response_of(a=np.zeros(2, np.float32), b=np.arange(3, dtype=np.int64))
    response.outputs.insert(
        0,
        InferOutputTensor("t", "INT32", [2], contents=TensorContents(int_contents=[4, 5])),
    )
    np.testing.assert_array_equal(InferOutput("t", response), [4, 5])
    np.testing.assert_array_equal(InferOutput("b", response), [0, 1, 2])
    assert InferOutput("b", response, np.int64).dtype == np.int64
    assert InferOutput("b", response, "INT64").dtype == np.int64


def test_infer_output_errors_name_the_output():
    response = response_of(y=np.zeros((2, 3), np.float32))
    with pytest.raises(KeyError, match=r"response from model 'm' has no output 'z' \(outputs: y\)"):
        InferOutput("z", response)
    with pytest.raises(TypeError, match=r"output 'y' of model 'm' is FP32 \(float32\), not FP64"):
        InferOutput("y", response, np.float64)
    response.raw_output_contents[0] = b"\0" * 4
    with pytest.raises(
        ValueError, match=r"output 'y' of model 'm' has 4 bytes of raw data, expected 24"
    ):
        InferOutput("y", response)
    response.outputs[0].parameters = shm_params("r", 0, 24)
    with pytest.raises(ValueError, match="was written to shared memory region 'r'"):
        InferOutput("y", response)


def test_with_bounds_checks_is_a_context_and_a_runner_and_restores():
    assert not bounds_checks_enabled()
    with with_bounds_checks():
        assert bounds_checks_enabled()
        with with_bounds_checks():
            assert bounds_checks_enabled()
        assert bounds_checks_enabled()
    assert not bounds_checks_enabled()
    assert with_bounds_checks(lambda a, b=0: (bounds_checks_enabled(), a + b), 1, b=2) == (True, 3)
    assert not bounds_checks_enabled()


def test_bounds_checks_are_thread_local():
    seen = []
    with with_bounds_checks():
        t = threading.Thread(target=lambda: seen.append(bounds_checks_enabled()))
        t.start()
        t.join()
    assert seen == [False]


def test_pool_view_is_plain_outside_and_checked_inside():
    pool = BufferPool(1024, 2)
    slot = pool.acquire_nowait()
    a, b = scratch(slot, [("a", (2, 3), np.float32), ("b", 4, np.int8)])
    plain = pool_view(a)
    assert type(plain) is np.ndarray and plain.shape == (2, 3)
    with with_bounds_checks():
        va, vb = pool_view(a, b)
    assert isinstance(va, CheckedArray) and va.tensor_name == "a" and vb.tensor_name == "b"
    va[1, 2] = 5.0
    assert plain[1, 2] == 5.0  # same memory
    with pytest.raises(TypeError, match="pool_view\\(\\) needs at least one scratch descriptor"):
        pool_view()
    pool.close()


@pytest.mark.parametrize(
    ("index", "message"),
    [
        (2, r"index 2 is out of range for axis 0 of tensor 'x' \(extent 2\)"),
        (-1, r"index -1 is out of range for axis 0 of tensor 'x' \(extent 2\)"),
        ((0, 3), r"index 3 is out of range for axis 1 of tensor 'x' \(extent 3\)"),
        (slice(1, 3), r"slice 1:3 reaches outside axis 0 of tensor 'x' \(extent 2\)"),
        ((slice(None), slice(0, 4)), r"slice 0:4 reaches outside axis 1 of tensor 'x'"),
        ((..., 5), r"index 5 is out of range for axis 1 of tensor 'x'"),
        (np.array([0, 2]), r"index 2 is out of range for axis 0 of tensor 'x'"),
        (np.array([True]), r"boolean mask of shape \[1\] does not match axis 0 of tensor 'x'"),
        ((0, 0, 0), r"too many indices for tensor 'x': 3 for 2 dim\(s\) \[2, 3\]"),
    ],
)
def test_checked_views_refuse_what_numpy_would_clip_or_wrap(index, message):
    x = checked(np.zeros((2, 3), np.float32), "x")
    with pytest.raises(IndexError, match=message):
        x[index] = 1.0
    with pytest.raises(IndexError, match=message):
        _ = x[index]
    assert not x.any()


def test_checked_views_allow_what_is_in_range_and_propagate_to_derived_views():
    x = checked(np.zeros((2, 3), np.float32), "x")
    x[1] = 1
    x[:, 0:3] += 1
    x[np.array([True, False])] = 7
    x[..., 2] = 3
    x[None, 0, 1] = 4
    row = x[1]
    assert isinstance(row, CheckedArray) and row.tensor_name == "x"
    with pytest.raises(
        IndexError, match=r"index 3 is out of range for axis 0 of tensor 'x' \(extent 3\)"
    ):
        row[3] = 0
    np.testing.assert_array_equal(np.asarray(x), [[7, 4, 3], [2, 2, 3]])


def test_infer_output_is_checked_inside_with_bounds_checks():
    response = response_of(y=np.zeros((1, 8), np.float32))
    with with_bounds_checks():
        out = InferOutput("y", response)
    with pytest.raises(
        IndexError, match=r"index 1 is out of range for axis 0 of tensor 'y' \(extent 1\)"
    ):
        _ = out[1]


def test_output_spec_normalizes_and_validates():
    s = OutputSpec("y", np.float32, 8)
    assert (s.dtype, s.per_item_dims, s.item_bytes, s.shape(3)) == (DType.F32, (8,), 32, (3, 8))
    assert OutputSpec("y", "BF16", (2, 2)).item_bytes == 8
    assert OutputSpec("y", DType.I64).item_bytes == 8
    with pytest.raises(ValueError, match=r"per_item_dims \[-1\] must be known sizes"):
        OutputSpec("y", np.float32, (-1,))
    with pytest.raises(TypeError, match="output 'y' has dtype f8_e5m2"):
        OutputSpec("y", ml_dtypes.float8_e5m2, (1,))


def test_descriptor_lists_and_output_specs_are_checked():
    pool = BufferPool(256, 1)
    d = scratch(pool.acquire_nowait(), "x", 4, np.float32)
    inp = InferInput("y", np.zeros(2))
    assert as_descriptors(d) == [d]
    assert as_descriptors((d, inp)) == [d, inp]
    with pytest.raises(
        TypeError,
        match="encode_chunk must return a scratch descriptor, an InferInput or a list of them, got ndarray",
    ):
        as_descriptors(np.zeros(2))
    with pytest.raises(
        TypeError, match="encode_chunk returned ndarray; expected scratch descriptors or InferInput"
    ):
        as_descriptors([d, np.zeros(2)])

    class NoSpecs:
        pass

    class BadSpecs:
        def output_specs(self):
            return ["y"]

    assert output_specs(NoSpecs()) == []
    with pytest.raises(
        TypeError, match="output_specs\\(\\) must return OutputSpec values, got 'y'"
    ):
        output_specs(BadSpecs())
    pool.close()

"""weights.safetensors: header-only index, memory-mapped views, the writer, and the spec errors."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from kserve_trio.core.errors import BundleError
from kserve_trio.core.tensors.dtypes import DType
from kserve_trio.runtime.weights import read_weights_index, write_weights


def _raw_file(path, header: dict, data: bytes = b"") -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


@pytest.fixture
def wfile(tmp_path):
    d = tmp_path / "mybundle"
    d.mkdir()
    return d / "weights.safetensors"


def test_roundtrip_keeps_order_dtypes_and_values(wfile):
    weights = [
        ("z_first", np.arange(6, dtype=np.float32).reshape(2, 3)),
        ("bf", np.array([1.5, -2.0, 3.25], ml_dtypes.bfloat16)),
        ("f8", np.array([0.5, 1.0], ml_dtypes.float8_e4m3fn)),
        ("f8b", np.array([2.0], ml_dtypes.float8_e5m2)),
        ("flag", np.array([True, False])),
        ("scalar", np.array(2.5)),
        ("empty", np.zeros((0, 3), np.int8)),
        ("strided", np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]),
        ("u", np.array([1, 2], np.uint16)),
    ]
    n = write_weights(wfile, weights)
    assert n == sum(a.nbytes for _, a in weights)
    idx = read_weights_index(wfile)
    assert idx.names == tuple(n for n, _ in weights)
    assert idx.n_tensors == len(weights)
    assert [e.dtype for e in idx.entries][:5] == [
        DType.F32,
        DType.BF16,
        DType.F8_E4M3,
        DType.F8_E5M2,
        DType.BOOL,
    ]
    for (name, a), h in zip(weights, idx.host_arrays(), strict=True):
        assert h.dtype == a.dtype and h.shape == a.shape, name
        np.testing.assert_array_equal(h, a)


def test_footprint_comes_from_the_header_alone(wfile):
    write_weights(wfile, [("a", np.ones((100, 10), np.float32)), ("b", np.ones(7, np.float16))])
    # wipe the data section: the index must not need it
    head = wfile.read_bytes()
    (hlen,) = struct.unpack("<Q", head[:8])
    wfile.write_bytes(head[: 8 + hlen] + b"\0" * (len(head) - 8 - hlen))
    idx = read_weights_index(wfile)
    assert idx.nbytes == 4000 + 14


def test_host_arrays_are_read_only_memory_maps(wfile):
    write_weights(wfile, [("a", np.ones((4, 4), np.float32))])
    (a,) = read_weights_index(wfile).host_arrays()
    assert not a.flags.writeable
    assert not a.flags.owndata
    with pytest.raises(ValueError, match=r"read-only"):
        a[0, 0] = 2


def test_files_interoperate_with_the_safetensors_package(wfile):
    write_weights(wfile, [("w", np.arange(4, dtype=np.float32)), ("s", np.array(3.0))])
    loaded = safetensors.numpy.load_file(str(wfile))
    np.testing.assert_array_equal(loaded["w"], np.arange(4))
    assert loaded["s"].shape == ()
    safetensors.numpy.save_file(
        {"b": np.ones(2, np.int32), "a": np.zeros((2, 2), np.float64)},
        str(wfile),
        metadata={"argument_order": json.dumps(["b", "a"])},
    )
    idx = read_weights_index(wfile)
    assert idx.names == ("b", "a")
    np.testing.assert_array_equal(idx.host_arrays()[0], [1, 1])


def test_file_without_tensors_has_no_weights(wfile):
    write_weights(wfile, [])
    idx = read_weights_index(wfile)
    assert idx.entries == () and idx.nbytes == 0 and idx.host_arrays() == []
    _raw_file(wfile, {})
    assert read_weights_index(wfile).entries == ()


def test_extra_tensors_outside_argument_order_are_counted_not_passed(wfile):
    _raw_file(
        wfile,
        {
            "__metadata__": {"argument_order": json.dumps(["a"])},
            "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
        },
        b"\0" * 8,
    )
    idx = read_weights_index(wfile)
    assert idx.names == ("a",) and idx.n_tensors == 2


def test_missing_name_is_the_spec_error(wfile):
    _raw_file(
        wfile,
        {
            "__metadata__": {"argument_order": json.dumps(["a", "ghost"])},
            "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        },
        b"\0" * 4,
    )
    with pytest.raises(BundleError) as info:
        read_weights_index(wfile)
    assert str(info.value) == (
        f"bundle 'mybundle' ({wfile.parent}): weight 'ghost' missing from safetensors"
    )


def test_unknown_dtype_is_refused(wfile):
    _raw_file(
        wfile,
        {
            "__metadata__": {"argument_order": json.dumps(["a"])},
            "a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]},
        },
        b"\0",
    )
    with pytest.raises(
        BundleError, match=r"weight 'a' has unknown dtype 'F4' in weights.safetensors"
    ):
        read_weights_index(wfile, bundle="named")


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        (
            {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
            b"\0" * 4,
            "weights.safetensors has tensors but no __metadata__ 'argument_order'",
        ),
        (
            {"__metadata__": {"argument_order": "a,b"}},
            b"",
            "__metadata__ 'argument_order' is not a JSON list of names",
        ),
        (
            {
                "__metadata__": {"argument_order": json.dumps(["a"])},
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]},
            },
            b"\0" * 4,
            "weight 'a' spans 4 bytes but F32[2] needs 8",
        ),
        (
            {
                "__metadata__": {"argument_order": json.dumps(["a"])},
                "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            },
            b"",
            "weight 'a' has data_offsets [0, 4] outside the file",
        ),
        (
            {
                "__metadata__": {"argument_order": json.dumps(["a", "a"])},
                "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            },
            b"\0" * 4,
            "argument_order repeats ['a']",
        ),
        (
            {
                "__metadata__": {"argument_order": json.dumps(["a"])},
                "a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]},
            },
            b"\0" * 4,
            "weight 'a' has a malformed shape [-1]",
        ),
    ],
)
def test_malformed_headers_are_refused(wfile, header, data, message):
    _raw_file(wfile, header, data)
    with pytest.raises(BundleError, match=r"^bundle 'mybundle' .*" + _re(message)):
        read_weights_index(wfile)


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_missing_truncated_and_non_json_files(wfile):
    with pytest.raises(BundleError, match=r"missing weights.safetensors"):
        read_weights_index(wfile)
    wfile.write_bytes(b"\x01\x02")
    with pytest.raises(BundleError, match=r"too short to be a safetensors file"):
        read_weights_index(wfile)
    wfile.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(BundleError, match=r"header length of 1000 bytes beyond the file"):
        read_weights_index(wfile)
    wfile.write_bytes(struct.pack("<Q", 3) + b"{x}")
    with pytest.raises(BundleError, match=r"header is not valid JSON"):
        read_weights_index(wfile)


def test_writer_refuses_duplicates_and_unsupported_dtypes(wfile):
    with pytest.raises(ValueError, match=r"duplicate weight names: \['a'\]"):
        write_weights(wfile, [("a", np.ones(1)), ("a", np.ones(1))])
    with pytest.raises(
        ValueError, match=r"weight 'c' has dtype complex64 with no safetensors type"
    ):
        write_weights(wfile, [("c", np.ones(1, np.complex64))])

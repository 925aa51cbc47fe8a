"""The client's counterparts of the upstream reference's remaining forms: ``InferInput`` from a
flat buffer with explicit dims and from typed contents, ``subslot`` + ``pool_view(slot, shape,
dtype)`` (the lower-level staging path), the nameless array-returning ``scratch`` and
``BufferPool``'s heap default."""

from __future__ import annotations

import numpy as np
import pytest

from kserve_trio.client import BufferPool, InferInput, pool_view, scratch, subslot
from kserve_trio.client.driver import build_chunk_request
from kserve_trio.core.memory.buffer_pool import pool_offset
from kserve_trio.core.protocol import codec
from kserve_trio.core.protocol.infer_wire import parse_infer_request


def sent(*inputs: InferInput) -> dict[str, np.ndarray]:
    """What a server decodes from a one-shot request carrying ``inputs``."""
    request = codec.encode_infer_request("m", [i.to_tensor() for i in inputs])
    decoded = codec.decode_infer_request(parse_infer_request(bytes(request)))
    return {t.name: t.data for t in decoded.inputs}


# --- InferInput variants ------------------------------------------------------------------------


def test_from_buffer_reshapes_a_flat_array_without_copying():
    flat = np.arange(6, dtype=np.float32)
    inp = InferInput.from_buffer("x", flat, (2, 3))
    assert inp.shape == (2, 3) and inp.datatype == "FP32"
    assert np.shares_memory(inp.array, flat)
    np.testing.assert_array_equal(sent(inp)["x"], flat.reshape(2, 3))


def test_from_buffer_reads_bytes_with_a_dtype_and_checks_the_count():
    raw = np.array([1, -2, 3, 4], np.int16).tobytes()
    inp = InferInput.from_buffer("ids", raw, [2, 2], "INT16")
    np.testing.assert_array_equal(sent(inp)["ids"], [[1, -2], [3, 4]])
    with pytest.raises(TypeError, match="a bytes buffer needs a dtype"):
        InferInput.from_buffer("ids", raw, [4])
    with pytest.raises(ValueError, match=r"4 element\(s\) do not fill shape \[3\]"):
        InferInput.from_buffer("ids", raw, [3], np.int16)
    with pytest.raises(ValueError, match="not a whole number of int32 elements"):
        InferInput.from_buffer("ids", raw[:6], [1], np.int32)


def test_from_contents_converts_typed_values_once_and_exactly():
    inp = InferInput.from_contents("x", [1.5, 2.0, -3.0, 4.25], [2, 2], "FP32")
    assert inp.datatype == "FP32"
    np.testing.assert_array_equal(sent(inp)["x"], np.array([[1.5, 2.0], [-3.0, 4.25]], np.float32))
    ids = InferInput.from_contents("ids", [7, 8, 9], [3], "INT64")
    assert sent(ids)["ids"].tolist() == [7, 8, 9] and ids.datatype == "INT64"
    text = InferInput.from_contents("t", [b"ab", "c\u00e9"], [2], "BYTES")
    assert text.datatype == "BYTES" and sent(text)["t"].tolist() == [b"ab", "c\u00e9".encode()]
    with pytest.raises(ValueError, match="contents do not fit uint8"):
        InferInput.from_contents("b", [300], [1], "UINT8")
    with pytest.raises(ValueError, match="contents do not fit int32 exactly"):
        InferInput.from_contents("b", [1.5], [1], "INT32")
    with pytest.raises(TypeError, match="unknown wire datatype 'FLOAT'"):
        InferInput.from_contents("b", [1.0], [1], "FLOAT")


# --- subslot and pool_view(slot, shape, dtype) ----------------------------------------------------


def test_a_hand_carved_subslot_is_viewed_and_sent_by_reference():
    with BufferPool(4096, 2, use_shm=True, name="kt_subslot_test") as pool:
        slot = pool.acquire_nowait()
        assert slot is not None
        head = subslot(slot, 16)
        feats = subslot(slot, 4 * 6)
        view = pool_view(feats, (2, 3), np.float32)
        view[:] = np.arange(6).reshape(2, 3)
        assert pool_offset(pool, view) == feats.offset == slot.offset + 16
        assert np.frombuffer(pool.view(feats.offset, 24), np.float32).tolist() == list(range(6))
        request = build_chunk_request("m", [InferInput("x", view)], pool, shm=True)
        assert request.raw_input_contents == []  # by reference into the region, not inline
        params = request.inputs[0].parameters
        assert params[codec.SHM_REGION_PARAM] == pool.region_name
        assert params[codec.SHM_OFFSET_PARAM] == feats.offset
        with pytest.raises(ValueError, match="overruns the slot of 16 bytes"):
            pool_view(head, (5,), np.float32)
        slot.release()


# --- nameless scratch --------------------------------------------------------------------------


def test_nameless_scratch_returns_the_arrays_themselves_carved_in_order():
    with BufferPool(1024, 1) as pool:
        slot = pool.acquire_nowait()
        assert slot is not None
        a = scratch(slot, (2, 3), np.float32)
        assert isinstance(a, np.ndarray) and a.shape == (2, 3) and a.dtype == np.float32
        b, c = scratch(slot, [((4,), np.int64), (5, "uint8")])
        assert (b.shape, b.dtype, c.shape, c.dtype) == ((4,), np.int64, (5,), np.uint8)
        offsets = [pool_offset(pool, arr) for arr in (a, b, c)]
        assert offsets == [0, 24, 56]  # disjoint, in order, each aligned to its itemsize
        a[:] = 1.0
        c[:] = 9
        assert np.frombuffer(pool.view(56, 5), np.uint8).tolist() == [9] * 5
        cursor = slot.cursor
        with pytest.raises(ValueError, match="overruns the slot"):
            scratch(slot, [((8,), np.uint8), ((1000,), np.float64)])
        assert slot.cursor == cursor  # nothing carved
        named = scratch(slot, "x", 2, np.int32)
        assert named.name == "x" and named.offset == 64  # the named form is unchanged
        slot.release()


def test_buffer_pool_defaults_to_the_heap():
    with BufferPool(64, 2) as pool:
        assert pool.use_shm is False and pool.region_name == ""

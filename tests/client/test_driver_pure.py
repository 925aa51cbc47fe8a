"""The driver's plain functions: chunk geometry, chunk requests, shared-memory rehydration."""

from __future__ import annotations

import numpy as np
import pytest

from kserve_trio.client import BufferPool, InferInput, InferOutput, OutputSpec, pool_view, scratch
from kserve_trio.client.driver import (
    build_chunk_request,
    chunk_geometry,
    chunks,
    pool_offset,
    rehydrate,
)
from kserve_trio.client.errors import RpcError
from kserve_trio.client.io import int64_param, string_param
from kserve_trio.core.protocol import codec
from kserve_trio.core.protocol.infer_wire import (
    InferOutputTensor,
    InferRequestedOutput,
    InferResponseMessage,
    parse_infer_request,
    parse_infer_response,
)
from kserve_trio.core.tensors.tensor import NamedTensor


@pytest.fixture
def shm_pool():
    pool = BufferPool(4096, 4, use_shm=True, name="kt_client_test")
    yield pool
    pool.close()


@pytest.fixture
def heap_pool():
    pool = BufferPool(4096, 4)
    yield pool
    pool.close()


def test_geometry_fits_the_batch_in_one_slot_when_it_can():
    assert chunk_geometry(64, 1 << 20, 8, 32) == (1, 32)
    assert chunk_geometry(100, 1000, 8, 32) == (1, 10)  # slot space caps the chunk
    assert chunk_geometry(100, 1000, 8, 32, padding=200) == (1, 8)


def test_geometry_spans_slots_for_a_large_item():
    assert chunk_geometry(2500, 1000, 8, 4) == (3, 1)
    assert chunk_geometry(1000, 1000, 8, 4, padding=8) == (2, 1)


def test_geometry_errors_when_an_item_cannot_fit():
    with pytest.raises(ValueError) as info:
        chunk_geometry(9000, 1000, 8, 1)
    assert str(info.value) == (
        "one item needs 9000 bytes, 9 slots of 1000 bytes, but the pool has 8 slots; "
        "increase pool_bytes on kserve_init"
    )
    with pytest.raises(ValueError, match="an item needs 0 bytes of slot space"):
        chunk_geometry(0, 1000, 8, 1)


def test_chunks_cover_every_item_once():
    assert chunks(10, 4) == [range(0, 4), range(4, 8), range(8, 10)]
    assert chunks(0, 4) == []
    assert [len(r) for r in chunks(10_000, 64)][-1] == 10_000 % 64


def carve(pool, n=2):
    slot = pool.acquire_nowait(1)
    x, m = scratch(slot, [("x", (n, 4), np.float32), ("mask", (n,), np.int32)])
    vx, vm = pool_view(x, m)
    vx[...] = np.arange(n * 4).reshape(n, 4)
    vm[...] = [7] * n
    return slot, x, m


def shm_of(tensor):
    return (
        string_param(tensor.parameters, codec.SHM_REGION_PARAM),
        int64_param(tensor.parameters, codec.SHM_OFFSET_PARAM),
        int64_param(tensor.parameters, codec.SHM_BYTE_SIZE_PARAM),
    )


def test_shm_descriptors_reference_region_and_offset(shm_pool):
    _slot, x, m = carve(shm_pool)
    req = build_chunk_request("mlp", [x, m], shm_pool, shm=True)
    assert [t.name for t in req.inputs] == ["x", "mask"]
    assert [t.datatype for t in req.inputs] == ["FP32", "INT32"]
    assert [list(t.shape) for t in req.inputs] == [[2, 4], [2]]
    assert shm_of(req.inputs[0]) == (shm_pool.region_name, x.offset, 32)
    assert shm_of(req.inputs[1]) == (shm_pool.region_name, m.offset, 8)
    assert req.raw_input_contents == []
    assert req.outputs == []


def test_inline_descriptors_copy_the_slot_bytes(heap_pool):
    _slot, x, m = carve(heap_pool)
    req = build_chunk_request("mlp", [x, m], heap_pool, shm=False)
    assert all(not t.parameters for t in req.inputs)
    decoded = codec.decode_infer_request(parse_infer_request(bytes(req)))
    np.testing.assert_array_equal(decoded.inputs[0].data, np.arange(8).reshape(2, 4))
    np.testing.assert_array_equal(decoded.inputs[1].data, [7, 7])


def test_infer_input_over_a_pool_view_travels_by_reference_others_inline(shm_pool):
    slot = shm_pool.acquire_nowait(1)
    x = scratch(slot, "x", (2, 4), np.float32)
    by_ref = InferInput("x", pool_view(x))
    inline = InferInput("extra", np.arange(3, dtype=np.int64))
    assert pool_offset(shm_pool, by_ref.array) == x.offset
    assert pool_offset(shm_pool, inline.array) is None
    assert pool_offset(shm_pool, pool_view(x)[:, 1]) is None  # not contiguous
    req = build_chunk_request("m", [inline, by_ref], shm_pool, shm=True)
    assert shm_of(req.inputs[1]) == (shm_pool.region_name, x.offset, 32)
    assert req.inputs[0].parameters == {}
    assert req.raw_input_contents == [np.arange(3, dtype=np.int64).tobytes()]


def test_declared_outputs_by_reference_on_shm_and_by_name_inline(shm_pool):
    slot, x, m = carve(shm_pool)
    outs = [OutputSpec("y", np.float32, (3,)), OutputSpec("z", np.int8, ())]
    bufs = scratch(slot, [(s.name, s.shape(2), s.dtype) for s in outs])
    assert bufs[0].offset >= m.offset + m.nbytes  # outputs after the inputs
    req = build_chunk_request("m", [x, m], shm_pool, shm=True, outputs=outs, out_bufs=bufs)
    assert [o.name for o in req.outputs] == ["y", "z"]
    assert shm_of(req.outputs[0]) == (shm_pool.region_name, bufs[0].offset, 24)
    assert shm_of(req.outputs[1]) == (shm_pool.region_name, bufs[1].offset, 2)
    inline = build_chunk_request("m", [x, m], shm_pool, shm=False, outputs=outs)
    assert [(o.name, o.parameters) for o in inline.outputs] == [("y", {}), ("z", {})]


def test_request_building_errors(shm_pool, heap_pool):
    _slot, x, _ = carve(shm_pool)
    with pytest.raises(ValueError, match="encode_chunk returned input 'x' twice"):
        build_chunk_request("m", [x, x], shm_pool, shm=True)
    with pytest.raises(ValueError, match="scratch descriptor 'x' was carved from another pool"):
        build_chunk_request("m", [x], heap_pool, shm=False)


def served(request, registry_pool, outputs):
    """What a server would answer: outputs written where the request asked."""

    class Registry:
        def write(self, region, offset, data):
            assert region == registry_pool.region_name
            registry_pool.view(offset, data.nbytes)[:] = data.tobytes()

    requested = [
        codec.RequestedOutput(o.name, codec.shm_ref(o.name, o.parameters)) for o in request.outputs
    ]
    tensors = [NamedTensor.from_array(n, a) for n, a in outputs.items()]
    return parse_infer_response(
        bytes(codec.encode_infer_response("m", "", tensors, requested or None, Registry()))
    )


def test_rehydrate_pure_shared_memory(shm_pool):
    slot, x, m = carve(shm_pool)
    outs = [OutputSpec("y", np.float32, (3,)), OutputSpec("z", np.int8, ())]
    bufs = scratch(slot, [(s.name, s.shape(2), s.dtype) for s in outs])
    req = build_chunk_request("m", [x, m], shm_pool, shm=True, outputs=outs, out_bufs=bufs)
    y = np.arange(6, dtype=np.float32).reshape(2, 3)
    z = np.array([3, 4], np.int8)
    response = served(req, shm_pool, {"y": y, "z": z})
    assert response.raw_output_contents == [b"", b""]  # one empty placeholder per shm output
    rehydrate(response, shm_pool, bufs)
    pool_view(bufs[0])[...] = -1  # the response holds its own copy
    np.testing.assert_array_equal(InferOutput("y", response), y)
    np.testing.assert_array_equal(InferOutput("z", response), z)
    assert all(o.parameters == {} for o in response.outputs)


def test_rehydrate_mixed_shared_memory_and_inline(shm_pool):
    slot, x, m = carve(shm_pool)
    (ybuf,) = scratch(slot, [("y", (2, 3), np.float32)])
    req = build_chunk_request("m", [x, m], shm_pool, shm=True, out_bufs=[ybuf])
    req.outputs.insert(0, InferRequestedOutput("a"))
    req.outputs.append(InferRequestedOutput("b"))
    a, y, b = np.ones(2, np.int64), np.full((2, 3), 2.5, np.float32), np.zeros(1, np.float64)
    response = served(req, shm_pool, {"a": a, "y": y, "b": b})
    assert len(response.raw_output_contents) == 3  # positional: y's entry is empty
    rehydrate(response, shm_pool, [ybuf])
    assert len(response.raw_output_contents) == 3
    for name, want in (("a", a), ("y", y), ("b", b)):
        np.testing.assert_array_equal(InferOutput(name, response), want)


def test_rehydrate_falls_back_to_the_wire_shape_and_checks_sizes(shm_pool):
    slot, _x, _m = carve(shm_pool)
    (ybuf,) = scratch(slot, [("y", (2,), np.float32)])
    pool_view(ybuf)[...] = [1.5, 2.5]
    out = InferOutputTensor("y", "FP32", [2], {codec.SHM_REGION_PARAM: shm_pool.region_name})
    response = InferResponseMessage(model_name="m", outputs=[out])
    rehydrate(response, shm_pool, [ybuf])
    np.testing.assert_array_equal(InferOutput("y", response), [1.5, 2.5])

    big = InferOutputTensor(
        "y",
        "FP32",
        [4],
        {codec.SHM_REGION_PARAM: shm_pool.region_name, codec.SHM_BYTE_SIZE_PARAM: 16},
    )
    with pytest.raises(
        RpcError,
        match="output 'y' of model 'm' reports 16 bytes in shared memory but 8 were reserved",
    ):
        rehydrate(InferResponseMessage(model_name="m", outputs=[big]), shm_pool, [ybuf])
    other = InferOutputTensor("q", "FP32", [1], {codec.SHM_REGION_PARAM: "elsewhere"})
    with pytest.raises(RpcError, match="output 'q' came back in shared memory region 'elsewhere'"):
        rehydrate(InferResponseMessage(model_name="m", outputs=[other]), shm_pool, [ybuf])


def test_rehydrate_reads_a_reserved_output_answered_with_an_empty_inline_entry(shm_pool):
    """Stock Triton writes the output to the region we named but answers with an empty inline
    entry and no shm parameters; a non-empty entry is the server answering inline instead."""
    slot, _x, _m = carve(shm_pool)
    (ybuf,) = scratch(slot, [("y", (2,), np.float32)])
    pool_view(ybuf)[...] = [1.5, 2.5]

    def triton_like(entries):
        outs = [InferOutputTensor("y", "FP32", [2]), InferOutputTensor("a", "INT8", [1])]
        return InferResponseMessage(model_name="m", outputs=outs, raw_output_contents=entries)

    response = rehydrate(triton_like([b"", b"\x07"]), shm_pool, [ybuf])
    np.testing.assert_array_equal(InferOutput("y", response), [1.5, 2.5])
    np.testing.assert_array_equal(InferOutput("a", response), [7])
    inline = np.array([9.0, 8.0], np.float32).tobytes()
    response = rehydrate(triton_like([inline, b"\x07"]), shm_pool, [ybuf])
    np.testing.assert_array_equal(InferOutput("y", response), [9.0, 8.0])
    too_big = triton_like([b"", b"\x07"])
    too_big.outputs[0].shape = [4]
    with pytest.raises(
        RpcError,
        match="output 'y' of model 'm' reports 16 bytes in shared memory but 8 were reserved",
    ):
        rehydrate(too_big, shm_pool, [ybuf])

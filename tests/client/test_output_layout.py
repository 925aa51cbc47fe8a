"""The streaming driver's ``rehydrate`` reads a mixed shared-memory/inline response in either
``raw_output_contents`` layout: Triton's positional one, and the older inline-only one."""

from __future__ import annotations

import numpy as np
import pytest

from kserve_trio.client import BufferPool, InferOutput, pool_view, scratch
from kserve_trio.client.driver import rehydrate
from kserve_trio.client.errors import RpcError
from kserve_trio.core.protocol import codec
from kserve_trio.core.protocol.infer_wire import InferOutputTensor, InferResponseMessage

A = np.array([1, -2], np.int64)
Y = np.full((2, 3), 2.5, np.float32)
B = np.array([0.25], np.float64)


@pytest.fixture
def pool():
    pool = BufferPool(4096, 2, use_shm=True, name="kt_layout_test")
    yield pool
    pool.close()


def response(pool: BufferPool, ybuf, *, positional: bool) -> InferResponseMessage:
    def out(name, datatype, shape, **kw):
        return InferOutputTensor(name, datatype, shape, **kw)

    shm = {
        codec.SHM_REGION_PARAM: pool.region_name,
        codec.SHM_OFFSET_PARAM: ybuf.offset,
        codec.SHM_BYTE_SIZE_PARAM: Y.nbytes,
    }
    raw = [A.tobytes(), b"", B.tobytes()] if positional else [A.tobytes(), B.tobytes()]
    return InferResponseMessage(
        model_name="m",
        outputs=[
            out("a", "INT64", [2]),
            out("y", "FP32", [2, 3], parameters=shm),
            out("b", "FP64", [1]),
        ],
        raw_output_contents=raw,
    )


@pytest.mark.parametrize("positional", [True, False])
def test_rehydrate_reads_both_layouts(pool, positional):
    slot = pool.acquire_nowait(1)
    ybuf = scratch(slot, "y", (2, 3), np.float32)
    pool_view(ybuf)[...] = Y
    resp = rehydrate(response(pool, ybuf, positional=positional), pool, [ybuf])
    assert len(resp.raw_output_contents) == 3
    for name, want in (("a", A), ("y", Y), ("b", B)):
        np.testing.assert_array_equal(InferOutput(name, resp), want)


def test_rehydrate_refuses_a_count_matching_neither_layout(pool):
    slot = pool.acquire_nowait(1)
    ybuf = scratch(slot, "y", (2, 3), np.float32)
    resp = response(pool, ybuf, positional=True)
    resp.raw_output_contents.append(b"")
    with pytest.raises(RpcError, match="has 4 raw_output_contents entries"):
        rehydrate(resp, pool, [ybuf])

"""BufferPool: geometry, carving, FIFO contiguous allocation (async on asyncio and trio, and
from plain threads), deadlines, cancellation, scratch views and the shm backing."""

from __future__ import annotations

import mmap
import os
import random
import re
import threading
import time

import anyio
import ml_dtypes
import numpy as np
import posix_ipc
import pytest

from kserve_trio.core.errors import PoolAcquireTimeout
from kserve_trio.core.memory.buffer_pool import (
    BufferPool,
    PoolSlot,
    ScratchBuffer,
    first_fit,
    pool_view,
    release,
    scratch,
    scratch_nbytes,
    subslot,
)
from kserve_trio.core.memory.shm import ShmRegistry
from kserve_trio.core.tensors.dtypes import DType
from tests.waiting import until, wait_until


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


def ms_from_now(ms: float) -> int:
    return time.monotonic_ns() + int(ms * 1e6)


async def settle() -> None:
    """Let every runnable task reach its next park."""
    for _ in range(10):
        await anyio.sleep(0)


# -- pure logic and geometry -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("free", "span", "start"),
    [
        ([True] * 4, 4, 0),
        ([False, True, True, False], 2, 1),
        ([True, False, True, True], 2, 2),
        ([True, False, True, False], 2, None),
        ([False, False], 1, None),
        ([False, True], 1, 1),
    ],
)
def test_first_fit(free, span, start):
    assert first_fit(free, span) == start


def test_geometry():
    pool = BufferPool(1000, n_slots=3)
    assert (pool.slot_bytes, pool.nbytes, pool.n_slots) == (333, 999, 3)
    assert pool.region_name == "" and pool.key == "" and not pool.use_shm
    assert pool.view(0, 999).nbytes == 999
    assert BufferPool(64).slot_bytes == 8  # 8 slots by default
    with pytest.raises(ValueError, match=r"^range \[990, 990\+10\) is outside buffer pool"):
        pool.view(990, 10)


@pytest.mark.parametrize(
    ("n_bytes", "n_slots", "message"),
    [
        (7, 8, "buffer pool of 7 bytes cannot be split into 8 slots (slot_bytes would be 0)"),
        (0, 1, "buffer pool of 0 bytes cannot be split into 1 slots (slot_bytes would be 0)"),
        (64, 0, "buffer pool needs at least one slot, got n_slots=0"),
    ],
)
def test_geometry_errors(n_bytes, n_slots, message):
    with pytest.raises(ValueError) as err:
        BufferPool(n_bytes, n_slots)
    assert str(err.value) == message


def test_slots_are_contiguous_runs():
    pool = BufferPool(400, n_slots=4)
    a = pool.acquire_nowait(1)
    b = pool.acquire_nowait(2)
    assert (a.index, a.offset, a.capacity, a.span) == (1, 0, 100, 1)
    assert (b.index, b.offset, b.capacity, b.span) == (2, 100, 200, 2)
    assert pool.acquire_nowait(2) is None
    c = pool.acquire_nowait(1)
    assert (c.index, c.offset) == (4, 300)
    release(a)
    release(c)
    assert pool.acquire_nowait(2) is None  # slots 1 and 4 are free but not adjacent
    b.release()
    d = pool.acquire_nowait(4)
    assert (d.index, d.offset, d.capacity) == (1, 0, 400)
    assert pool.free_slots() == 0


def test_subslot_carving_and_overrun():
    pool = BufferPool(400, n_slots=4)
    slot = pool.acquire_nowait(2)
    slot2 = pool.acquire_nowait(1)
    s1 = subslot(slot2, 30)
    s2 = subslot(slot2, 70)
    assert (s1.index, s1.offset, s1.capacity, s1.cursor) == (0, 200, 30, 0)
    assert (s2.offset, s2.capacity) == (230, 70)
    assert slot2.cursor == 100 and slot2.remaining == 0
    with pytest.raises(ValueError) as err:
        subslot(slot2, 1)
    assert str(err.value) == "subslot of 1 bytes overruns the slot (cursor 100, capacity 100)"
    assert slot2.cursor == 100
    inner = subslot(slot, 50)
    nested = subslot(inner, 20)
    assert (nested.offset, inner.cursor, slot.cursor) == (0, 20, 50)
    release(inner)  # derived subslots are not releasable: a no-op
    assert pool.free_slots() == 1
    release(slot)
    assert pool.free_slots() == 3


def test_span_outside_pool_raises_immediately():
    pool = BufferPool(400, n_slots=4)
    message = (
        "span {} is outside [1, 4] for buffer pool 'kserve_trio_pool' (4 slots): "
        "it could never be satisfied"
    )
    for span in (0, 5):
        with pytest.raises(ValueError) as err:
            pool.acquire_nowait(span)
        assert str(err.value) == message.format(span)
        with pytest.raises(ValueError) as err:
            pool.acquire_blocking(span)
        assert str(err.value) == message.format(span)
    assert pool.waiting() == 0


@pytest.mark.anyio
async def test_async_span_outside_pool_raises_immediately():
    pool = BufferPool(400, n_slots=4)
    with anyio.fail_after(1):
        with pytest.raises(ValueError, match=r"^span 5 is outside \[1, 4\]"):
            await pool.acquire(5)
    assert pool.waiting() == 0


def test_double_release_raises():
    pool = BufferPool(400, n_slots=4)
    slot = pool.acquire_nowait(2)
    release(slot)
    with pytest.raises(RuntimeError) as err:
        release(slot)
    assert str(err.value) == "double release of buffer pool 'kserve_trio_pool' slot 1 (span 2)"
    again = pool.acquire_nowait(2)  # the same slots, lent to someone else
    with pytest.raises(RuntimeError, match="double release"):
        release(slot)  # the stale handle must not free the new owner's slots
    assert pool.free_slots() == 2
    release(again)
    other = BufferPool(400, n_slots=4)
    with pytest.raises(ValueError, match="does not belong to buffer pool"):
        other.release(pool.acquire_nowait(1))


# -- async allocation (asyncio and trio) -------------------------------------------------------


@pytest.mark.anyio
async def test_span_waiter_blocks_until_adjacent_run_frees():
    pool = BufferPool(400, n_slots=4)
    held = [await pool.acquire() for _ in range(4)]
    got: list[PoolSlot] = []

    async def want_two() -> None:
        got.append(await pool.acquire(2))

    async with anyio.create_task_group() as tg:
        tg.start_soon(want_two)
        await settle()
        release(held[0])
        release(held[2])
        await settle()
        assert got == [] and pool.waiting() == 1  # two free slots, not adjacent
        release(held[1])
        await until(lambda: got)
    assert (got[0].index, got[0].span) == (1, 2)
    assert pool.waiting() == 0


@pytest.mark.anyio
async def test_fifo_large_waiter_not_starved():
    pool = BufferPool(400, n_slots=4)
    first = await pool.acquire()
    order: list[str] = []
    slots: dict[str, PoolSlot] = {}

    async def take(tag: str, span: int) -> None:
        slots[tag] = await pool.acquire(span)
        order.append(tag)

    async with anyio.create_task_group() as tg:
        tg.start_soon(take, "big", 4)
        await settle()
        for i in range(3):
            tg.start_soon(take, f"small{i}", 1)
            await settle()
        # three slots are free, yet the span-1 callers queue behind the head
        assert order == [] and pool.waiting() == 4 and pool.free_slots() == 3
        release(first)
        await until(lambda: "big" in order)
        await settle()
        assert order == ["big"]
        release(slots["big"])
    assert order == ["big", "small0", "small1", "small2"]
    assert [slots[f"small{i}"].index for i in range(3)] == [1, 2, 3]


@pytest.mark.anyio
async def test_cancelled_waiter_is_dequeued_and_next_proceeds():
    pool = BufferPool(200, n_slots=2)
    a, b = await pool.acquire(), await pool.acquire()
    got: list[PoolSlot] = []
    cancelled = anyio.Event()

    async def big(scope_box: list[anyio.CancelScope]) -> None:
        with anyio.CancelScope() as scope:
            scope_box.append(scope)
            await pool.acquire(2)
        cancelled.set()

    async def small() -> None:
        got.append(await pool.acquire(1))

    box: list[anyio.CancelScope] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(big, box)
        await settle()
        tg.start_soon(small)
        await settle()
        assert pool.waiting() == 2
        release(a)  # the head (span 2) cannot run yet; the span-1 waiter must not jump it
        await settle()
        assert got == []
        box[0].cancel()
        with anyio.fail_after(10):
            await cancelled.wait()
        await until(lambda: got)
    assert got[0].index == 1 and pool.waiting() == 0
    release(b)
    release(got[0])
    assert pool.free_slots() == 2


@pytest.mark.anyio
async def test_deadline_raises_quickly_and_leaks_nothing():
    pool = BufferPool(200, n_slots=2)
    held = await pool.acquire(2)
    t0 = time.monotonic()
    with anyio.fail_after(2):
        with pytest.raises(PoolAcquireTimeout) as err:
            await pool.acquire(1, deadline_ns=ms_from_now(50))
    elapsed = time.monotonic() - t0
    assert 0.045 <= elapsed < 1.0
    assert err.value.span == 1 and err.value.waited_ns >= 45_000_000
    assert str(err.value).startswith("buffer pool: no 1 contiguous free slot(s) within")
    assert pool.waiting() == 0 and pool.free_slots() == 0
    release(held)
    with anyio.fail_after(1):
        assert (await pool.acquire(2, deadline_ns=ms_from_now(50))).span == 2


@pytest.mark.anyio
async def test_expired_deadline_still_takes_free_slots():
    pool = BufferPool(200, n_slots=2)
    slot = await pool.acquire(1, deadline_ns=time.monotonic_ns() - 1)
    assert slot.index == 1
    with pytest.raises(PoolAcquireTimeout):
        await pool.acquire(2, deadline_ns=time.monotonic_ns() - 1)
    assert pool.waiting() == 0


@pytest.mark.anyio
async def test_timed_out_head_wakes_next():
    pool = BufferPool(200, n_slots=2)
    held = await pool.acquire(1)
    got: list[PoolSlot] = []
    errors: list[BaseException] = []

    async def big() -> None:
        try:
            await pool.acquire(2, deadline_ns=ms_from_now(40))
        except PoolAcquireTimeout as exc:
            errors.append(exc)

    async def small() -> None:
        got.append(await pool.acquire(1))

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(big)
            await settle()
            tg.start_soon(small)
    assert len(errors) == 1 and got[0].index == 2
    release(held)


@pytest.mark.anyio
async def test_no_overlapping_ranges_under_contention():
    pool = BufferPool(8 * 64, n_slots=8)
    rng = random.Random(7)
    live: dict[int, tuple[int, int]] = {}
    overlaps: list[str] = []
    served = 0

    async def worker(i: int) -> None:
        nonlocal served
        for _ in range(5):
            slot = await pool.acquire(rng.randint(1, 4))
            lo, hi = slot.offset, slot.offset + slot.capacity
            for other, (olo, ohi) in live.items():
                if lo < ohi and olo < hi:
                    overlaps.append(f"{i}:{lo}-{hi} vs {other}:{olo}-{ohi}")
            live[i] = (lo, hi)
            pool.view(lo, slot.capacity)[:] = bytes([i]) * slot.capacity
            await anyio.sleep(rng.random() / 1000)  # random holds: random interleavings
            assert bytes(pool.view(lo, slot.capacity)) == bytes([i]) * slot.capacity
            del live[i]
            release(slot)
            served += 1

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for i in range(30):
                tg.start_soon(worker, i)
    assert overlaps == []
    assert served == 150 and pool.free_slots() == 8 and pool.waiting() == 0


@pytest.mark.anyio
async def test_release_from_worker_thread_wakes_async_waiter():
    pool = BufferPool(200, n_slots=2)
    held = await pool.acquire(2)
    got: list[PoolSlot] = []

    async def want() -> None:
        got.append(await pool.acquire(1))

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(want)
            await settle()
            await anyio.to_thread.run_sync(release, held)
    assert got[0].index == 1


@pytest.mark.anyio
async def test_close_fails_waiters():
    pool = BufferPool(200, n_slots=2)
    await pool.acquire(2)
    errors: list[BaseException] = []

    async def want() -> None:
        try:
            await pool.acquire(1)
        except RuntimeError as exc:
            errors.append(exc)

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(want)
            await settle()
            pool.close()
    assert [str(e) for e in errors] == ["buffer pool 'kserve_trio_pool' is closed"]
    assert pool.waiting() == 0 and pool.closed
    with pytest.raises(RuntimeError, match="is closed"):
        pool.acquire_nowait()
    pool.close()  # idempotent


# -- plain threads -----------------------------------------------------------------------------


def test_blocking_acquire_from_threads():
    pool = BufferPool(6 * 32, n_slots=6)
    lock = threading.Lock()
    live: dict[int, tuple[int, int]] = {}
    overlaps: list[str] = []
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        rng = random.Random(i)
        try:
            for _ in range(20):
                slot = pool.acquire_blocking(rng.randint(1, 3))
                lo, hi = slot.offset, slot.offset + slot.capacity
                with lock:
                    overlaps.extend(
                        f"{lo}-{hi} vs {a}-{b}" for a, b in live.values() if lo < b and a < hi
                    )
                    live[i] = (lo, hi)
                time.sleep(rng.random() / 2000)  # random holds: random interleavings
                with lock:
                    del live[i]
                release(slot)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)
    assert errors == [] and overlaps == []
    assert pool.free_slots() == 6 and pool.waiting() == 0


def test_blocking_waiter_blocks_until_release_and_times_out():
    pool = BufferPool(200, n_slots=2)
    held = pool.acquire_blocking(2)
    t0 = time.monotonic()
    with pytest.raises(PoolAcquireTimeout) as err:
        pool.acquire_blocking(1, deadline_ns=ms_from_now(50))
    assert 0.045 <= time.monotonic() - t0 < 1.0
    assert err.value.span == 1 and pool.waiting() == 0
    got: list[PoolSlot] = []
    t = threading.Thread(target=lambda: got.append(pool.acquire_blocking(2)))
    t.start()
    wait_until(lambda: pool.waiting() == 1, what="the thread queued for two slots")
    assert got == []
    release(held)
    t.join(2)
    assert got and got[0].span == 2


@pytest.mark.anyio
async def test_blocking_and_async_waiters_share_one_fifo():
    pool = BufferPool(200, n_slots=2)
    held = await pool.acquire(2)
    order: list[str] = []

    def thread_big() -> None:
        slot = pool.acquire_blocking(2)
        order.append("thread")
        release(slot)

    async def task_small() -> None:
        slot = await pool.acquire(1)
        order.append("task")
        release(slot)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, thread_big)
            await until(lambda: pool.waiting() >= 1)
            tg.start_soon(task_small)
            await settle()
            assert pool.waiting() == 2
            release(held)
    assert order == ["thread", "task"]


# -- scratch and views -------------------------------------------------------------------------


def test_scratch_carves_typed_buffers_in_order():
    pool = BufferPool(4 * 256, n_slots=4)
    pool.acquire_nowait(1)
    slot = pool.acquire_nowait(2)
    feats, mask, flags, wide, half = scratch(
        slot,
        [
            ("INPUT__0", (3, 4), np.float32),
            ("MASK", 3, "int32"),
            ("FLAGS", (5,), np.bool_),
            ("WIDE", (2,), DType.F64),
            ("HALF", (2, 1), ml_dtypes.bfloat16),
        ],
    )
    assert isinstance(feats, ScratchBuffer)
    assert (feats.offset, feats.nbytes, feats.shape, feats.dtype) == (
        256,
        48,
        (3, 4),
        np.float32,
    )
    assert (mask.offset, mask.nbytes, mask.shape) == (304, 12, (3,))
    assert (flags.offset, flags.nbytes) == (316, 5)
    assert (wide.offset, wide.nbytes, wide.dtype) == (328, 16, np.float64)  # aligned up from 321
    assert (half.offset, half.nbytes, half.shape) == (344, 4, (2, 1))
    assert slot.cursor == 348 - 256
    assert all(d.region == "" for d in (feats, mask, flags, wide, half))
    one = scratch(slot, "EXTRA", (2,), np.int16)
    assert isinstance(one, ScratchBuffer) and (one.offset, one.name) == (348, "EXTRA")
    assert scratch_nbytes([((3, 4), np.float32), (3, np.int32)]) == 48 + 3 + 12 + 3


def test_scratch_overrun_carves_nothing():
    pool = BufferPool(128, n_slots=2)
    slot = pool.acquire_nowait(1)
    scratch(slot, "a", 10, np.uint8)
    with pytest.raises(ValueError) as err:
        scratch(slot, [("b", 4, np.int32), ("c", (4, 4), np.float32)])
    assert str(err.value) == (
        "scratch buffer 'c' (64 bytes of float32 (4, 4)) overruns the slot: 36 of 64 bytes left"
    )
    assert slot.cursor == 10
    with pytest.raises(ValueError, match="negative dimension"):
        scratch(slot, "d", (-1, 2), np.float32)
    with pytest.raises(TypeError, match="needs a shape and a dtype"):
        scratch(slot, "e")


def test_pool_view_writes_land_in_backing():
    pool = BufferPool(512, n_slots=2)
    slot = pool.acquire_nowait(1)
    descs = scratch(slot, [("x", (2, 3), np.float32), ("m", 4, np.int32)])
    x, m = pool_view(*descs)
    assert x.shape == (2, 3) and x.flags.writeable and x.flags.c_contiguous
    x[:] = np.arange(6, dtype=np.float32).reshape(2, 3)
    m[:] = [7, 8, 9, 10]
    raw = pool.view(slot.offset, 40)
    assert np.frombuffer(raw, np.float32, 6).tolist() == [0, 1, 2, 3, 4, 5]
    assert np.frombuffer(raw, np.int32, 4, offset=24).tolist() == [7, 8, 9, 10]
    single = pool_view(descs[1])
    assert isinstance(single, np.ndarray) and single.tolist() == [7, 8, 9, 10]
    empty = pool_view(scratch(slot, "z", (0, 3), np.float32))
    assert empty.shape == (0, 3)
    del raw
    pool.close()
    with pytest.raises(RuntimeError, match="is closed"):
        pool_view(descs[0])


# -- shm backing -------------------------------------------------------------------------------


def test_shm_pool_creates_and_unlinks_object():
    pool = BufferPool(4 * mmap.PAGESIZE, n_slots=4, use_shm=True, name="tpool")
    try:
        assert re.fullmatch(rf"/shm-tpool-{os.getpid()}-[0-9a-f]{{16}}", pool.key)
        assert pool.region_name == pool.key[1:]
        assert os.path.exists(f"/dev/shm/{pool.region_name}")
        slot = pool.acquire_nowait(1)
        arr = pool_view(scratch(slot, "v", 4, np.float32))
        arr[:] = [1.5, 2.5, 3.5, 4.5]
        # another process's view: the server registers the pool by key and reads the bytes
        reg = ShmRegistry()
        reg.register(pool.region_name, pool.key, 0, pool.nbytes)
        assert np.frombuffer(reg.read(pool.region_name, 0, 16), np.float32).tolist() == [
            1.5,
            2.5,
            3.5,
            4.5,
        ]
        reg.write(pool.region_name, 16, np.array([9], np.int32))
        assert np.frombuffer(pool.view(16, 4), np.int32)[0] == 9
        reg.close()
        del arr
    finally:
        pool.close()
    assert not os.path.exists(f"/dev/shm/{pool.region_name}")
    with pytest.raises(posix_ipc.ExistentialError):
        posix_ipc.SharedMemory(pool.key)
    with open("/proc/self/maps") as f:
        assert pool.region_name not in f.read()


def test_shm_pool_forgotten_is_unlinked_on_collection():
    import gc

    pool = BufferPool(4096, n_slots=1, use_shm=True, name="tgc")
    path = f"/dev/shm/{pool.region_name}"
    assert os.path.exists(path)
    del pool
    gc.collect()
    assert not os.path.exists(path)


def test_shm_pool_name_rules():
    with pytest.raises(ValueError) as err:
        BufferPool(4096, use_shm=True, name="a/b")
    assert str(err.value) == "shm buffer pool name 'a/b' must be non-empty without '/'"

"""The direct lane: a request that finds the dispatch loop idle, with a batch of known tiny
cost, runs in its own task on the event loop's thread; everything else goes through the loop to
the device thread.

The dispatch loop learns each (variant, batch size)'s execution cost (warmup seeds it). A batch
whose cost is at most ``KSERVE_TRIO_INLINE_EXEC_US`` may take the lane; 0 turns it off; a slow
model always runs on the device thread, and so do the batches the loop coalesces under load.
"""

from __future__ import annotations

import threading

import anyio
import numpy as np
import pytest

from kserve_trio.core.process.config import SchedulerConfig, SchedulingDiscipline
from kserve_trio.core.tensors.tensor import NamedTensor
from kserve_trio.worker.mock_backend import scale_model
from kserve_trio.worker.scheduler import Scheduler
from kserve_trio.worker.switches import INLINE_ENV
from tests.waiting import until

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request) -> str:
    return request.param


def recording(model, threads: list[str]):
    execute = model.execute

    def record(variant, batch_key, inputs):
        threads.append(threading.current_thread().name)
        return execute(variant, batch_key, inputs)

    model.execute = record
    return model


async def served_threads(monkeypatch, inline_us: str, delay: float = 0.0) -> list[str]:
    monkeypatch.setenv(INLINE_ENV, inline_us)
    threads: list[str] = []
    model = recording(scale_model(batch_sizes=(1, 4), delay=delay), threads)
    sched = Scheduler(SchedulerConfig(discipline=SchedulingDiscipline.FAIR))
    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        await sched.add_model(model)
        try:
            threads.clear()  # warmup ran on the device thread
            for i in range(5):
                x = np.full((1, 4), i, np.float32)
                out = await sched.infer("double", [NamedTensor.from_array("x", x)])
                np.testing.assert_array_equal(out[0].data, 2 * x)
        finally:
            await sched.stop()
    return threads


async def test_tiny_batches_run_on_the_loop_thread(monkeypatch):
    threads = await served_threads(monkeypatch, "5000")
    assert threads and set(threads) == {threading.current_thread().name}


async def test_zero_turns_inline_execution_off(monkeypatch):
    threads = await served_threads(monkeypatch, "0")
    assert threads and set(threads) == {"kserve-trio-device"}


async def test_a_slow_model_stays_on_the_device_thread(monkeypatch):
    threads = await served_threads(monkeypatch, "200", delay=0.002)
    assert threads and set(threads) == {"kserve-trio-device"}


async def test_an_idle_loop_lets_a_tiny_request_run_in_its_own_task(monkeypatch):
    """The direct lane: with nothing queued and the loop parked, a tiny request runs in the
    caller's task (no hand-over to the loop). While the loop is busy (here: a slow model's
    batch on the device thread) requests queue for it as before and it coalesces them."""
    monkeypatch.setenv(INLINE_ENV, "5000")
    threads: list[str] = []
    tiny = recording(scale_model(batch_sizes=(1, 4)), threads)
    slow = scale_model("slow", batch_sizes=(1,), delay=0.2)
    sched = Scheduler(SchedulerConfig(discipline=SchedulingDiscipline.FAIR))

    async def double(i: int) -> np.ndarray:
        x = np.full((1, 4), i, np.float32)
        return (await sched.infer("double", [NamedTensor.from_array("x", x)]))[0].data

    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        await sched.add_model(tiny)
        await sched.add_model(slow)
        loop = sched._loop
        try:
            threads.clear()
            for i in range(5):
                np.testing.assert_array_equal(await double(i), np.full((1, 4), 2 * i))
            assert loop.direct_batches == 5
            assert set(threads) == {threading.current_thread().name}

            results: dict[int, np.ndarray] = {}
            calls_before = len(tiny.calls)

            async def one(i: int) -> None:
                results[i] = await double(i)

            async with anyio.create_task_group() as burst:
                x = NamedTensor.from_array("x", np.ones((1, 4), np.float32))
                burst.start_soon(sched.infer, "slow", [x])
                await until(lambda: loop._inflight, what="the slow batch on the device thread")
                for i in range(4):
                    burst.start_soon(one, i)
            assert sorted(results) == [0, 1, 2, 3]
            for i, y in results.items():
                np.testing.assert_array_equal(y, np.full((1, 4), 2 * i))
            assert loop.direct_batches == 5  # none of the four took the lane
            assert [c.batch_key for c in tiny.calls[calls_before:]] == [4]  # one batch of 4
            assert threads[-1] == "kserve-trio-device"  # the loop's batches: the device thread
        finally:
            await sched.stop()

"""The device thread's hand-back to the event loop, on asyncio and trio, both ways it can be
made (``post``: queue the result, wake the loop, go on; ``block``: wait until the loop ran the
wake-up): results, a call that raises, a caller cancelled while its job runs, shutdown with
jobs queued, results finished while the loop was busy (one wake-up for all of them), and a
loop that ends before the job does.
"""

from __future__ import annotations

import threading
import time
from typing import cast

import anyio
import anyio.to_thread
import pytest

from kserve_trio.worker.device import DeviceThread, _Job
from kserve_trio.worker.switches import HANDBACKS
from tests.waiting import until

pytestmark = pytest.mark.anyio

WAIT = 10.0  # how long a condition may take to be seen on a loaded machine


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request) -> str:
    return request.param


@pytest.fixture(params=HANDBACKS)
def handback(request) -> str:
    return request.param


async def test_results_come_back_from_the_device_thread(handback):
    device = DeviceThread(handback)
    try:
        names = [
            await device.call(lambda i=i: (i, threading.current_thread().name)) for i in range(20)
        ]
    finally:
        await device.close()
    assert names == [(i, "kserve-trio-device") for i in range(20)]


async def test_a_job_that_raises_raises_in_the_caller_and_the_thread_goes_on(handback):
    def fails():
        raise ValueError("the device said no")

    device = DeviceThread(handback)
    try:
        with pytest.raises(ValueError, match="the device said no"):
            await device.call(fails)
        assert await device.call(lambda: 7) == 7
    finally:
        await device.close()


async def test_a_caller_cancelled_while_its_job_runs_waits_for_the_job(handback):
    started, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def job():
        started.set()
        release.wait(WAIT)
        ran.append("done")
        return "result"

    device = DeviceThread(handback)
    got: list[str] = []
    try:
        async with anyio.create_task_group() as tg:

            async def caller(scope: anyio.CancelScope) -> None:
                with scope:
                    got.append(await device.call(job))
                    await anyio.sleep(WAIT)  # the cancellation lands here, after the job

            scope = anyio.CancelScope()
            tg.start_soon(caller, scope)
            assert await anyio.to_thread.run_sync(started.wait, WAIT)
            scope.cancel()
            release.set()
        assert ran == ["done"] and got == ["result"]  # never abandoned half-way
        assert scope.cancelled_caught
        assert await device.call(lambda: "next") == "next"
    finally:
        release.set()
        await device.close()


async def test_close_runs_the_jobs_already_queued_then_ends_the_thread(handback):
    started, release = threading.Event(), threading.Event()
    device = DeviceThread(handback)
    results: list[int] = []

    def first() -> int:
        started.set()
        release.wait(WAIT)
        return 0

    async def run(fn) -> None:
        results.append(await device.call(fn))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, first)
        assert await anyio.to_thread.run_sync(started.wait, WAIT)  # the device is held
        for i in range(1, 4):
            tg.start_soon(run, lambda i=i: i)
        await until(lambda: device._jobs.qsize() >= 3)  # (trio starts tasks in no fixed order)
        tg.start_soon(device.close)
        release.set()
    assert sorted(results) == [0, 1, 2, 3]
    assert not device._thread.is_alive()


async def test_jobs_finished_while_the_loop_was_busy_come_back_with_one_wake_up():
    device = DeviceThread("post")
    posts: list[object] = []
    post = device._post

    def counting_post(callback):
        posts.append(callback)
        post(callback)

    device._post = counting_post
    gate = threading.Event()
    results: list[int] = []
    try:
        async with anyio.create_task_group() as tg:

            async def one(i: int) -> None:
                results.append(await device.call(lambda: (gate.wait(WAIT), i)[1]))

            for i in range(5):
                tg.start_soon(one, i)
            await until(lambda: device._jobs.qsize() >= 4)  # all five handed over (one running)
            # Hold the loop's thread while the device thread finishes all five: none of their
            # wake-ups can run meanwhile, so the first one posted carries them all.
            gate.set()
            deadline = time.monotonic() + WAIT
            while len(device._finished) < 5 and time.monotonic() < deadline:
                time.sleep(0.001)
            assert len(device._finished) == 5
    finally:
        await device.close()
    assert sorted(results) == list(range(5))
    assert len(posts) == 1


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_job_finishing_after_its_loop_ended_leaves_the_thread_serving(handback, backend):
    """The loop is gone when the job ends (a worker torn down around a hung device call): the
    hand-back finds nobody to wake, and the thread still takes its next job and its stop."""
    release, handed_back = threading.Event(), threading.Event()
    box: dict[str, DeviceThread] = {}

    async def main() -> None:
        device = box["device"] = DeviceThread(handback)
        device._jobs.put(_raw_job(lambda: release.wait(WAIT)))

    anyio.run(main, backend=backend)
    device = box["device"]
    release.set()
    device._jobs.put(_raw_job(handed_back.set))
    assert handed_back.wait(WAIT)
    device._jobs.put(None)
    device._thread.join(WAIT)
    assert not device._thread.is_alive()


def _raw_job(fn) -> _Job:
    """A job put on the queue without a waiting caller (its event belongs to no live loop)."""
    return cast(_Job, _RawJob(fn))


class _RawJob:
    def __init__(self, fn) -> None:
        self.fn, self.args = fn, ()
        self.result = self.error = None
        self.event = _NoLoopEvent()


class _NoLoopEvent:
    def set(self) -> None:  # pragma: no cover - only reached if the loop were still alive
        pass

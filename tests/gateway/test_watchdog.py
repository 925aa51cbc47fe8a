"""The wedge rule: only the gateway's own event loop stalling is a wedge (``watchdog``)."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from kserve_trio.gateway.watchdog import (
    MIN_LIMIT_SECONDS,
    LoopWatchdog,
    StallTracker,
    wedge_limit,
)


def test_a_stall_counts_only_while_the_checks_run_and_no_beat_comes():
    t = StallTracker(limit=10.0)
    assert not t.observe(0.0, 1)
    assert not t.observe(1.0, 2)  # a beat: no stall
    assert [t.observe(1.0 + i, 2) for i in range(1, 10)] == [False] * 9
    assert t.stalled == 9.0
    assert not t.observe(10.5, 3)  # a beat ends the stall
    assert t.stalled == 0.0
    for i in range(1, 5):
        t.observe(10.5 + i, 3)
    assert not t.observe(30.0, 3)  # a paused process: a gap over half the limit
    assert t.stalled == 0.0
    assert [t.observe(30.0 + i, 3) for i in range(1, 11)] == [False] * 9 + [True]  # wedged


def test_the_limit_is_rounds_of_intervals_never_under_the_floor_and_zero_is_off():
    assert wedge_limit(3, 10.0) == 30.0
    assert wedge_limit(3, 1.0) == MIN_LIMIT_SECONDS
    assert wedge_limit(0, 10.0) == 0.0


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_blocked_loop_is_reported_by_the_thread_and_a_beating_one_never(anyio_backend):
    wedged = threading.Event()
    watchdog = LoopWatchdog(2.0, on_wedge=lambda stalled: wedged.set(), period=0.02)
    async with anyio.create_task_group() as tg:
        await tg.start(watchdog.run)
        beats = watchdog.beats
        with anyio.fail_after(30):
            while watchdog.beats < beats + 5:  # a loop that runs keeps beating
                await anyio.sleep(0.02)
        assert not wedged.is_set()
        deadline = time.monotonic() + 30
        while not wedged.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)  # the loop held up: no beat while the thread keeps checking
        assert wedged.is_set()
        tg.cancel_scope.cancel()

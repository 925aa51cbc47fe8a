"""The idle trim (``serving.process_tuning``): a server process gives its freed heap back once
per quiet period, never while requests flow. The rules run on an injected clock, count and
resident size; the async shell on trio's ``MockClock`` with a recording trim."""

from __future__ import annotations

import threading

import anyio
import pytest
import trio.testing

from kserve_trio.serving.process_tuning import (
    IDLE_SECONDS,
    IdleTrim,
    malloc_trim,
    resident_bytes,
    run_idle_trim,
)

MiB = 1 << 20


class Process:
    """What the rules read: a clock, the served count and the resident size, all moved by the
    test."""

    def __init__(self) -> None:
        self.now = 0.0
        self.served = 0
        self.resident = 100 * MiB

    def rules(self) -> IdleTrim:
        return IdleTrim(lambda: self.served, clock=lambda: self.now, resident=lambda: self.resident)

    def ticks(self, rules: IdleTrim, seconds: float, *, serving: bool = False) -> list[float]:
        """One tick a second for ``seconds``, a request served before each when ``serving``;
        the times at which a trim was due."""
        due = []
        for _ in range(int(seconds)):
            self.now += 1.0
            if serving:
                self.served += 1
            if rules.due():
                due.append(self.now)
                rules.trimmed()
        return due


def test_the_trim_runs_once_per_quiet_period_and_never_while_requests_flow():
    p = Process()
    rules = p.rules()
    assert p.ticks(rules, 60, serving=True) == []  # a minute of traffic: never
    busy_until = p.now
    assert p.ticks(rules, 60) == [busy_until + IDLE_SECONDS]  # then once, after the quiet time
    p.served += 1  # one request ends the quiet period; the next tick sees it
    seen_at = p.now + 1
    assert p.ticks(rules, 60) == [seen_at + IDLE_SECONDS]


def test_a_pause_shorter_than_the_quiet_time_does_not_trim():
    p = Process()
    rules = p.rules()
    for _ in range(10):
        assert p.ticks(rules, 5, serving=True) == []
        assert p.ticks(rules, IDLE_SECONDS - 1) == []


def test_a_process_starts_armed_and_trims_once_after_start_up():
    p = Process()
    rules = p.rules()
    assert p.ticks(rules, 30) == [IDLE_SECONDS]


def test_resident_growth_with_nothing_served_counts_as_activity():
    """An attack refused before admission serves nothing and grows the heap: the quiet time
    restarts with each step of growth, and one trim follows once it stops."""
    p = Process()
    rules = p.rules()
    assert p.ticks(rules, 30) == [IDLE_SECONDS]
    start = p.now
    for _ in range(8):  # 8 x 20 MiB, one step every 2 s
        p.resident += 20 * MiB
        assert p.ticks(rules, 2) == []
    grown_until = p.now
    assert grown_until > start
    p.resident -= 150 * MiB  # what the trim gives back (the rules read it after the trim)
    due = p.ticks(rules, 30)
    assert len(due) == 1 and grown_until < due[0] <= grown_until + IDLE_SECONDS
    p.resident += 10 * MiB  # less than the regrowth step: nothing to give back
    assert p.ticks(rules, 30) == []


@pytest.fixture()
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


@pytest.fixture()
def anyio_backend(clock: trio.testing.MockClock):
    """trio on a clock that jumps to the next timer whenever every task waits."""
    return ("trio", {"clock": clock})


@pytest.mark.anyio
async def test_the_shell_trims_off_the_event_loop_once_traffic_stops():
    served = 0
    trims: list[int] = []
    trimmed = anyio.Event()

    def trim() -> None:
        trims.append(threading.get_ident())
        anyio.from_thread.run_sync(trimmed.set)

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: run_idle_trim(lambda: served, trim=trim, resident=lambda: 0))
        start = anyio.current_time()
        while anyio.current_time() - start < 60:  # a request every half second for a minute
            served += 1
            await anyio.sleep(0.5)
        assert trims == []
        stopped = anyio.current_time()
        await trimmed.wait()  # no other timer: the clock stands still while the thread runs
        assert stopped + IDLE_SECONDS - 1 <= anyio.current_time() <= stopped + IDLE_SECONDS + 1
        assert trims == [trims[0]] and trims[0] != threading.get_ident()  # a worker thread
        await anyio.sleep(60)
        assert len(trims) == 1
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_the_shell_returns_at_once_with_the_tuning_off(monkeypatch):
    monkeypatch.setenv("KSERVE_TRIO_MALLOC_TUNING", "0")
    with anyio.fail_after(1):
        await run_idle_trim(lambda: 0)


def test_malloc_trim_and_the_resident_size_on_linux_glibc():
    trim = malloc_trim()
    assert trim is not None, "this suite runs on Linux with glibc"
    assert trim() in (0, 1)
    assert resident_bytes() > 10 * MiB

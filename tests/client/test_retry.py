"""``RetryPolicy`` and ``call_with_retry``, with a fake clock; on asyncio and trio."""

from __future__ import annotations

import time

import anyio
import pytest

from kserve_trio.client import RetryPolicy, RpcError
from kserve_trio.client.retry import call_with_retry
from kserve_trio.core.errors import StatusCode

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def shed(message: str = "server is at its concurrency cap") -> RpcError:
    return RpcError(StatusCode.RESOURCE_EXHAUSTED, message, method="ModelInfer")


class Flaky:
    """Fails with ``errors`` in order, then returns "ok"; records each attempt's budget and
    spends ``cost`` seconds of the fake clock per attempt."""

    def __init__(self, clock: Clock, errors, cost: float = 0.0) -> None:
        self.clock = clock
        self.errors = list(errors)
        self.cost = cost
        self.budgets: list[float | None] = []

    async def __call__(self, budget):
        self.budgets.append(budget)
        self.clock.now += self.cost
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


async def run(flaky, policy, deadline, clock, rand=lambda: 1.0):
    return await call_with_retry(flaky, policy, deadline, clock=clock, sleep=clock.sleep, rand=rand)


async def test_succeeds_after_two_sheds_with_strictly_decreasing_budgets():
    clock = Clock()
    flaky = Flaky(clock, [shed(), shed()], cost=0.1)
    assert await run(flaky, RetryPolicy(jitter=False), 10.0, clock) == "ok"
    assert flaky.budgets[0] == pytest.approx(10.0)
    assert flaky.budgets[0] > flaky.budgets[1] > flaky.budgets[2]
    assert clock.sleeps == [1.0, 2.0]  # exponential: initial_backoff, then x factor
    assert flaky.budgets[2] == pytest.approx(10.0 - 0.1 - 1.0 - 0.1 - 2.0)


async def test_backoff_is_capped_and_fully_jittered():
    clock = Clock()
    flaky = Flaky(clock, [shed()] * 4)
    draws = iter([0.5, 0.25, 1.0, 0.1])
    policy = RetryPolicy(initial_backoff=1.0, factor=3.0, max_backoff=4.0)
    assert await run(flaky, policy, 100.0, clock, rand=lambda: next(draws)) == "ok"
    assert clock.sleeps == [0.5, 0.75, 4.0, 0.4]  # min(backoff, 4) * rand()


async def test_persistent_shedding_surfaces_resource_exhausted_within_the_budget():
    clock = Clock()
    flaky = Flaky(clock, [shed()] * 100, cost=0.01)
    with pytest.raises(RpcError) as info:
        await run(flaky, RetryPolicy(jitter=False), 5.0, clock)
    assert info.value.status is StatusCode.RESOURCE_EXHAUSTED
    assert clock.now - 100.0 <= 5.0
    assert clock.sleeps == [1.0, 2.0]  # a 4 s wait would end past 5 - min_budget
    assert info.value.__notes__[0].startswith("gave up after 3 attempt(s)")


async def test_persistent_shedding_in_real_time_never_sleeps_past_the_deadline():
    """On the real clock and the real sleep: each wait, from the clock reading it was decided
    on, ends within the budget (how late a loaded machine wakes the sleeper is not the rule's)."""
    readings: list[float] = []
    waits: list[tuple[float, float]] = []  # (the last clock reading, the wait decided on it)

    def clock() -> float:
        readings.append(time.monotonic())
        return readings[-1]

    async def sleep(seconds: float) -> None:
        waits.append((readings[-1], seconds))
        await anyio.sleep(seconds)

    async def always(budget):
        raise shed()

    started = time.monotonic()
    with pytest.raises(RpcError) as info:
        await call_with_retry(
            always, RetryPolicy(initial_backoff=0.05), 0.5, clock=clock, sleep=sleep
        )
    assert info.value.status is StatusCode.RESOURCE_EXHAUSTED
    assert waits  # it did retry
    assert all(read + wait < readings[0] + 0.5 for read, wait in waits), (readings[0], waits)
    assert time.monotonic() - started < 0.5 + 10  # and gave up: no hang


@pytest.mark.parametrize(
    "status",
    [
        StatusCode.DEADLINE_EXCEEDED,
        StatusCode.NOT_FOUND,
        StatusCode.INVALID_ARGUMENT,
        StatusCode.INTERNAL,
        StatusCode.FAILED_PRECONDITION,
    ],
)
async def test_fail_fast_codes_make_one_attempt(status):
    clock = Clock()
    flaky = Flaky(clock, [RpcError(status, "no")])
    with pytest.raises(RpcError) as info:
        await run(flaky, RetryPolicy(), 10.0, clock)
    assert info.value.status is status
    assert len(flaky.budgets) == 1 and clock.sleeps == []


async def test_non_grpc_errors_propagate_at_once():
    clock = Clock()
    flaky = Flaky(clock, [KeyError("x")])
    with pytest.raises(KeyError):
        await run(flaky, RetryPolicy(), 10.0, clock)
    assert len(flaky.budgets) == 1


async def test_unavailable_is_retried_only_when_enabled():
    clock = Clock()
    unavailable = RpcError(StatusCode.UNAVAILABLE, "no replica")
    flaky = Flaky(clock, [unavailable])
    assert await run(flaky, RetryPolicy(jitter=False), 10.0, clock) == "ok"
    assert len(flaky.budgets) == 2
    flaky = Flaky(clock, [unavailable])
    with pytest.raises(RpcError, match="no replica"):
        await run(flaky, RetryPolicy(retry_unavailable=False), 10.0, clock)
    assert len(flaky.budgets) == 1


async def test_oversized_messages_are_never_retried():
    clock = Clock()
    for err in (
        shed("received message larger than max (10 vs. 5)"),
        RpcError(StatusCode.RESOURCE_EXHAUSTED, "local", retryable=False),
    ):
        flaky = Flaky(clock, [err])
        with pytest.raises(RpcError):
            await run(flaky, RetryPolicy(), 10.0, clock)
        assert len(flaky.budgets) == 1


async def test_disabled_policy_or_no_deadline_is_one_attempt():
    clock = Clock()
    flaky = Flaky(clock, [shed()])
    with pytest.raises(RpcError):
        await run(flaky, RetryPolicy(enabled=False), 10.0, clock)
    assert flaky.budgets == [10.0]
    flaky = Flaky(clock, [shed()])
    with pytest.raises(RpcError):
        await run(flaky, RetryPolicy(), 0.0, clock)
    assert flaky.budgets == [None]


def test_policy_validation():
    with pytest.raises(ValueError, match=r"RetryPolicy\.factor must be >= 1, got 0.5"):
        RetryPolicy(factor=0.5)
    with pytest.raises(ValueError, match=r"RetryPolicy\.initial_backoff must be >= 0, got -1"):
        RetryPolicy(initial_backoff=-1)
    with pytest.raises(ValueError, match=r"RetryPolicy\.min_budget must be >= 0"):
        RetryPolicy(min_budget=-0.1)


async def test_real_sleep_is_anyio_sleep():
    attempts = []

    async def flaky(budget):
        attempts.append(budget)
        if len(attempts) < 3:
            raise shed()
        return 7

    with anyio.fail_after(2):
        assert await call_with_retry(flaky, RetryPolicy(initial_backoff=0.01), 1.0) == 7
    assert attempts[0] > attempts[1] > attempts[2]

"""The liveness watch (``serving.liveness``): a process is declared stuck only after the given
number of probes in a row went unanswered within their interval; any answer starts the count
again. Run on trio's ``MockClock`` with scripted probes."""

from __future__ import annotations

import anyio
import pytest
import trio.testing

from kserve_trio.serving.liveness import watch_liveness


@pytest.fixture()
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


@pytest.fixture()
def anyio_backend(clock: trio.testing.MockClock):
    """trio on a clock that jumps to the next timer whenever every task waits."""
    return ("trio", {"clock": clock})


def scripted(answers: list[str]):
    """A probe answering as scripted, one entry per probe: ``ok`` at once, ``no`` (False) at
    once, ``hang`` never; past the script it hangs."""
    calls: list[float] = []

    async def probe() -> bool:
        calls.append(anyio.current_time())
        answer = answers[len(calls) - 1] if len(calls) <= len(answers) else "hang"
        if answer == "hang":
            await anyio.sleep_forever()
        return answer == "ok"

    return probe, calls


@pytest.mark.anyio
async def test_a_process_that_never_answers_is_stuck_after_the_misses_in_a_row():
    probe, calls = scripted([])
    start = anyio.current_time()
    await watch_liveness(probe, interval=1.0, misses=3)
    assert anyio.current_time() - start == pytest.approx(3.0)
    assert [t - start for t in calls] == pytest.approx([0.0, 1.0, 2.0])


@pytest.mark.anyio
async def test_an_answer_starts_the_count_again_and_a_refusal_is_a_miss():
    probe, calls = scripted(["hang", "hang", "ok", "no", "hang", "ok", "ok"])
    start = anyio.current_time()
    await watch_liveness(probe, interval=0.5, misses=3)
    # misses: 1, 2, reset, 1, 2, reset, reset, then 1, 2, 3 (past the script: hangs)
    assert len(calls) == 10
    assert anyio.current_time() - start == pytest.approx(5.0)


@pytest.mark.anyio
async def test_zero_misses_never_ends_the_watch():
    probe, calls = scripted([])
    with anyio.move_on_after(3600) as scope:
        await watch_liveness(probe, interval=1.0, misses=0)
    assert scope.cancelled_caught and calls == []

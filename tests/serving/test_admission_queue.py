"""The admission queue (``serving.admission``: *bounded queue* and *arrival order*): waiters in
arrival order, a bound, deadlines, cancellation and drain."""

from __future__ import annotations

import anyio
import pytest

from kserve_trio.core.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from kserve_trio.serving.admission import WAITED_TOO_LONG, Admission

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


def capped(cap: int, queue: int) -> Admission:
    return Admission(
        lambda: cap,
        shutting_down="down",
        over_cap=lambda c: f"cap {c}",
        queue=lambda: queue,
        over_queue=lambda c, q: f"cap {c}, queue {q} full",
    )


async def test_waiters_get_freed_slots_in_arrival_order_and_the_queue_is_bounded():
    adm = capped(1, 2)
    await adm.queue_inference(None)
    order: list[int] = []

    async def waiter(i: int) -> None:
        await adm.queue_inference(None)
        order.append(i)

    async with anyio.create_task_group() as tg:
        for i in range(2):
            tg.start_soon(waiter, i)
            with anyio.fail_after(10):
                while adm.waiting < i + 1:
                    await anyio.sleep(0)
        with pytest.raises(ResourceExhausted, match=r"^cap 1, queue 2 full$"):
            await adm.queue_inference(None)  # beyond the queue: shed
        with pytest.raises(ResourceExhausted, match=r"^cap 1$"):
            adm.admit_inference()  # never overtakes the waiters
        adm.release_inference()
        with anyio.fail_after(10):
            while not order:
                await anyio.sleep(0)
        assert order == [0] and adm.inflight == 1
        adm.release_inference()
    assert order == [0, 1] and adm.inflight == 1 and adm.waiting == 0 and adm.shed == 2


async def test_a_deadline_passing_in_the_queue_is_deadline_exceeded():
    adm = capped(1, 4)
    adm.admit_inference()
    with pytest.raises(DeadlineExceeded, match=WAITED_TOO_LONG):
        await adm.queue_inference(anyio.current_time() + 0.05)
    assert adm.waiting == 0 and adm.inflight == 1
    adm.release_inference()
    await adm.queue_inference(anyio.current_time() + 0.05)  # a free slot: admitted at once
    assert adm.inflight == 1


async def test_a_cancelled_waiter_leaves_the_queue_and_the_slot_goes_on():
    adm = capped(1, 1)
    adm.admit_inference()
    async with anyio.create_task_group() as tg:
        tg.start_soon(adm.queue_inference, None)
        with anyio.fail_after(10):
            while adm.waiting < 1:
                await anyio.sleep(0)
        tg.cancel_scope.cancel()
    assert adm.waiting == 0
    adm.release_inference()
    assert adm.inflight == 0  # nobody was left in line to hand the slot to
    await adm.queue_inference(None)
    assert adm.inflight == 1


async def test_the_drain_wakes_every_waiter_unavailable():
    adm = capped(1, 4)
    adm.admit_inference()
    errors: list[BaseException] = []

    async def waiter() -> None:
        try:
            await adm.queue_inference(None)
        except Unavailable as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(waiter)
        with anyio.fail_after(10):
            while adm.waiting < 3:
                await anyio.sleep(0)
        adm.start_drain()
    assert len(errors) == 3 and adm.waiting == 0 and adm.inflight == 1

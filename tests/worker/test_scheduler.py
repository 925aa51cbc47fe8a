"""The dispatch engine end to end on the numpy mock: coalescing, limits, deadlines, lifecycle."""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import numpy as np
import pytest
from trio.testing import MockClock

from kserve_trio.core.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kserve_trio.core.process.config import ModelSchedConfig, SchedulerConfig, SchedulingDiscipline
from kserve_trio.core.tensors.tensor import NamedTensor
from kserve_trio.worker.mock_backend import MockModel, mock_manifest, scale_model, tensor
from kserve_trio.worker.scheduler import Scheduler
from tests.waiting import until

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def config(**kw: Any) -> SchedulerConfig:
    kw.setdefault("discipline", SchedulingDiscipline.FIFO)
    return SchedulerConfig(**kw)


def xs(rows: int, start: float = 0.0, features: int = 4, name: str = "x") -> NamedTensor:
    data = (np.arange(rows * features, dtype=np.float32) + start).reshape(rows, features)
    return NamedTensor.from_array(name, data)


@asynccontextmanager
async def serving(*models: MockModel, cfg: SchedulerConfig | None = None, **kw: Any):
    sched = Scheduler(cfg or config(), **kw)
    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        for m in models:
            await sched.add_model(m)
        try:
            yield sched
        finally:
            await sched.stop()


@asynccontextmanager
async def device_held(sched: Scheduler) -> AsyncIterator[None]:
    """Occupy the device thread so that requests queue up behind it."""
    gate, entered = threading.Event(), threading.Event()

    def block() -> None:
        entered.set()
        gate.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(sched.run_on_device, block)
        await until(entered.is_set)
        try:
            yield
        finally:
            gate.set()


async def collect(results: dict, key: Any, fn, *args: Any, **kw: Any) -> None:
    try:
        results[key] = await fn(*args, **kw)
    except Exception as exc:
        results[key] = exc


def depth(sched: Scheduler, name: str) -> int:
    return sched.scheduler_metrics()[name].queue_depth


# ----------------------------------------------------------------------------- coalescing


async def test_coalesces_four_single_rows_into_one_batch_4_dispatch():
    model = scale_model(batch_sizes=(1, 4, 8))
    async with serving(model) as sched:
        results: dict = {}
        async with anyio.create_task_group() as tg, device_held(sched):
            for i in range(4):
                tg.start_soon(collect, results, i, sched.infer, "double", [xs(1, start=10 * i)])
            await until(lambda: depth(sched, "double") == 4)
        assert [(c.batch_key, c.shapes) for c in model.calls] == [(4, ((4, 4),))]
        for i in range(4):
            (y,) = results[i]
            assert y.name == "y" and y.shape == (1, 4)
            np.testing.assert_array_equal(y.data, xs(1, start=10 * i).data * 2)
        m = sched.scheduler_metrics()["double"]
        assert m.batch_size_hist == {4: 1}
        assert (m.dispatch_count, m.requests_served, m.rows_served) == (1, 4, 4)


async def test_pads_a_one_row_request_to_4_and_drops_the_padding():
    model = scale_model(batch_sizes=(4, 8))
    async with serving(model) as sched:
        (y,) = await sched.infer("double", [xs(1, start=3)])
    assert model.calls[0].batch_key == 4 and model.calls[0].shapes == ((4, 4),)
    assert y.shape == (1, 4)
    np.testing.assert_array_equal(y.data, [[6, 8, 10, 12]])


async def test_no_cross_talk_between_64_concurrent_distinct_requests():
    model = scale_model(batch_sizes=(1, 4, 8), delay=0.002)
    rng = np.random.default_rng(0)
    sent = {i: xs(int(rng.integers(1, 4)), start=1000.0 * i) for i in range(64)}
    async with serving(model) as sched:
        results: dict = {}
        async with anyio.create_task_group() as tg:
            for i, t in sent.items():
                tg.start_soon(collect, results, i, sched.infer, "double", [t])
        m = sched.scheduler_metrics()["double"]
    for i, t in sent.items():
        (y,) = results[i]
        np.testing.assert_array_equal(y.data, t.data * 2)
    assert m.requests_served == 64
    assert m.rows_served == sum(t.shape[0] for t in sent.values())
    assert m.dispatch_count < 64  # some dispatches coalesced several requests


async def test_max_batch_size_caps_coalescing_but_still_pads_to_a_compiled_size():
    model = scale_model(batch_sizes=(4, 8))
    cfg = config(models={"double": ModelSchedConfig(max_batch_size=2)})
    async with serving(model, cfg=cfg) as sched:
        async with anyio.create_task_group() as tg, device_held(sched):
            for i in range(4):
                tg.start_soon(sched.infer, "double", [xs(1, start=i)])
            await until(lambda: depth(sched, "double") == 4)
        m = sched.scheduler_metrics()["double"]
    assert [c.batch_key for c in model.calls] == [4, 4]
    assert (m.dispatch_count, m.rows_served, m.max_batch_size) == (2, 4, 2)


async def test_per_input_batch_axes_concatenate_and_slice_along_their_own_axis():
    # x: manifest "cn" = wire (n, c), batch axis 0; z: manifest "nc" = wire (c, n), batch axis 1.
    manifest = mock_manifest(
        "pair",
        [tensor("x", "f32", "cn", c=2), tensor("z", "f32", "nc", c=2)],
        [tensor("y", "f32", "cn", c=2), tensor("w", "f32", "nc", c=2)],
        batch_sizes=(4,),
    )
    model = MockModel(manifest, lambda x, z: [x + z.T, (x * 10).T])
    async with serving(model) as sched:
        results: dict = {}
        async with anyio.create_task_group() as tg, device_held(sched):
            for i, rows in enumerate((1, 2)):
                x = np.full((rows, 2), i + 1, np.float32)
                z = np.full((2, rows), 100 * (i + 1), np.float32)
                inputs = [NamedTensor.from_array("x", x), NamedTensor.from_array("z", z)]
                tg.start_soon(collect, results, i, sched.infer, "pair", inputs)
            await until(lambda: depth(sched, "pair") == 2)
    assert model.calls[0].shapes == ((4, 2), (2, 4))
    y0, w0 = results[0]
    y1, w1 = results[1]
    np.testing.assert_array_equal(y0.data, [[101, 101]])
    np.testing.assert_array_equal(y1.data, [[202, 202], [202, 202]])
    assert w0.shape == (2, 1) and w1.shape == (2, 2)
    np.testing.assert_array_equal(w1.data, np.full((2, 2), 20))


async def test_variants_coalesce_separately_a_a_then_b():
    manifest = mock_manifest(
        "var",
        [tensor("x", "f32", "sn", s=-1)],
        [tensor("y", "f32", "sn", s=-1)],
        batch_sizes=(2,),
        input_shapes=[{"s": 3}, {"s": 5}],
    )
    model = MockModel(manifest, lambda x: x + 1)
    async with serving(model) as sched:
        results: dict = {}
        async with anyio.create_task_group() as tg, device_held(sched):
            for i, s in enumerate((3, 3, 5)):
                t = NamedTensor.from_array("x", np.full((1, s), i, np.float32))
                tg.start_soon(collect, results, i, sched.infer, "var", [t])
                await until(lambda i=i: depth(sched, "var") == i + 1)
        with pytest.raises(InvalidArgument) as err:
            await sched.infer("var", [NamedTensor.from_array("x", np.zeros((1, 4), np.float32))])
    assert [(c.variant, c.shapes) for c in model.calls] == [(0, ((2, 3),)), (1, ((2, 5),))]
    assert [results[i][0].data.tolist() for i in range(3)] == [
        [[1.0] * 3],
        [[2.0] * 3],
        [[3.0] * 5],
    ]
    assert (
        err.value.message
        == "no compiled program for input shape variant [4] (have [[3], [5]]) in model 'var'"
    )


async def test_unbatched_model_runs_one_request_per_dispatch_on_the_key_0_module():
    model = scale_model("plain", batched=False)
    async with serving(model) as sched:
        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(
                    sched.infer, "plain", [NamedTensor.from_array("x", np.full(4, i, np.float32))]
                )
        m = sched.scheduler_metrics()["plain"]
    assert (m.dispatch_count, m.requests_served, m.rows_served, m.max_batch_size) == (6, 6, 6, 0)
    assert {c.batch_key for c in model.calls} == {0}


# ----------------------------------------------------------------------------- admission


async def test_rows_above_the_largest_compiled_size_are_refused_before_enqueue():
    model = scale_model(batch_sizes=(1, 4, 8))
    async with serving(model) as sched:
        with pytest.raises(InvalidArgument) as err:
            sched.check_admissible("double", [xs(9)])
        assert err.value.message == "model 'double' accepts at most 8 rows per request (got 9)"
        with pytest.raises(InvalidArgument, match=r"accepts at most 8 rows per request \(got 9\)"):
            await sched.infer("double", [xs(9)])
        sched.check_admissible("double", [xs(8)])  # the largest size itself is fine
        with pytest.raises(NotFound) as nf:
            sched.check_admissible("nope", [xs(1)])
        assert nf.value.message == "unknown model: nope"
    assert model.executions == 0


async def test_a_non_coalescable_model_needs_an_exact_compiled_size():
    manifest = mock_manifest(
        "sum",
        [tensor("x", "f32", "cn", c=2)],
        [tensor("s", "f32", "c", c=2)],  # a reduction over rows: output has no batch axis
        batch_sizes=(4,),
    )
    model = MockModel(manifest, lambda x: x.sum(axis=0))
    async with serving(model) as sched:
        with pytest.raises(InvalidArgument) as err:
            sched.check_admissible("sum", [xs(3, features=2)])
        assert (
            err.value.message == "model 'sum' has no compiled program for batch size 3 (have [4])"
        )
        (s,) = await sched.infer("sum", [xs(4, features=2)])
    np.testing.assert_array_equal(s.data, [12, 16])


async def test_per_model_queue_cap_is_independent_per_model():
    a, b = scale_model("a"), scale_model("b")
    async with serving(a, b, cfg=config(max_queue_depth=2)) as sched:
        results: dict = {}
        async with anyio.create_task_group() as tg, device_held(sched):
            for i in range(2):
                tg.start_soon(collect, results, ("a", i), sched.infer, "a", [xs(1)])
            await until(lambda: depth(sched, "a") == 2)
            with pytest.raises(ResourceExhausted) as err:
                await sched.infer("a", [xs(1)])
            assert err.value.message == "queue for model 'a' is full (2); request rejected"
            for i in range(2):  # b still admits up to its own cap
                tg.start_soon(collect, results, ("b", i), sched.infer, "b", [xs(1)])
            await until(lambda: depth(sched, "b") == 2)
    assert all(isinstance(v, list) for v in results.values()) and len(results) == 4


async def test_deadline_already_passed_is_refused_at_admission():
    model = scale_model()
    async with serving(model) as sched:
        with pytest.raises(DeadlineExceeded) as err:
            await sched.infer("double", [xs(1)], deadline_ns=time.monotonic_ns() - 1)
    assert err.value.message == "deadline exceeded before dispatch for model 'double'"
    assert model.executions == 0


async def test_deadline_passing_while_queued_removes_the_request():
    model = scale_model()
    async with serving(model) as sched:
        async with device_held(sched):
            with pytest.raises(DeadlineExceeded) as err:
                await sched.infer("double", [xs(1)], deadline_ns=time.monotonic_ns() + 50_000_000)
            assert depth(sched, "double") == 0
    assert err.value.message == "deadline exceeded while queued for model 'double'"
    assert model.executions == 0


async def test_dispatch_timeout_while_queued_is_deadline_exceeded():
    model = scale_model()
    async with serving(model, cfg=config(dispatch_timeout_seconds=0.1)) as sched:
        async with device_held(sched):
            with pytest.raises(DeadlineExceeded) as err:
                await sched.infer("double", [xs(1)])
            assert depth(sched, "double") == 0
        (y,) = await sched.infer("double", [xs(1)])  # a fresh request is served
    assert err.value.message == "dispatch timeout (0.1s) exceeded while queued for model 'double'"
    assert model.executions == 1 and y.shape == (1, 4)


@pytest.mark.parametrize("anyio_backend", [("trio", {"clock": MockClock(autojump_threshold=0)})])
async def test_dispatch_timeout_while_running_lets_the_execution_finish_and_drops_the_result(
    anyio_backend,
):
    # trio's MockClock jumps to the next timer whenever every task waits: the 0.1 s timeout
    # always fires before the release 0.3 s later, however late a loaded machine runs either
    clock: MockClock = anyio_backend[1]["clock"]
    gate = threading.Event()
    model = scale_model(gate=gate)
    timeout = config(dispatch_timeout_seconds=0.1)
    async with serving(model, cfg=timeout, clock=lambda: int(clock.current_time() * 1e9)) as sched:
        released_at = 0.0

        async def release_later() -> None:
            nonlocal released_at
            await anyio.to_thread.run_sync(model.started.wait)
            await anyio.sleep(0.3)  # on the mock clock: well past the 0.1 s timeout
            released_at = anyio.current_time()
            gate.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(release_later)
            with pytest.raises(DeadlineExceeded) as err:
                await sched.infer("double", [xs(1)])
            raised_at = anyio.current_time()
    assert (
        err.value.message
        == "dispatch timeout (0.1s) exceeded while model 'double' was executing; result dropped"
    )
    assert model.executions == 1  # the execution ran to completion
    assert raised_at >= released_at  # never returned while the device still used the inputs


async def test_edf_sheds_a_request_its_learned_cost_cannot_finish_in_time():
    model = scale_model("slow", delay=0.1)
    async with serving(model, cfg=config(discipline=SchedulingDiscipline.EDF)) as sched:
        await sched.infer("slow", [xs(1)])  # learns a ~0.1 s cost for batch 1
        with pytest.raises(DeadlineExceeded) as err:
            await sched.infer("slow", [xs(1)], deadline_ns=time.monotonic_ns() + 30_000_000)
    # the estimate is what the first call measured: 0.1 s or more on a loaded machine
    assert err.value.message.startswith(
        "deadline for model 'slow' cannot be met (estimated compute "
    )
    assert model.executions == 1


# ----------------------------------------------------------------------------- cancellation


async def test_100_queued_requests_cancelled_before_dispatch_never_execute():
    model = scale_model()
    async with serving(model) as sched:
        async with device_held(sched):
            async with anyio.create_task_group() as tg:
                for i in range(100):
                    tg.start_soon(sched.infer, "double", [xs(1, start=i)])
                await until(lambda: depth(sched, "double") == 100)
                tg.cancel_scope.cancel()
            assert depth(sched, "double") == 0
        assert model.executions == 0
        (y,) = await sched.infer("double", [xs(1, start=1)])
    # one still queued would have run before this request or in its batch: none did
    assert model.executions == 1
    np.testing.assert_array_equal(y.data, xs(1, start=1).data * 2)


async def test_a_caller_cancelled_while_running_waits_for_the_execution_then_cancels():
    gate = threading.Event()
    model = scale_model(gate=gate)
    async with serving(model) as sched:
        async with anyio.create_task_group() as tg:
            tg.start_soon(sched.infer, "double", [xs(1)])
            await anyio.to_thread.run_sync(model.started.wait)
            tg.cancel_scope.cancel()
            threading.Timer(0.05, gate.set).start()
        assert gate.is_set()  # the task group only exited after the execution finished
        assert model.executions == 1


# ----------------------------------------------------------------------------- hooks


async def test_hooks_run_in_worker_threads_and_overlap():
    threads: list[str] = []
    # each preprocess waits for another to be running at the same time: hooks that ran one
    # after another would break the barrier at its timeout
    pairs = threading.Barrier(2, timeout=30)

    def pre(inputs: list[NamedTensor]) -> list[NamedTensor]:
        threads.append(threading.current_thread().name)
        pairs.wait()
        return [NamedTensor.from_array("x", inputs[0].data + 1)]

    def post(outputs: list[NamedTensor]) -> list[NamedTensor]:
        threads.append(threading.current_thread().name)
        return [NamedTensor.from_array("z", outputs[0].data - 1)]

    model = scale_model()
    sched = Scheduler(config())
    results: dict = {}
    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        await sched.add_model(model, preprocess=pre, postprocess=post)
        async with anyio.create_task_group() as inner:
            for i in range(8):
                inner.start_soon(collect, results, i, sched.infer, "double", [xs(1, start=i)])
        await sched.stop()
    main = threading.main_thread().name
    assert len(threads) == 16 and main not in threads and "kserve-trio-device" not in threads
    for i in range(8):
        (z,) = results[i]
        assert z.name == "z"
        np.testing.assert_array_equal(z.data, (xs(1, start=i).data + 1) * 2 - 1)


async def test_a_failing_preprocess_is_internal_and_never_queues():
    def pre(inputs):
        raise ValueError("nope")

    model = scale_model()
    sched = Scheduler(config())
    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        await sched.add_model(model, preprocess=pre)
        with pytest.raises(Internal) as err:
            await sched.infer("double", [xs(1)])
        await sched.stop()
    assert err.value.message == "preprocess of model 'double' failed: ValueError: nope"
    assert model.executions == 0


async def test_an_execution_failure_reaches_every_coalesced_request():
    model = scale_model("bad", batch_sizes=(4,), fail=RuntimeError("boom"))
    async with serving(model) as sched:
        results: dict = {}
        async with anyio.create_task_group() as tg, device_held(sched):
            for i in range(3):
                tg.start_soon(collect, results, i, sched.infer, "bad", [xs(1)])
            await until(lambda: depth(sched, "bad") == 3)
    assert len(model.calls) == 1
    for err in results.values():
        assert isinstance(err, Internal)
        assert err.message == "execution of model 'bad' failed: boom"


# ----------------------------------------------------------------------------- lifecycle


async def test_stop_rejects_queued_requests_and_run_returns():
    model = scale_model()
    sched = Scheduler(config())
    results: dict = {}
    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        await sched.add_model(model)
        async with anyio.create_task_group() as inner, device_held(sched):
            for i in range(3):
                inner.start_soon(collect, results, i, sched.infer, "double", [xs(1)])
            await until(lambda: depth(sched, "double") == 3)
            inner.start_soon(sched.stop)
            await until(lambda: len(results) == 3)
    # leaving the outer task group proves run() returned
    for err in results.values():
        assert isinstance(err, Unavailable) and err.message == "server is shutting down"
    assert model.executions == 0
    with pytest.raises(Unavailable, match="server is shutting down"):
        await sched.infer("double", [xs(1)])
    with pytest.raises(Unavailable, match="server is shutting down"):
        await sched.add_model(scale_model("other"))
    with pytest.raises(Unavailable, match="server is shutting down"):
        await sched.run_on_device(lambda: None)


async def test_infer_before_run_is_unavailable_and_stop_without_run_returns():
    sched = Scheduler(config())
    await sched.add_model(scale_model())
    with pytest.raises(Unavailable, match="scheduler is not running yet"):
        await sched.infer("double", [xs(1)])
    await sched.stop()
    with pytest.raises(Unavailable, match="server is shutting down"):
        await sched.infer("double", [xs(1)])


async def test_remove_model_answers_queued_requests_not_found():
    model = scale_model()
    async with serving(model) as sched:
        results: dict = {}
        async with anyio.create_task_group() as tg, device_held(sched):
            for i in range(2):
                tg.start_soon(collect, results, i, sched.infer, "double", [xs(1)])
            await until(lambda: depth(sched, "double") == 2)
            await sched.remove_model("double")
            await until(lambda: len(results) == 2)
        assert not sched.has_model("double") and sched.model_names() == []
        with pytest.raises(NotFound, match="unknown model: double"):
            await sched.infer("double", [xs(1)])
        with pytest.raises(NotFound, match="unknown model: double"):
            await sched.remove_model("double")
    for err in results.values():
        assert isinstance(err, NotFound) and err.message == "model 'double' was unloaded"
    assert model.executions == 0


async def test_remove_model_waits_for_its_running_execution():
    gate = threading.Event()
    model = scale_model(gate=gate)
    async with serving(model) as sched:
        results: dict = {}
        async with anyio.create_task_group() as tg:
            tg.start_soon(collect, results, 0, sched.infer, "double", [xs(1, start=1)])
            await anyio.to_thread.run_sync(model.started.wait)
            threading.Timer(0.05, gate.set).start()
            await sched.remove_model("double")
            assert gate.is_set() and model.executions == 1
    np.testing.assert_array_equal(results[0][0].data, xs(1, start=1).data * 2)


async def test_duplicate_add_is_refused():
    async with serving(scale_model()) as sched:
        with pytest.raises(FailedPrecondition, match="model 'double' is already loaded"):
            await sched.add_model(scale_model())


async def test_run_on_device_runs_on_the_device_thread_and_propagates_errors():
    model = scale_model()
    async with serving(model) as sched:
        assert await sched.run_on_device(
            lambda a, b: (a + b, threading.current_thread().name), 2, 3
        ) == (
            5,
            "kserve-trio-device",
        )

        def boom() -> None:
            raise KeyError("k")

        with pytest.raises(KeyError):
            await sched.run_on_device(boom)
        await sched.infer("double", [xs(1)])
    assert {c.thread for c in model.calls} == {"kserve-trio-device"}


async def test_one_execution_at_a_time_across_models():
    a, b = scale_model("a", delay=0.005), scale_model("b", delay=0.005)
    async with serving(a, b) as sched, anyio.create_task_group() as tg:
        for i in range(10):
            tg.start_soon(sched.infer, "a", [xs(1 + i % 3)])
            tg.start_soon(sched.infer, "b", [xs(1 + i % 2)])
    spans = sorted((c.started, c.ended) for c in a.calls + b.calls)
    assert all(prev[1] <= nxt[0] for prev, nxt in itertools.pairwise(spans))
    assert {c.thread for c in a.calls + b.calls} == {"kserve-trio-device"}


# ----------------------------------------------------------------------------- disciplines


def order_recorder(order: list[str], name: str) -> MockModel:
    return MockModel(
        mock_manifest(
            name, [tensor("x", "f32", "cn", c=4)], [tensor("y", "f32", "cn", c=4)], batch_sizes=(1,)
        ),
        lambda x: (order.append(name), x)[1],
    )


async def queue_then_release(sched: Scheduler, plan: list[tuple[str, int]]) -> None:
    """Queue one request per (model, deadline_ns) in order while the device is held."""
    async with anyio.create_task_group() as tg, device_held(sched):
        for n, (name, deadline) in enumerate(plan):
            tg.start_soon(functools.partial(sched.infer, name, [xs(1)], deadline_ns=deadline))
            await until(
                lambda n=n: sum(m.queue_depth for m in sched.scheduler_metrics().values()) == n + 1
            )


async def test_fifo_serves_the_oldest_front_first():
    order: list[str] = []
    a, b = order_recorder(order, "a"), order_recorder(order, "b")
    async with serving(a, b) as sched:
        await queue_then_release(sched, [("b", 0), ("a", 0), ("b", 0)])
    assert order == ["b", "a", "b"]


async def test_edf_serves_the_soonest_deadline_first():
    order: list[str] = []
    a, b = order_recorder(order, "a"), order_recorder(order, "b")
    far = time.monotonic_ns() + 60 * 10**9
    async with serving(a, b, cfg=config(discipline=SchedulingDiscipline.EDF)) as sched:
        await queue_then_release(sched, [("a", 0), ("b", far), ("a", far - 1)])
    # a holds the soonest deadline (its second request); coalescing stays FIFO within a queue
    assert order == ["a", "a", "b"]


async def test_set_policy_weight_steers_the_fair_discipline():
    order: list[str] = []
    a, b = order_recorder(order, "a"), order_recorder(order, "b")
    cfg = config(discipline=SchedulingDiscipline.FAIR, recency_penalty_cap=1.0)
    async with serving(a, b, cfg=cfg, warmup=False) as sched:
        with pytest.raises(NotFound, match="unknown model: nope"):
            sched.set_policy("nope", weight=2.0)
        with pytest.raises(InvalidArgument) as err:
            sched.set_policy("a", weight=0)
        assert err.value.message == "weight for model 'a' must be a positive number (got 0)"
        sched.set_policy("a", weight=3.0)
        assert sched.scheduler_metrics()["a"].weight == 3.0
        await queue_then_release(sched, [("b", 0), ("a", 0)])  # b is older; a is owed more
    assert order == ["a", "b"]


async def test_fair_warmup_seeds_the_cost_of_every_compiled_size():
    fair = scale_model("f", batch_sizes=(1, 4))
    fifo = scale_model("g", batch_sizes=(1, 4))
    async with serving(fair, cfg=config(discipline=SchedulingDiscipline.FAIR)) as sched:
        assert [c.batch_key for c in fair.calls] == [1, 4]
        assert [c.shapes for c in fair.calls] == [((1, 4),), ((4, 4),)]
        costs = sched.cost_estimates("f")
        assert set(costs) == {(None, 1), (None, 4)} and all(v > 0 for v in costs.values())
    async with serving(fifo) as sched:
        assert fifo.executions == 0 and sched.cost_estimates("g") == {}


async def test_scheduler_metrics_counters():
    model = scale_model(batch_sizes=(1, 4, 8), delay=0.001)
    cfg = config(models={"double": ModelSchedConfig(max_batch_size=8)})
    async with serving(model, cfg=cfg) as sched:
        empty = sched.scheduler_metrics()["double"]
        assert (empty.dispatch_count, empty.wait_p50, empty.wait_p99, empty.batch_size_hist) == (
            0,
            0.0,
            0.0,
            {},
        )
        async with anyio.create_task_group() as tg, device_held(sched):
            for rows in (2, 2, 4):
                tg.start_soon(sched.infer, "double", [xs(rows)])
            await until(lambda: depth(sched, "double") == 3)
        await sched.infer("double", [xs(1)])
        m = sched.scheduler_metrics()["double"]
    assert (m.dispatch_count, m.requests_served, m.rows_served) == (2, 4, 9)
    assert m.batch_size_hist == {1: 1, 8: 1}
    assert m.max_batch_size == 8 and m.queue_depth == 0 and m.weight == 1.0
    assert m.total_compute > 0 and 0 < m.recent_compute_ema <= m.total_compute
    assert 0 < m.wait_p50 <= m.wait_p99
    # Triton's batch statistics read these: compute per batch size, queue and compute totals.
    assert set(m.batch_compute_seconds) == {1, 8}
    assert sum(m.batch_compute_seconds.values()) == pytest.approx(m.total_compute)
    assert m.batch_compute_seconds[8] >= 0.001  # the mock sleeps 1 ms per execution
    assert m.queue_seconds_total > 0  # three requests queued behind the held device
    # each request counts its batch's compute: 3 shared the batch of 8, 1 ran alone
    assert m.request_compute_seconds_total == pytest.approx(
        3 * m.batch_compute_seconds[8] + m.batch_compute_seconds[1]
    )


async def test_a_failing_warmup_only_warns():
    model = scale_model("flaky", fail=RuntimeError("no device"))
    async with serving(model, cfg=config(discipline=SchedulingDiscipline.FAIR)) as sched:
        assert sched.has_model("flaky") and sched.cost_estimates("flaky") == {}
        assert model.executions == 3  # each compiled size was tried once


async def test_a_model_removed_during_preprocess_is_not_found():
    entered, release = threading.Event(), threading.Event()

    def pre(inputs):
        entered.set()
        release.wait()
        return inputs

    model = scale_model()
    sched = Scheduler(config())
    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        await sched.add_model(model, preprocess=pre)
        results: dict = {}
        async with anyio.create_task_group() as inner:
            inner.start_soon(collect, results, 0, sched.infer, "double", [xs(1)])
            await anyio.to_thread.run_sync(entered.wait)
            await sched.remove_model("double")
            release.set()
        await sched.stop()
    assert isinstance(results[0], NotFound)
    assert results[0].message == "model 'double' was unloaded"
    assert model.executions == 0

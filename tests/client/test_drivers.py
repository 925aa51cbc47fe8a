"""The drivers' behaviour around the chunks: concurrency bound, first error, slots, sync entry
points (against the in-memory endpoint, on asyncio and trio)."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from kserve_trio.client import (
    InferInput,
    InferOutput,
    KServeModel,
    RetryPolicy,
    RpcError,
    infer_async,
    infer_sync,
    kserve_init,
    with_bounds_checks,
)
from kserve_trio.client.io import bounds_checks_enabled
from kserve_trio.client.runtime import get_state
from kserve_trio.core.errors import StatusCode
from tests.client.fake_server import FakeServer, ScaleIO, factory_for


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.close()


def model_for(server, **kw):
    kw.setdefault("max_batch_size", 4)
    kw.setdefault("retry", RetryPolicy(initial_backoff=0.01))
    return KServeModel("fake", 9001, "scale", transport_factory=factory_for(server), **kw)


@pytest.mark.anyio
async def test_in_flight_chunks_are_bounded_by_the_pool_slots(server):
    kserve_init(pool_bytes=4096, n_slots=2)
    server.infer_delay = 0.01
    io = ScaleIO(40)
    await infer_async(model_for(server), io)
    np.testing.assert_array_equal(io.y, io.x * 2)
    assert server.max_in_flight == 2
    assert all(p.free_slots() == 2 for p in get_state().pools())


@pytest.mark.anyio
async def test_first_error_stops_new_chunks_lets_started_ones_finish_and_is_raised_plainly(server):
    kserve_init(pool_bytes=4096, n_slots=4)
    server.infer_delay = 0.01
    server.errors = [RpcError(StatusCode.INVALID_ARGUMENT, "bad chunk")]
    io = ScaleIO(400)
    with pytest.raises(RpcError, match="bad chunk") as info:
        await infer_async(model_for(server), io)
    assert info.value.status is StatusCode.INVALID_ARGUMENT
    started = server.calls["ModelInfer"]
    assert started < 100  # spawning stopped
    assert len(io.decoded) == started - 1  # every other started chunk completed
    assert all(p.free_slots() == 4 for p in get_state().pools())


@pytest.mark.anyio
async def test_a_user_error_in_encode_releases_the_slot(server):
    class Broken(ScaleIO):
        def encode_chunk(self, items, slot):
            raise ZeroDivisionError("user bug")

    with pytest.raises(ZeroDivisionError, match="user bug"):
        await infer_async(model_for(server), Broken(8))
    assert all(p.free_slots() == p.n_slots for p in get_state().pools())


@pytest.mark.anyio
async def test_an_empty_io_sends_nothing(server):
    await infer_async(model_for(server), ScaleIO(0))
    assert sum(server.calls.values()) == 0


@pytest.mark.anyio
async def test_infer_async_refuses_a_list_of_inputs(server):
    with pytest.raises(TypeError, match=r"infer_async\(model, io\) needs an InferenceIO, got list"):
        await infer_async(model_for(server), [InferInput("x", np.zeros((1, 4), np.float32))])


@pytest.mark.anyio
async def test_infer_sync_refuses_to_block_an_event_loop(server, anyio_backend):
    with pytest.raises(RuntimeError) as info:
        infer_sync(model_for(server), ScaleIO(4))
    assert str(info.value) == (
        f"infer_sync(model, io) would block this thread's {anyio_backend} event loop; "
        "use 'await infer_async(model, io)' instead"
    )
    with pytest.raises(RuntimeError, match=r"use 'await model.infer\(inputs\)' instead"):
        infer_sync(model_for(server), [])
    assert sum(server.calls.values()) == 0


def test_infer_sync_one_shot_returns_the_response_and_io_returns_none(server):
    x = np.ones((3, 4), np.float32)
    response = infer_sync(model_for(server), [InferInput("x", x)])
    np.testing.assert_array_equal(InferOutput("y", response), x * 2)
    io = ScaleIO(9)
    assert infer_sync(model_for(server), io) is None
    assert io.decoded == [range(0, 4), range(4, 8), range(8, 9)]  # serial, in order
    assert server.max_in_flight == 1


def test_infer_sync_carries_the_bounds_check_context_to_the_user_code(server):
    seen = []

    class Spy(ScaleIO):
        def encode_chunk(self, items, slot):
            seen.append(bounds_checks_enabled())
            return super().encode_chunk(items, slot)

    infer_sync(model_for(server), Spy(4))
    with with_bounds_checks():
        infer_sync(model_for(server), Spy(4))
    assert seen == [False, True]


def test_one_shot_retries_a_shed_request(server):
    server.shed = 2
    response = infer_sync(model_for(server), [InferInput("x", np.ones((1, 4), np.float32))])
    np.testing.assert_array_equal(InferOutput("y", response), [[2, 2, 2, 2]])
    assert server.calls["ModelInfer"] == 3
    assert server.budgets[0] > server.budgets[1] > server.budgets[2]


def test_async_model_methods(server, anyio_backend):
    async def main():
        async with model_for(server) as m:
            spec = await m.io_spec()
            return spec, await m.shm_status()

    spec, status = anyio.run(main, backend=anyio_backend)
    assert spec.name == "scale" and [t.name for t in spec.outputs] == ["y"]
    assert status == {}


def test_kserve_shutdown_from_inside_a_sync_drive_is_refused(server):
    from kserve_trio.client import kserve_shutdown

    errors = []

    class Shutter(ScaleIO):
        def decode_chunk(self, items, response):
            try:
                kserve_shutdown()
            except RuntimeError as exc:
                errors.append(str(exc))
            super().decode_chunk(items, response)

    io = Shutter(4)
    model = model_for(server)
    infer_sync(model, io)
    state = get_state()
    infer_sync(model, ScaleIO(4))
    assert get_state() is state  # the refused shutdown left the state in place
    assert errors == [
        "kserve_shutdown() cannot run on the client loop itself (e.g. from inside an IO method "
        "driven by infer_sync); call it after the driver returns"
    ]
    np.testing.assert_array_equal(io.y, io.x * 2)

"""Shared-memory routing, registration and stale-registration recovery, against
the in-memory fake endpoint, on asyncio and trio."""

from __future__ import annotations

import time

import anyio
import numpy as np
import posix_ipc
import pytest

from kserve_trio.client import (
    KServeModel,
    RetryPolicy,
    RpcError,
    SharedMemoryUnavailable,
    infer_async,
    kserve_init,
    kserve_shutdown,
)
from kserve_trio.client.runtime import get_state
from kserve_trio.core.errors import StatusCode
from tests.client.fake_server import FakeServer, ScaleIO, factory_for
from tests.waiting import until

pytestmark = pytest.mark.anyio

FAST_RETRY = RetryPolicy(initial_backoff=0.01, jitter=False)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.close()


def model_for(server, port=9001, **kw):
    kw.setdefault("max_batch_size", 8)
    kw.setdefault("retry", FAST_RETRY)
    return KServeModel("fake", port, "scale", transport_factory=factory_for(server), **kw)


def expected(io):
    return io.x * 2


async def run_io(model, n=64, **io_kw):
    io = ScaleIO(n, **io_kw)
    await infer_async(model, io)
    np.testing.assert_array_equal(io.y, expected(io))
    return io


async def test_auto_registers_the_pool_once_and_sends_inputs_by_reference(server):
    model = model_for(server)
    await run_io(model)
    await run_io(model)
    assert server.calls["IsSameIPCNamespace"] == 1
    assert server.calls["SystemSharedMemoryRegister"] == 1
    pool = get_state().shm_pool()
    status = server.registry.status()
    assert list(status) == [pool.region_name]
    assert status[pool.region_name].key == pool.key
    assert status[pool.region_name].byte_size == pool.nbytes
    assert server.shm_inputs == 16 and server.inline_inputs == 0


async def test_declared_outputs_come_back_through_shared_memory(server):
    model = model_for(server)
    io = await run_io(model, 20, declare_outputs=True)
    assert [len(r) for r in io.decoded] == [8, 8, 4]
    assert server.shm_inputs == 3


async def test_off_never_probes_and_sends_inline(server):
    await run_io(model_for(server, shared_memory="off"))
    assert server.calls["IsSameIPCNamespace"] == 0
    assert server.calls["SystemSharedMemoryRegister"] == 0
    assert server.inline_inputs == 8 and server.shm_inputs == 0


async def test_auto_goes_inline_when_the_server_is_in_another_namespace(server):
    server.same_namespace = False
    await run_io(model_for(server, shared_memory="auto"), declare_outputs=True)
    assert server.calls["SystemSharedMemoryRegister"] == 0
    assert server.inline_inputs == 8


async def test_on_fails_loudly_when_the_server_is_in_another_namespace(server):
    server.same_namespace = False
    with pytest.raises(
        SharedMemoryUnavailable, match=r"server fake:9001 is in another IPC namespace"
    ):
        await run_io(model_for(server, shared_memory="on"))
    assert server.calls["ModelInfer"] == 0


async def test_unimplemented_probe_is_inline_for_auto_and_registers_anyway_for_on(server):
    server.same_namespace = None
    await run_io(model_for(server, shared_memory="auto"))
    assert server.calls["SystemSharedMemoryRegister"] == 0
    await run_io(model_for(server, shared_memory="on"))
    assert server.calls["SystemSharedMemoryRegister"] == 1
    assert server.shm_inputs == 8


async def test_other_probe_errors_propagate(server):
    server.probe_stall = 60.0  # far past the 0.2 s deadline, however loaded the machine
    with pytest.raises(RpcError) as info:
        await run_io(model_for(server, deadline=0.2))
    assert info.value.status is StatusCode.DEADLINE_EXCEEDED


async def test_restarted_server_is_re_registered_once_and_the_stream_completes(server):
    model = model_for(server, max_batch_size=4)
    await run_io(model, 8)
    server.forget_after = server.calls["ModelInfer"] + 3
    await run_io(model, 64)
    assert server.calls["SystemSharedMemoryRegister"] == 2
    assert get_state().endpoints[("fake", 9001)].latched is False


async def test_concurrent_stale_failures_coalesce_into_one_re_register(server):
    kserve_init(pool_bytes=1 << 16, n_slots=8)
    model = model_for(server, max_batch_size=2)
    await run_io(model, 4)
    server.infer_delay = 0.02
    server.restart()  # every in-flight chunk of the next stream sees the stale registration
    await run_io(model, 64)
    assert server.max_in_flight > 1
    assert server.calls["SystemSharedMemoryRegister"] == 2


async def test_failing_re_register_latches_inline_and_completes(server):
    model = model_for(server, max_batch_size=4)
    await run_io(model, 8)
    server.restart()
    server.fail_register = 1
    shm_before = server.shm_inputs
    await run_io(model, 32, declare_outputs=True)
    ep = get_state().endpoints[("fake", 9001)]
    assert ep.latched is True
    registers = server.calls["SystemSharedMemoryRegister"]
    await run_io(model, 32)
    assert server.calls["SystemSharedMemoryRegister"] == registers  # none while latched
    assert server.shm_inputs == shm_before
    assert server.inline_inputs == 16


async def test_a_second_stale_error_after_re_registering_latches(server):
    model = model_for(server, max_batch_size=4)
    await run_io(model, 4)
    stale = "unregistered shared memory region: whatever"
    server.errors = [RpcError(StatusCode.FAILED_PRECONDITION, stale)] * 2
    await run_io(model, 4)
    assert get_state().endpoints[("fake", 9001)].latched is True
    assert server.calls["SystemSharedMemoryRegister"] == 2
    assert server.inline_inputs == 1


async def test_other_failed_preconditions_fail_fast(server):
    model = model_for(server)
    await run_io(model, 8)
    server.errors = [RpcError(StatusCode.FAILED_PRECONDITION, "model 'scale' is not resident")]
    with pytest.raises(RpcError, match="model 'scale' is not resident") as info:
        await run_io(model, 8)
    assert info.value.status is StatusCode.FAILED_PRECONDITION
    assert server.calls["SystemSharedMemoryRegister"] == 1


async def test_background_re_probe_restores_shared_memory(server):
    kserve_init(shm_reprobe_interval=0.05)
    model = model_for(server)
    await run_io(model, 8)
    server.restart()
    server.fail_register = 1
    await run_io(model, 8)
    ep = get_state().endpoints[("fake", 9001)]
    assert ep.latched
    await until(lambda: not ep.latched, what="the route unlatched")
    shm_before = server.shm_inputs
    await run_io(model, 8)
    assert server.shm_inputs == shm_before + 1
    assert server.calls["SystemSharedMemoryRegister"] == 3


async def test_routes_are_per_server(server):
    other = FakeServer(same_namespace=False)
    try:
        await run_io(model_for(server, port=9001))
        await run_io(model_for(other, port=9002))
        assert server.calls["SystemSharedMemoryRegister"] == 1
        assert other.calls["SystemSharedMemoryRegister"] == 0
        assert other.inline_inputs == 8
    finally:
        other.close()


def test_shutdown_unregisters_everywhere_and_unlinks(server, anyio_backend):
    other = FakeServer()
    try:

        async def main():
            await run_io(model_for(server, port=9001))
            await run_io(model_for(other, port=9002))

        anyio.run(main, backend=anyio_backend)
        key = get_state().shm_pool().key
        assert len(server.registry.status()) == 1 and len(other.registry.status()) == 1
        kserve_shutdown()
        assert server.registry.status() == {} and other.registry.status() == {}
        with pytest.raises(posix_ipc.ExistentialError):
            posix_ipc.SharedMemory(key)
    finally:
        other.close()


def test_shutdown_returns_quickly_while_a_re_probe_stalls(server, anyio_backend):
    kserve_init(shm_reprobe_interval=0.01)

    async def main():
        model = model_for(server)
        await run_io(model, 8)
        server.restart()
        server.fail_register = 1
        await run_io(model, 8)
        server.probe_stall = 30.0
        await until(lambda: server.stalled_probes, what="the re-prober stuck in its probe")

    anyio.run(main, backend=anyio_backend)
    assert server.calls["IsSameIPCNamespace"] >= 2
    started = time.monotonic()
    kserve_shutdown()
    assert time.monotonic() - started < 10  # did not wait out the 30 s stalled probe

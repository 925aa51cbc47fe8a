"""The client against a real in-process worker serving the demo repository.

Acceptance of the Client library capability: one-shot (sync and async) and streaming inference
over 10,000 ``mlp`` items and 2,000 ``cnn`` items give the model's per-item results, inline and
through shared memory; the fault cases (shedding under a concurrency cap, deadline exhaustion,
pool exhaustion, shutdown and interpreter exit) behave as specified.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import anyio
import anyio.from_thread
import ml_dtypes
import numpy as np
import pytest

from kserve_trio.client import (
    InferInput,
    InferOutput,
    IOValidationError,
    KServeModel,
    OutputSpec,
    PoolAcquireTimeout,
    RetryPolicy,
    RpcError,
    infer_async,
    infer_sync,
    kserve_init,
    kserve_shutdown,
    manifest_io_spec,
    model_io_spec,
    pool_view,
    scratch,
    validate_io,
)
from kserve_trio.client.runtime import get_state
from kserve_trio.client.transport import default_transport_factory
from kserve_trio.core.errors import StatusCode
from kserve_trio.worker.server import serve, stop
from tests.device_hold import hold_device
from tests.e2e import reference as ref
from tests.waiting import until, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODELS = {
    # name: (per-item input shape, per-item output dims, reference, tolerance)
    "mlp": ((16,), (8,), ref.mlp, 1e-5),
    "cnn": ((3, 32, 32), (10,), ref.cnn, 1e-4),
}


def start(repo, **endpoints):
    endpoints.setdefault("port", 0)
    return serve(
        None,
        blocking=False,
        model_dirs=[str(repo)],
        model_control_mode="static",
        endpoints=endpoints,
    )


@pytest.fixture(scope="module")
def server(demo_repo):
    running = start(demo_repo, max_concurrent_requests=256)
    yield running
    stop(running)


class ArrayIO:
    """Streams the rows of ``x`` through a demo model; results land in ``y``."""

    def __init__(self, x: np.ndarray, out_dims, *, declare: bool = False) -> None:
        self.x = x
        self.y = np.full((len(x), *out_dims), np.nan, np.float32)
        self.out_dims = tuple(out_dims)
        self.declare = declare
        self.chunks: list[range] = []

    def __len__(self):
        return len(self.x)

    def item_input_bytes(self):
        return int(np.prod(self.x.shape[1:])) * 4

    def encode_chunk(self, items, slot):
        d = scratch(slot, "input_0", (len(items), *self.x.shape[1:]), np.float32)
        pool_view(d)[...] = self.x[items.start : items.stop]
        return d

    def decode_chunk(self, items, response):
        self.y[items.start : items.stop] = InferOutput("output", response, np.float32)
        self.chunks.append(items)

    def output_specs(self):
        return [OutputSpec("output", np.float32, self.out_dims)] if self.declare else []


def data(model: str, n: int, seed: int = 0) -> np.ndarray:
    shape, _, _, _ = MODELS[model]
    return np.random.default_rng(seed).standard_normal((n, *shape), dtype=np.float32)


def expected(demo_repo, model: str, x: np.ndarray) -> np.ndarray:
    _, _, fn, _ = MODELS[model]
    return fn(x, ref.weights(demo_repo, model))


# --------------------------------------------------------------------------------------------
# Results


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_one_shot_sync_and_async_give_the_model_results(server, demo_repo, model, anyio_backend):
    x = data(model, 5)
    want = expected(demo_repo, model, x)
    tol = MODELS[model][3]
    with KServeModel(server.address, model) as m:
        response = infer_sync(m, [InferInput("input_0", x)])
        np.testing.assert_allclose(InferOutput("output", response), want, rtol=tol, atol=tol)

    async def one_shot():
        async with KServeModel(f"grpc://{server.address}", model) as m:
            return await m.infer([InferInput("input_0", x)], outputs=["output"], id="req-1")

    response = anyio.run(one_shot, backend=anyio_backend)
    assert response.id == "req-1" and response.model_name == model
    np.testing.assert_allclose(InferOutput("output", response), want, rtol=tol, atol=tol)


def test_bf16_one_shot(server, demo_repo):
    x = np.random.default_rng(3).standard_normal((2, 16), dtype=np.float32)
    xb = x.astype(ml_dtypes.bfloat16)
    response = infer_sync(KServeModel(server.address, "mlp_bf16"), [InferInput("input_0", xb)])
    out = InferOutput("output", response, ml_dtypes.bfloat16)
    wb = {k: v.astype(np.float32) for k, v in ref.weights(demo_repo, "mlp_bf16").items()}
    np.testing.assert_allclose(out.astype(np.float32), ref.mlp(xb, wb), rtol=5e-2, atol=5e-2)


STREAMS = [
    ("mlp", 10_000, 64),
    ("cnn", 2_000, 32),
]


@pytest.mark.parametrize(("model", "n", "batch"), STREAMS, ids=[s[0] for s in STREAMS])
@pytest.mark.parametrize("shared_memory", ["off", "on"])
def test_streaming_async_gives_every_item_the_model_result(
    server, demo_repo, model, n, batch, shared_memory, anyio_backend
):
    x = data(model, n, seed=1)
    want = expected(demo_repo, model, x)
    tol = MODELS[model][3]
    ios = [ArrayIO(x, MODELS[model][1]), ArrayIO(x, MODELS[model][1], declare=True)]

    async def main():
        async with KServeModel(
            server.address, model, max_batch_size=batch, shared_memory=shared_memory
        ) as m:
            async with anyio.create_task_group() as tg:  # two streams at once on one model
                for io in ios:
                    tg.start_soon(infer_async, m, io)
            if shared_memory == "on":
                regions = await m.shm_status()
                assert get_state().shm_pool().region_name in regions

    anyio.run(main, backend=anyio_backend)
    for io in ios:
        np.testing.assert_allclose(io.y, want, rtol=tol, atol=tol)
        assert sum(len(r) for r in io.chunks) == n
        assert max(len(r) for r in io.chunks) == batch
    ep = get_state().endpoints[(server.host, server.port)]
    assert ep.registrations == (1 if shared_memory == "on" else 0)
    assert not ep.latched


@pytest.mark.parametrize("shared_memory", ["off", "auto"])
def test_streaming_sync_gives_every_item_the_model_result(server, demo_repo, shared_memory):
    x = data("mlp", 10_000, seed=2)
    io = ArrayIO(x, (8,), declare=True)
    infer_sync(
        KServeModel(server.address, "mlp", max_batch_size=64, shared_memory=shared_memory), io
    )
    np.testing.assert_allclose(io.y, expected(demo_repo, "mlp", x), rtol=1e-5, atol=1e-5)
    assert [r.start for r in io.chunks] == list(range(0, 10_000, 64))  # serial, in order


def test_model_io_spec_matches_manifest_io_spec(server, demo_repo):
    for model in ("mlp", "cnn", "mlp_bf16"):
        online = model_io_spec(KServeModel(server.address, model))
        assert online == manifest_io_spec(demo_repo / model)


def test_validate_io_against_the_live_model(server):
    model = KServeModel(server.address, "mlp")
    validate_io(model, ArrayIO(data("mlp", 4), (8,), declare=True), items=2)

    class Misnamed(ArrayIO):
        def encode_chunk(self, items, slot):
            d = scratch(slot, "x", (len(items), 16), np.float32)
            return d

    with pytest.raises(
        IOValidationError, match="encode_chunk returned input 'x', which model 'mlp'"
    ):
        validate_io(model, Misnamed(data("mlp", 4), (8,)))


def test_unknown_model_fails_with_the_server_status(server):
    with pytest.raises(RpcError) as info:
        infer_sync(
            KServeModel(server.address, "nope"),
            [InferInput("input_0", np.zeros((1, 16), np.float32))],
        )
    assert info.value.status is StatusCode.NOT_FOUND
    assert info.value.method == "ModelInfer"


# --------------------------------------------------------------------------------------------
# Faults


class CountingTransport:
    """The default transport of the running event loop, counting the status of every failed
    call."""

    failures: list[StatusCode] = []

    def __init__(self, endpoint):
        self.endpoint = endpoint
        self._inner = default_transport_factory(endpoint)

    async def unary(self, *args, **kwargs):
        try:
            return await self._inner.unary(*args, **kwargs)
        except RpcError as exc:
            CountingTransport.failures.append(exc.status)
            raise

    async def aclose(self):
        await self._inner.aclose()

    def close(self):
        self._inner.close()


def test_shedding_under_a_concurrency_cap_is_retried_to_success(demo_repo, anyio_backend):
    running = start(demo_repo, max_concurrent_requests=1)
    try:
        CountingTransport.failures = []
        x = data("mlp", 512, seed=4)
        io = ArrayIO(x, (8,))
        model = KServeModel(
            running.address,
            "mlp",
            max_batch_size=8,
            shared_memory="off",
            deadline=20.0,
            retry=RetryPolicy(initial_backoff=0.02, max_backoff=0.2),
            transport_factory=CountingTransport,
        )
        infer_sync(model, ArrayIO(data("mlp", 8), (8,)))  # warm the route before the burst
        # While the device is held the burst's first chunk waits in the queue with the only
        # admission, so the others are shed and retried; the device is let go once a shed
        # was seen (no timer decides the order).
        blocker = hold_device(running)
        errors: list[BaseException] = []

        def run_burst() -> None:
            try:
                anyio.run(infer_async, model, io, backend=anyio_backend)
            except BaseException as exc:
                errors.append(exc)

        burst = threading.Thread(target=run_burst)
        burst.start()
        try:
            wait_until(
                lambda: StatusCode.RESOURCE_EXHAUSTED in CountingTransport.failures,
                30,
                "a chunk shed by the concurrency cap",
            )
        finally:
            blocker.release()
            burst.join(60)
        assert not burst.is_alive() and errors == []
        np.testing.assert_allclose(io.y, expected(demo_repo, "mlp", x), rtol=1e-5, atol=1e-5)
        assert StatusCode.RESOURCE_EXHAUSTED in CountingTransport.failures
        assert set(CountingTransport.failures) == {StatusCode.RESOURCE_EXHAUSTED}
    finally:
        stop(running)


def test_deadline_exhaustion_is_reported_as_such(server):
    x = np.zeros((1, 16), np.float32)
    model = KServeModel(server.address, "mlp", deadline=0.3)
    infer_sync(model, [InferInput("input_0", x)])  # connected and warm
    blocker = hold_device(server)  # held until released: the device never frees up
    try:
        started = time.monotonic()
        with pytest.raises(RpcError) as info:
            infer_sync(model, [InferInput("input_0", x)])
        assert info.value.status is StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 30  # the deadline ended it, not the device
        with pytest.raises(RpcError) as info:
            infer_sync(model, ArrayIO(data("mlp", 4), (8,)))
        assert info.value.status is StatusCode.DEADLINE_EXCEEDED
    finally:
        blocker.release()


def test_pool_exhaustion_raises_pool_acquire_timeout_and_leaks_no_slot(
    server, demo_repo, anyio_backend
):
    kserve_init(pool_bytes=1 << 16, n_slots=1)
    model = KServeModel(server.address, "mlp", deadline=0.3, shared_memory="off", max_batch_size=8)
    pool = get_state().inline_pool()
    held = pool.acquire_nowait()
    started = time.monotonic()
    with pytest.raises(
        PoolAcquireTimeout, match=r"no 1 contiguous free slot\(s\) within the deadline"
    ):
        infer_sync(model, ArrayIO(data("mlp", 4), (8,)))
    assert 0.25 < time.monotonic() - started < 10  # waited out the 0.3 s deadline, then gave up
    assert pool.waiting() == 0
    held.release()
    assert pool.free_slots() == 1
    x = data("mlp", 64)
    io = ArrayIO(x, (8,))
    anyio.run(infer_async, model, io, backend=anyio_backend)
    np.testing.assert_allclose(io.y, expected(demo_repo, "mlp", x), rtol=1e-5, atol=1e-5)
    assert pool.free_slots() == 1


def test_message_caps_are_enforced_locally_and_not_retried(server):
    x = np.zeros((64, 16), np.float32)
    small_send = KServeModel(server.address, "mlp", max_send_message_length=1000)
    started = time.monotonic()
    with pytest.raises(RpcError, match=r"sent message larger than max \(\d+ vs. 1000\)") as info:
        infer_sync(small_send, [InferInput("input_0", x)])
    assert info.value.status is StatusCode.RESOURCE_EXHAUSTED
    assert time.monotonic() - started < 5  # refused at once: no retry backoff
    small_recv = KServeModel(server.address, "mlp", max_receive_message_length=100)
    with pytest.raises(RpcError, match=r"received message larger than max \(\d+ vs. 100\)"):
        infer_sync(small_recv, [InferInput("input_0", x)])
    assert infer_sync(small_send, [InferInput("input_0", x[:2])]) is not None


def shm_objects() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("shm-kserve_trio_client-")}


def test_kserve_shutdown_unregisters_and_unlinks_every_region(server, anyio_backend):
    before = shm_objects()
    model = KServeModel(server.address, "mlp", max_batch_size=8, shared_memory="on")
    infer_sync(model, ArrayIO(data("mlp", 16), (8,), declare=True))
    region = get_state().shm_pool().region_name
    assert region in shm_objects()
    status = anyio.run(KServeModel(server.address, "mlp").shm_status, backend=anyio_backend)
    assert region in status
    kserve_shutdown()
    assert anyio.run(KServeModel(server.address, "mlp").shm_status, backend=anyio_backend) == {}
    assert shm_objects() == before - {region}


CHILD = """
import sys
import numpy as np
from kserve_trio.client import KServeModel, infer_sync
from kserve_trio.client.runtime import get_state
from tests.client.test_worker_e2e import ArrayIO, data

model = KServeModel(sys.argv[1], "mlp", max_batch_size=8, shared_memory="on")
io = ArrayIO(data("mlp", 32), (8,), declare=True)
infer_sync(model, io)
assert not np.isnan(io.y).any()
print("REGION", get_state().shm_pool().region_name, flush=True)
# no kserve_shutdown(): interpreter exit must clean up
"""


def test_interpreter_exit_unregisters_and_unlinks(server):
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), server.address],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("REGION ")]
    region = line.split()[1]
    assert region.startswith("shm-kserve_trio_client-")
    assert region not in shm_objects()
    assert region not in anyio.run(KServeModel(server.address, "mlp").shm_status)


@pytest.mark.slow
def test_worker_restarted_mid_stream_re_registers_and_the_stream_completes(
    demo_repo, anyio_backend
):
    first = start(demo_repo)
    port = first.port
    x = data("mlp", 10_000, seed=5)
    io = ArrayIO(x, (8,), declare=True)
    model = KServeModel(
        first.address,
        "mlp",
        max_batch_size=8,
        shared_memory="on",
        deadline=60.0,
        retry=RetryPolicy(initial_backoff=0.05, max_backoff=0.5),
        transport_factory=CountingTransport,
    )
    CountingTransport.failures = []
    box: dict = {}

    async def restart_when_streaming():
        await until(lambda: len(io.chunks) >= 50, 60, "50 chunks decoded")
        box["decoded_at_stop"] = len(io.chunks)
        await anyio.to_thread.run_sync(stop, first)
        box["second"] = await anyio.to_thread.run_sync(lambda: start(demo_repo, port=port))

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(restart_when_streaming)
            await infer_async(model, io)

    try:
        anyio.run(main, backend=anyio_backend)
        np.testing.assert_allclose(io.y, expected(demo_repo, "mlp", x), rtol=1e-5, atol=1e-5)
        ep = get_state().endpoints[(first.host, port)]
        assert ep.registrations == 2  # the initial one and one after the restart
        assert not ep.latched
        assert box["decoded_at_stop"] < 1250 // 2  # the restart really was mid-stream
        assert StatusCode.FAILED_PRECONDITION in CountingTransport.failures  # stale, then fixed
        assert sum(len(r) for r in io.chunks) == 10_000  # every chunk decoded exactly once
    finally:
        if "second" in box:
            stop(box["second"])

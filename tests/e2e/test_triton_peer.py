"""Interoperability with a stock Triton server (``tritonserver`` 2.51 from ``nvidia-pytriton``).

Our client against Triton's Python backend (``tools/triton_peer/models``), on asyncio and trio:
``shared_memory="auto"`` falls back to inline transport (Triton has no IsSameIPCNamespace),
``"on"`` registers the pool with SystemSharedMemoryRegister and exchanges tensors through it
(Triton answers an output written to shared memory with an empty inline entry; the client reads
the region), ``compression="gzip"`` / ``"deflate"`` requests are served, and the results are the
models' results. Slow-marked, run in CI; a peer that cannot
start FAILS the test (never a skip).
"""

from __future__ import annotations

import os

import anyio
import numpy as np
import pytest

from kserve_trio.client import (
    InferInput,
    InferOutput,
    KServeModel,
    OutputSpec,
    h2_transport,
    infer_async,
    infer_sync,
    kserve_shutdown,
    pool_view,
    scratch,
)
from kserve_trio.client.runtime import Route, get_state, probe_same_namespace
from kserve_trio.client.transport import default_transport_factory
from kserve_trio.core.errors import StatusCode
from kserve_trio.core.tensors.dtypes import DType
from tests.e2e.triton_peer import PeerStartError, TritonPeer

pytestmark = pytest.mark.slow

MODELS = {"identity": lambda x: x, "affine": lambda x: 2 * x + 1}


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("triton-peer")
    try:
        server = TritonPeer(workdir).start()
    except PeerStartError as exc:
        pytest.fail(f"the stock Triton peer did not start: {exc}", pytrace=False)
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def fresh_client():
    kserve_shutdown()
    yield
    kserve_shutdown()


class RowsIO:
    """Rows of ``x`` [n, 16] through a peer model; ``y`` gets the results. Outputs are
    declared, so with shared memory they are written to the pool by Triton."""

    def __init__(self, x: np.ndarray) -> None:
        self.x = x
        self.y = np.full_like(x, np.nan)

    def __len__(self) -> int:
        return len(self.x)

    def item_input_bytes(self) -> int:
        return 16 * 4

    def encode_chunk(self, items, slot):
        desc = scratch(slot, "INPUT0", (len(items), 16), np.float32)
        pool_view(desc)[...] = self.x[items.start : items.stop]
        return desc

    def decode_chunk(self, items, response) -> None:
        self.y[items.start : items.stop] = InferOutput("OUTPUT0", response, np.float32)

    def output_specs(self):
        return [OutputSpec("OUTPUT0", np.float32, (16,))]


class ReplySpy:
    """The default transport, recording the size of each ModelInfer reply's first raw entry."""

    raw_sizes: list[int] = []

    def __init__(self, endpoint) -> None:
        self.endpoint = endpoint
        self._inner = default_transport_factory(endpoint)

    async def unary(self, method, request, reply_type, **kwargs):
        reply = await self._inner.unary(method, request, reply_type, **kwargs)
        if method.endswith("/ModelInfer"):
            ReplySpy.raw_sizes.append(len(reply.raw_output_contents[0]))
        return reply

    async def aclose(self) -> None:
        await self._inner.aclose()

    def close(self) -> None:
        self._inner.close()


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 16), dtype=np.float32)


def endpoint_state(peer):
    return get_state().endpoints[("127.0.0.1", peer.grpc_port)]


@pytest.mark.anyio
async def test_the_peer_is_a_stock_triton_without_is_same_ipc_namespace(peer):
    async with KServeModel(peer.grpc_address, "identity") as m:
        assert await m.server_ready() and await m.model_ready()
        spec = await m.io_spec()
        assert [(t.name, t.dtype, t.shape) for t in spec.inputs] == [
            ("INPUT0", DType.F32, (-1, 16))
        ]
        assert await probe_same_namespace(m.transport(), "/anything", 10.0) is None


@pytest.mark.anyio
@pytest.mark.parametrize("model", sorted(MODELS))
async def test_auto_falls_back_to_inline(peer, model):
    x = rows(203, seed=1)
    io = RowsIO(x)
    ReplySpy.raw_sizes = []
    async with KServeModel(
        peer.grpc_address,
        model,
        max_batch_size=8,
        shared_memory="auto",
        deadline=30.0,
        transport_factory=ReplySpy,
    ) as m:
        await infer_async(m, io)
        regions = await m.shm_status()
    np.testing.assert_array_equal(io.y, MODELS[model](x))
    ep = endpoint_state(peer)
    assert ep.routes["auto"] is Route.INLINE
    assert ep.registrations == 0 and not ep.registered
    assert get_state().shm_pool().region_name not in regions
    assert ReplySpy.raw_sizes and all(size > 0 for size in ReplySpy.raw_sizes)  # inline replies


@pytest.mark.anyio
@pytest.mark.parametrize("model", sorted(MODELS))
async def test_on_exchanges_tensors_through_system_shared_memory(peer, model):
    x = rows(203, seed=2)
    io = RowsIO(x)
    ReplySpy.raw_sizes = []
    async with KServeModel(
        peer.grpc_address,
        model,
        max_batch_size=8,
        shared_memory="on",
        deadline=30.0,
        transport_factory=ReplySpy,
    ) as m:
        await infer_async(m, io)
        regions = await m.shm_status()
    np.testing.assert_array_equal(io.y, MODELS[model](x))
    region = get_state().shm_pool().region_name
    assert region in regions  # registered with SystemSharedMemoryRegister
    assert regions[region].byte_size == get_state().shm_pool().nbytes
    ep = endpoint_state(peer)
    assert ep.routes["on"] is Route.SHM
    assert ep.registrations == 1 and not ep.latched
    # Triton wrote every output to our region and answered with an empty inline entry
    assert len(ReplySpy.raw_sizes) == 26 and set(ReplySpy.raw_sizes) == {0}


@pytest.mark.anyio
@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
async def test_our_compressed_requests_are_served_by_the_peer(peer, algorithm, monkeypatch):
    packed: list[int] = []
    compress = h2_transport.compress  # the client's transport compresses what it sends

    def counting(data, name):
        packed.append(len(data))
        return compress(data, name)

    monkeypatch.setattr(h2_transport, "compress", counting)
    x = rows(37, seed=6)
    io = RowsIO(x)
    async with KServeModel(
        peer.grpc_address,
        "affine",
        max_batch_size=8,
        shared_memory="off",
        deadline=30.0,
        compression=algorithm,
    ) as m:
        response = await m.infer([InferInput("INPUT0", x[:3])], id="z")
        await infer_async(m, io)
    assert response.id == "z"
    np.testing.assert_array_equal(InferOutput("OUTPUT0", response), 2 * x[:3] + 1)
    np.testing.assert_array_equal(io.y, 2 * x + 1)
    assert len(packed) >= 1 + 5  # the one-shot request and every chunk went out compressed


def test_one_shot_and_sync_drivers_against_the_peer(peer):
    x = rows(5, seed=3)
    with KServeModel(peer.grpc_address, "affine", shared_memory="on", deadline=30.0) as m:
        response = infer_sync(m, [InferInput("INPUT0", x)])
        np.testing.assert_array_equal(InferOutput("OUTPUT0", response), 2 * x + 1)
        io = RowsIO(rows(40, seed=4))
        infer_sync(m, io)
        np.testing.assert_array_equal(io.y, 2 * io.x + 1)
    assert endpoint_state(peer).registrations == 1


@pytest.mark.anyio
async def test_the_peers_own_errors_come_back_with_their_status(peer):
    from kserve_trio.client import RpcError

    async with KServeModel(peer.grpc_address, "no_such_model", shared_memory="off") as m:
        with pytest.raises(RpcError) as info:
            await m.infer([InferInput("INPUT0", rows(1, 0))])
    assert info.value.status is StatusCode.NOT_FOUND
    assert info.value.message == "Request for unknown model: 'no_such_model' is not found"


def test_shutdown_unregisters_from_the_peer_and_unlinks(peer):
    with KServeModel(peer.grpc_address, "identity", shared_memory="on", deadline=30.0) as m:
        infer_sync(m, RowsIO(rows(16, seed=5)))
        region = get_state().shm_pool().region_name
        assert os.path.exists(f"/dev/shm/{region}")
    kserve_shutdown()
    assert not os.path.exists(f"/dev/shm/{region}")

    async def status():
        async with KServeModel(peer.grpc_address, "identity") as m:
            return await m.shm_status()

    assert region not in anyio.run(status)


def test_sigterm_stops_the_peer_and_leaves_no_shared_memory(peer):
    """Last in the module: the fixture's later stop() is then a no-op."""
    assert peer.shm_objects()  # the Python backend's own regions exist while it runs
    leftovers = peer.stop()
    assert peer.proc is not None and peer.proc.returncode == 0, peer.log_tail()
    assert leftovers == []  # Triton removed its regions itself
    assert peer.shm_objects() == []

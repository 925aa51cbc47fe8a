"""``KServeModel(..., compression=...)`` against a real in-process worker, on asyncio and trio:
requests go out compressed, the worker answers compressed (it does when the request was and the
client accepts it), and the results are the model's; the streaming drivers and the metadata
calls use it too. Also the client's BYTES tensors against the demo ``tokenize_sum``.
(The stock-Triton side is in tests/e2e/test_triton_peer.py.)
"""

from __future__ import annotations

import shutil

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
    pool_view,
    scratch,
)
from kserve_trio.client._h2_call import _Call
from kserve_trio.export.demo import tokenize_sum_reference, write_demo_repository
from tests.e2e import reference as ref
from tests.inprocess import in_process_worker


@pytest.fixture(scope="module")
def repo(demo_repo, tmp_path_factory):
    root = tmp_path_factory.mktemp("client-compression") / "models"
    root.mkdir()
    shutil.copytree(demo_repo / "mlp", root / "mlp")
    write_demo_repository(root, only=["tokenize_sum"])
    return root


@pytest.fixture(scope="module")
def server(repo):
    with in_process_worker(repo) as running:
        yield running


@pytest.fixture
def replies(monkeypatch) -> list[bool]:
    """Whether each reply the h2 transport read was compressed."""
    seen: list[bool] = []

    class SpyCall(_Call):
        def message(self, address):
            seen.append(self.compressed)
            return super().message(address)

    monkeypatch.setattr(h2_transport, "_Call", SpyCall)
    return seen


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_one_shot_inference_with_compression(server, repo, replies, algorithm, anyio_backend):
    x = np.random.default_rng(5).standard_normal((6, 16), dtype=np.float32)

    async def main():
        async with KServeModel(server.address, "mlp", compression=algorithm) as m:
            assert m.compression == algorithm
            assert await m.model_ready()
            spec = await m.io_spec()
            response = await m.infer([InferInput("input_0", x)], id="c1")
            return spec, response

    spec, response = anyio.run(main, backend=anyio_backend)
    assert [t.name for t in spec.inputs] == ["input_0"]
    assert response.id == "c1"
    np.testing.assert_allclose(
        InferOutput("output", response), ref.mlp(x, ref.weights(repo, "mlp")), rtol=1e-5, atol=1e-5
    )
    assert replies and all(replies)  # every reply, metadata included, came back compressed


def test_without_compression_nothing_is_compressed(server, replies, anyio_backend):
    async def main():
        async with KServeModel(server.address, "mlp") as m:
            assert m.compression is None
            return await m.infer([InferInput("input_0", np.ones((1, 16), np.float32))])

    anyio.run(main, backend=anyio_backend)
    assert replies == [False]


class Rows:
    def __init__(self, x: np.ndarray) -> None:
        self.x = x
        self.y = np.full((len(x), 8), np.nan, np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def item_input_bytes(self) -> int:
        return 16 * 4

    def encode_chunk(self, items, slot):
        d = scratch(slot, "input_0", (len(items), 16), np.float32)
        pool_view(d)[...] = self.x[items.start : items.stop]
        return d

    def decode_chunk(self, items, response):
        self.y[items.start : items.stop] = InferOutput("output", response, np.float32)

    def output_specs(self):
        return []


def test_the_streaming_driver_sends_compressed_chunks(server, repo, replies, anyio_backend):
    io = Rows(np.random.default_rng(6).standard_normal((300, 16), dtype=np.float32))

    async def main():
        async with KServeModel(
            server.address, "mlp", max_batch_size=32, shared_memory="off", compression="gzip"
        ) as m:
            await infer_async(m, io)

    anyio.run(main, backend=anyio_backend)
    np.testing.assert_allclose(io.y, ref.mlp(io.x, ref.weights(repo, "mlp")), rtol=1e-5, atol=1e-5)
    assert len(replies) >= 10 and all(replies)


def test_an_unknown_compression_is_refused():
    with pytest.raises(ValueError, match="compression must be None, 'gzip' or 'deflate'"):
        KServeModel("127.0.0.1:1", "m", compression="zstd")


@pytest.mark.parametrize("compression", [None, "gzip"])
def test_the_clients_bytes_tensors_round_trip_through_tokenize_sum(
    server, compression, anyio_backend
):
    texts = np.array([b"one two three", "\u00e9t\u00e9 chaud".encode(), b""], dtype=object)

    async def main():
        async with KServeModel(server.address, "tokenize_sum", compression=compression) as m:
            return await m.infer([InferInput("text", texts)])

    response = anyio.run(main, backend=anyio_backend)
    tokens, labels = tokenize_sum_reference(texts)
    np.testing.assert_array_equal(InferOutput("tokens", response), tokens)
    label = InferOutput("label", response)
    assert label.dtype == object and list(label) == list(labels)
    assert InferInput("text", texts).datatype == "BYTES"
    with pytest.raises(ValueError, match="OutputSpec 'label' is BYTES"):
        OutputSpec("label", "BYTES")

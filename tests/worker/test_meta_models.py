"""Meta models end to end: a model.py orchestration chaining two compiled models."""

from __future__ import annotations

import asyncio
import shutil
import textwrap

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException

from kserve_trio.worker.server import serve, stop
from tests.e2e import reference as ref

CHAIN_MANIFEST = """\
format_version: "2.0"
kind: meta
meta:
  calls: [mlp, double8]
client_inputs:
  - {name: x, dtype: f32, shape: cn, dims: {c: 16}}
client_outputs:
  - {name: y, dtype: f32, shape: cn, dims: {c: 8}}
"""

CHAIN_MODEL_PY = """
import time
import numpy as np
from kserve_trio.core.tensors.tensor import NamedTensor

def run(inputs, call):
    (x,) = inputs
    h = call("mlp", [NamedTensor.from_array("input_0", np.asarray(x.data))])[0].data
    # A data-dependent step between the two models: keep only above-mean activations.
    h = np.where(h > h.mean(axis=1, keepdims=True), h, 0.0).astype(np.float32)
    if float(x.data[0, 0]) == 123.0:  # waits out the request's budget before the next sub-call
        while call.deadline_ns and time.monotonic_ns() <= call.deadline_ns:
            time.sleep(0.005)
    buf = call.scratch("h", h.shape, np.float32)
    buf[...] = h
    y = call("double8", [NamedTensor.from_array("input_0", buf.copy())])[0].data
    return [NamedTensor.from_array("y", np.asarray(y))]

register_meta_model("chain", run=run)
"""

UNDECLARED_MODEL_PY = """
from kserve_trio.core.tensors.tensor import NamedTensor

def run(inputs, call):
    return call("cnn", inputs)

register_meta_model("rogue", run=run)
"""


def chain_reference(x, w):
    h = ref.mlp(x, w)
    h = np.where(h > h.mean(axis=1, keepdims=True), h, 0.0)
    return 2.0 * h


@pytest.fixture(scope="module")
def meta_repo(demo_repo, tmp_path_factory):
    from kserve_trio.export import export_bundle

    repo = tmp_path_factory.mktemp("meta") / "models"
    repo.mkdir()
    shutil.copytree(demo_repo / "mlp", repo / "mlp")
    export_bundle(
        "jax",
        lambda x, two: x * two,
        np.zeros((1, 8), np.float32),
        [("two", np.array(2.0, np.float32))],
        dir=repo / "double8",
        batch_sizes=[1, 8, 32],
    )
    for name, manifest, code in (
        ("chain", CHAIN_MANIFEST, CHAIN_MODEL_PY),
        ("rogue", CHAIN_MANIFEST.replace("chain", "rogue"), UNDECLARED_MODEL_PY),
    ):
        (repo / name).mkdir()
        (repo / name / "manifest.yaml").write_text(manifest)
        (repo / name / "model.py").write_text(textwrap.dedent(code))
    return repo


@pytest.fixture(scope="module")
def server(meta_repo):
    running = serve(
        None,
        blocking=False,
        model_dirs=[str(meta_repo)],
        model_control_mode="static",
        endpoints={"port": 0},
        meta={"fanout_bytes": 1 << 20, "fanout_slots": 4},
    )
    yield running
    stop(running)


def chain_input(x):
    inp = grpcclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def test_meta_chains_two_models_correctly_under_concurrency(server, meta_repo):
    w = ref.weights(meta_repo, "mlp")

    async def main():
        client = aioclient.InferenceServerClient(server.address)
        try:

            async def one(i):
                x = np.random.default_rng(i).standard_normal((1 + i % 4, 16), dtype=np.float32)
                inp = aioclient.InferInput("x", list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                r = await client.infer("chain", [inp])
                return x, r.as_numpy("y")

            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await client.close()

    for x, y in asyncio.run(main()):
        np.testing.assert_allclose(y, chain_reference(x, w), rtol=1e-5, atol=1e-5)


def test_meta_metadata_index_and_hidden_submodels(server):
    c = grpcclient.InferenceServerClient(server.address)
    md = c.get_model_metadata("chain", as_json=True)
    assert md["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", "16"]}]
    names = [m["name"] for m in c.get_model_repository_index(as_json=True)["models"]]
    assert "chain" in names and "mlp" not in names and "double8" not in names
    assert c.is_model_ready("mlp")  # hidden from the index, still directly inferable
    inp = grpcclient.InferInput("input_0", [1, 8], "FP32")
    inp.set_data_from_numpy(np.ones((1, 8), np.float32))
    np.testing.assert_allclose(c.infer("double8", [inp]).as_numpy("output"), 2.0)


def test_expired_budget_stops_before_the_next_subcall(server):
    c = grpcclient.InferenceServerClient(server.address)
    x = np.zeros((1, 16), np.float32)
    x[0, 0] = 123.0
    with pytest.raises(InferenceServerException) as err:
        # Triton's timeout parameter (µs): room for the first sub-call on a loaded machine
        c.infer("chain", [chain_input(x)], timeout=2_000_000)
    assert err.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert "before its call to 'double8'" in err.value.message()


def test_calling_an_undeclared_model_is_an_error_naming_it(server):
    c = grpcclient.InferenceServerClient(server.address)
    with pytest.raises(InferenceServerException) as err:
        c.infer("rogue", [chain_input(np.ones((1, 16), np.float32))])
    assert "called undeclared model 'cnn'; add it to meta.calls" in err.value.message()
    assert c.is_server_live()

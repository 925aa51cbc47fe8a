"""PyTorch models exported here, served by one CLI worker, queried with stock tritonclient.

One session fixture exports every model into one repository (the MLP through the
``bundle export-torch`` command line, the rest through ``export_bundle``) and starts one worker;
each test compares the served outputs with torch eager at every compiled batch size and at a
padded one: f32 within rtol/atol 1e-5, bf16 within its own tolerance, integer outputs exactly.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from kserve_trio.export import export_bundle
from tests.e2e.conftest import WorkerProcess
from tests.export import torch_models

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
F32 = {"rtol": 1e-5, "atol": 1e-5}
# bf16 keeps 8 significant bits: one rounding of a value near 1 is up to 2**-8 (0.4%); XLA and
# torch round the intermediate results at different points, so allow a few such roundings
BF16 = {"rtol": 2e-2, "atol": 2e-2}


@pytest.fixture(scope="session")
def torch_repo(tmp_path_factory) -> pathlib.Path:
    repo = tmp_path_factory.mktemp("torch") / "models"
    repo.mkdir()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "kserve_trio",
            "bundle",
            "export-torch",
            "tests.export.torch_models:mlp",
            "--example-shape",
            "1,16",
            "--batch-sizes",
            "1,4,8",
            "--dir",
            str(repo / "mlp"),
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=600,
    )
    export_bundle(
        "torch",
        torch_models.cnn(),
        (torch.randn(1, 3, 16, 16),),
        dir=repo / "cnn",
        batch_sizes=[1, 4],
    )
    export_bundle(
        "torch",
        torch_models.encoder(),
        (torch.randn(1, 5, 16),),
        dir=repo / "encoder",
        batch_sizes=[1, 2, 4],
    )
    export_bundle(
        "torch",
        torch_models.multi_io(),
        (torch.randn(1, 8), torch.randn(1, 4)),
        dir=repo / "multi_io",
        batch_sizes=[1, 4],
        input_names=["x", "y"],
        output_names=["logits", "label", "diff"],
    )
    export_bundle(
        "torch",
        torch_models.tokens(),
        (torch.randn(1, 6, 8),),
        dir=repo / "tokens",
        batch_sizes=[1, 2],
        input_shapes=[[(1, 6, 8)], [(1, 10, 8)]],
    )
    script = torch_models.cnn_torchscript(str(repo.parent / "cnn.pt"))
    export_bundle(
        "torchscript", script, (torch.randn(1, 3, 16, 16),), dir=repo / "cnn_ts", batch_sizes=[1, 4]
    )
    export_bundle(
        "torch",
        torch_models.mlp_bf16(),
        (torch.randn(1, 16).to(torch.bfloat16),),
        dir=repo / "mlp_bf16",
        batch_sizes=[1, 4],
    )
    return repo


@pytest.fixture(scope="session")
def torch_worker(torch_repo):
    worker = WorkerProcess(torch_repo)
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.terminate()


@pytest.fixture(scope="session")
def client(torch_worker):
    return grpcclient.InferenceServerClient(torch_worker.url)


def _infer(client, model, arrays, names=None, datatypes=None):
    names = names or [f"input_{i}" for i in range(len(arrays))]
    inputs = []
    for i, (n, a) in enumerate(zip(names, arrays, strict=True)):
        dt = (datatypes or ["FP32"] * len(arrays))[i]
        inp = grpcclient.InferInput(n, list(a.shape), dt)
        inp.set_data_from_numpy(a)
        inputs.append(inp)
    return client.infer(model, inputs)


def _eager(model, *xs):
    with torch.no_grad():
        return model(*[torch.from_numpy(np.ascontiguousarray(x)) for x in xs])


def test_every_model_is_ready_and_the_worker_never_loads_torch(torch_worker, client):
    models = sorted(m["name"] for m in client.get_model_repository_index(as_json=True)["models"])
    assert models == ["cnn", "cnn_ts", "encoder", "mlp", "mlp_bf16", "multi_io", "tokens"]
    for m in models:
        assert client.is_model_ready(m), m
    maps = pathlib.Path(f"/proc/{torch_worker.proc.pid}/maps").read_text()
    assert "libtorch" not in maps and "torch/lib" not in maps


@pytest.mark.parametrize(
    ("model", "factory", "shape", "rows"),
    [
        ("mlp", torch_models.mlp, (16,), (1, 3, 4, 8)),
        ("cnn", torch_models.cnn, (3, 16, 16), (1, 3, 4)),
        ("cnn_ts", torch_models.cnn, (3, 16, 16), (1, 2, 4)),
        ("encoder", torch_models.encoder, (5, 16), (1, 2, 3, 4)),
    ],
)
def test_single_input_models_match_torch_eager(client, model, factory, shape, rows):
    m = factory()
    rng = np.random.default_rng(len(model))
    for n in rows:
        x = rng.standard_normal((n, *shape), dtype=np.float32)
        got = _infer(client, model, [x]).as_numpy("output")
        want = _eager(m, x).numpy()
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, **F32, err_msg=f"{model} at {n} row(s)")


def test_multi_input_multi_output(client):
    m = torch_models.multi_io()
    rng = np.random.default_rng(7)
    for n in (1, 2, 4):
        x = rng.standard_normal((n, 8), dtype=np.float32)
        y = rng.standard_normal((n, 4), dtype=np.float32)
        r = _infer(client, "multi_io", [x, y], names=["x", "y"])
        logits, label, diff = _eager(m, x, y)
        np.testing.assert_allclose(r.as_numpy("logits"), logits.numpy(), **F32)
        got_label = r.as_numpy("label")
        assert got_label.dtype == np.int64
        np.testing.assert_array_equal(got_label, label.numpy())
        np.testing.assert_allclose(r.as_numpy("diff"), diff.numpy(), **F32)
    md = client.get_model_metadata("multi_io", as_json=True)
    assert [o["datatype"] for o in md["outputs"]] == ["FP32", "INT64", "FP32"]


def test_shape_variants(client):
    m = torch_models.tokens()
    rng = np.random.default_rng(8)
    for length in (6, 10):
        for n in (1, 2):
            x = rng.standard_normal((n, length, 8), dtype=np.float32)
            got = _infer(client, "tokens", [x]).as_numpy("output")
            np.testing.assert_allclose(got, _eager(m, x).numpy(), **F32)
    md = client.get_model_metadata("tokens", as_json=True)
    assert md["inputs"][0]["shape"] == ["-1", "-1", "8"]


def test_bf16(client):
    m = torch_models.mlp_bf16()
    rng = np.random.default_rng(9)
    for n in (1, 3, 4):
        x = rng.standard_normal((n, 16), dtype=np.float32).astype(ml_dtypes.bfloat16)
        got = _infer(client, "mlp_bf16", [x], datatypes=["BF16"]).as_numpy("output")
        with torch.no_grad():
            want = m(torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)).float().numpy()
        np.testing.assert_allclose(got.astype(np.float32), want, **BF16)

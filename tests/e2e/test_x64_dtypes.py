"""INT64, UINT64 and FP64 served by a default CLI worker (no JAX_ENABLE_X64), read by tritonclient.

Two bundles are exported in this process and served by one worker whose environment has no jax
64-bit flag: ``wide`` takes and returns int64, uint64 and float64 tensors (one float32 output
that must stay float32, and an echo of the float64 input), ``argmax64`` takes float32 and returns an int64 index (its only
64-bit tensor is a result). Every value must come back bit for bit: int64 min/max, uint64 max,
float64 values float32 cannot hold, nan and infinities, at every batch size.
"""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.e2e.conftest import WorkerProcess

pytestmark = pytest.mark.slow

I64 = np.iinfo(np.int64)
U64 = np.iinfo(np.uint64)
W = np.array([1 / 3, -2.0, 1e-300, 1 + 2**-50])


def wide_fn(a, b, c, w):
    import jax.numpy as jnp

    return (
        a + jnp.int64(1),
        b ^ jnp.uint64(0xFFFF_FFFF_FFFF_FFFF),
        c * w,
        (c * w).astype(jnp.float32),
        c,
    )


def wide_ref(a, b, c):
    with np.errstate(over="ignore", invalid="ignore"):
        return [a + np.int64(1), b ^ np.uint64(U64.max), c * W, (c * W).astype(np.float32), c]


def argmax_fn(x):
    import jax.numpy as jnp

    return jnp.argmax(x, axis=-1).astype(jnp.int64) + jnp.int64(2**40)


@pytest.fixture(scope="module")
def x64_worker(tmp_path_factory):
    import jax

    from kserve_trio.export import export_bundle

    repo = tmp_path_factory.mktemp("x64") / "models"
    examples = (
        np.zeros((1, 4), np.int64),
        np.zeros((1, 4), np.uint64),
        np.zeros((1, 4), np.float64),
    )
    export_bundle(
        "jax",
        wide_fn,
        examples,
        [("w", W)],
        dir=repo / "wide",
        batch_sizes=[1, 4],
        input_names=["i64", "u64", "f64"],
        output_names=["i64_out", "u64_out", "f64_out", "f32_out", "f64_echo"],
    )
    # a 64-bit result from 32-bit inputs: the user traces in 64-bit mode themselves
    with jax.enable_x64(True):
        export_bundle(
            "jax",
            argmax_fn,
            np.zeros((1, 5), np.float32),
            None,
            dir=repo / "argmax64",
            batch_sizes=[1, 8],
        )
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("JAX_ENABLE_X64", raising=False)
        worker = WorkerProcess(repo)
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.terminate()


def extremes(rows: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.integers(I64.min, I64.max, (rows, 4), dtype=np.int64, endpoint=True)
    b = rng.integers(0, U64.max, (rows, 4), dtype=np.uint64, endpoint=True)
    c = rng.standard_normal((rows, 4)) * 1e200
    a[0] = [I64.min, I64.max, -1, 2**53 + 1]
    b[0] = [U64.max, 0, 2**63, 2**53 + 1]
    c[0] = [np.nan, np.inf, -np.inf, 1 + 2**-40]
    if rows > 1:
        c[1] = [5e-324, -0.0, 1.7976931348623157e308, 0.1]
    return [a, b, c]


def test_metadata_reports_64_bit_datatypes(x64_worker):
    c = grpcclient.InferenceServerClient(x64_worker.url)
    md = c.get_model_metadata("wide", as_json=True)
    assert [(t["name"], t["datatype"]) for t in md["inputs"]] == [
        ("i64", "INT64"),
        ("u64", "UINT64"),
        ("f64", "FP64"),
    ]
    assert [t["datatype"] for t in md["outputs"]] == ["INT64", "UINT64", "FP64", "FP32", "FP64"]
    md = c.get_model_metadata("argmax64", as_json=True)
    assert md["outputs"][0]["datatype"] == "INT64"


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_exact_round_trips_at_every_batch_size(x64_worker, rows):
    """1 and 4 are compiled sizes; 2 and 3 are padded to 4 (the padding must not leak)."""
    c = grpcclient.InferenceServerClient(x64_worker.url)
    xs = extremes(rows, seed=rows)
    inputs = []
    for name, dt, x in zip(("i64", "u64", "f64"), ("INT64", "UINT64", "FP64"), xs, strict=True):
        inp = grpcclient.InferInput(name, list(x.shape), dt)
        inp.set_data_from_numpy(x)
        inputs.append(inp)
    r = c.infer("wide", inputs)
    want = wide_ref(*xs)
    names = ("i64_out", "u64_out", "f64_out", "f32_out", "f64_echo")
    for name, ref in zip(names, want, strict=True):
        got = r.as_numpy(name)
        assert got.dtype == ref.dtype, name
        assert got.shape == ref.shape, name
        assert got.tobytes() == ref.tobytes(), name  # bit for bit, nan payloads and -0.0 included
    got = r.as_numpy("i64_out")
    assert got[0, 1] == I64.min and got[0, 0] == I64.min + 1
    assert r.as_numpy("u64_out")[0, 1] == U64.max
    f64 = r.as_numpy("f64_out")
    assert np.isnan(f64[0, 0]) and f64[0, 1] == np.inf * W[1] == -np.inf
    assert f64[0, 3] == (1 + 2**-40) * (1 + 2**-50)
    assert float(np.float32(f64[0, 3])) != f64[0, 3]
    echo = r.as_numpy("f64_echo")
    assert echo.tobytes() == xs[2].tobytes()  # nan, +-inf, -0.0, the smallest subnormal


def test_64_bit_result_of_a_32_bit_model(x64_worker):
    c = grpcclient.InferenceServerClient(x64_worker.url)
    x = np.random.default_rng(3).standard_normal((6, 5)).astype(np.float32)
    inp = grpcclient.InferInput("input_0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    out = c.infer("argmax64", [inp]).as_numpy("output")
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out, x.argmax(-1).astype(np.int64) + 2**40)


def test_worker_environment_has_no_x64_flag(x64_worker):
    """The worker served all of the above without jax's flag in its environment."""
    import pathlib

    environ = pathlib.Path(f"/proc/{x64_worker.proc.pid}/environ").read_bytes().split(b"\0")
    assert not any(e.startswith(b"JAX_ENABLE_X64=") for e in environ)
    assert x64_worker.proc.poll() is None

"""64-bit tensors load and run without the user touching jax's 64-bit flag.

The runtime scopes jax's 64-bit mode to modules with an ``i64``/``u64``/``f64`` tensor; these
tests load such a bundle in a process whose global flag is off and check that (1) every value
round-trips bit for bit, extremes included, on both loading paths, (2) the global flag and jax's
default dtypes are untouched afterwards, and (3) 32-bit modules keep the unwrapped executable.
"""

from __future__ import annotations

import pathlib
import threading

import numpy as np
import pytest

from kserve_trio.runtime import load_compiled_model
from kserve_trio.runtime.x64 import WIDE_DTYPES, needs_x64

I64 = np.iinfo(np.int64)
U64 = np.iinfo(np.uint64)


def wide_fn(a, b, c, w):
    """int64 + 1 wraps, uint64 ^ mask, float64 * w (w = 1/3, not representable in f32)."""
    import jax.numpy as jnp

    return a + jnp.int64(1), b ^ jnp.uint64(0xFFFF_FFFF_FFFF_FFFF), c * w, (c * w).sum(-1)


@pytest.fixture(scope="module")
def wide_bundle(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    import jax

    from kserve_trio.export import export_bundle

    assert not jax.config.jax_enable_x64, "the test process must run with jax's x64 flag off"
    d = tmp_path_factory.mktemp("x64") / "wide"
    examples = (
        np.zeros((1, 4), np.int64),
        np.zeros((1, 4), np.uint64),
        np.zeros((1, 4), np.float64),
    )
    export_bundle("jax", wide_fn, examples, [("w", np.full(4, 1 / 3))], dir=d, batch_sizes=[1, 4])
    return d


def extreme_inputs(rows: int) -> list[np.ndarray]:
    a = np.array([[I64.min, I64.max, -1, 2**53 + 1]] * rows, np.int64)
    b = np.array([[U64.max, 0, 2**63, 2**53 + 1]] * rows, np.uint64)
    c = np.array([[1e300, np.nan, np.inf, 1 + 2**-40]] * rows, np.float64)
    c[:, 1] = np.nan
    return [a, b, c]


def expected(a, b, c):
    with np.errstate(over="ignore"):
        w = np.full(4, 1 / 3)
        return [a + np.int64(1), b ^ np.uint64(U64.max), c * w, (c * w).sum(-1)]


@pytest.mark.parametrize("prefer_jaxexport", [True, False], ids=["jaxexport", "mlir"])
def test_64_bit_bundle_round_trips_exactly(backend, wide_bundle, prefer_jaxexport):
    import jax

    m = load_compiled_model(wide_bundle, backend, prefer_jaxexport=prefer_jaxexport)
    try:
        assert {e.source for e in m.executables.values()} == (
            {"jaxexport"} if prefer_jaxexport else {"mlir"}
        )
        for rows in (1, 4):
            xs = extreme_inputs(rows)
            outs = m.execute(None, rows, xs)
            want = expected(*xs)
            assert [o.dtype for o in outs] == [np.int64, np.uint64, np.float64, np.float64]
            for got, ref in zip(outs, want, strict=True):
                np.testing.assert_array_equal(got, ref)  # bit-exact; nan == nan here
            assert outs[0][0, 1] == I64.min  # int64 max + 1 wraps, as in numpy
            assert outs[1][0, 1] == U64.max
            assert outs[2][0, 3] == (1 + 2**-40) * (1 / 3)
            assert float(np.float32(outs[2][0, 3])) != outs[2][0, 3]  # not representable in f32
        # the weight went to the device as f64, not narrowed
        (w_dev,) = m._device_weights
        assert np.asarray(w_dev).dtype == np.float64
        assert np.asarray(w_dev)[0] == 1 / 3
    finally:
        m.close()
    # nothing leaked into the process-wide jax configuration
    assert not jax.config.jax_enable_x64
    assert jax.numpy.zeros(2).dtype == np.float32
    assert (jax.numpy.ones(2, np.float32) * 0.1).dtype == np.float32


def test_32_bit_modules_keep_the_plain_executable(backend, demo_bundles):
    """The f32 mlp's executable is jax's compiled object itself: no scope on its hot path."""
    import jax

    m = load_compiled_model(demo_bundles / "mlp", backend)
    try:
        for exe in m.executables.values():
            assert isinstance(exe.call, jax.stages.Compiled)
    finally:
        m.close()


def test_64_bit_and_32_bit_models_run_concurrently(backend, wide_bundle, demo_bundles):
    """The scope is thread-local: a 64-bit call on one thread never changes another's types."""
    wide = load_compiled_model(wide_bundle, backend)
    mlp = load_compiled_model(demo_bundles / "mlp", backend)
    x32 = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    ref32 = mlp.execute(None, 1, [x32])[0].copy()
    errors: list[BaseException] = []

    def run_wide() -> None:
        try:
            for _ in range(200):
                xs = extreme_inputs(4)
                np.testing.assert_array_equal(wide.execute(None, 4, xs)[0], expected(*xs)[0])
        except BaseException as exc:
            errors.append(exc)

    def run_32() -> None:
        try:
            for _ in range(200):
                out = mlp.execute(None, 1, [x32])[0]
                assert out.dtype == np.float32
                np.testing.assert_array_equal(out, ref32)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run_wide), threading.Thread(target=run_32)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        wide.close()
        mlp.close()
    assert not errors, errors


def test_transfer_keeps_64_bit_host_arrays(backend):
    import jax

    hosts = [
        np.array([I64.min, I64.max], np.int64),
        np.array([U64.max], np.uint64),
        np.array([1 / 3, np.inf], np.float64),
        np.array([0.5], np.float32),
    ]
    bufs = backend.transfer_to_device(hosts)
    try:
        for h, b in zip(hosts, bufs, strict=True):
            assert b.dtype == h.dtype
            np.testing.assert_array_equal(np.asarray(b), h)
    finally:
        backend.free_weights(bufs)
    assert not jax.config.jax_enable_x64


def test_needs_x64():
    assert needs_x64([np.float32, np.int64])
    assert needs_x64([np.dtype("uint64")])
    assert needs_x64(["float64"])
    assert not needs_x64([np.float32, np.int32, np.uint32, np.float16, np.bool_])
    assert not needs_x64([])
    assert np.dtype(np.int64) in WIDE_DTYPES

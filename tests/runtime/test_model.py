"""Loading bundles: numbers, compile-once, shared device weights, residency, and refusals."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import jax
import ml_dtypes
import numpy as np
import pytest

from kserve_trio.core.errors import BundleError, FailedPrecondition, Internal
from kserve_trio.export import export_bundle
from kserve_trio.runtime import CompiledModel, compile_count, load_compiled_model
from kserve_trio.runtime.weights import write_weights

from .conftest import mlp_fn, rand, two_in_two_out

MLP_W = {
    "w1": rand((16, 64), seed=1),
    "b1": rand((64,), seed=2),
    "w2": rand((64, 8), seed=3),
    "b2": rand((8,), seed=4),
}
TWO_W = [("w", rand((5, 3), seed=5)), ("c", rand((3,), seed=6))]
SEQ_W = {"proj": rand((4, 2), seed=7)}


def seq_fn(x, proj):
    """[B, L, 4] -> [B, L, 2] and a per-row sum [B]."""
    y = x @ proj
    return y, y.sum(axis=(1, 2))


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    root = tmp_path_factory.mktemp("bundles")
    export_bundle("jax", mlp_fn, rand((1, 16)), MLP_W, dir=root / "mlp", batch_sizes=[1, 8, 32])
    export_bundle(
        "jax",
        two_in_two_out,
        (rand((1, 5)), rand((1, 5))),
        TWO_W,
        dir=root / "two",
        batch_sizes=[2, 4],
    )
    export_bundle("jax", mlp_fn, rand((3, 16)), MLP_W, dir=root / "flat")
    export_bundle(
        "jax",
        seq_fn,
        rand((1, 3, 4)),
        SEQ_W,
        dir=root / "seq",
        batch_sizes=[1, 2],
        input_shapes=[[(1, 3, 4)], [(1, 5, 4)]],
    )
    bf = {k: v.astype(ml_dtypes.bfloat16) for k, v in MLP_W.items()}
    export_bundle(
        "jax",
        mlp_fn,
        rand((1, 16)).astype(ml_dtypes.bfloat16),
        bf,
        dir=root / "bf",
        batch_sizes=[4],
    )
    return root


def _without_sidecars(src, dst):
    shutil.copytree(src, dst)
    for p in dst.glob("*.jaxexport"):
        p.unlink()
    return dst


def _close(a, b, rtol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=1e-6)


# ---------------------------------------------------------------------------- numbers


@pytest.mark.parametrize("sidecar", [True, False])
def test_mlp_matches_the_jitted_function_at_every_batch_size(bundles, backend, tmp_path, sidecar):
    d = bundles / "mlp" if sidecar else _without_sidecars(bundles / "mlp", tmp_path / "mlp")
    m = load_compiled_model(d, backend)
    assert {e.source for e in m.executables.values()} == {"jaxexport" if sidecar else "mlir"}
    assert m.variants == (None,) and m.batch_keys(None) == (1, 8, 32)
    ref = jax.jit(mlp_fn)
    for n in (1, 8, 32):
        x = rand((n, 16), seed=n)
        (y,) = m.execute(None, n, [x])
        assert y.shape == (n, 8) and y.dtype == np.float32
        _close(y, ref(x, *MLP_W.values()))


@pytest.mark.parametrize("sidecar", [True, False])
def test_multi_input_multi_output(bundles, backend, tmp_path, sidecar):
    d = bundles / "two" if sidecar else _without_sidecars(bundles / "two", tmp_path / "two")
    m = load_compiled_model(d, backend)
    assert [t.name for t in m.manifest.executable_outputs] == ["output_0", "output_1"]
    for n in (2, 4):
        a, b = rand((n, 5), seed=n), rand((n, 5), seed=n + 10)
        ya, yb = m.execute(None, n, [a, b])
        ra, rb = jax.jit(two_in_two_out)(a, b, *(w for _, w in TWO_W))
        _close(ya, ra)
        _close(yb, rb)


@pytest.mark.parametrize("sidecar", [True, False])
def test_unbatched_model(bundles, backend, tmp_path, sidecar):
    d = bundles / "flat" if sidecar else _without_sidecars(bundles / "flat", tmp_path / "flat")
    m = load_compiled_model(d, backend)
    assert m.batch_keys(None) == (0,)
    assert m.manifest.batching.compiled_batch_sizes == ()
    x = rand((3, 16), seed=9)
    (y,) = m.execute(None, 0, [x])
    _close(y, jax.jit(mlp_fn)(x, *MLP_W.values()))


@pytest.mark.parametrize("sidecar", [True, False])
def test_multi_shape_model(bundles, backend, tmp_path, sidecar):
    d = bundles / "seq" if sidecar else _without_sidecars(bundles / "seq", tmp_path / "seq")
    m = load_compiled_model(d, backend)
    assert m.variants == (0, 1)
    assert m.batch_keys(0) == (1, 2) and m.batch_keys(1) == (1, 2)
    assert m.manifest.variant_keys == ((3,), (5,))
    for variant, length in ((0, 3), (1, 5)):
        assert m.manifest.variant_index({"input_0": (2, length, 4)}) == variant
        x = rand((2, length, 4), seed=length)
        y, s = m.execute(variant, 2, [x])
        ry, rs = jax.jit(seq_fn)(x, SEQ_W["proj"])
        _close(y, ry)
        _close(s, rs, rtol=1e-5)


def test_bf16_model_within_bf16_tolerance(bundles, backend):
    m = load_compiled_model(bundles / "bf", backend)
    x = rand((4, 16), seed=11).astype(ml_dtypes.bfloat16)
    (y,) = m.execute(None, 4, [x])
    assert y.dtype == ml_dtypes.bfloat16
    ref = jax.jit(mlp_fn)(x, *(w.astype(ml_dtypes.bfloat16) for w in MLP_W.values()))
    np.testing.assert_allclose(
        y.astype(np.float32), np.asarray(ref).astype(np.float32), rtol=2e-2, atol=2e-2
    )


def test_demo_bundles_load_and_match_their_references(demo_bundles, backend):
    from kserve_trio.export import demo

    m = load_compiled_model(demo_bundles / "cnn", backend)
    x = rand((8, 3, 32, 32), seed=3)
    _close(m.execute(None, 8, [x])[0], demo.cnn_reference(x), rtol=1e-4)
    s4 = load_compiled_model(demo_bundles / "scale4", backend)
    assert s4.batch_keys(None) == (0,) and s4.manifest.batching.compiled_batch_sizes == (1,)
    np.testing.assert_array_equal(
        s4.execute(None, 0, [np.arange(4, dtype=np.float32)])[0], [0, 2, 4, 6]
    )


# ---------------------------------------------------------------------------- compile once, weights once


def test_each_module_compiles_exactly_once(bundles, backend):
    before = compile_count()
    m = load_compiled_model(bundles / "seq", backend)
    assert compile_count() - before == 4 == len(m.executables)
    for variant in m.variants:
        for key in m.batch_keys(variant):
            m.execute(variant, key, [rand((key, 3 + 2 * variant, 4))])
    assert compile_count() - before == 4  # executing never compiles


def test_device_weights_are_allocated_once_per_model(bundles, backend, monkeypatch):
    calls = []
    real = backend.transfer_to_device
    monkeypatch.setattr(backend, "transfer_to_device", lambda hosts: calls.append(1) or real(hosts))
    base = backend.memory_in_use()
    m = load_compiled_model(bundles / "mlp", backend)
    assert len(calls) == 1
    assert m.weight_nbytes == sum(w.nbytes for w in MLP_W.values())
    assert backend.memory_in_use() - base == m.weight_nbytes
    for n in (1, 8, 32):
        m.execute(None, n, [rand((n, 16))])
    assert len(calls) == 1
    m.close()


# ---------------------------------------------------------------------------- residency


def test_free_and_reload_weights(bundles, backend):
    m = load_compiled_model(bundles / "mlp", backend, resident=False)
    assert not m.weights_resident()
    x = rand((1, 16))
    with pytest.raises(FailedPrecondition, match=r"^model 'mlp' is not resident$"):
        m.execute(None, 1, [x])
    m.load_weights()
    assert m.weights_resident()
    first = m.execute(None, 1, [x])[0].copy()
    base = backend.memory_in_use()
    m.free_weights()
    assert not m.weights_resident()
    assert base - backend.memory_in_use() == m.weight_nbytes
    m.free_weights()  # idempotent
    m.load_weights([w.copy() for w in m.host_weights()])
    np.testing.assert_array_equal(m.execute(None, 1, [x])[0], first)


def test_load_weights_checks_host_arrays(bundles, backend):
    m = load_compiled_model(bundles / "mlp", backend, resident=False)
    hosts = [w.copy() for w in m.host_weights()]
    hosts[2] = hosts[2].astype(np.float64)
    with pytest.raises(
        BundleError,
        match=r"host weight 'w2' is float64\[64, 8\], the weights file has f32\[64, 8\]",
    ):
        m.load_weights(hosts)
    with pytest.raises(
        BundleError, match=r"3 host weight array\(s\) given, the weights file has 4"
    ):
        m.load_weights(hosts[:3])
    assert not m.weights_resident()


def test_close_frees_weights_and_refuses_work(bundles, backend):
    m = load_compiled_model(bundles / "mlp", backend)
    bufs = m._device_weights
    m.close()
    assert all(b.is_deleted() for b in bufs)
    assert m.executables == {}
    with pytest.raises(FailedPrecondition, match=r"^model 'mlp' has been unloaded$"):
        m.execute(None, 1, [rand((1, 16))])
    with pytest.raises(FailedPrecondition, match=r"has been unloaded"):
        m.load_weights()


def test_unknown_keys_and_bad_inputs_are_internal_errors(bundles, backend):
    m = load_compiled_model(bundles / "mlp", backend)
    with pytest.raises(
        Internal,
        match=r"no module compiled for variant None batch size 4 \(have batch sizes \[1, 8, 32\]\)",
    ):
        m.execute(None, 4, [rand((4, 16))])
    with pytest.raises(Internal, match=r"has no shape variant 3"):
        m.batch_keys(3)
    with pytest.raises(
        Internal, match=r"^model 'mlp' execution failed \(variant None, batch size 8\)"
    ):
        m.execute(None, 8, [rand((7, 16))])
    assert isinstance(m, CompiledModel) and "mlp" in repr(m)


# ---------------------------------------------------------------------------- refusals


def test_arity_mismatch_is_refused_before_compiling(bundles, backend, tmp_path):
    d = shutil.copytree(bundles / "mlp", tmp_path / "mlp")
    extra = jax.export.export(
        jax.jit(lambda x, w1, b1, w2, b2, rng: mlp_fn(x, w1, b1, w2, b2) + rng)
    )(
        *[
            jax.ShapeDtypeStruct(s, np.float32)
            for s in [(8, 16), (16, 64), (64,), (64, 8), (8,), (8,)]
        ]
    )
    (d / "model.b8.mlir").write_bytes(extra.mlir_module_serialized)
    before = compile_count()
    with pytest.raises(BundleError) as info:
        load_compiled_model(d, backend)
    assert str(info.value) == (
        f"bundle 'mlp' ({d}): module 'model.b8.mlir' takes 6 argument(s) but the bundle declares "
        "5 (1 executable input(s) in manifest.yaml + 4 weight(s) in weights.safetensors)"
    )
    assert compile_count() == before


def test_shape_mismatch_names_the_argument(bundles, backend, tmp_path):
    d = shutil.copytree(bundles / "mlp", tmp_path / "mlp")
    shutil.copy(d / "model.b1.mlir", d / "model.b8.mlir")
    with pytest.raises(
        BundleError,
        match=r"module 'model.b8.mlir' argument 0 \(input 'input_0'\) is tensor<1x16xf32> but the manifest declares f32\[8,16\]",
    ):
        load_compiled_model(d, backend)


def test_weight_mismatch_names_the_weight(bundles, backend, tmp_path):
    d = shutil.copytree(bundles / "mlp", tmp_path / "mlp")
    w = dict(MLP_W)
    w["b2"] = np.zeros(9, np.float32)
    write_weights(d / "weights.safetensors", list(w.items()))
    with pytest.raises(
        BundleError,
        match=r"argument 4 \(weight 'b2'\) is tensor<8xf32> but weights.safetensors holds f32\[9\]",
    ):
        load_compiled_model(d, backend)


def test_missing_weight_name_is_the_spec_error(bundles, backend, tmp_path):
    d = shutil.copytree(bundles / "mlp", tmp_path / "mlp")
    import json
    import struct

    raw = (d / "weights.safetensors").read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + hlen])
    header["__metadata__"]["argument_order"] = json.dumps(["w1", "b1", "w2", "bias2"])
    blob = json.dumps(header).encode()
    (d / "weights.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + hlen :])
    with pytest.raises(BundleError, match=r"weight 'bias2' missing from safetensors"):
        load_compiled_model(d, backend)


def test_a_mismatching_sidecar_is_ignored_for_the_mlir(bundles, backend, tmp_path):
    d = shutil.copytree(bundles / "mlp", tmp_path / "mlp")
    shutil.copy(d / "model.b1.jaxexport", d / "model.b8.jaxexport")
    before = compile_count()
    m = load_compiled_model(d, backend)
    assert compile_count() - before == 3
    assert m.executables[(None, 8)].source == "mlir"
    assert m.executables[(None, 1)].source == "jaxexport"
    _close(m.execute(None, 8, [rand((8, 16))])[0], jax.jit(mlp_fn)(rand((8, 16)), *MLP_W.values()))


def test_meta_bundles_have_nothing_to_compile(tmp_path, backend):
    d = tmp_path / "meta"
    d.mkdir()
    (d / "manifest.yaml").write_text(
        'format_version: "2.0"\nkind: meta\nmeta: {calls: []}\n'
        "client_inputs: [{name: x, dtype: f32, shape: a, dims: {a: 2}}]\n"
        "client_outputs: [{name: y, dtype: f32, shape: a, dims: {a: 2}}]\n"
    )
    (d / "model.py").write_text("register_meta_model('meta', run=lambda i, c: i)\n")
    with pytest.raises(BundleError, match=r"a meta bundle has no compiled modules to load"):
        load_compiled_model(d, backend)


# ---------------------------------------------------------------------------- a fresh process


@pytest.mark.slow
def test_bundles_load_in_a_fresh_process_with_and_without_sidecars(bundles, tmp_path):
    """Export here, load in a new interpreter: the same numbers, with and without .jaxexport."""
    inputs = {
        "mlp": {n: [rand((n, 16), seed=n)] for n in (1, 8, 32)},
        "two": {n: [rand((n, 5), seed=n), rand((n, 5), seed=n + 1)] for n in (2, 4)},
        "flat": {0: [rand((3, 16), seed=5)]},
    }
    refs = {
        "mlp": {n: [jax.jit(mlp_fn)(*x, *MLP_W.values())] for n, x in inputs["mlp"].items()},
        "two": {
            n: list(jax.jit(two_in_two_out)(*x, *(w for _, w in TWO_W)))
            for n, x in inputs["two"].items()
        },
        "flat": {0: [jax.jit(mlp_fn)(*inputs["flat"][0], *MLP_W.values())]},
    }
    arrays = {}
    for model, by_n in inputs.items():
        for n, xs in by_n.items():
            for i, x in enumerate(xs):
                arrays[f"{model}|{n}|{i}"] = x
    np.savez(tmp_path / "in.npz", **arrays)
    bare = tmp_path / "bare"
    for model in inputs:
        _without_sidecars(bundles / model, bare / model)
    script = textwrap.dedent(
        f"""
        import numpy as np
        from kserve_trio.runtime import JaxBackend, load_compiled_model, compile_count
        be = JaxBackend.create("cpu")
        xs = np.load({str(tmp_path / "in.npz")!r})
        out = {{}}
        for tag, root in (("side", {str(bundles)!r}), ("bare", {str(bare)!r})):
            for model in ("mlp", "two", "flat"):
                m = load_compiled_model(root + "/" + model, be)
                for key in m.batch_keys(None):
                    args = [xs[k] for k in sorted(xs.files) if k.startswith(f"{{model}}|{{key}}|")]
                    for j, y in enumerate(m.execute(None, key, args)):
                        out[f"{{tag}}|{{model}}|{{key}}|{{j}}"] = y
        out["compiles"] = np.array(compile_count())
        np.savez({str(tmp_path / "out.npz")!r}, **out)
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=240, capture_output=True)
    got = np.load(tmp_path / "out.npz")
    assert int(got["compiles"]) == 2 * (3 + 2 + 1)
    for tag in ("side", "bare"):
        for model, by_n in refs.items():
            for n, ys in by_n.items():
                for j, y in enumerate(ys):
                    _close(got[f"{tag}|{model}|{n}|{j}"], y)


# ---------------------------------------------------------------------------- signature rules


def _sig(args, results):
    from kserve_trio.runtime._xla import EntrySignature, TensorType

    def tt(shape):
        return TensorType(tuple(shape), "f32", f"tensor<{'x'.join(map(str, shape))}xf32>")

    return EntrySignature(tuple(tt(s) for s in args), tuple(tt(s) for s in results))


def test_output_variable_axes_are_free_even_when_letters_coincide():
    from kserve_trio.core.bundles.manifest import parse_manifest
    from kserve_trio.runtime.model import check_module_signature
    from kserve_trio.runtime.weights import WeightsIndex

    m = parse_manifest(
        {
            "format_version": "2.0",
            "executable_inputs": [{"name": "x", "dtype": "f32", "shape": "cn", "dims": {"c": -1}}],
            "executable_outputs": [{"name": "y", "dtype": "f32", "shape": "cn", "dims": {"c": -1}}],
            "batching": {"compiled_batch_sizes": [2]},
            "input_shapes": [{"c": 3}],
        },
        "v",
    )
    none = WeightsIndex(path=None, entries=(), n_tensors=0, metadata={})  # type: ignore[arg-type]
    kw = dict(
        manifest=m, weights=none, module="model.v0.b2.mlir", variant=0, batch_key=2, where="w"
    )
    check_module_signature(_sig([(2, 3)], [(2, 7)]), **kw)  # output length differs: fine
    with pytest.raises(
        BundleError,
        match=r"argument 0 \(input 'x'\) is tensor<2x5xf32> but the manifest declares f32\[2,3\]",
    ):
        check_module_signature(_sig([(2, 5)], [(2, 7)]), **kw)
    with pytest.raises(
        BundleError,
        match=r"result 0 \(output 'y'\) is tensor<3x7xf32> but the manifest declares f32\[2,\?\]",
    ):
        check_module_signature(_sig([(2, 3)], [(3, 7)]), **kw)
    with pytest.raises(
        BundleError,
        match=r"returns 2 result\(s\) but the manifest declares 1 executable output\(s\)",
    ):
        check_module_signature(_sig([(2, 3)], [(2, 7), (2,)]), **kw)


@pytest.mark.gpu
def test_demo_bundles_on_cuda_match_their_references(demo_bundles):
    """Numerics f32 on the GPU gives the CPU's numbers; the weights live on the GPU."""
    from .test_backend import run_fresh

    run_fresh(
        f"""
        import numpy as np
        from kserve_trio.export import demo
        from kserve_trio.runtime import JaxBackend, load_compiled_model
        gpu = JaxBackend.create("cuda", numerics="f32", allow_cpu_fallback=False, preallocate=False)
        m = load_compiled_model({str(demo_bundles / "mlp")!r}, gpu)
        assert all(b.devices() == {{gpu.device}} for b in m._device_weights)
        rng = np.random.default_rng(0)
        for n in m.batch_keys(None):
            x = rng.standard_normal((n, 16)).astype(np.float32)
            np.testing.assert_allclose(m.execute(None, n, [x])[0], demo.mlp_reference(x),
                                       rtol=1e-5, atol=1e-6)
        before = gpu.memory_stats()["bytes_in_use"]
        m.free_weights()
        assert gpu.memory_stats()["bytes_in_use"] <= before - m.weight_nbytes
        """
    )

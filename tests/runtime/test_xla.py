"""The private-API module ``runtime._xla``: artifacts, entry signatures, numerics, Exported glue.

These tests pin the jax minor version in ``pyproject.toml``: if a jax upgrade breaks a private
interface, it breaks here first.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from kserve_trio.runtime import _xla

SCALE4 = """
module @scale4 {
  func.func public @main(%arg0: tensor<4xf32>, %arg1: tensor<4xf32>) -> tensor<4xf32> {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}
"""

TYPES = """
module @types {
  func.func @main(%a: tensor<2x3xbf16>, %b: tensor<i1>, %c: tensor<5xui8>, %d: tensor<1x2x3xi64>,
                  %e: tensor<4xf8E4M3FN>) -> (tensor<2x3xbf16>, tensor<i1>) {
    return %a, %b : tensor<2x3xbf16>, tensor<i1>
  }
}
"""

NO_MAIN = """
module @m {
  func.func @forward(%arg0: tensor<4xf32>) -> tensor<4xf32> {
    return %arg0 : tensor<4xf32>
  }
}
"""

DYNAMIC = """
module @dyn {
  func.func @main(%arg0: tensor<?x4xf32>) -> tensor<?x4xf32> {
    return %arg0 : tensor<?x4xf32>
  }
}
"""


def _mixed(x, w, k, h):
    """A TF32 dot, a default-precision dot, a convolution and a bf16 dot."""
    y = jax.lax.dot(x, w, precision=jax.lax.DotAlgorithmPreset.TF32_TF32_F32)
    z = jax.lax.conv_general_dilated(k, k, (1, 1), "SAME")
    return y, z, x @ w, h @ h


_SPECS = [
    jax.ShapeDtypeStruct((2, 4), np.float32),
    jax.ShapeDtypeStruct((4, 3), np.float32),
    jax.ShapeDtypeStruct((1, 1, 3, 3), np.float32),
    jax.ShapeDtypeStruct((2, 2), jax.numpy.bfloat16),
]


@pytest.fixture(scope="module")
def mixed_artifact() -> bytes:
    # exported for cuda: jax refuses to lower a TF32 algorithm for the CPU, but the artifact is
    # plain StableHLO and the rewrite works on it anywhere
    return jax.export.export(jax.jit(_mixed), platforms=("cuda",))(*_SPECS).mlir_module_serialized


def _text(artifact: bytes) -> str:
    ctx, module = _xla.parse_module(artifact)
    with ctx:
        return str(module)


def _compile_and_run(artifact: bytes, args):
    sig = _xla.entry_signature(artifact)
    exp = _xla.exported_from_module(artifact, sig, platform="cpu", name="t")
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    return jax.jit(exp.call).lower(*specs).compile()(*args)


def test_text_becomes_portable_artifact_and_artifacts_pass_through():
    art = _xla.as_portable_artifact(SCALE4)
    assert art.startswith(_xla.MLIR_BYTECODE_MAGIC)
    assert _xla.as_portable_artifact(art) == art
    assert _xla.as_portable_artifact(SCALE4.encode()) == art


def test_garbage_is_refused_with_the_parser_message():
    with pytest.raises(_xla.ModuleFormatError, match=r"cannot read StableHLO module"):
        _xla.as_portable_artifact("func.func @main(")
    with pytest.raises(_xla.ModuleFormatError, match=r"neither MLIR bytecode nor UTF-8 text"):
        _xla.as_portable_artifact(b"\xff\xfe\x00garbage")
    with pytest.raises(TypeError, match=r"cannot make a StableHLO module out of int"):
        _xla.as_portable_artifact(42)


def test_entry_signature_reads_arguments_and_results():
    sig = _xla.entry_signature(_xla.as_portable_artifact(SCALE4))
    assert sig.arity == 2
    assert [(t.shape, t.token) for t in sig.args] == [((4,), "f32"), ((4,), "f32")]
    assert [(t.shape, t.token) for t in sig.results] == [((4,), "f32")]


def test_entry_signature_maps_every_element_type():
    sig = _xla.entry_signature(TYPES)
    assert [(t.shape, t.token) for t in sig.args] == [
        ((2, 3), "bf16"),
        ((), "bool"),
        ((5,), "u8"),
        ((1, 2, 3), "i64"),
        ((4,), "f8_e4m3"),
    ]
    assert sig.results[1].spelling == "tensor<i1>"


def test_module_without_main_is_refused():
    with pytest.raises(_xla.ModuleFormatError, match=r"module has no 'main' function"):
        _xla.entry_signature(NO_MAIN)


def test_dynamic_shapes_are_refused_for_execution():
    sig = _xla.entry_signature(DYNAMIC)
    assert sig.args[0].shape == (-1, 4)
    with pytest.raises(_xla.ModuleFormatError, match=r"dynamic dimension in tensor<\?x4xf32>"):
        _xla.exported_from_module(_xla.as_portable_artifact(DYNAMIC), sig, platform="cpu", name="d")


def test_exported_from_module_runs_a_foreign_module():
    art = _xla.as_portable_artifact(SCALE4)
    (y,) = _compile_and_run(art, [np.arange(4, dtype=np.float32), np.full(4, 2, np.float32)])
    np.testing.assert_array_equal(np.asarray(y), [0, 2, 4, 6])


def test_f32_rewrite_sets_highest_and_replaces_tf32_algorithms(mixed_artifact):
    new, counts = _xla.rewrite_numerics(mixed_artifact, force_f32=True, strip_tf32=False)
    assert counts == _xla.NumericsRewrite(set_highest=2, tf32_to_f32=1, tf32_stripped=0)
    text = _text(new)
    assert "lhs_precision_type = tf32" not in text
    assert "lhs_precision_type = f32, rhs_precision_type = f32" in text
    conv = next(line for line in text.splitlines() if "stablehlo.convolution" in line)
    assert (
        "precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]" in conv
    )
    bf16_dot = next(line for line in text.splitlines() if "bf16" in line and "dot_general" in line)
    assert "HIGHEST" not in bf16_dot  # only f32 ops are touched


def test_strip_removes_tf32_algorithms_only(mixed_artifact):
    new, counts = _xla.rewrite_numerics(mixed_artifact, force_f32=False, strip_tf32=True)
    assert counts == _xla.NumericsRewrite(tf32_stripped=1)
    text = _text(new)
    assert "algorithm" not in text
    assert "HIGHEST" not in text


def test_no_rewrite_returns_the_input_unchanged(mixed_artifact):
    same, counts = _xla.rewrite_numerics(mixed_artifact, force_f32=False, strip_tf32=False)
    assert same == mixed_artifact and not counts.changed
    art = _xla.as_portable_artifact(SCALE4)  # no matmul at all
    same, counts = _xla.rewrite_numerics(art, force_f32=True, strip_tf32=True)
    assert same == art and not counts.changed


def test_rewritten_modules_compile_and_compute_the_same_numbers(mixed_artifact):
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s.shape).astype(s.dtype) for s in _SPECS]
    base = [
        np.asarray(o)
        for o in _compile_and_run(
            _xla.rewrite_numerics(mixed_artifact, force_f32=False, strip_tf32=True)[0], args
        )
    ]
    forced = [
        np.asarray(o)
        for o in _compile_and_run(
            _xla.rewrite_numerics(mixed_artifact, force_f32=True, strip_tf32=False)[0], args
        )
    ]
    for a, b in zip(base, forced, strict=True):
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=1e-5)


def test_signature_matches_compares_shapes_and_dtypes():
    sig = _xla.entry_signature(SCALE4)
    f32_4 = jax.ShapeDtypeStruct((4,), np.float32)
    assert _xla.signature_matches(sig.args, [f32_4, f32_4])
    assert not _xla.signature_matches(sig.args, [f32_4])
    assert not _xla.signature_matches(sig.args, [f32_4, jax.ShapeDtypeStruct((4,), np.float16)])
    assert not _xla.signature_matches(sig.args, [f32_4, jax.ShapeDtypeStruct((5,), np.float32)])


def test_backends_initialized_after_first_device_lookup():
    jax.devices()
    assert _xla.backends_initialized() is True


def test_portable_target_version_is_a_dotted_version():
    parts = _xla.portable_target_version().split(".")
    assert len(parts) == 3 and all(p.isdigit() for p in parts)

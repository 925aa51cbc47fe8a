"""write_bundle: layouts, manifest, weights, provenance patch, and refusing before writing."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from ruamel.yaml import YAML

from kserve_trio.core.bundles.bundle import discover_modules, validate_manifest
from kserve_trio.core.errors import BundleError
from kserve_trio.export import IOSpec, write_bundle
from kserve_trio.runtime import load_compiled_model, read_weights_index


def matmul(n: int, k: int = 4, m: int = 2) -> str:
    """StableHLO text: ``main(x: [n,k], w: [k,m], b: [m]) -> x @ w + b``."""
    return f"""
module @mm {{
  func.func public @main(%x: tensor<{n}x{k}xf32>, %w: tensor<{k}x{m}xf32>, %b: tensor<{m}xf32>)
      -> tensor<{n}x{m}xf32> {{
    %0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0]
        : (tensor<{n}x{k}xf32>, tensor<{k}x{m}xf32>) -> tensor<{n}x{m}xf32>
    %1 = stablehlo.broadcast_in_dim %b, dims = [1] : (tensor<{m}xf32>) -> tensor<{n}x{m}xf32>
    %2 = stablehlo.add %0, %1 : tensor<{n}x{m}xf32>
    return %2 : tensor<{n}x{m}xf32>
  }}
}}
"""


W = [("w", np.arange(8, dtype=np.float32).reshape(4, 2)), ("b", np.array([1, -1], np.float32))]
X = IOSpec("x", "f32", (1, 4), batch_axis=0)
Y = IOSpec("y", "f32", (1, 2), batch_axis=0)


def _yaml(d):
    return YAML(typ="safe").load((d / "manifest.yaml").read_text())


def test_single_shape_layout_round_trips_through_the_server(tmp_path, backend):
    d = write_bundle(
        tmp_path / "mm",
        name="mm",
        executable_inputs=[X],
        executable_outputs=[Y],
        modules={4: matmul(4), 2: matmul(2)},
        weights=W,
    )
    assert d == tmp_path / "mm"
    assert sorted(p.name for p in d.iterdir()) == [
        "manifest.yaml",
        "model.b2.mlir",
        "model.b4.mlir",
        "weights.safetensors",
    ]
    raw = _yaml(d)
    assert raw["format_version"] == "2.0" and raw["name"] == "mm"
    assert raw["batching"] == {"compiled_batch_sizes": [2, 4]}
    assert raw["executable_inputs"] == [
        {"name": "x", "dtype": "f32", "shape": "an", "dims": {"a": 4}}
    ]
    text = (d / "manifest.yaml").read_text()
    assert "dims: {a: 4}" in text and "compiled_batch_sizes: [2, 4]" in text
    assert read_weights_index(d / "weights.safetensors").names == ("w", "b")
    m = validate_manifest(d)
    assert set(discover_modules(d, m)[None]) == {2, 4}
    model = load_compiled_model(d, backend)
    x = np.ones((2, 4), np.float32)
    np.testing.assert_allclose(model.execute(None, 2, [x])[0], x @ W[0][1] + W[1][1])


def test_one_any_size_module_with_declared_sizes(tmp_path):
    d = write_bundle(
        tmp_path / "one",
        executable_inputs=[IOSpec("x", "f32", (4,))],
        executable_outputs=[IOSpec("y", "f32", (4,))],
        modules={0: SCALE4},
        weights={"w": np.full(4, 2, np.float32)},
        compiled_batch_sizes=[1],
    )
    assert (d / "model.mlir").is_file() and not list(d.glob("model.b*"))
    assert _yaml(d)["batching"] == {"compiled_batch_sizes": [1]}
    with pytest.raises(
        ValueError,
        match=r"compiled_batch_sizes \[8\] disagrees with the modules' batch sizes \[2\]",
    ):
        write_bundle(
            tmp_path / "mm",
            executable_inputs=[X],
            executable_outputs=[Y],
            modules={2: matmul(2)},
            weights=W,
            compiled_batch_sizes=[8],
        )


SCALE4 = """
module @scale4 {
  func.func public @main(%arg0: tensor<4xf32>, %arg1: tensor<4xf32>) -> tensor<4xf32> {
    %0 = stablehlo.multiply %arg0, %arg1 : tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}
"""


def seq(n: int, length: int) -> str:
    """``main(x: [n, L, 4], w: [4, 2]) -> [n, L, 2]``."""
    return f"""
module @seq {{
  func.func public @main(%x: tensor<{n}x{length}x4xf32>, %w: tensor<4x2xf32>) -> tensor<{n}x{length}x2xf32> {{
    %0 = stablehlo.dot_general %x, %w, contracting_dims = [2] x [0]
        : (tensor<{n}x{length}x4xf32>, tensor<4x2xf32>) -> tensor<{n}x{length}x2xf32>
    return %0 : tensor<{n}x{length}x2xf32>
  }}
}}
"""


def test_multi_shape_layout(tmp_path, backend):
    xs = IOSpec("x", "f32", (1, -1, 4), batch_axis=0)
    ys = IOSpec("y", "f32", (1, -1, 2), batch_axis=0)
    w = [("w", np.ones((4, 2), np.float32))]
    d = write_bundle(
        tmp_path / "seq",
        executable_inputs=[xs],
        executable_outputs=[ys],
        modules={(3,): {1: seq(1, 3), 2: seq(2, 3)}, (5,): {1: seq(1, 5), 2: seq(2, 5)}},
        weights=w,
        input_shapes=[[3], [5]],
    )
    assert sorted(p.name for p in d.glob("model*")) == [
        "model.v0.b1.mlir",
        "model.v0.b2.mlir",
        "model.v1.b1.mlir",
        "model.v1.b2.mlir",
    ]
    assert _yaml(d)["input_shapes"] == [{"c": 3}, {"c": 5}]  # x is [n, c, a] row-major
    model = load_compiled_model(d, backend)
    assert model.variants == (0, 1)
    (y,) = model.execute(1, 2, [np.ones((2, 5, 4), np.float32)])
    np.testing.assert_array_equal(y, np.full((2, 5, 2), 4.0))

    common = dict(executable_inputs=[xs], executable_outputs=[ys], weights=w)
    with pytest.raises(
        ValueError, match=r"modules must be keyed by the input_shapes variants \[\(3,\), \(5,\)\]"
    ):
        write_bundle(
            tmp_path / "a", modules={(3,): {1: seq(1, 3)}}, input_shapes=[[3], [5]], **common
        )
    with pytest.raises(
        ValueError,
        match=r"every variant must have the same batch sizes: \(3,\) has \[1, 2\], \(5,\) has \[1\]",
    ):
        write_bundle(
            tmp_path / "b",
            modules={(3,): {1: seq(1, 3), 2: seq(2, 3)}, (5,): {1: seq(1, 5)}},
            input_shapes=[[3], [5]],
            **common,
        )
    with pytest.raises(
        ValueError, match=r"input_shapes variant \[3, 4\] has 2 size\(s\) for 1 variable axes"
    ):
        write_bundle(
            tmp_path / "c", modules={(3, 4): {1: seq(1, 3)}}, input_shapes=[[3, 4]], **common
        )
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_shared_variable_letters_must_agree(tmp_path):
    a = IOSpec("a", "f32", (1, -1), batch_axis=0, letters=("t",))
    b = IOSpec("b", "f32", (1, -1), batch_axis=0, letters=("t",))
    with pytest.raises(
        ValueError, match=r"axis letter 't' .* is shared by two variable axes of different sizes"
    ):
        write_bundle(
            tmp_path / "x",
            executable_inputs=[a, b],
            executable_outputs=[Y],
            modules={(2, 3): {1: SCALE4}},
            input_shapes=[[2, 3]],
        )


def test_name_must_equal_the_directory_basename(tmp_path):
    with pytest.raises(ValueError) as info:
        write_bundle(
            tmp_path / "dirname",
            name="other",
            executable_inputs=[X],
            executable_outputs=[Y],
            modules={2: matmul(2)},
            weights=W,
        )
    assert str(info.value) == (
        "bundle name 'other' must equal the directory basename 'dirname' "
        "(the directory name is the serving name)"
    )
    assert not (tmp_path / "dirname").exists()


def test_arity_mismatch_is_refused_and_nothing_is_written(tmp_path):
    with pytest.raises(ValueError) as info:
        write_bundle(
            tmp_path / "bad",
            executable_inputs=[X],
            executable_outputs=[Y],
            modules={2: matmul(2)},
            weights=W[:1],
        )
    assert str(info.value) == (
        "bundle 'bad': the compiled program is UNSERVABLE and has not been written: model.b2.mlir "
        "takes 3 argument(s) but the bundle declares 2 (1 input(s) + 1 weight(s)); 1 surplus "
        "argument(s): the program lifted values the bundle does not carry (e.g. an RNG key, an "
        "effect token, a platform index or a shape variable)"
    )
    with pytest.raises(
        ValueError,
        match=r"model.b2.mlir takes 3 argument\(s\) but the bundle declares 4 .* 1 argument\(s\) short",
    ):
        write_bundle(
            tmp_path / "bad",
            executable_inputs=[X],
            executable_outputs=[Y],
            modules={2: matmul(2)},
            weights=[*W, ("extra", np.ones(1, np.float32))],
        )
    assert not (tmp_path / "bad").exists()


def test_shape_mismatch_is_refused_before_writing(tmp_path):
    with pytest.raises(
        BundleError,
        match=r"module 'model.b2.mlir' argument 0 \(input 'x'\) is tensor<4x4xf32> but the manifest declares f32\[2,4\]",
    ):
        write_bundle(
            tmp_path / "bad",
            executable_inputs=[X],
            executable_outputs=[Y],
            modules={2: matmul(4)},
            weights=W,
        )
    assert not (tmp_path / "bad").exists()


def test_git_diff_goes_to_working_tree_patch(tmp_path):
    diff = "diff --git a/m.py b/m.py\n+x = 1\n\n"
    d = write_bundle(
        tmp_path / "p",
        executable_inputs=[X],
        executable_outputs=[Y],
        modules={2: matmul(2)},
        weights=W,
        provenance={"git_commit": "abc", "git_diff": diff, "nested": {"k": [1, 2]}},
    )
    assert (d / "working_tree.patch").read_text() == diff
    prov = _yaml(d)["provenance"]
    assert prov == {
        "git_commit": "abc",
        "git_diff_file": "working_tree.patch",
        "nested": {"k": [1, 2]},
    }


def test_rewriting_a_bundle_replaces_its_files(tmp_path):
    common = dict(executable_inputs=[X], executable_outputs=[Y], weights=W)
    d = write_bundle(
        tmp_path / "r",
        modules={2: matmul(2), 4: matmul(4)},
        provenance={"git_diff": "d\n"},
        **common,
    )
    (d / "model.py").write_text("register_model('r')\n")
    write_bundle(d, modules={8: matmul(8)}, **common)
    assert sorted(p.name for p in d.iterdir()) == [
        "manifest.yaml",
        "model.b8.mlir",
        "model.py",
        "weights.safetensors",
    ]


def test_exported_modules_bring_their_jaxexport_sidecar(tmp_path):
    def fn(x, w, b):
        return x @ w + b

    specs = [jax.ShapeDtypeStruct(s, np.float32) for s in [(2, 4), (4, 2), (2,)]]
    exp = jax.export.export(jax.jit(fn), platforms=("cpu",))(*specs)
    d = write_bundle(
        tmp_path / "e", executable_inputs=[X], executable_outputs=[Y], modules={2: exp}, weights=W
    )
    assert (d / "model.b2.mlir").read_bytes() == exp.mlir_module_serialized
    assert (d / "model.b2.jaxexport").read_bytes() == bytes(exp.serialize())


def test_client_specs_and_extra_files(tmp_path):
    d = write_bundle(
        tmp_path / "c",
        executable_inputs=[X],
        executable_outputs=[Y],
        modules={2: matmul(2)},
        weights=dict(W),
        client_outputs=[IOSpec("probs", "f32", (1, 2), batch_axis=0)],
        extra_files={"model.py": "register_model('c')\n"},
        description="a test",
    )
    raw = _yaml(d)
    assert raw["client_outputs"][0]["name"] == "probs" and "client_inputs" not in raw
    assert raw["description"] == "a test"
    assert validate_manifest(d).wire_outputs[0].name == "probs"
    with pytest.raises(ValueError, match=r"extra file name '../x' must be a plain file name"):
        write_bundle(
            tmp_path / "c2",
            executable_inputs=[X],
            executable_outputs=[Y],
            modules={2: matmul(2)},
            weights=W,
            extra_files={"../x": "no"},
        )


def test_bad_modules_and_weights(tmp_path):
    common = dict(executable_inputs=[X], executable_outputs=[Y])
    with pytest.raises(ValueError, match=r"model.b2.mlir: cannot read StableHLO module"):
        write_bundle(tmp_path / "m", modules={2: "not mlir"}, weights=W, **common)
    with pytest.raises(
        ValueError,
        match=r"key 0 \(one module for any batch size\) cannot be mixed with batch sizes \[2\]",
    ):
        write_bundle(tmp_path / "m", modules={0: SCALE4, 2: matmul(2)}, weights=W, **common)
    with pytest.raises(ValueError, match=r"duplicate weight names: \['w'\]"):
        write_bundle(tmp_path / "m", modules={2: matmul(2)}, weights=[W[0], W[0]], **common)
    with pytest.raises(
        TypeError, match=r"weights must be a mapping name -> array or a sequence of"
    ):
        write_bundle(tmp_path / "m", modules={2: matmul(2)}, weights=[np.ones(3)], **common)
    with pytest.raises(TypeError, match=r"weight names must be non-empty strings, got 3"):
        write_bundle(tmp_path / "m", modules={2: matmul(2)}, weights=[(3, np.ones(2))], **common)
    with pytest.raises(TypeError, match=r"executable_inputs entries must be IOSpec, got dict"):
        write_bundle(
            tmp_path / "m",
            executable_inputs=[{"name": "x"}],
            executable_outputs=[Y],
            modules={2: matmul(2)},
        )
    assert not (tmp_path / "m").exists()


def test_weights_file_records_argument_order_as_json(tmp_path):
    d = write_bundle(
        tmp_path / "o",
        executable_inputs=[X],
        executable_outputs=[Y],
        modules={2: matmul(2)},
        weights=W,
    )
    idx = read_weights_index(d / "weights.safetensors")
    assert json.loads(idx.metadata["argument_order"]) == ["w", "b"]

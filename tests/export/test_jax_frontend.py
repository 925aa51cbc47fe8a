"""export_bundle("jax", ...): the contract, naming, weights styles, batch axes, variants, refusals."""

from __future__ import annotations

import inspect
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ruamel.yaml import YAML

from kserve_trio.core.bundles.bundle import validate_manifest
from kserve_trio.export import export_bundle, jax_frontend
from kserve_trio.runtime import load_compiled_model


def _rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _yaml(d):
    return YAML(typ="safe").load((d / "manifest.yaml").read_text())


def test_the_signature_is_the_contract():
    sig = inspect.signature(export_bundle)
    params = [(p.name, p.kind.name, p.default) for p in sig.parameters.values()]
    empty = inspect.Parameter.empty
    assert params == [
        ("frontend", "POSITIONAL_OR_KEYWORD", empty),
        ("fn", "POSITIONAL_OR_KEYWORD", empty),
        ("example_inputs", "POSITIONAL_OR_KEYWORD", empty),
        ("weights", "POSITIONAL_OR_KEYWORD", None),
        ("dir", "KEYWORD_ONLY", empty),
        ("name", "KEYWORD_ONLY", None),
        ("batch_sizes", "KEYWORD_ONLY", None),
        ("input_names", "KEYWORD_ONLY", None),
        ("output_names", "KEYWORD_ONLY", None),
        ("input_batch_axes", "KEYWORD_ONLY", 0),
        ("output_batch_axes", "KEYWORD_ONLY", 0),
        ("client_inputs", "KEYWORD_ONLY", None),
        ("client_outputs", "KEYWORD_ONLY", None),
        ("input_shapes", "KEYWORD_ONLY", None),
        ("matmul_precision", "KEYWORD_ONLY", None),
        ("provenance", "KEYWORD_ONLY", None),
        ("output_select", "KEYWORD_ONLY", None),
    ]
    assert sig.return_annotation in ("Path", pathlib.Path)


def test_unbatched_export_of_a_bare_array(tmp_path, backend):
    w = {"w": _rand(3, 3)}
    d = export_bundle("jax", lambda x, w: jnp.tanh(x @ w), _rand(2, 3), w, dir=tmp_path / "tanh")
    assert d == tmp_path / "tanh"
    assert sorted(p.name for p in d.glob("model*")) == ["model.jaxexport", "model.mlir"]
    raw = _yaml(d)
    assert raw["batching"]["compiled_batch_sizes"] == []
    assert raw["executable_inputs"] == [
        {"name": "input_0", "dtype": "f32", "shape": "ac", "dims": {"a": 3, "c": 2}}
    ]
    assert raw["executable_outputs"][0]["name"] == "output"
    m = load_compiled_model(d, backend)
    x = _rand(2, 3, seed=1)
    np.testing.assert_allclose(m.execute(None, 0, [x])[0], np.tanh(x @ w["w"]), rtol=1e-5)


def test_output_select_exports_the_chosen_arrays_and_drops_the_rest(tmp_path, backend):
    w = {"w": _rand(3, 3)}

    def step(x, w):  # returns (logits, hidden, an int step count) like a training-style forward
        h = jnp.tanh(x @ w)
        return {"logits": h.sum(axis=1), "hidden": h, "step": 7}

    d = export_bundle(
        "jax",
        step,
        _rand(2, 3),
        w,
        dir=tmp_path / "sel",
        batch_sizes=[2],
        output_select=lambda r: (r["hidden"], r["logits"]),
    )
    assert [o["name"] for o in _yaml(d)["executable_outputs"]] == ["output_0", "output_1"]
    m = load_compiled_model(d, backend)
    x = _rand(2, 3, seed=2)
    hidden, logits = m.execute(None, 2, [x])
    np.testing.assert_allclose(hidden, np.tanh(x @ w["w"]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(logits, np.tanh(x @ w["w"]).sum(axis=1), rtol=1e-5, atol=1e-6)
    one = export_bundle(
        "jax", step, _rand(2, 3), w, dir=tmp_path / "one", output_select=lambda r: r["logits"]
    )
    assert [o["name"] for o in _yaml(one)["executable_outputs"]] == ["output"]


def test_output_select_must_return_only_arrays(tmp_path):
    def step(x):
        return x * 2, 7

    with pytest.raises(TypeError, match="output_select returned a int at position 1"):
        export_bundle("jax", step, _rand(2, 3), dir=tmp_path / "bad", output_select=lambda r: r)
    assert not (tmp_path / "bad" / "manifest.yaml").exists()
    with pytest.raises(TypeError, match="output_select is a jax frontend argument"):
        export_bundle("torch", object(), (), dir=tmp_path / "t", output_select=lambda r: r)


def test_tuple_outputs_are_numbered_and_names_can_be_given(tmp_path):
    d = export_bundle(
        "jax",
        lambda a, b: (a + b, a - b),
        (_rand(1, 2), _rand(1, 2)),
        None,
        dir=tmp_path / "t",
        batch_sizes=[1],
    )
    raw = _yaml(d)
    assert [t["name"] for t in raw["executable_inputs"]] == ["input_0", "input_1"]
    assert [t["name"] for t in raw["executable_outputs"]] == ["output_0", "output_1"]
    d = export_bundle(
        "jax",
        lambda a: [a * 2],
        _rand(1, 2),
        [],
        dir=tmp_path / "n",
        batch_sizes=[1],
        input_names=["x"],
        output_names=["y"],
    )
    raw = _yaml(d)
    assert (
        raw["executable_inputs"][0]["name"] == "x" and raw["executable_outputs"][0]["name"] == "y"
    )
    with pytest.raises(ValueError, match=r"output_names has 1 name\(s\) for 2 tensor\(s\)"):
        export_bundle(
            "jax",
            lambda a: (a, a),
            _rand(1, 2),
            None,
            dir=tmp_path / "z",
            batch_sizes=[1],
            output_names=["y"],
        )


def _mlp(x, w1, b1):
    return x @ w1 + b1


@pytest.mark.parametrize("style", ["pairs", "mapping"])
def test_flat_weights_are_trailing_positional_arrays(tmp_path, backend, style):
    w1, b1 = _rand(4, 3, seed=2), _rand(3, seed=3)
    weights = [("w1", w1), ("b1", b1)] if style == "pairs" else {"w1": w1, "b1": b1}
    d = export_bundle("jax", _mlp, _rand(1, 4), weights, dir=tmp_path / "m", batch_sizes=[2, 5])
    m = load_compiled_model(d, backend)
    assert m.weights.names == ("w1", "b1")
    x = _rand(5, 4, seed=4)
    np.testing.assert_allclose(m.execute(None, 5, [x])[0], x @ w1 + b1, rtol=1e-6)


def test_pytree_weights_are_one_argument_named_by_key_path(tmp_path, backend):
    params = {
        "dense": {"kernel": _rand(4, 3, seed=5), "bias": _rand(3, seed=6)},
        "scale": [np.float32(2.0)],
    }

    def fn(x, p):
        return (x @ p["dense"]["kernel"] + p["dense"]["bias"]) * p["scale"][0]

    d = export_bundle("jax", fn, _rand(1, 4), params, dir=tmp_path / "tree", batch_sizes=[3])
    m = load_compiled_model(d, backend)
    assert m.weights.names == ("dense/bias", "dense/kernel", "scale/0")
    x = _rand(3, 4, seed=7)
    np.testing.assert_allclose(
        m.execute(None, 3, [x])[0], np.asarray(jax.jit(fn)(x, params)), rtol=1e-6
    )


def test_unused_weights_stay_arguments(tmp_path, backend):
    d = export_bundle(
        "jax",
        lambda x, used, unused: x * used,
        _rand(1, 2),
        {"used": _rand(2), "unused": _rand(7)},
        dir=tmp_path / "u",
        batch_sizes=[1],
    )
    m = load_compiled_model(d, backend)
    assert m.weights.names == ("used", "unused")
    assert m.executables[(None, 1)].n_args == 3


def test_per_tensor_batch_axes(tmp_path, backend):
    def fn(a, b):  # a [B, 3], b [3, B] -> ([B, 3], [2])
        return a + b.T, jnp.zeros(2) + a.sum()

    d = export_bundle(
        "jax",
        fn,
        (_rand(1, 3), _rand(3, 1)),
        None,
        dir=tmp_path / "ax",
        batch_sizes=[2, 4],
        input_batch_axes=[0, 1],
        output_batch_axes=[0, None],
    )
    mf = validate_manifest(d)
    assert [t.batch_axis for t in mf.executable_inputs] == [0, 1]
    assert [t.batch_axis for t in mf.executable_outputs] == [0, None]
    m = load_compiled_model(d, backend)
    a, b = _rand(4, 3, seed=1), _rand(3, 4, seed=2)
    y0, y1 = m.execute(None, 4, [a, b])
    np.testing.assert_allclose(y0, a + b.T, rtol=1e-6)
    np.testing.assert_allclose(y1, np.full(2, a.sum()), rtol=1e-5)


def test_output_batch_axis_must_carry_the_batch(tmp_path):
    with pytest.raises(ValueError) as info:
        export_bundle("jax", lambda x: x.T, _rand(1, 16), None, dir=tmp_path / "t", batch_sizes=[2])
    assert str(info.value) == (
        "output 'output' has extent 16 on its batch axis 0 at batch size 2; pass "
        "output_batch_axes (None for an unbatched output)"
    )
    assert not (tmp_path / "t").exists()


def test_input_shapes_make_variable_axes(tmp_path, backend):
    def fn(tokens, mask, emb):  # [B, L] int32, [B, L] f32 -> [B, L, 4], [B]
        return emb[tokens] * mask[..., None], mask.sum(-1)

    emb = _rand(10, 4)
    d = export_bundle(
        "jax",
        fn,
        (np.zeros((1, 3), np.int32), np.ones((1, 3), np.float32)),
        {"emb": emb},
        dir=tmp_path / "v",
        batch_sizes=[1, 2],
        input_shapes=[[(1, 3), (1, 3)], [(1, 6), (1, 6)]],
    )
    raw = _yaml(d)
    # each input's variable axis gets a letter of its own, so the variants name both
    assert raw["executable_inputs"][0]["dims"] == {"z": -1}
    assert raw["executable_inputs"][1]["dims"] == {"y": -1}
    assert raw["input_shapes"] == [{"z": 3, "y": 3}, {"z": 6, "y": 6}]
    assert raw["executable_outputs"][0]["dims"] == {"a": 4, "c": -1}
    assert raw["provenance"]["input_shapes"] == [[[1, 3], [1, 3]], [[1, 6], [1, 6]]]
    m = load_compiled_model(d, backend)
    tok = np.array([[1, 2, 3, 4, 5, 6], [0, 0, 9, 9, 1, 1]], np.int32)
    mask = np.ones((2, 6), np.float32)
    variant = m.manifest.variant_index({"input_0": tok.shape, "input_1": mask.shape})
    assert variant == 1
    y, s = m.execute(variant, 2, [tok, mask])
    np.testing.assert_allclose(y, emb[tok], rtol=1e-6)
    np.testing.assert_array_equal(s, [6, 6])
    with pytest.raises(ValueError, match=r"input_shapes has duplicate variants"):
        export_bundle(
            "jax",
            fn,
            (np.zeros((1, 3), np.int32), np.ones((1, 3), np.float32)),
            {"emb": emb},
            dir=tmp_path / "dup",
            batch_sizes=[1],
            input_shapes=[[(1, 3), (1, 3)], [(2, 3), (2, 3)]],
        )


def test_argument_errors(tmp_path):
    f = lambda x: x * 2  # noqa: E731
    with pytest.raises(
        ValueError, match=r"unknown export frontend 'flax'; available: jax, torch, torchscript"
    ):
        export_bundle("flax", f, _rand(1), None, dir=tmp_path / "a")
    with pytest.raises(TypeError, match=r"fn takes 2 positional argument\(s\) but there are 1"):
        export_bundle("jax", lambda x, w: x @ w, _rand(1, 2), dir=tmp_path / "a")
    with pytest.raises(ValueError, match=r"unknown matmul_precision 'fast'"):
        export_bundle("jax", f, _rand(1), dir=tmp_path / "a", matmul_precision="fast")
    with pytest.raises(ValueError, match=r"bundle name 'b' must equal the directory basename 'a'"):
        export_bundle("jax", f, _rand(1), None, dir=tmp_path / "a", name="b")
    with pytest.raises(
        ValueError, match=r"several batch sizes need at least one input with a batch axis"
    ):
        export_bundle(
            "jax", f, _rand(1), None, dir=tmp_path / "a", batch_sizes=[1, 2], input_batch_axes=None
        )
    with pytest.raises(ValueError, match=r"batch_sizes must be positive integers, got \[0\]"):
        export_bundle("jax", f, _rand(1), None, dir=tmp_path / "a", batch_sizes=[0])
    with pytest.raises(ValueError, match=r"input_names has 2 name\(s\) for 1 tensor\(s\)"):
        export_bundle("jax", f, _rand(1), None, dir=tmp_path / "a", input_names=["a", "b"])
    with pytest.raises(TypeError, match=r"example input 0 is a str, not an array"):
        export_bundle("jax", f, ("x",), None, dir=tmp_path / "a")
    with pytest.raises(
        ValueError, match=r"input_batch_axes: axis 2 is not an axis of input 'input_0' \[1, 3\]"
    ):
        export_bundle(
            "jax", f, _rand(1, 3), None, dir=tmp_path / "a", batch_sizes=[1], input_batch_axes=2
        )
    assert not (tmp_path / "a").exists()


def test_a_program_with_lifted_arguments_is_refused_before_writing(tmp_path, monkeypatch):
    def two_platforms(fn, args, platform):
        # a multi-platform export takes a leading platform-index argument: one too many
        return jax.export.export(jax.jit(fn, keep_unused=True), platforms=("cpu", "cuda"))(*args)

    monkeypatch.setattr(jax_frontend, "_export_one", two_platforms)
    with pytest.raises(ValueError) as info:
        export_bundle(
            "jax",
            _mlp,
            _rand(1, 4),
            {"w1": _rand(4, 3), "b1": _rand(3)},
            dir=tmp_path / "lift",
            batch_sizes=[1],
        )
    assert (
        "the compiled program is UNSERVABLE and has not been written: model.b1.mlir takes 4 "
        "argument(s) but the bundle declares 3 (1 input(s) + 2 weight(s)); 1 surplus"
        in str(info.value)
    )
    assert not (tmp_path / "lift").exists()


def test_provenance_is_stamped_and_the_callers_keys_win(tmp_path):
    d = export_bundle(
        "jax",
        lambda x: x + 1,
        _rand(1, 2),
        None,
        dir=tmp_path / "p",
        batch_sizes=[1, 4],
        provenance={"converter": "mine", "run": 7},
    )
    prov = _yaml(d)["provenance"]
    assert prov["source_framework"] == "jax"
    assert prov["jax_version"] == jax.__version__
    assert prov["batch_sizes"] == [1, 4]
    assert prov["converter"] == "mine" and prov["run"] == 7


def test_matmul_precision_is_frozen_into_the_program(tmp_path):
    from kserve_trio.runtime import _xla

    def text(d):
        ctx, module = _xla.parse_module((d / "model.mlir").read_bytes())
        with ctx:
            return module.operation.get_asm(enable_debug_info=False)

    w = {"w": _rand(4, 3)}
    f = lambda x, w: x @ w  # noqa: E731
    plain = export_bundle("jax", f, _rand(2, 4), w, dir=tmp_path / "plain")
    assert "HIGHEST" not in text(plain)
    assert "matmul_precision" not in _yaml(plain)["provenance"]
    hi = export_bundle("jax", f, _rand(2, 4), w, dir=tmp_path / "hi", matmul_precision="HIGHEST")
    assert "HIGHEST" in text(hi)
    assert _yaml(hi)["provenance"]["matmul_precision"] == "highest"

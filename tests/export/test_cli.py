"""``python -m kserve_trio bundle demo|inspect``: the demo repository and the inspection report."""

from __future__ import annotations

import shutil
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from ruamel.yaml import YAML

from kserve_trio.__main__ import main
from kserve_trio.core.bundles.bundle import validate_manifest
from kserve_trio.core.tensors.tensor import NamedTensor
from kserve_trio.export import demo
from kserve_trio.runtime import load_compiled_model, read_weights_index


def _yaml(d):
    return YAML(typ="safe").load((d / "manifest.yaml").read_text())


def _io(d):
    m = validate_manifest(d)
    return (
        [(t.name, t.dtype.token, t.wire_shape()) for t in m.executable_inputs],
        [(t.name, t.dtype.token, t.wire_shape()) for t in m.executable_outputs],
        list(m.batching.compiled_batch_sizes),
    )


def _weights(d):
    idx = read_weights_index(d / "weights.safetensors")
    return [(e.name, e.dtype.token, list(e.shape)) for e in idx.entries]


# ---------------------------------------------------------------------------- demo


def test_demo_writes_exactly_the_five_bundles(tmp_path, capsys):
    assert main(["bundle", "demo", str(tmp_path), "--only", "scale4", "--only", "mlp"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp", "scale4"]
    assert "wrote scale4:" in capsys.readouterr().out


def test_demo_repository_contents(demo_root):
    assert sorted(p.name for p in demo_root.iterdir()) == sorted(demo.DEMO_MODELS)
    for d in demo_root.iterdir():
        assert _yaml(d).get("kind", "model") == "model"  # no meta model

    assert _io(demo_root / "mlp") == (
        [("input_0", "f32", [-1, 16])],
        [("output", "f32", [-1, 8])],
        [1, 8, 32, 64],
    )
    assert _weights(demo_root / "mlp") == [
        ("w1", "f32", [16, 64]),
        ("b1", "f32", [64]),
        ("w2", "f32", [64, 8]),
        ("b2", "f32", [8]),
    ]
    assert _io(demo_root / "cnn") == (
        [("input_0", "f32", [-1, 3, 32, 32])],
        [("output", "f32", [-1, 10])],
        [1, 8, 32],
    )
    assert _weights(demo_root / "cnn") == [
        ("conv_w", "f32", [8, 3, 3, 3]),
        ("conv_b", "f32", [8]),
        ("fc_w", "f32", [8, 10]),
        ("fc_b", "f32", [10]),
    ]
    assert _io(demo_root / "mlp_bf16") == (
        [("input_0", "bf16", [-1, 16])],
        [("output", "bf16", [-1, 8])],
        [1, 8, 32, 64],
    )
    assert {t for _, t, _ in _weights(demo_root / "mlp_bf16")} == {"bf16"}
    soft = validate_manifest(demo_root / "mlp_softmax")
    assert [(t.name, t.dtype.token, t.wire_shape()) for t in soft.client_outputs] == [
        ("probs", "f32", [-1, 8])
    ]
    assert soft.client_inputs is None


def test_demo_weights_come_from_default_rng_0(demo_root):
    hosts = read_weights_index(demo_root / "mlp" / "weights.safetensors").host_arrays()
    ref = demo.mlp_weights()
    for h, (name, r) in zip(hosts, ref.items(), strict=True):
        np.testing.assert_array_equal(h, r, err_msg=name)
    w1 = hosts[0]
    rng = np.random.default_rng(0)
    np.testing.assert_array_equal(w1, (rng.standard_normal((16, 64)) / 4.0).astype(np.float32))
    bf = read_weights_index(demo_root / "mlp_bf16" / "weights.safetensors").host_arrays()
    np.testing.assert_array_equal(bf[0], ref["w1"].astype(ml_dtypes.bfloat16))


def test_scale4_is_the_upstream_fixture(demo_root):
    d = demo_root / "scale4"
    assert sorted(p.name for p in d.iterdir()) == [
        "manifest.yaml",
        "model.mlir",
        "weights.safetensors",
    ]
    raw = _yaml(d)
    assert raw["executable_inputs"] == [
        {"name": "x", "dtype": "f32", "shape": "c", "dims": {"c": 4}}
    ]
    assert raw["executable_outputs"] == [
        {"name": "y", "dtype": "f32", "shape": "c", "dims": {"c": 4}}
    ]
    assert raw["batching"] == {"compiled_batch_sizes": [1]}
    (w,) = read_weights_index(d / "weights.safetensors").host_arrays()
    np.testing.assert_array_equal(w, [2, 2, 2, 2])


def test_demo_models_compute_their_references(demo_root, backend):
    x = np.random.default_rng(5).standard_normal((8, 16)).astype(np.float32)
    mlp = load_compiled_model(demo_root / "mlp", backend)
    np.testing.assert_allclose(
        mlp.execute(None, 8, [x])[0], demo.mlp_reference(x), rtol=1e-5, atol=1e-6
    )
    ref = jax.jit(demo.mlp_fn)(x, *demo.mlp_weights().values())
    np.testing.assert_allclose(mlp.execute(None, 8, [x])[0], np.asarray(ref), rtol=1e-6)
    img = np.random.default_rng(6).standard_normal((1, 3, 32, 32)).astype(np.float32)
    cnn = load_compiled_model(demo_root / "cnn", backend)
    np.testing.assert_allclose(
        cnn.execute(None, 1, [img])[0], demo.cnn_reference(img), rtol=1e-4, atol=1e-5
    )
    bf = load_compiled_model(demo_root / "mlp_bf16", backend)
    yb = bf.execute(None, 8, [x.astype(ml_dtypes.bfloat16)])[0].astype(np.float32)
    np.testing.assert_allclose(yb, demo.mlp_reference(x), rtol=5e-2, atol=5e-2)


def test_mlp_softmax_model_py_registers_a_softmax_postprocess(demo_root, backend):
    from kserve_trio.worker.hooks import loading_bundle, register_meta_model, register_model

    source = (demo_root / "mlp_softmax" / "model.py").read_text()
    with loading_bundle("mlp_softmax") as reg:
        exec(
            compile(source, "model.py", "exec"),
            {"register_model": register_model, "register_meta_model": register_meta_model},
        )
    assert reg.kind == "model" and reg.name == "mlp_softmax" and reg.preprocess is None
    x = np.random.default_rng(7).standard_normal((8, 16)).astype(np.float32)
    model = load_compiled_model(demo_root / "mlp_softmax", backend)
    (logits,) = model.execute(None, 8, [x])
    (probs,) = reg.postprocess([NamedTensor.from_array("output", logits)])
    assert probs.name == "probs" and probs.shape == (8, 8)
    np.testing.assert_allclose(probs.data, demo.softmax_reference(x), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(probs.data.sum(-1), 1.0, rtol=1e-6)


def test_demo_refuses_unknown_names(tmp_path, capsys):
    assert main(["bundle", "demo", str(tmp_path), "--only", "resnet"]) == 2
    assert "unknown demo model(s) ['resnet']" in capsys.readouterr().err


# ---------------------------------------------------------------------------- inspect


def test_inspect_a_servable_bundle(demo_root, capsys):
    assert main(["bundle", "inspect", str(demo_root / "mlp_softmax")]) == 0
    out = capsys.readouterr().out
    assert "bundle mlp_softmax" in out
    assert "executable inputs: input_0 f32[-1,16] batch axis 0" in out
    assert "client outputs: probs f32[-1,8] batch axis 0" in out
    assert "compiled batch sizes: 1, 8, 32, 64" in out
    assert "weights: 4 tensor(s), 6432 bytes (6.3 KiB) in argument order" in out
    assert "modules: each must take 5 argument(s) (1 input(s) + 4 weight(s))" in out
    assert "model.b8.mlir: 5 args ok (+ .jaxexport)" in out
    assert out.index("model.b8.mlir") < out.index("model.b32.mlir")
    assert out.rstrip().endswith("verdict: servable")


def test_inspect_a_repository(demo_root, capsys):
    assert main(["bundle", "inspect", str(demo_root)]) == 0
    out = capsys.readouterr().out
    assert out.count("verdict: servable") == 5
    assert "model.mlir: 2 args ok\n" in out  # scale4 has no sidecar


def test_inspect_reports_an_arity_mismatch_with_exit_1(demo_root, tmp_path, capsys):
    d = shutil.copytree(demo_root / "mlp", tmp_path / "mlp")
    four = jax.export.export(jax.jit(lambda *a: a[0] @ a[1], keep_unused=True))(
        jax.ShapeDtypeStruct((8, 16), np.float32), jax.ShapeDtypeStruct((16, 8), np.float32)
    )
    (d / "model.b8.mlir").write_bytes(four.mlir_module_serialized)
    assert main(["bundle", "inspect", str(d)]) == 1
    out = capsys.readouterr().out
    assert "model.b8.mlir: 2 args MISMATCH" in out
    assert "verdict: UNSERVABLE" in out
    assert "- model.b8.mlir: arity 2 != 5" in out


def test_inspect_reports_bundle_errors_with_exit_1(demo_root, tmp_path, capsys):
    d = shutil.copytree(demo_root / "scale4", tmp_path / "scale4")
    (d / "model.mlir").unlink()
    assert main(["bundle", "inspect", str(d)]) == 1
    assert "UNSERVABLE: bundle 'scale4'" in capsys.readouterr().out
    d2 = shutil.copytree(demo_root / "mlp", tmp_path / "mlp")
    shutil.copy(d2 / "model.b1.mlir", d2 / "model.b8.mlir")
    assert main(["bundle", "inspect", str(d2)]) == 1
    assert "argument 0 (input 'input_0') is tensor<1x16xf32>" in capsys.readouterr().out


def test_inspect_usage_errors(tmp_path, capsys):
    assert main(["bundle", "inspect", str(tmp_path / "nope")]) == 2
    assert main(["bundle", "inspect", str(tmp_path)]) == 2
    assert "holds no bundle" in capsys.readouterr().err
    assert main(["bundle"]) == 2


def test_cli_entry_point_in_a_fresh_interpreter(demo_root):
    res = subprocess.run(
        [sys.executable, "-m", "kserve_trio", "bundle", "inspect", str(demo_root / "scale4")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "verdict: servable" in res.stdout


@pytest.mark.parametrize("name", demo.DEMO_MODELS)
def test_every_demo_bundle_passes_the_arity_audit(demo_root, name):
    from kserve_trio.export import assert_bundle_arity

    assert assert_bundle_arity(demo_root / name).servable

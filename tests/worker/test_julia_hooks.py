"""Bundles from the Julia server whose hooks are only in ``model.jl``: refused at load with a
message naming the file and how to port it, unless the manifest's or the worker's
``serve_without_hooks`` says to serve the executable without them (meta models and bundles
with client tensors never can be)."""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from kserve_trio.core.bundles.bundle import MODEL_JL, bundle_signature_files, validate_manifest
from kserve_trio.core.errors import BundleError, ConfigError, ManifestError
from kserve_trio.core.process.config import apply_env_overrides, build_config, config_to_raw
from kserve_trio.worker.registry import load_repository
from tests.e2e import reference as ref
from tests.inprocess import in_process_worker

JL = 'register_model("mlp"; preprocess = xs -> xs)\n'
META = """\
format_version: "2.0"
kind: meta
meta:
  calls: [mlp]
client_inputs:
  - {name: x, dtype: f32, shape: cn, dims: {c: 16}}
client_outputs:
  - {name: y, dtype: f32, shape: cn, dims: {c: 8}}
"""


@pytest.fixture
def jl_mlp(demo_repo, tmp_path) -> Path:
    """The demo ``mlp`` with a ``model.jl`` beside it and no ``model.py``."""
    bundle = tmp_path / "models" / "mlp"
    shutil.copytree(demo_repo / "mlp", bundle)
    (bundle / "model.py").unlink(missing_ok=True)
    (bundle / MODEL_JL).write_text(JL)
    return bundle


def opt_in(bundle: Path) -> None:
    manifest = bundle / "manifest.yaml"
    manifest.write_text(manifest.read_text() + "serve_without_hooks: true\n")


def test_a_model_jl_only_bundle_is_refused_naming_the_file_and_the_port(jl_mlp):
    with pytest.raises(BundleError) as err:
        validate_manifest(jl_mlp)
    message = str(err.value)
    assert message.startswith(f"bundle 'mlp' ({jl_mlp}): model.jl holds this bundle's hooks")
    assert "port them to model.py (register_model(name, preprocess=..., postprocess=...)" in message
    assert "docs/bundles.md, 'Porting model.jl to model.py'" in message
    assert "'serve_without_hooks: true'" in message


def test_the_manifest_or_the_worker_may_serve_it_without_hooks(jl_mlp):
    assert validate_manifest(jl_mlp, serve_without_hooks=True).name == "mlp"
    opt_in(jl_mlp)
    m = validate_manifest(jl_mlp)
    assert m.serve_without_hooks


def test_a_bundle_with_model_py_uses_it_and_ignores_model_jl(jl_mlp):
    (jl_mlp / "model.py").write_text('register_model("mlp")\n')
    assert not validate_manifest(jl_mlp).serve_without_hooks
    assert jl_mlp / MODEL_JL in bundle_signature_files(jl_mlp)  # a port is a change


def test_a_meta_with_only_model_jl_is_refused_even_when_opted_in(tmp_path):
    bundle = tmp_path / "pipe"
    bundle.mkdir()
    (bundle / "manifest.yaml").write_text(META + "serve_without_hooks: true\n")
    (bundle / MODEL_JL).write_text('register_meta_model("pipe"; run = (xs, call) -> xs)\n')
    with pytest.raises(BundleError, match=r"port them to model\.py \(register_meta_model"):
        validate_manifest(bundle, serve_without_hooks=True)


def test_client_tensors_need_the_hooks_so_opting_in_does_not_help(jl_mlp):
    manifest = jl_mlp / "manifest.yaml"
    manifest.write_text(
        manifest.read_text() + "client_inputs:\n- {name: x, dtype: f32, shape: an, dims: {a: 16}}\n"
    )
    with pytest.raises(BundleError, match="cannot be served without them"):
        validate_manifest(jl_mlp, serve_without_hooks=True)


def test_the_manifest_key_must_be_a_boolean(jl_mlp):
    manifest = jl_mlp / "manifest.yaml"
    manifest.write_text(manifest.read_text() + "serve_without_hooks: 'yes'\n")
    with pytest.raises(ManifestError, match="'serve_without_hooks' must be a boolean"):
        validate_manifest(jl_mlp)


def test_the_worker_key_is_read_from_yaml_and_environment():
    assert build_config({"serve_without_hooks": True}).serve_without_hooks
    assert not build_config({}).serve_without_hooks
    raw, _ = apply_env_overrides({}, {"INFERENCE_SERVER_SERVE_WITHOUT_HOOKS": "1"})
    assert build_config(raw).serve_without_hooks
    assert config_to_raw(build_config(raw))["serve_without_hooks"] is True
    with pytest.raises(ConfigError, match="serve_without_hooks"):
        build_config({"serve_without_hooks": "maybe"})


def test_the_worker_refuses_it_with_the_reason_and_serves_it_when_opted_in(jl_mlp, demo_repo):
    import tritonclient.grpc as grpcclient

    models = jl_mlp.parent
    bundles, failures = load_repository([models], backend=None)
    assert bundles == {} and "model.jl holds this bundle's hooks" in failures["mlp"].reason
    with capture_logs() as logs, in_process_worker(models, serve_without_hooks=True) as running:
        c = grpcclient.InferenceServerClient(running.address)
        assert c.is_model_ready("mlp")
        x = np.ones((2, 16), np.float32)
        inp = grpcclient.InferInput("input_0", [2, 16], "FP32")
        inp.set_data_from_numpy(x)
        got = c.infer("mlp", [inp]).as_numpy("output")
    np.testing.assert_allclose(got, ref.mlp(x, ref.weights(demo_repo, "mlp")), rtol=1e-5, atol=1e-5)
    assert [e["served_with"] for e in logs if e["event"] == "model_jl_not_run"] == ["no hooks"]


def _index(client) -> dict[str, tuple[str, str]]:
    """name -> (state, reason) of a tritonclient (gRPC) repository index."""
    return {m.name: (m.state, m.reason) for m in client.get_model_repository_index().models}


def test_the_repository_index_lists_the_refused_bundle_with_its_reason_until_it_loads(
    jl_mlp, demo_repo
):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    from tests.e2e.conftest import free_port

    models = jl_mlp.parent
    shutil.copytree(demo_repo / "scale4", models / "scale4")
    http_port = free_port()
    with in_process_worker(
        models,
        model_control_mode="dynamic",
        model_poll_seconds=0.05,
        endpoints={"http_port": http_port},
    ) as running:
        c = grpcclient.InferenceServerClient(running.address)
        index = _index(c)
        assert index["scale4"] == ("READY", "")
        state, reason = index["mlp"]
        assert state == "UNAVAILABLE"
        assert "model.jl holds this bundle's hooks" in reason and "model.py" in reason
        rest = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
        rest_index = {m["name"]: m for m in rest.get_model_repository_index()}
        assert rest_index["mlp"]["state"] == "UNAVAILABLE"
        assert rest_index["mlp"]["reason"] == reason
        ready_only = urllib.request.urlopen(
            f"http://127.0.0.1:{http_port}/v2/repository/index", data=b'{"ready": true}'
        )
        assert [m["name"] for m in json.load(ready_only)] == ["scale4"]
        assert not c.is_model_ready("mlp")

        (jl_mlp / "model.py").write_text('register_model("mlp")\n')  # the port, done
        deadline = time.monotonic() + 120
        while _index(c)["mlp"][0] != "READY":
            assert time.monotonic() < deadline, f"mlp never loaded: {_index(c)['mlp']}"
            time.sleep(0.05)
        assert _index(c)["mlp"] == ("READY", "")
        assert c.is_model_ready("mlp")

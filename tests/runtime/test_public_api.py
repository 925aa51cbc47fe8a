"""The public surface of ``kserve_trio.runtime`` and ``kserve_trio.export`` (trio-style pin)."""

from __future__ import annotations

import subprocess
import sys

import kserve_trio.export as export
import kserve_trio.runtime as runtime


def test_runtime_surface():
    assert sorted(runtime.__all__) == [
        "Backend",
        "CompiledModel",
        "Executable",
        "JaxBackend",
        "JaxSettings",
        "NumericsPlan",
        "WeightsIndex",
        "compile_count",
        "free_weights",
        "load_compiled_model",
        "plan_jax_settings",
        "plan_numerics",
        "read_weights_index",
        "transfer_to_device",
        "write_weights",
    ]
    for name in runtime.__all__:
        assert getattr(runtime, name) is not None


def test_export_surface():
    assert sorted(export.__all__) == [
        "ArityReport",
        "IOSpec",
        "ModuleArity",
        "assert_bundle_arity",
        "bundle_arity_report",
        "bundle_entry_arity",
        "collect_provenance",
        "export_bundle",
        "write_bundle",
    ]


def test_compiled_model_has_the_scheduler_interface():
    cm = runtime.CompiledModel
    for attr in (
        "batch_keys",
        "execute",
        "weights_resident",
        "load_weights",
        "free_weights",
        "close",
    ):
        assert callable(getattr(cm, attr))


def test_importing_the_packages_does_not_import_jax():
    code = (
        "import sys, kserve_trio.runtime, kserve_trio.export, kserve_trio.export.cli; "
        "print('jax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

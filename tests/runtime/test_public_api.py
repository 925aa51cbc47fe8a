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
        "EntrySignature",
        "Executable",
        "JaxBackend",
        "JaxSettings",
        "ModuleFormatError",
        "NumericsPlan",
        "TensorType",
        "WeightsIndex",
        "as_portable_artifact",
        "check_module_signature",
        "compile_count",
        "entry_signature",
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


def test_torch_stays_out_of_the_worker_runtime_and_export_import_paths():
    """torch is imported only by the torch export frontends, when one is selected: not by the
    worker, the runtime, the CLI, ``kserve_trio.export`` or a jax export."""
    code = (
        "import sys, numpy as np\n"
        "import kserve_trio.runtime, kserve_trio.export, kserve_trio.export.cli\n"
        "import kserve_trio.export.frontends, kserve_trio.export.torch_cli\n"
        "import kserve_trio.worker, kserve_trio.worker.cli, kserve_trio.__main__\n"
        "kserve_trio.__main__.build_parser()\n"
        "import tempfile, os\n"
        "d = os.path.join(tempfile.mkdtemp(), 'm')\n"
        "kserve_trio.export.export_bundle('jax', lambda x: x * 2, np.zeros((1, 2), np.float32),"
        " dir=d, batch_sizes=[1])\n"
        "kserve_trio.runtime.load_compiled_model(d, kserve_trio.runtime.JaxBackend.create('cpu'))\n"
        "print(sorted(m for m in ('torch', 'torchax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"

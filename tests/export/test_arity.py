"""The arity audit: entry arity, the triage report, and the refusal."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

from kserve_trio.core.errors import BundleError
from kserve_trio.export import (
    ArityReport,
    ModuleArity,
    assert_bundle_arity,
    bundle_arity_report,
    bundle_entry_arity,
)


def test_entry_arity_of_demo_modules(demo_root):
    assert bundle_entry_arity(demo_root / "mlp" / "model.b8.mlir") == 5
    assert bundle_entry_arity(demo_root / "scale4" / "model.mlir") == 2


def test_report_of_a_servable_bundle(demo_root):
    r = bundle_arity_report(demo_root / "mlp")
    assert r == ArityReport(
        name="mlp",
        n_inputs=1,
        n_weights=4,
        expected=5,
        modules=tuple(ModuleArity(f"model.b{n}.mlir", 5, True) for n in (1, 8, 32, 64)),
        servable=True,
    )
    assert assert_bundle_arity(demo_root / "mlp") == r


@pytest.fixture
def broken(demo_root, tmp_path):
    d = shutil.copytree(demo_root / "mlp", tmp_path / "broken")
    six = jax.export.export(jax.jit(lambda *a: a[0], keep_unused=True))(
        *[jax.ShapeDtypeStruct((8, 16), np.float32)] * 6
    )
    (d / "model.b8.mlir").write_bytes(six.mlir_module_serialized)
    (d / "model.b32.mlir").write_bytes(b"not a module")
    return d


def test_report_triages_without_raising(broken):
    r = bundle_arity_report(broken)
    assert not r.servable
    by_file = {m.module_file: m for m in r.modules}
    assert by_file["model.b1.mlir"].servable
    assert by_file["model.b8.mlir"] == ModuleArity("model.b8.mlir", 6, False)
    assert by_file["model.b32.mlir"].entry_args is None
    assert "cannot read StableHLO module" in by_file["model.b32.mlir"].error


def test_assert_refuses_naming_every_bad_module(broken):
    with pytest.raises(BundleError) as info:
        assert_bundle_arity(broken)
    msg = str(info.value)
    assert msg.startswith(
        "bundle `broken` is UNSERVABLE: expected 5 argument(s) per module (1 input(s) + 4 "
        "weight(s)), but model.b8.mlir takes 6 argument(s); model.b32.mlir is unreadable ("
    )
    assert "model.b1.mlir" not in msg


def test_weights_count_excludes_metadata_and_missing_files_count_zero(demo_root, tmp_path):
    d = shutil.copytree(demo_root / "scale4", tmp_path / "s")
    assert bundle_arity_report(d).n_weights == 1
    (d / "weights.safetensors").unlink()
    r = bundle_arity_report(d)
    assert (r.n_weights, r.expected, r.servable) == (0, 1, False)

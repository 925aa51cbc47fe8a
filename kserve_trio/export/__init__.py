"""Export: produce model bundles (the format authority for producers).

Public surface:

* ``IOSpec`` -- a tensor's row-major spec and its manifest encoding;
* ``write_bundle`` -- the low-level writer (modules + specs + weights -> a bundle directory);
* ``export_bundle(frontend, fn, example_inputs, weights=None, *, dir, ...)`` -- trace a JAX
  function (``"jax"``) or a PyTorch module (``"torch"``, ``"torchscript"``);
* ``collect_provenance`` -- git and environment provenance for the manifest;
* ``bundle_entry_arity``, ``bundle_arity_report``, ``assert_bundle_arity`` -- the arity audit.

With ``kserve_trio.runtime`` this is the only package that imports jax (lazily, on use); torch
is imported only by the torch frontends, when one is selected.
"""

from __future__ import annotations

from kserve_trio.export.arity import (
    ArityReport,
    ModuleArity,
    assert_bundle_arity,
    bundle_arity_report,
    bundle_entry_arity,
)
from kserve_trio.export.frontends import export_bundle
from kserve_trio.export.iospec import IOSpec
from kserve_trio.export.provenance import collect_provenance
from kserve_trio.export.writer import write_bundle

__all__ = [
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

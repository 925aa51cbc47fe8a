"""The bundle format: what a compiled model is on disk.

- ``manifest``: ``manifest.yaml`` parsed into a ``Manifest``, with no filesystem access;
- ``bundle``: every file name of a bundle directory and every rule about it (loading and
  validating a bundle's manifest against its files).

Stands on ``core.tensors`` (manifests name dtypes); the protocol, memory and process domains are
not its business. Code outside the domain imports the names below from this face (the
manifest's too: ``manifest``'s own face serves the domain's modules); the modules import each
other by module path.
"""

from kserve_trio.core.bundles.bundle import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    MODEL_JL,
    MODEL_PY,
    PATCH_FILE,
    WEIGHTS_FILE,
    bundle_signature_files,
    discover_modules,
    is_bundle_dir,
    is_program_file,
    load_manifest,
    module_file,
    module_files,
    sidecar_file,
    sidecar_path,
    validate_manifest,
)
from kserve_trio.core.bundles.manifest import (
    DimKind,
    Manifest,
    TensorSpec,
    parse_manifest,
    request_rows,
    wire_batch_spec,
)

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "MODEL_JL",
    "MODEL_PY",
    "PATCH_FILE",
    "WEIGHTS_FILE",
    "DimKind",
    "Manifest",
    "TensorSpec",
    "bundle_signature_files",
    "discover_modules",
    "is_bundle_dir",
    "is_program_file",
    "load_manifest",
    "module_file",
    "module_files",
    "parse_manifest",
    "request_rows",
    "sidecar_file",
    "sidecar_path",
    "validate_manifest",
    "wire_batch_spec",
]

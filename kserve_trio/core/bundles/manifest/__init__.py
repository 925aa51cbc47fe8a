"""Bundle manifests: ``manifest.yaml`` parsed into a ``Manifest``, with no filesystem access.

This package owns the in-memory form of a manifest (``Manifest``, ``TensorSpec``, ``Dim``), the
rules a manifest must satisfy on its own (``parse_manifest``, ``parse_manifest_text``) and the
small derived questions every layer asks of one (``wire_batch_spec``, ``request_rows``,
``Manifest.variant_index``). Every shape-bearing field is row-major; the one reversal of the
manifest's column-major letter strings happens in the parser. The rules about the directory
around a manifest (file names, modules on disk, ``validate_manifest``) are
``kserve_trio.core.bundles.bundle``'s.

The parts live in private modules: ``_types`` (the value types and derived questions) and
``_parse`` (the parser).
"""

from __future__ import annotations

from kserve_trio.core.bundles.manifest._parse import (
    BATCH_LETTERS,
    SUPPORTED_FORMAT_VERSIONS,
    SUPPORTED_KINDS,
    parse_manifest,
    parse_manifest_text,
    parse_tensor_spec,
)
from kserve_trio.core.bundles.manifest._types import (
    BatchingSpec,
    Dim,
    DimKind,
    Manifest,
    TensorSpec,
    VariableAxis,
    executable_batch_spec,
    is_meta,
    request_rows,
    wire_batch_spec,
)

__all__ = [
    "BATCH_LETTERS",
    "SUPPORTED_FORMAT_VERSIONS",
    "SUPPORTED_KINDS",
    "BatchingSpec",
    "Dim",
    "DimKind",
    "Manifest",
    "TensorSpec",
    "VariableAxis",
    "executable_batch_spec",
    "is_meta",
    "parse_manifest",
    "parse_manifest_text",
    "parse_tensor_spec",
    "request_rows",
    "wire_batch_spec",
]

"""Arity audit of written bundles: do the manifest, the weights and the modules agree?

A module is servable only if its ``main`` takes exactly (executable inputs + weights) arguments.
``bundle_arity_report`` reads the three numbers and reports without raising, so it can triage a
whole directory of bundles; ``assert_bundle_arity`` is the same check as a refusal;
``bundle_entry_arity`` reads one module's argument count out of its portable artifact (which cannot
be regex'd: it is VHLO bytecode).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from kserve_trio.core.bundles import MANIFEST_FILE, WEIGHTS_FILE, load_manifest, module_files
from kserve_trio.core.errors import BundleError
from kserve_trio.runtime import entry_signature


@dataclass(frozen=True)
class ModuleArity:
    """One ``model*.mlir`` of a bundle: its entry argument count (``None`` if unreadable)."""

    module_file: str
    entry_args: int | None
    servable: bool
    error: str | None = None


@dataclass(frozen=True)
class ArityReport:
    """``name``, ``n_inputs`` (manifest), ``n_weights`` (tensors in the weights file),
    ``expected`` = their sum, one ``ModuleArity`` per module, and the overall verdict."""

    name: str
    n_inputs: int
    n_weights: int
    expected: int
    modules: tuple[ModuleArity, ...]
    servable: bool


def bundle_entry_arity(mlir_path: str | os.PathLike[str]) -> int:
    """The number of arguments the ``main`` function in ``mlir_path`` takes.

    Raises ``ValueError`` (``runtime.ModuleFormatError``) when the file is not a readable
    StableHLO module with a ``main``.
    """
    return entry_signature(Path(mlir_path).read_bytes()).arity


def _tensor_count(path: Path) -> int:
    """Tensors in a safetensors file, ``__metadata__`` excluded (0 when missing/unreadable)."""
    try:
        with open(path, "rb") as fh:
            (hlen,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(hlen).decode("utf-8"))
    except (OSError, struct.error, ValueError):
        return 0
    return len([k for k in header if k != "__metadata__"]) if isinstance(header, dict) else 0


def bundle_arity_report(dir: str | os.PathLike[str]) -> ArityReport:
    """Compare every ``model*.mlir`` in ``dir`` with its manifest inputs + weights; never raises
    for a mismatch (a missing or unparsable ``manifest.yaml`` still raises its error)."""
    d = Path(dir)
    manifest = load_manifest(d / MANIFEST_FILE)
    n_inputs = len(manifest.executable_inputs)
    n_weights = _tensor_count(d / WEIGHTS_FILE)
    expected = n_inputs + n_weights
    mods: list[ModuleArity] = []
    for f in module_files(d):
        try:
            args: int | None = bundle_entry_arity(d / f)
            err = None
        except (OSError, ValueError) as exc:
            args, err = None, str(exc)
        mods.append(ModuleArity(f, args, args == expected, err))
    servable = bool(mods) and all(m.servable for m in mods) if not manifest.is_meta else True
    return ArityReport(manifest.name, n_inputs, n_weights, expected, tuple(mods), servable)


def assert_bundle_arity(dir: str | os.PathLike[str]) -> ArityReport:
    """``bundle_arity_report`` as a refusal: ``BundleError`` naming every unservable module."""
    r = bundle_arity_report(dir)
    if r.servable:
        return r
    if not r.modules:
        detail = "it has no model*.mlir module"
    else:
        detail = "; ".join(
            f"{m.module_file} takes {m.entry_args} argument(s)"
            if m.entry_args is not None
            else f"{m.module_file} is unreadable ({m.error})"
            for m in r.modules
            if not m.servable
        )
    raise BundleError(
        f"bundle `{r.name}` is UNSERVABLE: expected {r.expected} argument(s) per module "
        f"({r.n_inputs} input(s) + {r.n_weights} weight(s)), but {detail}"
    )


__all__ = [
    "ArityReport",
    "ModuleArity",
    "assert_bundle_arity",
    "bundle_arity_report",
    "bundle_entry_arity",
]

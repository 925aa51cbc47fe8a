"""The bundle format on disk: every file name of a bundle directory and every rule about it.

A bundle is a directory whose basename is the model's serving name. It holds:

* ``manifest.yaml`` (``MANIFEST_FILE``), parsed by ``kserve_trio.core.bundles.manifest``; producers write
  ``format_version`` ``FORMAT_VERSION``;
* ``weights.safetensors`` (``WEIGHTS_FILE``), the trailing arguments of every module;
* ``model.py`` (``MODEL_PY``), the optional pre/post-processing or meta-model hooks;
* ``model.jl`` (``MODEL_JL``), the upstream Julia server's hooks: never run here. A bundle whose
  hooks are only there is refused with how to port them (``validate_manifest``), unless it is
  explicitly served without them (``serve_without_hooks``);
* the compiled StableHLO modules ``model[.v{i}][.b{N}].mlir`` (``module_file``): ``.v{i}`` for
  the ``i``-th entry of ``input_shapes`` of a multi-shape model, ``.b{N}`` for a module compiled
  for batch size N (without it, one module serves any batch size);
* a ``.jaxexport`` sidecar next to any module (``sidecar_file``), the same program serialized by
  ``jax.export`` (a faster loading path; the ``.mlir`` stays authoritative);
* ``working_tree.patch`` (``PATCH_FILE``) when the provenance carries a git diff.

This module answers every question about those files (which exist, which define the bundle's
version, which modules a manifest needs), so no other module spells a bundle file name.

Error wording: a rule about the directory is a ``BundleError`` ``bundle '<name>' (<dir>): <rule>``;
a manifest rule that depends on the directory (``model.py`` present or not) is a
``ManifestError`` ``manifest '<name>' (<manifest path>): <rule>``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from kserve_trio.core.bundles.manifest import Manifest, parse_manifest_text
from kserve_trio.core.errors import BundleError, ManifestError

MANIFEST_FILE = "manifest.yaml"
WEIGHTS_FILE = "weights.safetensors"
MODEL_PY = "model.py"
MODEL_JL = "model.jl"
PORTING_GUIDE = "docs/bundles.md, 'Porting model.jl to model.py'"
"""Where a refusal of a ``model.jl``-only bundle sends its author."""
PATCH_FILE = "working_tree.patch"
FORMAT_VERSION = "2.0"
"""The ``format_version`` a producer writes (readers also accept ``2``)."""

MODULE_PREFIX = "model"
MODULE_SUFFIX = ".mlir"
JAXEXPORT_SUFFIX = ".jaxexport"


# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------


def serving_name(bundle_dir: str | os.PathLike[str]) -> str:
    """The serving name of a bundle: its directory's basename (a manifest's own ``name`` key is
    informational)."""
    return os.path.basename(os.path.normpath(os.path.abspath(bundle_dir)))


def _variant_prefix(variant: int | None) -> str:
    return MODULE_PREFIX if variant is None else f"{MODULE_PREFIX}.v{variant}"


def module_file(variant: int | None, batch: int) -> str:
    """The file name of one compiled module: ``model[.v{variant}][.b{batch}].mlir``; ``variant``
    ``None`` for a single-shape model, ``batch`` 0 for a module that serves any batch size."""
    prefix = _variant_prefix(variant)
    return f"{prefix}{MODULE_SUFFIX}" if batch == 0 else f"{prefix}.b{batch}{MODULE_SUFFIX}"


def sidecar_file(module: str) -> str:
    """The ``.jaxexport`` sidecar name of a module file name (``model.b4.mlir`` ->
    ``model.b4.jaxexport``)."""
    stem = module[: -len(MODULE_SUFFIX)] if module.endswith(MODULE_SUFFIX) else module
    return stem + JAXEXPORT_SUFFIX


def sidecar_path(module: str | os.PathLike[str]) -> Path:
    """The sidecar path next to a module path."""
    p = Path(module)
    return p.with_name(sidecar_file(p.name))


def is_program_file(name: str) -> bool:
    """Whether a file name is a module or a sidecar of some variant (``model*.mlir`` /
    ``model*.jaxexport``): the files a producer replaces as one set."""
    return name.startswith(MODULE_PREFIX) and name.endswith((MODULE_SUFFIX, JAXEXPORT_SUFFIX))


def module_files(bundle_dir: str | os.PathLike[str]) -> list[str]:
    """Every ``model*.mlir`` file name in ``bundle_dir``, needed or not, in natural order
    (``model.b8`` before ``model.b32``): what an audit of the compiled programs looks at."""
    names = [
        e.name
        for e in os.scandir(bundle_dir)
        if e.is_file() and e.name.startswith(MODULE_PREFIX) and e.name.endswith(MODULE_SUFFIX)
    ]
    return sorted(names, key=_natural)


def _natural(name: str) -> list[int | str]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def is_bundle_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory holding a ``manifest.yaml`` (a bundle, valid or not)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST_FILE))


# --------------------------------------------------------------------------------------------
# Reading and validating
# --------------------------------------------------------------------------------------------


def _bundle_error(m_name: str, bundle_dir: Path, rule: str) -> BundleError:
    return BundleError(f"bundle '{m_name}' ({bundle_dir}): {rule}")


def load_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read and parse a manifest file; the serving name is its directory's basename.

    Runs the manifest's own rules only, not the bundle-directory checks of ``validate_manifest``,
    so a client can derive a model's I/O spec from a lone manifest.
    """
    p = Path(path)
    name = serving_name(p.parent)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ManifestError(
            f"manifest '{name}' ({p}): cannot read: {exc.strerror or exc}"
        ) from None
    return parse_manifest_text(text, name, source=str(p))


def validate_manifest(
    bundle_dir: str | os.PathLike[str], *, serve_without_hooks: bool = False
) -> Manifest:
    """Load a bundle's manifest and check the rules that involve the directory around it.

    1. *A manifest that parses*: ``manifest.yaml`` exists and parses (``parse_manifest``'s rules);
    2. *Julia hooks*: hooks only in ``model.jl`` (no ``model.py``; the Julia server's hooks, which
       nothing here runs) are refused naming the file and how to port it: always for a meta model or
       one with ``client_inputs``/``client_outputs`` (without its hooks its wire I/O does not
       exist), otherwise unless the manifest's ``serve_without_hooks: true`` or the worker's
       ``serve_without_hooks`` (the keyword) says to serve the executable as it is;
    3. *Meta models ship model.py*: a meta model ships ``model.py``;
    4. *Client I/O needs model.py*: ``client_inputs``/``client_outputs`` appear only when
       ``model.py`` is present;
    5. *Modules and weights*: a regular model's compiled modules are all present
       (``discover_modules``), and it ships ``weights.safetensors``.

    Whether ``model.py`` calls the right registration function is checked by whoever executes it.
    """
    d = Path(bundle_dir)
    name = serving_name(d)
    mpath = d / MANIFEST_FILE
    if not mpath.is_file():
        raise _bundle_error(name, d, f"missing {MANIFEST_FILE}")
    m = load_manifest(mpath)
    has_py = (d / MODEL_PY).is_file()
    if not has_py and (d / MODEL_JL).is_file():
        _check_julia_hooks(m, d, serve_without_hooks)
    where = f"manifest '{name}' ({mpath})"
    if m.is_meta and not has_py:
        raise ManifestError(
            f"{where}: meta model requires a {MODEL_PY} that calls register_meta_model"
        )
    if not has_py and (m.client_inputs is not None or m.client_outputs is not None):
        raise ManifestError(
            f"{where}: client_inputs/client_outputs are only valid when {MODEL_PY} is present"
        )
    if m.is_meta:
        return m
    discover_modules(d, m)
    if not (d / WEIGHTS_FILE).is_file():
        raise _bundle_error(name, d, f"missing {WEIGHTS_FILE}")
    return m


def _check_julia_hooks(m: Manifest, d: Path, serve_without_hooks: bool) -> None:
    """*Julia hooks* of ``validate_manifest``: a bundle with ``model.jl`` and no ``model.py``."""
    port = (
        f"{MODEL_JL} holds this bundle's hooks and this server does not run Julia: port them to "
        f"{MODEL_PY}"
    )
    if m.is_meta:
        raise _bundle_error(
            m.name, d, f"{port} (register_meta_model(name, run=...); see {PORTING_GUIDE})"
        )
    hooks = "register_model(name, preprocess=..., postprocess=...)"
    if m.client_inputs is not None or m.client_outputs is not None:
        raise _bundle_error(
            m.name,
            d,
            f"{port} ({hooks}; see {PORTING_GUIDE}); its client_inputs/client_outputs exist "
            "only through those hooks, so it cannot be served without them",
        )
    if not (serve_without_hooks or m.serve_without_hooks):
        raise _bundle_error(
            m.name,
            d,
            f"{port} ({hooks}; see {PORTING_GUIDE}), or set 'serve_without_hooks: true' in its "
            f"{MANIFEST_FILE} (or the worker's configuration) to serve the executable without them",
        )


def _batch_modules(
    d: Path, files: Sequence[str], m: Manifest, variant: int | None
) -> dict[int, Path]:
    """One variant's modules: ``<prefix>.b{N}.mlir`` keyed by N, else ``<prefix>.mlir`` under 0.

    If any ``.b{N}`` file exists, each compiled batch size needs one (extra ones still load).
    """
    prefix = _variant_prefix(variant)
    rx = re.compile("^" + re.escape(prefix) + r"\.b(\d+)" + re.escape(MODULE_SUFFIX) + "$")
    found: dict[int, Path] = {}
    for f in files:
        mt = rx.match(f)
        if mt is None:
            continue
        digits = mt.group(1)
        if digits != str(int(digits)) or int(digits) == 0:
            raise _bundle_error(
                m.name,
                d,
                f"module file '{f}' must name a positive batch size without leading zeros",
            )
        found[int(digits)] = d / f
    if not found:
        single = module_file(variant, 0)
        if single not in files:
            raise _bundle_error(m.name, d, f"has no {single} or {prefix}.b{{N}}{MODULE_SUFFIX}")
        return {0: d / single}
    for size in m.batching.compiled_batch_sizes:
        if size not in found:
            raise _bundle_error(
                m.name, d, f"declares batch size {size} but has no {module_file(variant, size)}"
            )
    return dict(sorted(found.items()))


def discover_modules(
    bundle_dir: str | os.PathLike[str], manifest: Manifest
) -> dict[int | None, dict[int, Path]]:
    """Find a regular bundle's compiled StableHLO modules.

    Returns variant index -> batch key -> path. A single-shape bundle has the one variant
    ``None`` (``model.b{N}.mlir`` or ``model.mlir``); a multi-shape bundle has variant ``i`` for
    each ``input_shapes`` entry (``model.v{i}.b{N}.mlir`` or ``model.v{i}.mlir``). Batch key 0
    means "one module for any batch size". ``*.jaxexport`` sidecars are not modules. A meta
    bundle has none (``{}``). A variant with several batch sizes needs an input with a batch axis
    to choose between them.
    """
    d = Path(bundle_dir)
    if manifest.is_meta:
        return {}
    try:
        files = sorted(e.name for e in os.scandir(d) if e.is_file())
    except OSError as exc:
        raise _bundle_error(
            manifest.name, d, f"cannot list directory: {exc.strerror or exc}"
        ) from None
    out: dict[int | None, dict[int, Path]] = {}
    if not manifest.input_shapes:
        out[None] = _batch_modules(d, files, manifest, None)
    else:
        for i in range(len(manifest.input_shapes)):
            out[i] = _batch_modules(d, files, manifest, i)
    if manifest.input_batch_dim is None and any(len(v) > 1 for v in out.values()):
        raise _bundle_error(
            manifest.name,
            d,
            "multiple compiled batch sizes but no input with a batch axis ('n'/'b')",
        )
    return out


def bundle_signature_files(bundle_dir: str | os.PathLike[str]) -> list[Path]:
    """Every existing file that defines a bundle's version, sorted by name.

    ``manifest.yaml``, ``weights.safetensors``, ``model.py``, ``model.jl`` and every ``model*.mlir`` /
    ``model*.jaxexport`` (variant files included). The watcher stats these
    to notice that a bundle changed.
    """
    d = Path(bundle_dir)
    fixed = {MANIFEST_FILE, WEIGHTS_FILE, MODEL_PY, MODEL_JL}
    try:
        entries = [e for e in os.scandir(d) if e.is_file()]
    except OSError:
        return []
    names = sorted(e.name for e in entries if e.name in fixed or is_program_file(e.name))
    return [d / n for n in names]


__all__ = [
    "FORMAT_VERSION",
    "JAXEXPORT_SUFFIX",
    "MANIFEST_FILE",
    "MODEL_JL",
    "MODEL_PY",
    "MODULE_PREFIX",
    "MODULE_SUFFIX",
    "PATCH_FILE",
    "PORTING_GUIDE",
    "WEIGHTS_FILE",
    "bundle_signature_files",
    "discover_modules",
    "is_bundle_dir",
    "is_program_file",
    "load_manifest",
    "module_file",
    "module_files",
    "serving_name",
    "sidecar_file",
    "sidecar_path",
    "validate_manifest",
]

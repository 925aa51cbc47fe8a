"""``write_bundle``: the low-level bundle writer.

Given tensor specs, StableHLO modules and ordered weights, it writes a bundle directory that the
server loads: ``manifest.yaml``, ``model[.v{i}][.b{N}].mlir`` portable artifacts (plus a
``.jaxexport`` sidecar for every module handed over as a ``jax.export.Exported``),
``weights.safetensors`` with its ``argument_order``, and ``working_tree.patch`` when the
provenance carries a git diff. Everything is checked before the first byte is written: the name,
the layout, the manifest rules (through ``core.bundles.manifest``; the file names are ``core.bundles.bundle``'s),
and every module's entry signature --
its arity first (the "UNSERVABLE" gate), then each argument's and result's shape and dtype.
Files are written under temporary names and renamed into place, the manifest last, so a watcher
never sees a half-written bundle.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kserve_trio.core.bundles import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    PATCH_FILE,
    WEIGHTS_FILE,
    is_program_file,
    module_file,
    parse_manifest,
    sidecar_file,
)
from kserve_trio.export.iospec import IOSpec
from kserve_trio.runtime import (
    ModuleFormatError,
    as_portable_artifact,
    check_module_signature,
    entry_signature,
)
from kserve_trio.runtime.weights import WeightEntry, WeightsIndex, write_weights


@dataclass(frozen=True)
class _Module:
    file: str
    artifact: bytes
    sidecar: bytes | None
    variant: int | None
    key: int


def _is_exported(obj: object) -> bool:
    return type(obj).__name__ == "Exported" and hasattr(obj, "mlir_module_serialized")


def _module_bytes(m: object, what: str) -> tuple[bytes, bytes | None]:
    if _is_exported(m):
        return bytes(m.mlir_module_serialized), bytes(m.serialize())  # type: ignore[attr-defined]
    try:
        return as_portable_artifact(m), None
    except ModuleFormatError as exc:
        raise ValueError(f"{what}: {exc}") from None


def normalize_weights(weights: Any) -> list[tuple[str, np.ndarray]]:
    """Ordered ``(name, host array)`` pairs from a mapping or a sequence of pairs (or None)."""
    if weights is None:
        return []
    items = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
    out: list[tuple[str, np.ndarray]] = []
    for item in items:
        try:
            n, a = item
        except (TypeError, ValueError):
            raise TypeError(
                "weights must be a mapping name -> array or a sequence of (name, array) pairs"
            ) from None
        if not isinstance(n, str) or not n:
            raise TypeError(f"weight names must be non-empty strings, got {n!r}")
        out.append((n, np.asarray(a)))
    names = [n for n, _ in out]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"duplicate weight names: {dups}")
    return out


def _layout(
    modules: Mapping[Any, Any],
    input_shapes: Sequence[Sequence[int]] | None,
    compiled_batch_sizes: Sequence[int] | None,
) -> tuple[list[tuple[str, Any, int | None, int]], list[int]]:
    """``(file, module, variant, key)`` for every module, and the compiled batch sizes."""

    def batch_files(by_key: Mapping[Any, Any], variant: int | None, what: str):
        keys = list(by_key)
        for k in keys:
            if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 0:
                raise ValueError(f"{what}: batch key {k!r} must be an int >= 0")
        if not keys:
            raise ValueError(f"{what}: no modules given")
        if 0 in keys:
            if len(keys) > 1:
                raise ValueError(
                    f"{what}: key 0 (one module for any batch size) cannot be mixed with batch "
                    f"sizes {sorted(k for k in keys if k)}"
                )
            return [(module_file(variant, 0), by_key[0], variant, 0)], []
        return [
            (module_file(variant, int(k)), by_key[k], variant, int(k)) for k in sorted(keys)
        ], sorted(int(k) for k in keys)

    if input_shapes is None:
        files, sizes = batch_files(modules, None, "modules")
    else:
        variants = [tuple(int(s) for s in v) for v in input_shapes]
        if not variants:
            raise ValueError("input_shapes is empty")
        if len(set(variants)) != len(variants):
            raise ValueError(f"input_shapes has duplicate variants: {variants}")
        given = {tuple(int(s) for s in k): v for k, v in modules.items()}
        if set(given) != set(variants):
            raise ValueError(
                f"modules must be keyed by the input_shapes variants {variants}, got {list(given)}"
            )
        files, sizes = [], None
        for i, v in enumerate(variants):
            f, s = batch_files(given[v], i, f"modules[{v}]")
            if sizes is not None and s != sizes:
                raise ValueError(
                    f"every variant must have the same batch sizes: {variants[0]} has {sizes}, "
                    f"{v} has {s}"
                )
            sizes = s
            files += f
        sizes = sizes or []
    if compiled_batch_sizes is not None:
        declared = sorted(int(s) for s in compiled_batch_sizes)
        if sizes and declared != sizes:
            raise ValueError(
                f"compiled_batch_sizes {declared} disagrees with the modules' batch sizes {sizes}"
            )
        sizes = declared
    return files, sizes


def _input_shapes_entries(
    inputs: Sequence[IOSpec], variants: Sequence[Sequence[int]]
) -> list[dict[str, int]]:
    """``input_shapes`` manifest entries: each variant's sizes keyed by the variable letters."""
    vaxes = [(s.name, ax, letter) for s in inputs for ax, letter in s.variable_axes()]
    if not vaxes:
        raise ValueError("input_shapes given but no executable input has a variable (-1) axis")
    entries = []
    for v in variants:
        if len(v) != len(vaxes):
            raise ValueError(
                f"input_shapes variant {list(v)} has {len(v)} size(s) for {len(vaxes)} variable "
                f"axes {[f'{n}[{a}]' for n, a, _ in vaxes]}"
            )
        entry: dict[str, int] = {}
        for (tname, ax, letter), size in zip(vaxes, v, strict=True):
            if int(size) <= 0:
                raise ValueError(f"input_shapes variant {list(v)}: sizes must be > 0")
            if letter in entry and entry[letter] != int(size):
                raise ValueError(
                    f"input_shapes variant {list(v)}: axis letter '{letter}' ({tname}[{ax}]) is "
                    f"shared by two variable axes of different sizes; give them distinct letters"
                )
            entry[letter] = int(size)
        entries.append(entry)
    return entries


def build_manifest(
    *,
    name: str,
    executable_inputs: Sequence[IOSpec],
    executable_outputs: Sequence[IOSpec],
    compiled_batch_sizes: Sequence[int],
    client_inputs: Sequence[IOSpec] | None = None,
    client_outputs: Sequence[IOSpec] | None = None,
    input_shapes: Sequence[Mapping[str, int]] | None = None,
    provenance: Mapping[str, Any] | None = None,
    description: str | None = None,
) -> dict[str, Any]:
    """The manifest mapping, keys in the order they are written."""
    raw: dict[str, Any] = {"format_version": FORMAT_VERSION, "name": name}
    if description:
        raw["description"] = description
    raw["executable_inputs"] = [s.to_manifest() for s in executable_inputs]
    raw["executable_outputs"] = [s.to_manifest() for s in executable_outputs]
    if client_inputs is not None:
        raw["client_inputs"] = [s.to_manifest() for s in client_inputs]
    if client_outputs is not None:
        raw["client_outputs"] = [s.to_manifest() for s in client_outputs]
    raw["batching"] = {"compiled_batch_sizes": [int(s) for s in compiled_batch_sizes]}
    if input_shapes is not None:
        raw["input_shapes"] = [dict(e) for e in input_shapes]
    raw["provenance"] = dict(provenance or {})
    return raw


def dump_manifest(raw: Mapping[str, Any]) -> str:
    """YAML text: block style, with each tensor's ``dims`` and every list of numbers inline."""
    from ruamel.yaml import YAML
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    def conv(v: Any, key: str | None = None) -> Any:
        if isinstance(v, Mapping):
            m = CommentedMap((str(k), conv(x, str(k))) for k, x in v.items())
            if key in ("dims", "<variant>"):
                m.fa.set_flow_style()
            return m
        if isinstance(v, list | tuple):
            s = CommentedSeq(conv(x, "<variant>" if key == "input_shapes" else None) for x in v)
            if all(isinstance(x, int | float | bool) for x in v):
                s.fa.set_flow_style()
            return s
        if isinstance(v, np.generic):
            return v.item()
        return v

    yaml = YAML()
    yaml.width = 4096
    buf = io.StringIO()
    yaml.dump(conv(dict(raw)), buf)
    return buf.getvalue()


def _specs(value: Sequence[IOSpec] | None, what: str) -> list[IOSpec] | None:
    if value is None:
        return None
    out = list(value)
    for s in out:
        if not isinstance(s, IOSpec):
            raise TypeError(f"{what} entries must be IOSpec, got {type(s).__name__}")
    return out


def _arity_refusal(name: str, mod: _Module, n_args: int, n_in: int, n_w: int) -> ValueError:
    expected = n_in + n_w
    diff = n_args - expected
    why = (
        f"{diff} surplus argument(s): the program lifted values the bundle does not carry "
        "(e.g. an RNG key, an effect token, a platform index or a shape variable)"
        if diff > 0
        else f"{-diff} argument(s) short: weights were embedded as constants or dropped as unused"
    )
    return ValueError(
        f"bundle '{name}': the compiled program is UNSERVABLE and has not been written: "
        f"{mod.file} takes {n_args} argument(s) but the bundle declares {expected} "
        f"({n_in} input(s) + {n_w} weight(s)); {why}"
    )


def write_bundle(
    dir: str | os.PathLike[str],
    *,
    name: str | None = None,
    executable_inputs: Sequence[IOSpec],
    executable_outputs: Sequence[IOSpec],
    modules: Mapping[Any, Any],
    weights: Any = None,
    client_inputs: Sequence[IOSpec] | None = None,
    client_outputs: Sequence[IOSpec] | None = None,
    input_shapes: Sequence[Sequence[int]] | None = None,
    provenance: Mapping[str, Any] | None = None,
    compiled_batch_sizes: Sequence[int] | None = None,
    description: str | None = None,
    extra_files: Mapping[str, str | bytes] | None = None,
) -> Path:
    """Write a bundle into ``dir`` (created if missing); returns ``dir`` as a ``Path``.

    * ``name`` must equal ``dir``'s basename (the serving name) when given.
    * ``modules``: single shape -- ``{batch size: module}``, one ``model.b{N}.mlir`` each, or
      ``{0: module}`` for one ``model.mlir`` (``compiled_batch_sizes`` may then declare the sizes
      it serves, e.g. ``[1]``). Multi-shape -- ``input_shapes`` lists the variants, each the
      sizes of the executable inputs' ``-1`` axes in (input order, row-major axis order), and
      ``modules`` maps each variant (as a tuple) to its own ``{batch size: module}``; files are
      ``model.v{i}[.b{N}].mlir``, all variants with the same batch sizes. A module is portable-
      artifact bytes, MLIR text, a ``jaxlib.mlir.ir.Module`` or a ``jax.export.Exported`` (which
      also writes its ``.jaxexport`` sidecar).
    * ``weights``: ``(name, array)`` pairs or a mapping, in argument order.
    * ``provenance``: free mapping; a ``git_diff`` entry is written to ``working_tree.patch``
      and replaced by ``git_diff_file``.
    * ``extra_files``: more files for the bundle (e.g. ``{"model.py": source}``).

    Raises ``ValueError`` (``ManifestError``/``BundleError`` for manifest and signature rules)
    before writing anything; a module whose arity differs from inputs + weights is refused as
    UNSERVABLE.
    """
    d = Path(dir)
    basename = os.path.basename(os.path.normpath(os.path.abspath(d)))
    if name is not None and name != basename:
        raise ValueError(
            f"bundle name '{name}' must equal the directory basename '{basename}' "
            "(the directory name is the serving name)"
        )
    name = basename
    ins = _specs(executable_inputs, "executable_inputs") or []
    outs = _specs(executable_outputs, "executable_outputs") or []
    cins = _specs(client_inputs, "client_inputs")
    couts = _specs(client_outputs, "client_outputs")
    pairs = normalize_weights(weights)

    layout, sizes = _layout(modules, input_shapes, compiled_batch_sizes)
    shapes_entries = _input_shapes_entries(ins, input_shapes) if input_shapes is not None else None

    prov = dict(provenance or {})
    patch = prov.pop("git_diff", None)
    if patch is not None:
        prov["git_diff_file"] = PATCH_FILE

    raw = build_manifest(
        name=name,
        executable_inputs=ins,
        executable_outputs=outs,
        compiled_batch_sizes=sizes,
        client_inputs=cins,
        client_outputs=couts,
        input_shapes=shapes_entries,
        provenance=prov,
        description=description,
    )
    manifest = parse_manifest(raw, name, source=str(d / MANIFEST_FILE))
    text = dump_manifest(raw)

    index = WeightsIndex(
        path=d / WEIGHTS_FILE,
        entries=tuple(
            WeightEntry(n, _dtype_of(n, a), tuple(a.shape), 0, a.nbytes) for n, a in pairs
        ),
        n_tensors=len(pairs),
        metadata={},
    )
    mods: list[_Module] = []
    for file, module, variant, key in layout:
        artifact, sidecar = _module_bytes(module, file)
        mods.append(_Module(file, artifact, sidecar, variant, key))
    where = f"bundle '{name}' ({d})"
    for mod in mods:
        try:
            sig = entry_signature(mod.artifact)
        except ModuleFormatError as exc:
            raise ValueError(f"{where}: {mod.file}: {exc}") from None
        if sig.arity != len(ins) + len(pairs):
            raise _arity_refusal(name, mod, sig.arity, len(ins), len(pairs))
        check_module_signature(
            sig,
            manifest=manifest,
            weights=index,
            module=mod.file,
            variant=mod.variant,
            batch_key=mod.key,
            where=where,
        )

    d.mkdir(parents=True, exist_ok=True)
    written: set[str] = set()

    def put(fname: str, data: bytes | str) -> None:
        tmp = d / f".{fname}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, d / fname)
        written.add(fname)

    tmp_w = d / f".{WEIGHTS_FILE}.tmp"
    write_weights(tmp_w, pairs)
    os.replace(tmp_w, d / WEIGHTS_FILE)
    written.add(WEIGHTS_FILE)
    for mod in mods:
        put(mod.file, mod.artifact)
        if mod.sidecar is not None:
            put(sidecar_file(mod.file), mod.sidecar)
    if patch is not None:
        put(PATCH_FILE, patch)
    for fname, content in (extra_files or {}).items():
        if os.path.basename(fname) != fname or fname in (MANIFEST_FILE, WEIGHTS_FILE):
            raise ValueError(f"extra file name {fname!r} must be a plain file name of its own")
        put(fname, content)
    for entry in os.scandir(d):
        stale = is_program_file(entry.name) or entry.name == PATCH_FILE
        if stale and entry.name not in written:
            os.unlink(entry.path)
    put(MANIFEST_FILE, text)
    return d


def _dtype_of(name: str, a: np.ndarray):
    from kserve_trio.export.iospec import as_dtype

    try:
        return as_dtype(a.dtype)
    except ValueError:
        raise ValueError(
            f"weight '{name}' has dtype {a.dtype}, which bundles cannot carry"
        ) from None


__all__ = [
    "build_manifest",
    "dump_manifest",
    "normalize_weights",
    "write_bundle",
]

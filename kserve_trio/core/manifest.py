"""Bundle manifests: parsing ``manifest.yaml`` and the bundle-level validation rules.

This module owns the in-memory form of a bundle's manifest (``Manifest``, ``TensorSpec``, ``Dim``),
the rules a manifest must satisfy, the discovery of a bundle's compiled modules on disk, and the
small derived questions every layer asks of a manifest (which tensor carries the batch axis, how
many rows a request has, which shape variant a prepared request selects).

Axis order. The manifest's letter strings keep the upstream column-major convention (batch letter
last, ``whcn``) so bundles stay interchangeable. This module reverses them exactly once, when it
parses a tensor entry: every ``TensorSpec`` field except ``letters`` is row-major (numpy C order =
wire order), so ``shape: whcn`` becomes dims ``(n, c, h, w)`` with ``batch_axis == 0``. No other
module reverses an axis.

Error wording. Every error is a ``ManifestError`` (the YAML breaks a rule) or a ``BundleError`` (the
directory around it does). The message starts with where the problem is, then the rule broken in
the upstream wording::

    manifest '<serving name>' (<source>): <rule>
    bundle '<serving name>' (<bundle dir>): <rule>

Null values. A key whose value is YAML ``null`` counts as absent, so ``client_inputs:`` with nothing
after it means "no client specs", and ``executable_inputs:`` alone is reported as missing.
"""

from __future__ import annotations

import enum
import os
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from kserve_trio.core.dtypes import DType, dtype_from_token
from kserve_trio.core.errors import BundleError, InvalidArgument, ManifestError

SUPPORTED_FORMAT_VERSIONS: tuple[str, ...] = ("2.0", "2")
SUPPORTED_KINDS: tuple[str, ...] = ("model", "meta")
BATCH_LETTERS = frozenset("nb")
"""Lowercase ``n`` and ``b`` are the reserved batch markers (uppercase ``N``/``B`` are ordinary)."""

MANIFEST_FILE = "manifest.yaml"
WEIGHTS_FILE = "weights.safetensors"
MODEL_PY = "model.py"

_LETTERS = frozenset(string.ascii_letters)


# --------------------------------------------------------------------------------------------
# Value types
# --------------------------------------------------------------------------------------------


class DimKind(enum.Enum):
    """What an axis is: a fixed size, the batch axis (``n``/``b``), or a dynamic non-batch axis."""

    FIXED = "fixed"
    BATCH = "batch"
    VARIABLE = "variable"


@dataclass(frozen=True, slots=True)
class Dim:
    """One axis of a tensor. ``size`` is meaningful only for ``FIXED`` (it is 0 otherwise);
    ``letter`` is the manifest letter naming the axis, kept for messages and variant lookup."""

    kind: DimKind
    size: int = 0
    letter: str = ""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of a manifest section, in row-major (wire) axis order.

    ``batch_axis`` is the 0-based row-major index of the batch dim, or ``None``. ``letters`` is the
    letter string exactly as the manifest wrote it (column-major), kept so a spec can be written
    back unchanged; ``row_letters`` is the same string in the order of ``dims``.
    """

    name: str
    dtype: DType
    dims: tuple[Dim, ...]
    batch_axis: int | None
    letters: str

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def row_letters(self) -> str:
        """The axis letters in row-major order (one per entry of ``dims``)."""
        return self.letters[::-1]

    @property
    def is_batched(self) -> bool:
        return self.batch_axis is not None

    def wire_shape(self, rows: int | None = None) -> list[int]:
        """The KServe metadata shape: fixed sizes, ``-1`` for batch and variable axes.

        With ``rows`` the batch axis carries that count instead of ``-1`` (a concrete request
        shape for a model whose other axes are all fixed).
        """
        out: list[int] = []
        for d in self.dims:
            if d.kind is DimKind.FIXED:
                out.append(d.size)
            elif d.kind is DimKind.BATCH and rows is not None:
                out.append(rows)
            else:
                out.append(-1)
        return out

    def matches(self, shape: Sequence[int]) -> str | None:
        """Why ``shape`` (row-major) does not fit this spec, or ``None`` when it does.

        The reason reads after the tensor's name, e.g. ``"input 'x' " + reason``:
        ``has 3 dims, expected 4`` or ``dim 1 has extent 5, expected 3`` (0-based wire axis).
        Batch and variable axes accept any non-negative extent.
        """
        if len(shape) != len(self.dims):
            return f"has {len(shape)} dims, expected {len(self.dims)}"
        for axis, (extent, d) in enumerate(zip(shape, self.dims, strict=True)):
            if extent < 0:
                return f"dim {axis} has negative extent {extent}"
            if d.kind is DimKind.FIXED and extent != d.size:
                return f"dim {axis} has extent {extent}, expected {d.size}"
        return None


@dataclass(frozen=True, slots=True)
class BatchingSpec:
    """The batch sizes the bundle was compiled for, as written (possibly empty)."""

    compiled_batch_sizes: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class VariableAxis:
    """A variable (``-1``) axis of an executable input: one component of the variant key."""

    input_name: str
    axis: int
    letter: str


@dataclass(frozen=True)
class Manifest:
    """A parsed and validated ``manifest.yaml``; every shape-bearing field is row-major.

    ``name`` is the serving name (the bundle directory's basename), not the manifest's own
    ``name`` key. ``variable_axes`` lists the variable axes of the executable inputs in (input
    order, row-major axis order); that order defines the variant key, and ``variant_keys[i]`` is
    the key of ``input_shapes[i]`` (compiled as ``model.v{i}.*``).
    """

    format_version: str
    name: str
    description: str
    kind: str
    executable_inputs: tuple[TensorSpec, ...]
    executable_outputs: tuple[TensorSpec, ...]
    client_inputs: tuple[TensorSpec, ...] | None
    client_outputs: tuple[TensorSpec, ...] | None
    batching: BatchingSpec
    input_shapes: tuple[dict[str, int], ...] = field(hash=False)
    variable_axes: tuple[VariableAxis, ...]
    variant_keys: tuple[tuple[int, ...], ...]
    meta_calls: tuple[str, ...]
    provenance: dict[str, Any] = field(hash=False)
    input_batch_dim: int | None

    @property
    def is_meta(self) -> bool:
        return self.kind == "meta"

    @property
    def wire_inputs(self) -> tuple[TensorSpec, ...]:
        """What a client sends: ``client_inputs`` when a model.py transforms them, else the
        executable inputs."""
        return self.client_inputs if self.client_inputs is not None else self.executable_inputs

    @property
    def wire_outputs(self) -> tuple[TensorSpec, ...]:
        """What a client receives: ``client_outputs`` if present, else the executable outputs."""
        return self.client_outputs if self.client_outputs is not None else self.executable_outputs

    def variant_index(self, shapes: Mapping[str, Sequence[int]]) -> int | None:
        """The ``input_shapes`` index matching prepared executable inputs' (row-major) shapes.

        ``None`` when the model has a single shape. A shape with no compiled variant is the
        request's fault: ``InvalidArgument`` naming the key and the keys that exist.
        """
        if not self.variant_keys:
            return None
        key: list[int] = []
        for va in self.variable_axes:
            shape = shapes.get(va.input_name)
            if shape is None:
                raise InvalidArgument(
                    f"model '{self.name}': input '{va.input_name}' is missing; "
                    "cannot select an input shape variant"
                )
            if va.axis >= len(shape):
                raise InvalidArgument(
                    f"model '{self.name}': input '{va.input_name}' has {len(shape)} dims; "
                    f"variable axis '{va.letter}' is dim {va.axis}"
                )
            key.append(int(shape[va.axis]))
        for i, vk in enumerate(self.variant_keys):
            if tuple(key) == vk:
                return i
        have = [list(vk) for vk in self.variant_keys]
        raise InvalidArgument(
            f"no compiled program for input shape variant {key} (have {have}) "
            f"in model '{self.name}'"
        )


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------


class _Where:
    """Builds errors that start with the manifest they concern."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    @classmethod
    def manifest(cls, name: str, source: str) -> _Where:
        return cls(f"manifest '{name}' ({source})")

    def error(self, rule: str) -> ManifestError:
        return ManifestError(f"{self.prefix}: {rule}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _tname(v: object) -> str:
    return "null" if v is None else type(v).__name__


def _parse_tensor(raw: object, section: str, index: int, where: _Where) -> TensorSpec:
    """One tensor entry. Rules, in the order they are checked:

    1. the entry is a mapping with a non-empty string ``name``, a string ``dtype`` that is a known
       token, and a string ``shape``; ``dims`` (default ``{}``) is a mapping;
    2. ``shape`` is ASCII letters only, without repeats, with at most one batch marker (``n``/``b``);
    3. every ``dims`` key is a single ASCII letter other than ``n``/``b``, every value an integer
       ``> 0`` or ``-1`` (variable axis);
    4. ``dims`` names only letters of the shape, and every non-batch letter has an entry.

    The letters are then reversed into row-major ``dims``.
    """
    if not isinstance(raw, Mapping):
        raise where.error(f"{section}[{index}] tensor entry must be a mapping (got {_tname(raw)})")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise where.error(f"{section}[{index}] tensor entry missing string 'name'")
    t = f"{section} tensor '{name}'"
    token = raw.get("dtype")
    if not isinstance(token, str):
        raise where.error(f"{t} missing string 'dtype'")
    try:
        dtype = dtype_from_token(token)
    except ValueError:
        raise where.error(f"{t} has unknown dtype '{token}'") from None
    letters = raw.get("shape")
    if not isinstance(letters, str):
        raise where.error(f"{t} missing string 'shape' (einsum letters)")
    dims_map = raw.get("dims", {})
    if dims_map is None:
        dims_map = {}
    if not isinstance(dims_map, Mapping):
        raise where.error(f"{t} has 'dims' that is not a mapping (got {_tname(dims_map)})")

    for c in letters:
        if c not in _LETTERS:
            raise where.error(f"{t} shape '{letters}' contains non-letter character '{c}'")
    if len(set(letters)) != len(letters):
        raise where.error(f"{t} shape '{letters}' has duplicate axis letters")
    if sum(c in BATCH_LETTERS for c in letters) > 1:
        raise where.error(f"{t} has more than one batch axis ('n'/'b') in shape '{letters}'")

    sizes: dict[str, int] = {}
    for k, v in dims_map.items():
        if not (isinstance(k, str) and len(k) == 1 and k in _LETTERS):
            raise where.error(f"{t} dims key '{k}' is not a single ASCII letter")
        if k in BATCH_LETTERS:
            raise where.error(f"{t} dims key '{k}' is reserved for the batch axis")
        if not _is_int(v):
            raise where.error(f"{t} dims['{k}'] is not an integer (got {_tname(v)})")
        if not (v > 0 or v == -1):
            raise where.error(f"{t} dims['{k}']={v}; must be > 0 or -1")
        sizes[k] = v
    orphans = sorted(set(sizes) - set(letters))
    if orphans:
        raise where.error(f"{t} has dims entries not in shape: {orphans}")

    dims: list[Dim] = []
    batch_axis: int | None = None
    for axis, c in enumerate(reversed(letters)):
        if c in BATCH_LETTERS:
            dims.append(Dim(DimKind.BATCH, 0, c))
            batch_axis = axis
        elif c not in sizes:
            raise where.error(f"{t} shape uses '{c}' but dims has no entry for it")
        elif sizes[c] == -1:
            dims.append(Dim(DimKind.VARIABLE, 0, c))
        else:
            dims.append(Dim(DimKind.FIXED, sizes[c], c))
    return TensorSpec(name, dtype, tuple(dims), batch_axis, letters)


def parse_tensor_spec(raw: Mapping[str, Any], *, section: str = "tensor") -> TensorSpec:
    """Parse one tensor entry (``{name, dtype, shape, dims}``) on its own, e.g. in tests or tools."""
    return _parse_tensor(raw, section, 0, _Where("tensor spec"))


def _parse_section(raw: Mapping[str, Any], section: str, where: _Where) -> tuple[TensorSpec, ...]:
    value = raw.get(section)
    if not isinstance(value, list):
        raise where.error(f"'{section}' must be a list")
    specs = tuple(_parse_tensor(e, section, i, where) for i, e in enumerate(value))
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise where.error(f"duplicate tensor name '{s.name}' in '{section}'")
        seen.add(s.name)
    return specs


def _parse_format_version(raw: Mapping[str, Any], where: _Where) -> str:
    """``"2.0"``/``"2"`` as strings or as YAML numbers ``2.0``/``2``; stored as a string."""
    fv = raw.get("format_version")
    if fv is None:
        raise where.error("missing 'format_version'")
    text = str(fv) if isinstance(fv, str | int | float) and not isinstance(fv, bool) else repr(fv)
    if text not in SUPPORTED_FORMAT_VERSIONS:
        raise where.error(
            f"unsupported format_version '{text}'; supported: {', '.join(SUPPORTED_FORMAT_VERSIONS)}"
        )
    return text


def _parse_batching(raw: Mapping[str, Any], where: _Where) -> BatchingSpec:
    block = raw.get("batching", {})
    if block is None:
        block = {}
    if not isinstance(block, Mapping):
        raise where.error("'batching' must be a mapping")
    sizes = block.get("compiled_batch_sizes", [])
    if sizes is None:
        sizes = []
    if not isinstance(sizes, list):
        raise where.error("'batching.compiled_batch_sizes' must be a list")
    for s in sizes:
        if not _is_int(s):
            raise where.error(
                f"'batching.compiled_batch_sizes' entries must be integers (got {_tname(s)})"
            )
        if s <= 0:
            raise where.error(f"batching.compiled_batch_sizes must be positive integers (got {s})")
    if len(set(sizes)) != len(sizes):
        raise where.error(f"batching.compiled_batch_sizes has duplicate entries: {sizes}")
    return BatchingSpec(tuple(sizes))


def _parse_meta_calls(raw: Mapping[str, Any], name: str, where: _Where) -> tuple[str, ...]:
    block = raw.get("meta")
    if not isinstance(block, Mapping):
        raise where.error("meta manifest missing 'meta' mapping")
    calls = block.get("calls")
    if not isinstance(calls, list):
        raise where.error("meta manifest 'meta.calls' must be a list")
    for c in calls:
        if not isinstance(c, str):
            raise where.error(
                f"meta manifest 'meta.calls' entries must be strings (got {_tname(c)})"
            )
    dups = sorted({c for c in calls if calls.count(c) > 1})
    if dups:
        raise where.error(f"meta model has duplicate entries in meta.calls: {dups}")
    if name in calls:
        raise where.error(f"meta model '{name}' lists itself in meta.calls")
    return tuple(calls)


def _variable_axes(inputs: Sequence[TensorSpec]) -> tuple[VariableAxis, ...]:
    return tuple(
        VariableAxis(t.name, axis, d.letter)
        for t in inputs
        for axis, d in enumerate(t.dims)
        if d.kind is DimKind.VARIABLE
    )


def _parse_input_shapes(
    raw: Mapping[str, Any], vaxes: Sequence[VariableAxis], is_meta: bool, where: _Where
) -> tuple[tuple[dict[str, int], ...], tuple[tuple[int, ...], ...]]:
    """The compiled shape variants. Rules:

    1. a meta model declares none;
    2. the block is a list, and only a model with a variable executable-input axis may have one;
    3. each entry maps single ASCII letters to integers ``> 0``, names only variable-axis letters
       and names every one of them (inputs sharing a letter share the size);
    4. no two entries resolve to the same key;
    5. a regular model with a variable executable-input axis declares at least one entry.
    """
    block = raw.get("input_shapes")
    if is_meta:
        if block is not None:
            raise where.error("meta model must not declare 'input_shapes'")
        return (), ()
    if block is None:
        if vaxes:
            va = vaxes[0]
            raise where.error(
                "has a variable executable-input axis but no 'input_shapes' to enumerate the "
                f"compiled shapes (input '{va.input_name}' axis '{va.letter}')"
            )
        return (), ()
    if not isinstance(block, list):
        raise where.error("'input_shapes' must be a list")
    if not vaxes:
        raise where.error(
            "declares 'input_shapes' but no executable input has a variable axis (a -1 in its dims)"
        )
    letters = {va.letter for va in vaxes}
    entries: list[dict[str, int]] = []
    keys: list[tuple[int, ...]] = []
    for i, entry in enumerate(block):
        at = f"input_shapes[{i}]"
        if not isinstance(entry, Mapping):
            raise where.error(f"{at} must be a mapping of axis letters to sizes")
        sizes: dict[str, int] = {}
        for k, v in entry.items():
            if not (isinstance(k, str) and len(k) == 1 and k in _LETTERS):
                raise where.error(f"{at} key '{k}' is not a single ASCII letter")
            if not _is_int(v):
                raise where.error(f"{at}['{k}'] is not an integer (got {_tname(v)})")
            if v <= 0:
                raise where.error(f"{at}['{k}']={v} must be > 0")
            sizes[k] = v
        extra = sorted(set(sizes) - letters)
        if extra:
            raise where.error(f"{at} has sizes for non-variable axes: {extra}")
        for va in vaxes:
            if va.letter not in sizes:
                raise where.error(f"{at} missing a size for variable axis '{va.letter}'")
        key = tuple(sizes[va.letter] for va in vaxes)
        if key in keys:
            raise where.error(
                f"has duplicate entries in input_shapes ({at} repeats input_shapes[{keys.index(key)}])"
            )
        entries.append(sizes)
        keys.append(key)
    if not entries:
        va = vaxes[0]
        raise where.error(
            "has a variable executable-input axis but no 'input_shapes' to enumerate the "
            f"compiled shapes (input '{va.input_name}' axis '{va.letter}')"
        )
    return tuple(entries), tuple(keys)


def parse_manifest(raw: Mapping[str, Any], name: str, *, source: str = "<manifest>") -> Manifest:
    """Parse a manifest mapping and check every rule that needs only its contents.

    ``name`` is the serving name (the bundle directory's basename); the manifest's own ``name``
    key is informational and only has to be a string. ``source`` names the file in messages.
    Rules beyond the per-tensor ones (see ``_parse_tensor``) and ``input_shapes``
    (``_parse_input_shapes``):

    1. ``format_version`` is ``2.0`` or ``2``; ``kind`` is ``model`` (default) or ``meta``;
    2. a meta model has a ``meta.calls`` list of distinct strings not naming itself, and non-empty
       ``client_inputs`` and ``client_outputs``;
    3. a regular model has ``executable_inputs`` and ``executable_outputs`` lists;
    4. tensor names are unique within each section;
    5. all executable inputs carry a batch axis, or none does (positions may differ);
    6. ``batching.compiled_batch_sizes`` is a list of distinct positive integers;
    7. every client-facing tensor has a KServe wire dtype (no fp8).
    """
    where = _Where.manifest(name, source)
    if not isinstance(raw, Mapping):
        raise where.error(f"manifest is not a mapping (got {_tname(raw)})")
    declared = raw.get("name")
    if declared is not None and not isinstance(declared, str):
        raise where.error("manifest field 'name' must be a string")
    format_version = _parse_format_version(raw, where)
    description = raw.get("description")
    if description is None:
        description = ""
    if not isinstance(description, str):
        raise where.error(f"field 'description' must be a string (got {_tname(description)})")
    kind = raw.get("kind")
    if kind is None:
        kind = "model"
    if not isinstance(kind, str):
        raise where.error("field 'kind' must be a string")
    if kind not in SUPPORTED_KINDS:
        raise where.error(f"unsupported kind '{kind}'; supported: {', '.join(SUPPORTED_KINDS)}")
    meta = kind == "meta"

    meta_calls = _parse_meta_calls(raw, name, where) if meta else ()
    sections: dict[str, tuple[TensorSpec, ...] | None] = {}
    for section in ("executable_inputs", "executable_outputs"):
        if raw.get(section) is None:
            if not meta:
                raise where.error(f"missing '{section}'")
            sections[section] = ()
        else:
            sections[section] = _parse_section(raw, section, where)
    for section in ("client_inputs", "client_outputs"):
        sections[section] = (
            None if raw.get(section) is None else _parse_section(raw, section, where)
        )
    exec_in = sections["executable_inputs"] or ()
    exec_out = sections["executable_outputs"] or ()
    client_in, client_out = sections["client_inputs"], sections["client_outputs"]

    if meta:
        if not client_in:
            raise where.error("meta model must declare non-empty client_inputs")
        if not client_out:
            raise where.error("meta model must declare non-empty client_outputs")

    if any(t.is_batched for t in exec_in):
        unbatched = [t.name for t in exec_in if not t.is_batched]
        if unbatched:
            raise where.error(
                "mixes batched and unbatched executable inputs; every executable input must "
                "carry a batch axis ('n'/'b') or none may. "
                f"Unbatched input(s): {', '.join(unbatched)}"
            )

    batching = _parse_batching(raw, where)
    vaxes = _variable_axes(exec_in)
    input_shapes, variant_keys = _parse_input_shapes(raw, vaxes, meta, where)

    for section, specs in (
        ("client_inputs", client_in) if client_in is not None else ("executable_inputs", exec_in),
        ("client_outputs", client_out)
        if client_out is not None
        else ("executable_outputs", exec_out),
    ):
        for t in specs:
            if not t.dtype.has_wire:
                raise where.error(
                    f"{section} tensor '{t.name}' has dtype {t.dtype.token} "
                    "which has no KServe wire datatype mapping"
                )

    provenance = raw.get("provenance")
    return Manifest(
        format_version=format_version,
        name=name,
        description=description,
        kind=kind,
        executable_inputs=exec_in,
        executable_outputs=exec_out,
        client_inputs=client_in,
        client_outputs=client_out,
        batching=batching,
        input_shapes=input_shapes,
        variable_axes=vaxes if not meta else (),
        variant_keys=variant_keys,
        meta_calls=meta_calls,
        provenance=dict(provenance) if isinstance(provenance, Mapping) else {},
        input_batch_dim=next((t.batch_axis for t in exec_in if t.is_batched), None),
    )


def _serving_name(directory: Path) -> str:
    return os.path.basename(os.path.normpath(os.path.abspath(directory)))


def load_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read and parse a manifest file; the serving name is its directory's basename.

    Runs ``parse_manifest`` only, not the bundle-directory checks of ``validate_manifest``, so a
    client can derive a model's I/O spec from a lone manifest.
    """
    p = Path(path)
    name = _serving_name(p.parent)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ManifestError(
            f"manifest '{name}' ({p}): cannot read: {exc.strerror or exc}"
        ) from None
    try:
        raw = YAML(typ="safe").load(text)
    except YAMLError as exc:
        detail = " ".join(str(exc).split())
        raise ManifestError(f"manifest '{name}' ({p}): invalid YAML: {detail}") from None
    return parse_manifest(raw, name, source=str(p))


# --------------------------------------------------------------------------------------------
# The bundle directory
# --------------------------------------------------------------------------------------------


def _bundle_error(m_name: str, bundle_dir: Path, rule: str) -> BundleError:
    return BundleError(f"bundle '{m_name}' ({bundle_dir}): {rule}")


def validate_manifest(bundle_dir: str | os.PathLike[str]) -> Manifest:
    """Load a bundle's manifest and check the rules that involve the directory around it.

    1. ``manifest.yaml`` exists and parses (``parse_manifest``'s rules);
    2. a meta model ships ``model.py``;
    3. ``client_inputs``/``client_outputs`` appear only when ``model.py`` is present;
    4. a regular model's compiled modules are all present (``discover_modules``), and it ships
       ``weights.safetensors``.

    Whether ``model.py`` calls the right registration function is checked by whoever executes it.
    """
    d = Path(bundle_dir)
    name = _serving_name(d)
    mpath = d / MANIFEST_FILE
    if not mpath.is_file():
        raise _bundle_error(name, d, f"missing {MANIFEST_FILE}")
    m = load_manifest(mpath)
    has_py = (d / MODEL_PY).is_file()
    where = _Where.manifest(name, str(mpath))
    if m.is_meta and not has_py:
        raise where.error(f"meta model requires a {MODEL_PY} that calls register_meta_model")
    if not has_py and (m.client_inputs is not None or m.client_outputs is not None):
        raise where.error(f"client_inputs/client_outputs are only valid when {MODEL_PY} is present")
    if m.is_meta:
        return m
    discover_modules(d, m)
    if not (d / WEIGHTS_FILE).is_file():
        raise _bundle_error(name, d, f"missing {WEIGHTS_FILE}")
    return m


def _batch_modules(d: Path, files: Sequence[str], m: Manifest, prefix: str) -> dict[int, Path]:
    """One variant's modules: ``<prefix>.b{N}.mlir`` keyed by N, else ``<prefix>.mlir`` under 0.

    If any ``.b{N}`` file exists, each compiled batch size needs one (extra ones still load).
    """
    rx = re.compile("^" + re.escape(prefix) + r"\.b(\d+)\.mlir$")
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
        if f"{prefix}.mlir" not in files:
            raise _bundle_error(m.name, d, f"has no {prefix}.mlir or {prefix}.b{{N}}.mlir")
        return {0: d / f"{prefix}.mlir"}
    for size in m.batching.compiled_batch_sizes:
        if size not in found:
            raise _bundle_error(
                m.name, d, f"declares batch size {size} but has no {prefix}.b{size}.mlir"
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
        out[None] = _batch_modules(d, files, manifest, "model")
    else:
        for i in range(len(manifest.input_shapes)):
            out[i] = _batch_modules(d, files, manifest, f"model.v{i}")
    if manifest.input_batch_dim is None and any(len(v) > 1 for v in out.values()):
        raise _bundle_error(
            manifest.name,
            d,
            "multiple compiled batch sizes but no input with a batch axis ('n'/'b')",
        )
    return out


def bundle_signature_files(bundle_dir: str | os.PathLike[str]) -> list[Path]:
    """Every existing file that defines a bundle's version, sorted by name.

    ``manifest.yaml``, ``weights.safetensors``, ``model.py`` and every ``model*.mlir`` /
    ``model*.jaxexport`` (variant files included). The watcher stats these
    to notice that a bundle changed.
    """
    d = Path(bundle_dir)
    fixed = {MANIFEST_FILE, WEIGHTS_FILE, MODEL_PY}
    try:
        entries = [e for e in os.scandir(d) if e.is_file()]
    except OSError:
        return []
    names = sorted(
        e.name
        for e in entries
        if e.name in fixed
        or (e.name.startswith("model") and e.name.endswith((".mlir", ".jaxexport")))
    )
    return [d / n for n in names]


# --------------------------------------------------------------------------------------------
# Derived questions
# --------------------------------------------------------------------------------------------


def is_meta(m: Manifest) -> bool:
    """True for a meta model (a model.py orchestration over other models)."""
    return m.is_meta


def _first_batched(specs: Sequence[TensorSpec]) -> tuple[str, int] | None:
    for t in specs:
        if t.batch_axis is not None:
            return t.name, t.batch_axis
    return None


def wire_batch_spec(m: Manifest) -> tuple[str, int] | None:
    """``(name, row-major axis)`` of the first wire-facing input with a batch axis, or ``None``.

    The gateway counts a request's rows from this without decoding it; the first input need not
    be batched (a cross-encoder's query is not), so the name is what it matches on.
    """
    return _first_batched(m.wire_inputs)


def executable_batch_spec(m: Manifest) -> tuple[str, int] | None:
    """``(name, row-major axis)`` of the first executable input with a batch axis, or ``None``."""
    return _first_batched(m.executable_inputs)


def request_rows(m: Manifest, inputs: Mapping[str, Sequence[int]]) -> int:
    """Rows of a request: the extent of the first wire-facing batched input at its
    batch axis, read from ``inputs`` (name -> row-major shape); 1 when nothing is batched."""
    spec = wire_batch_spec(m)
    if spec is None:
        return 1
    tensor, axis = spec
    shape = inputs.get(tensor)
    if shape is None:
        raise InvalidArgument(f"model '{m.name}': required input '{tensor}' is missing")
    if axis >= len(shape):
        raise InvalidArgument(
            f"model '{m.name}': input '{tensor}' has {len(shape)} dims; its batch axis is dim {axis}"
        )
    return int(shape[axis])


__all__ = [
    "BATCH_LETTERS",
    "MANIFEST_FILE",
    "MODEL_PY",
    "SUPPORTED_FORMAT_VERSIONS",
    "SUPPORTED_KINDS",
    "WEIGHTS_FILE",
    "BatchingSpec",
    "Dim",
    "DimKind",
    "Manifest",
    "TensorSpec",
    "VariableAxis",
    "bundle_signature_files",
    "discover_modules",
    "executable_batch_spec",
    "is_meta",
    "load_manifest",
    "parse_manifest",
    "parse_tensor_spec",
    "request_rows",
    "validate_manifest",
    "wire_batch_spec",
]

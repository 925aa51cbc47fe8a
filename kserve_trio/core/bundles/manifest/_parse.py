"""Parsing ``manifest.yaml`` into a ``Manifest``: YAML text or an already-loaded mapping in, a
validated ``Manifest`` or a ``ManifestError`` out, with no filesystem access (the bundle
directory's rules are ``kserve_trio.core.bundles.bundle``'s).

Axis order. The manifest's letter strings keep the upstream column-major convention (batch letter
last, ``whcn``) so bundles stay interchangeable. This module reverses them exactly once, when it
parses a tensor entry: ``shape: whcn`` becomes dims ``(n, c, h, w)`` with ``batch_axis == 0``.
No other module reverses an axis.

Error wording. Every error is a ``ManifestError`` whose message starts with where the problem is,
then the rule broken in the upstream wording: ``manifest '<serving name>' (<source>): <rule>``.

Null values. A key whose value is YAML ``null`` counts as absent, so ``client_inputs:`` with nothing
after it means "no client specs", and ``executable_inputs:`` alone is reported as missing.
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from kserve_trio.core.bundles.manifest._types import (
    BatchingSpec,
    Dim,
    DimKind,
    Manifest,
    TensorSpec,
    VariableAxis,
)
from kserve_trio.core.errors import ManifestError
from kserve_trio.core.plain import is_int
from kserve_trio.core.tensors import dtype_from_token

SUPPORTED_FORMAT_VERSIONS: tuple[str, ...] = ("2.0", "2")
SUPPORTED_KINDS: tuple[str, ...] = ("model", "meta")
BATCH_LETTERS = frozenset("nb")
"""Lowercase ``n`` and ``b`` are the reserved batch markers (uppercase ``N``/``B`` are ordinary)."""

_LETTERS = frozenset(string.ascii_letters)


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
        if not is_int(v):
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
        if not is_int(s):
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
            if not is_int(v):
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
    7. every client-facing tensor has a KServe wire dtype (no fp8);
    8. no executable tensor is ``bytes``: string tensors exist only on ``client_inputs`` /
       ``client_outputs``, which a ``model.py`` turns into tensors and back (so a model without
       client specs cannot take or return them either);
    9. ``serve_without_hooks``, when present, is a boolean.
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

    for section, specs in (("executable_inputs", exec_in), ("executable_outputs", exec_out)):
        for t in specs:
            if t.dtype.is_bytes:
                raise where.error(
                    f"{section} tensor '{t.name}' has dtype bytes, which no executable takes or "
                    "returns; declare string tensors in client_inputs/client_outputs and turn "
                    "them into tensors in model.py"
                )

    serve_without_hooks = raw.get("serve_without_hooks", False)
    if not isinstance(serve_without_hooks, bool):
        raise where.error(
            f"field 'serve_without_hooks' must be a boolean (got {_tname(serve_without_hooks)})"
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
        serve_without_hooks=serve_without_hooks,
    )


def parse_manifest_text(text: str, name: str, *, source: str = "<manifest>") -> Manifest:
    """Parse ``manifest.yaml`` text: invalid YAML is a ``ManifestError`` carrying the parser's
    message on one line, then ``parse_manifest``'s rules apply."""
    try:
        raw = YAML(typ="safe").load(text)
    except YAMLError as exc:
        detail = " ".join(str(exc).split())
        raise ManifestError(f"manifest '{name}' ({source}): invalid YAML: {detail}") from None
    return parse_manifest(raw, name, source=source)

"""``export_bundle``: trace a JAX function once per batch size (and shape variant) into a bundle.

The function is exported with ``jax.export`` for one platform with static shapes and
``keep_unused=True``, so every module's ``main`` takes exactly ``(inputs..., weights...)``:
weights are always arguments, never constants, and none is dropped for being unused. Each module
is written both as its portable StableHLO artifact (``.mlir``, what any server loads) and as the
full ``Exported.serialize()`` blob (``.jaxexport``, jax's public loading path).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kserve_trio.export.iospec import AXIS_LETTERS, IOSpec, as_dtype
from kserve_trio.export.writer import write_bundle
from kserve_trio.runtime.x64 import needs_x64, x64_scope

FRONTENDS: tuple[str, ...] = ("jax",)


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, Mapping)


def split_weights(weights: Any) -> tuple[list[str], list[Any], Any]:
    """``(names, arrays, treedef)`` of ``weights``. Rules:

    1. ``None`` or an empty collection: no weights;
    2. a sequence of ``(name, array)`` pairs, or a flat mapping whose values are all arrays:
       trailing positional arrays in that order (``treedef`` is ``None``);
    3. any other pytree (nested dicts, flax params, an equinox module): one trailing argument,
       flattened in ``jax.tree_util`` order, each leaf named by its key path joined with ``/``.
    """
    import jax

    if weights is None:
        return [], [], None
    if isinstance(weights, Mapping) and all(_is_array(v) for v in weights.values()):
        names = [str(k) for k in weights]
        return names, list(weights.values()), None
    if isinstance(weights, list | tuple) and all(
        isinstance(p, tuple | list) and len(p) == 2 and isinstance(p[0], str) and _is_array(p[1])
        for p in weights
    ):
        return [p[0] for p in weights], [p[1] for p in weights], None
    leaves, treedef = jax.tree_util.tree_flatten_with_path(weights)
    names = [
        jax.tree_util.keystr(path, simple=True, separator="/") or "param" for path, _ in leaves
    ]
    arrays = [leaf if _is_array(leaf) else np.asarray(leaf) for _, leaf in leaves]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"weight key paths collide: {dups}")
    return names, arrays, treedef


def _per_tensor_axes(value: Any, n: int, what: str) -> list[int | None]:
    if value is None or isinstance(value, int):
        return [value] * n
    axes = list(value)
    if len(axes) != n:
        raise ValueError(f"{what} has {len(axes)} entries for {n} tensor(s)")
    for a in axes:
        if a is not None and (isinstance(a, bool) or not isinstance(a, int)):
            raise ValueError(f"{what} entries must be ints or None, got {a!r}")
    return axes


def _names(given: Sequence[str] | None, n: int, default: list[str], what: str) -> list[str]:
    if given is None:
        return default
    names = list(given)
    if len(names) != n:
        raise ValueError(f"{what} has {len(names)} name(s) for {n} tensor(s)")
    if len(set(names)) != len(names):
        raise ValueError(f"{what} has duplicate names: {names}")
    return names


def _variable_letters(
    specs_axes: list[list[int]], ranks: list[int], batch: list[int | None]
) -> list[tuple[str, ...] | None]:
    """Explicit letters for inputs with variable axes: each variable axis gets a letter no other
    input's variable axis uses (so unrelated axes never have to share a size), fixed axes the
    usual a, c, d... skipping those."""
    pool_var = list(reversed(AXIS_LETTERS))
    out: list[tuple[str, ...] | None] = []
    taken_var: list[str] = []
    for axes, rank, b in zip(specs_axes, ranks, batch, strict=True):
        if not axes:
            out.append(None)
            continue
        var = {ax: pool_var.pop(0) for ax in axes}
        taken_var += var.values()
        fixed_pool = [c for c in AXIS_LETTERS if c not in taken_var]
        free = [i for i in range(rank) if i != b]
        letters: dict[int, str] = dict(var)
        for i in reversed(free):
            if i not in letters:
                letters[i] = fixed_pool.pop(0)
        out.append(tuple(letters[i] for i in free))
    return out


def _platform() -> str:
    import jax

    p = jax.default_backend()
    return "cuda" if p == "gpu" else p


def _versions() -> dict[str, str]:
    import jax
    import jaxlib

    from kserve_trio.export.provenance import _kserve_trio_version

    return {
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.__version__,
        "kserve_trio_version": _kserve_trio_version(),
    }


def _export_one(fn: Any, args: Sequence[Any], platform: str) -> Any:
    """One static-shape, single-platform export; every argument stays an argument.

    With a 64-bit argument (``int64``, ``uint64``, ``float64``) the trace runs in jax's 64-bit
    mode, else jax would narrow it to 32 bits; a function of 32-bit arguments is traced under
    whatever jax configuration the caller has.
    """
    import jax

    wide = needs_x64(leaf.dtype for leaf in jax.tree_util.tree_leaves(list(args)))
    with x64_scope() if wide else contextlib.nullcontext():
        return jax.export.export(jax.jit(fn, keep_unused=True), platforms=(platform,))(*args)


def export_bundle(
    frontend: str,
    fn: Any,
    example_inputs: Any,
    weights: Any,
    *,
    dir: str | os.PathLike[str],
    name: str | None = None,
    batch_sizes: Sequence[int] | None = None,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    input_batch_axes: int | Sequence[int | None] | None = 0,
    output_batch_axes: int | Sequence[int | None] | None = 0,
    client_inputs: Sequence[IOSpec] | None = None,
    client_outputs: Sequence[IOSpec] | None = None,
    input_shapes: Sequence[Sequence[Sequence[int]]] | None = None,
    provenance: Mapping[str, Any] | None = None,
) -> Path:
    """Export ``fn`` to a bundle in ``dir`` and return ``dir``. Only the ``"jax"`` frontend exists.

    * ``dir`` is the bundle directory (created if missing); its basename is the model name, and
      ``name``, when given, must equal it (else ``ValueError``).
    * ``example_inputs``: a tuple of arrays (a bare array is a 1-tuple); they give the dtypes and,
      without ``input_shapes``, the shapes.
    * ``weights``: ``(name, array)`` pairs or a flat mapping -> ``fn(*inputs, *arrays)``; any
      other pytree -> ``fn(*inputs, params)`` (see ``split_weights``).
    * ``batch_sizes=None``: one unbatched ``model.mlir`` at the example shapes. A list: one
      ``model.b{N}.mlir`` per size, each tensor's extent on its batch axis replaced by N. Batch
      axes are 0-based row-major: an int for every tensor, ``None`` for none, or one entry per
      tensor (``None`` = that tensor is unbatched); each output's extent on its batch axis must
      be N.
    * ``input_shapes``: several compiled shape variants, each one shape per input (batch extents
      are replaced by N); axes that differ between variants become variable (``-1``) on the
      inputs and, where they differ, on the outputs; files are ``model.v{i}[.b{N}].mlir``.
    * Names: ``input_0, input_1, ...``; ``output`` for one returned array, ``output_0, ...`` for a
      tuple or list (any returned pytree is flattened), unless ``input_names``/``output_names``.
    * ``client_inputs``/``client_outputs`` and ``provenance`` go to ``write_bundle``; the
      provenance is stamped with the framework versions first, and the caller's keys win.

    A traced module whose arity differs from inputs + weights is refused (``ValueError``,
    "UNSERVABLE") before anything is written.
    """
    if frontend not in FRONTENDS:
        raise ValueError(f"unknown export frontend {frontend!r}; available: {', '.join(FRONTENDS)}")
    import jax

    d = Path(dir)
    basename = os.path.basename(os.path.normpath(os.path.abspath(d)))
    if name is not None and name != basename:
        raise ValueError(
            f"bundle name '{name}' must equal the directory basename '{basename}' "
            "(the directory name is the serving name)"
        )
    examples = (
        list(example_inputs) if isinstance(example_inputs, tuple | list) else [example_inputs]
    )
    for i, x in enumerate(examples):
        if not _is_array(x):
            raise TypeError(f"example input {i} is a {type(x).__name__}, not an array")
    n_in = len(examples)
    in_names = _names(input_names, n_in, [f"input_{i}" for i in range(n_in)], "input_names")
    w_names, w_arrays, treedef = split_weights(weights)
    in_dtypes = [as_dtype(x.dtype) for x in examples]

    if batch_sizes is None:
        sizes: list[int] = [0]
        in_axes: list[int | None] = [None] * n_in
    else:
        sizes = sorted({int(s) for s in batch_sizes})
        if not sizes or sizes[0] <= 0:
            raise ValueError(f"batch_sizes must be positive integers, got {list(batch_sizes)}")
        in_axes = _per_tensor_axes(input_batch_axes, n_in, "input_batch_axes")
        if len(sizes) > 1 and all(a is None for a in in_axes):
            raise ValueError("several batch sizes need at least one input with a batch axis")

    if input_shapes is None:
        variants = [[tuple(int(d_) for d_ in x.shape) for x in examples]]
    else:
        variants = [[tuple(int(d_) for d_ in s) for s in v] for v in input_shapes]
        if not variants:
            raise ValueError("input_shapes is empty")
        for v in variants:
            if len(v) != n_in:
                raise ValueError(
                    f"input_shapes entry {v} has {len(v)} shape(s) for {n_in} input(s)"
                )
    for i, ax in enumerate(in_axes):
        for v in variants:
            if ax is not None and not 0 <= ax < len(v[i]):
                raise ValueError(
                    f"input_batch_axes: axis {ax} is not an axis of input '{in_names[i]}' {list(v[i])}"
                )

    # which input axes vary between variants (batch axes excluded)
    ranks = [len(variants[0][i]) for i in range(n_in)]
    var_axes: list[list[int]] = []
    for i in range(n_in):
        if any(len(v[i]) != ranks[i] for v in variants):
            raise ValueError(f"input '{in_names[i]}' changes rank between input_shapes entries")
        var_axes.append(
            [k for k in range(ranks[i]) if k != in_axes[i] and len({v[i][k] for v in variants}) > 1]
        )
    keys = [tuple(v[i][k] for i in range(n_in) for k in var_axes[i]) for v in variants]
    multi = len(variants) > 1
    if multi and len(set(keys)) != len(keys):
        raise ValueError(
            f"input_shapes has duplicate variants: {[list(map(list, v)) for v in variants]}"
        )

    platform = _platform()
    w_specs = [jax.ShapeDtypeStruct(tuple(a.shape), a.dtype) for a in w_arrays]
    w_args = [jax.tree_util.tree_unflatten(treedef, w_specs)] if treedef is not None else w_specs

    exported: dict[tuple[int, ...], dict[int, Any]] = {}
    out_avals_by: dict[tuple[int, int], tuple[Any, ...]] = {}
    out_single = None
    for vi, v in enumerate(variants):
        for n in sizes:
            shapes = [
                tuple(n if (k == in_axes[i] and n > 0) else s for k, s in enumerate(v[i]))
                for i in range(n_in)
            ]
            args = [
                jax.ShapeDtypeStruct(s, dt.numpy) for s, dt in zip(shapes, in_dtypes, strict=True)
            ]
            exp = _export_one(fn, [*args, *w_args], platform)
            exported.setdefault(keys[vi], {})[n] = exp
            out_avals_by[(vi, n)] = tuple(exp.out_avals)
            single = exp.out_tree.num_leaves == 1 and exp.out_tree.num_nodes == 1
            out_single = single if out_single is None else out_single

    first = out_avals_by[(0, sizes[0])]
    n_out = len(first)
    out_names = _names(
        output_names,
        n_out,
        ["output"] if out_single else [f"output_{j}" for j in range(n_out)],
        "output_names",
    )
    out_axes = (
        [None] * n_out
        if sizes == [0]
        else _per_tensor_axes(output_batch_axes, n_out, "output_batch_axes")
    )
    # output checks: batch extents equal N; axes that differ across variants become -1
    out_shapes: list[list[int]] = []
    for j in range(n_out):
        ax = out_axes[j]
        shape = list(first[j].shape)
        for (_vi, n), avals in out_avals_by.items():
            s = tuple(avals[j].shape)
            if len(s) != len(shape):
                raise ValueError(f"output '{out_names[j]}' changes rank between variants")
            if ax is not None:
                if not 0 <= ax < len(s):
                    raise ValueError(
                        f"output_batch_axes: axis {ax} is not an axis of output '{out_names[j]}' {list(s)}"
                    )
                if s[ax] != n:
                    raise ValueError(
                        f"output '{out_names[j]}' has extent {s[ax]} on its batch axis {ax} at batch "
                        f"size {n}; pass output_batch_axes (None for an unbatched output)"
                    )
            for k, ext in enumerate(s):
                if k != ax and ext != shape[k]:
                    shape[k] = -1
        out_shapes.append(shape)

    letters = _variable_letters(var_axes, ranks, in_axes) if multi else [None] * n_in
    in_specs = []
    for i in range(n_in):
        shape = list(variants[0][i])
        for k in var_axes[i] if multi else []:
            shape[k] = -1
        if in_axes[i] is not None and sizes != [0]:
            shape[in_axes[i]] = sizes[0]
        in_specs.append(IOSpec(in_names[i], in_dtypes[i], tuple(shape), in_axes[i], letters[i]))
    out_specs = []
    for j in range(n_out):
        shape = out_shapes[j]
        out_specs.append(IOSpec(out_names[j], as_dtype(first[j].dtype), tuple(shape), out_axes[j]))

    stamp: dict[str, Any] = {
        "source_framework": "jax",
        "converter": "kserve_trio.export.export_bundle",
        **_versions(),
        "platform": platform,
        "batch_sizes": [] if sizes == [0] else sizes,
    }
    if multi:
        stamp["input_shapes"] = [[list(s) for s in v] for v in variants]
    stamp.update(provenance or {})

    host_weights = [(n, np.asarray(a)) for n, a in zip(w_names, w_arrays, strict=True)]
    if multi:
        modules: Mapping[Any, Any] = exported
        shapes_arg: list[tuple[int, ...]] | None = keys
    else:
        modules = exported[keys[0]]
        shapes_arg = None
    return write_bundle(
        d,
        executable_inputs=in_specs,
        executable_outputs=out_specs,
        modules=modules,
        weights=host_weights,
        client_inputs=client_inputs,
        client_outputs=client_outputs,
        input_shapes=shapes_arg,
        provenance=stamp,
    )


__all__ = ["FRONTENDS", "export_bundle", "split_weights"]

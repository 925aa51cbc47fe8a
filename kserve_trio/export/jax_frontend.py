"""The ``jax`` export frontend: trace a JAX function once per batch size (and shape variant).

The function is exported with ``jax.export`` for one platform with static shapes and
``keep_unused=True``, so every module's ``main`` takes exactly ``(inputs..., weights...)``:
weights are always arguments, never constants, and none is dropped for being unused. Each module
is written both as its portable StableHLO artifact (``.mlir``, what any server loads) and as the
full ``Exported.serialize()`` blob (``.jaxexport``, jax's public loading path). The bundle rules
(names, batch axes, variants, the arity gate) are those of ``export.assemble``, shared with the
torch frontends; ``export_bundle`` (``export.frontends``) is the entry point.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kserve_trio.export.assemble import (
    ExportPlan,
    assemble_bundle,
    check_matmul_precision,
    jax_platform,
    jax_versions,
    plan_export,
)
from kserve_trio.export.iospec import IOSpec
from kserve_trio.runtime.x64 import needs_x64, x64_scope


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


def precision_scope(matmul_precision: str | None) -> Any:
    """jax's ``default_matmul_precision`` context for a trace (a no-op for ``None``).

    The precision is written into every dot and convolution of the traced program, so it is
    fixed at export time: the serving platform cannot change it later (only the worker's
    ``runtime.numerics: f32`` rewrites f32 ops to HIGHEST).
    """
    if matmul_precision is None:
        return contextlib.nullcontext()
    import jax

    return jax.default_matmul_precision(matmul_precision)


def _selected(fn: Any, output_select: Callable[[Any], Any]) -> Any:
    """``fn`` followed by ``output_select``: the traced function returns exactly the selected
    arrays, as a tuple (a single selected value is a 1-tuple only when the selector returned a
    tuple or list, so ``lambda r: r[0]`` keeps one output named ``output``)."""
    import jax

    if not callable(output_select):
        raise TypeError(f"output_select must be callable, got {type(output_select).__name__}")

    @functools.wraps(fn)
    def traced(*args: Any) -> Any:
        chosen = output_select(fn(*args))
        items = list(chosen) if isinstance(chosen, tuple | list) else [chosen]
        for i, item in enumerate(items):
            if not isinstance(item, jax.Array):
                raise TypeError(
                    f"output_select returned a {type(item).__name__} at position {i}; it must "
                    "return only arrays (drop the non-array returns in the selector)"
                )
        return tuple(items) if isinstance(chosen, tuple | list) else chosen

    return traced


def _positional_capacity(fn: Any) -> int | None:
    """How many positional arguments ``fn`` takes (``None``: any number, or unknown)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    n = 0
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            return None
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty:
            n += 1
    return n


def export_jax(
    fn: Any,
    example_inputs: Any,
    weights: Any = None,
    *,
    dir: Any,
    name: str | None = None,
    batch_sizes: Sequence[int] | None = None,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    input_batch_axes: int | Sequence[int | None] | None = 0,
    output_batch_axes: int | Sequence[int | None] | None = 0,
    client_inputs: Sequence[IOSpec] | None = None,
    client_outputs: Sequence[IOSpec] | None = None,
    input_shapes: Sequence[Sequence[Sequence[int]]] | None = None,
    matmul_precision: str | None = None,
    provenance: Mapping[str, Any] | None = None,
    output_select: Callable[[Any], Any] | None = None,
) -> Path:
    """``export_bundle("jax", ...)``: see ``export.frontends.export_bundle``."""
    import jax

    if output_select is not None:
        fn = _selected(fn, output_select)

    examples = (
        list(example_inputs) if isinstance(example_inputs, tuple | list) else [example_inputs]
    )
    for i, x in enumerate(examples):
        if not _is_array(x):
            raise TypeError(f"example input {i} is a {type(x).__name__}, not an array")
    precision = check_matmul_precision(matmul_precision)
    plan: ExportPlan = plan_export(
        [(tuple(int(d) for d in x.shape), x.dtype) for x in examples],
        dir=dir,
        name=name,
        batch_sizes=batch_sizes,
        input_names=input_names,
        input_batch_axes=input_batch_axes,
        input_shapes=input_shapes,
    )
    w_names, w_arrays, treedef = split_weights(weights)
    if weights is None:
        capacity = _positional_capacity(fn)
        if capacity is not None and capacity > plan.n_in:
            raise TypeError(
                f"fn takes {capacity} positional argument(s) but there are {plan.n_in} example "
                "input(s) and no weights: pass the weights (export_bundle(frontend, fn, "
                "example_inputs, weights, ...))"
            )

    platform = jax_platform()
    w_specs = [jax.ShapeDtypeStruct(tuple(a.shape), a.dtype) for a in w_arrays]
    w_args = [jax.tree_util.tree_unflatten(treedef, w_specs)] if treedef is not None else w_specs

    exported: dict[tuple[int, int], Any] = {}
    single: bool | None = None
    with precision_scope(precision):
        for vi, n, shapes in plan.traces():
            args = [
                jax.ShapeDtypeStruct(s, dt.numpy)
                for s, dt in zip(shapes, plan.in_dtypes, strict=True)
            ]
            exp = _export_one(fn, [*args, *w_args], platform)
            exported[(vi, n)] = exp
            if single is None:
                single = exp.out_tree.num_leaves == 1 and exp.out_tree.num_nodes == 1

    stamp: dict[str, Any] = {
        "source_framework": "jax",
        "converter": "kserve_trio.export.export_bundle",
        **jax_versions(),
        "platform": platform,
    }
    if precision is not None:
        stamp["matmul_precision"] = precision
    return assemble_bundle(
        plan,
        exported,
        single_output=bool(single),
        output_names=output_names,
        output_batch_axes=output_batch_axes,
        weights=[(n, np.asarray(a)) for n, a in zip(w_names, w_arrays, strict=True)],
        client_inputs=client_inputs,
        client_outputs=client_outputs,
        stamp=stamp,
        provenance=provenance,
    )


__all__ = ["export_jax", "precision_scope", "split_weights"]

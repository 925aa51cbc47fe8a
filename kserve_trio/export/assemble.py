"""The bundle contract every export frontend shares: plan the traces, then assemble the bundle.

A frontend (jax, torch, torchscript) only has to turn "the model at these input shapes" into a
``jax.export.Exported`` whose entry takes ``(inputs..., weights...)``. Everything else is the same
for all of them and lives here, so that the rules cannot drift apart:

* ``plan_export`` checks the directory name, the example inputs, ``batch_sizes``, the batch axes
  and the ``input_shapes`` variants, and says which concrete input shapes to trace
  (``ExportPlan.traces``);
* ``assemble_bundle`` names the outputs, checks each output's batch axis, marks the axes that
  differ between variants as variable (``-1``), builds the ``IOSpec``s, stamps the provenance and
  hands everything to ``write_bundle`` -- whose arity gate refuses a program that takes other than
  inputs + weights arguments before anything is written.

Nothing here imports jax at module level.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kserve_trio.core.tensors import DType
from kserve_trio.export.iospec import AXIS_LETTERS, IOSpec, as_dtype
from kserve_trio.export.provenance import kserve_trio_version
from kserve_trio.export.writer import write_bundle

MATMUL_PRECISIONS: tuple[str, ...] = (
    "default",
    "high",
    "highest",
    "bfloat16",
    "tensorfloat32",
    "float32",
)
"""Values ``matmul_precision`` accepts (jax's ``jax_default_matmul_precision`` names)."""


def per_tensor_axes(value: Any, n: int, what: str) -> list[int | None]:
    """One batch axis (or ``None``) per tensor from an int, ``None`` or a sequence of them."""
    if value is None or isinstance(value, int):
        return [value] * n
    axes = list(value)
    if len(axes) != n:
        raise ValueError(f"{what} has {len(axes)} entries for {n} tensor(s)")
    for a in axes:
        if a is not None and (isinstance(a, bool) or not isinstance(a, int)):
            raise ValueError(f"{what} entries must be ints or None, got {a!r}")
    return axes


def tensor_names(given: Sequence[str] | None, n: int, default: list[str], what: str) -> list[str]:
    """``given`` checked (count, uniqueness), or ``default``."""
    if given is None:
        return default
    names = list(given)
    if len(names) != n:
        raise ValueError(f"{what} has {len(names)} name(s) for {n} tensor(s)")
    if len(set(names)) != len(names):
        raise ValueError(f"{what} has duplicate names: {names}")
    return names


def variable_letters(
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


def check_matmul_precision(value: str | None) -> str | None:
    """``value`` lower-cased if it is one of ``MATMUL_PRECISIONS`` (or ``None``)."""
    if value is None:
        return None
    token = str(value).strip().lower()
    if token not in MATMUL_PRECISIONS:
        raise ValueError(
            f"unknown matmul_precision {value!r}; expected one of {', '.join(MATMUL_PRECISIONS)}"
        )
    return token


@dataclass(frozen=True)
class ExportPlan:
    """What to trace: the bundle directory, the inputs and every (variant, batch size).

    ``sizes`` is ``[0]`` for one unbatched module; ``keys[vi]`` is variant ``vi``'s key in the
    multi-shape layout (the sizes of its variable axes in input order).
    """

    dir: Path
    in_names: list[str]
    in_dtypes: list[DType]
    in_axes: list[int | None]
    sizes: list[int]
    variants: list[list[tuple[int, ...]]]
    var_axes: list[list[int]]
    ranks: list[int]
    keys: list[tuple[int, ...]]

    @property
    def n_in(self) -> int:
        return len(self.in_names)

    @property
    def multi(self) -> bool:
        return len(self.variants) > 1

    def shapes(self, vi: int, n: int) -> list[tuple[int, ...]]:
        """The concrete input shapes of variant ``vi`` at batch size ``n``."""
        v = self.variants[vi]
        return [
            tuple(n if (k == self.in_axes[i] and n > 0) else s for k, s in enumerate(v[i]))
            for i in range(self.n_in)
        ]

    def traces(self) -> Iterator[tuple[int, int, list[tuple[int, ...]]]]:
        """``(variant index, batch size, input shapes)`` for every module to trace."""
        for vi in range(len(self.variants)):
            for n in self.sizes:
                yield vi, n, self.shapes(vi, n)


def bundle_dir(dir: str | os.PathLike[str], name: str | None) -> Path:
    """``dir`` as a Path, checking that ``name`` (when given) is its basename."""
    d = Path(dir)
    basename = os.path.basename(os.path.normpath(os.path.abspath(d)))
    if name is not None and name != basename:
        raise ValueError(
            f"bundle name '{name}' must equal the directory basename '{basename}' "
            "(the directory name is the serving name)"
        )
    return d


def plan_export(
    examples: Sequence[tuple[tuple[int, ...], Any]],
    *,
    dir: str | os.PathLike[str],
    name: str | None,
    batch_sizes: Sequence[int] | None,
    input_names: Sequence[str] | None,
    input_batch_axes: int | Sequence[int | None] | None,
    input_shapes: Sequence[Sequence[Sequence[int]]] | None,
) -> ExportPlan:
    """Check the export arguments and plan the traces. ``examples`` is ``(shape, dtype)`` per
    input; the rules are those of ``export_bundle`` (docs/bundles.md)."""
    d = bundle_dir(dir, name)
    n_in = len(examples)
    in_names = tensor_names(input_names, n_in, [f"input_{i}" for i in range(n_in)], "input_names")
    in_dtypes = []
    for i, (_, dt) in enumerate(examples):
        try:
            in_dtypes.append(as_dtype(dt))
        except ValueError:
            raise ValueError(
                f"input {i} ('{in_names[i]}') has dtype {dt}, which bundles cannot carry"
            ) from None

    if batch_sizes is None:
        sizes: list[int] = [0]
        in_axes: list[int | None] = [None] * n_in
    else:
        sizes = sorted({int(s) for s in batch_sizes})
        if not sizes or sizes[0] <= 0:
            raise ValueError(f"batch_sizes must be positive integers, got {list(batch_sizes)}")
        in_axes = per_tensor_axes(input_batch_axes, n_in, "input_batch_axes")
        if len(sizes) > 1 and all(a is None for a in in_axes):
            raise ValueError("several batch sizes need at least one input with a batch axis")

    if input_shapes is None:
        variants = [[tuple(int(d_) for d_ in s) for s, _ in examples]]
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
    if len(variants) > 1 and len(set(keys)) != len(keys):
        raise ValueError(
            f"input_shapes has duplicate variants: {[list(map(list, v)) for v in variants]}"
        )
    return ExportPlan(d, in_names, in_dtypes, in_axes, sizes, variants, var_axes, ranks, keys)


def assemble_bundle(
    plan: ExportPlan,
    exported: Mapping[tuple[int, int], Any],
    *,
    single_output: bool,
    output_names: Sequence[str] | None,
    output_batch_axes: int | Sequence[int | None] | None,
    weights: Sequence[tuple[str, np.ndarray]],
    client_inputs: Sequence[IOSpec] | None,
    client_outputs: Sequence[IOSpec] | None,
    stamp: Mapping[str, Any],
    provenance: Mapping[str, Any] | None,
) -> Path:
    """Write the bundle of ``exported[(variant index, batch size)]`` (``jax.export.Exported``
    objects, entry ``(inputs..., weights...)``); see the module docstring for the rules.

    ``single_output``: the model returned one array (named ``output``) rather than a sequence
    (``output_0, ...``). ``stamp`` is the frontend's provenance; ``provenance`` wins over it.
    """
    sizes = plan.sizes
    first = tuple(exported[(0, sizes[0])].out_avals)
    n_out = len(first)
    out_names = tensor_names(
        output_names,
        n_out,
        ["output"] if single_output and n_out == 1 else [f"output_{j}" for j in range(n_out)],
        "output_names",
    )
    out_axes = (
        [None] * n_out
        if sizes == [0]
        else per_tensor_axes(output_batch_axes, n_out, "output_batch_axes")
    )
    # output checks: batch extents equal N; axes that differ across variants become -1
    out_shapes: list[list[int]] = []
    for j in range(n_out):
        ax = out_axes[j]
        shape = list(first[j].shape)
        for (_vi, n), exp in exported.items():
            avals = tuple(exp.out_avals)
            if len(avals) != n_out:
                raise ValueError(
                    f"the model returns {len(avals)} output(s) at batch size {n} but {n_out} at "
                    f"batch size {sizes[0]}"
                )
            s = tuple(avals[j].shape)
            if np.dtype(avals[j].dtype) != np.dtype(first[j].dtype):
                raise ValueError(f"output '{out_names[j]}' changes dtype between variants")
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

    multi = plan.multi
    letters = (
        variable_letters(plan.var_axes, plan.ranks, plan.in_axes) if multi else [None] * plan.n_in
    )
    in_specs = []
    for i in range(plan.n_in):
        shape = list(plan.variants[0][i])
        for k in plan.var_axes[i] if multi else []:
            shape[k] = -1
        axis = plan.in_axes[i]
        if axis is not None and sizes != [0]:
            shape[axis] = sizes[0]
        in_specs.append(
            IOSpec(plan.in_names[i], plan.in_dtypes[i], tuple(shape), plan.in_axes[i], letters[i])
        )
    out_specs = []
    for j in range(n_out):
        try:
            dt = as_dtype(first[j].dtype)
        except ValueError:
            raise ValueError(
                f"output {j} ('{out_names[j]}') has dtype {first[j].dtype}, which bundles cannot "
                "carry; nothing has been written"
            ) from None
        out_specs.append(IOSpec(out_names[j], dt, tuple(out_shapes[j]), out_axes[j]))

    prov: dict[str, Any] = dict(stamp)
    prov["batch_sizes"] = [] if sizes == [0] else sizes
    if multi:
        prov["input_shapes"] = [[list(s) for s in v] for v in plan.variants]
    prov.update(provenance or {})

    by_key: dict[tuple[int, ...], dict[int, Any]] = {}
    for (vi, n), exp in exported.items():
        by_key.setdefault(plan.keys[vi], {})[n] = exp
    modules: Mapping[Any, Any] = by_key if multi else by_key[plan.keys[0]]
    return write_bundle(
        plan.dir,
        executable_inputs=in_specs,
        executable_outputs=out_specs,
        modules=modules,
        weights=list(weights),
        client_inputs=client_inputs,
        client_outputs=client_outputs,
        input_shapes=plan.keys if multi else None,
        provenance=prov,
    )


def jax_platform() -> str:
    """The platform jax traces for here (``cpu`` or ``cuda``)."""
    import jax

    p = jax.default_backend()
    return "cuda" if p == "gpu" else p


def jax_versions() -> dict[str, str]:
    """jax, jaxlib and kserve_trio versions for the provenance."""
    import jax
    import jaxlib.version

    return {
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.version.__version__,
        "kserve_trio_version": kserve_trio_version(),
    }


__all__ = [
    "MATMUL_PRECISIONS",
    "ExportPlan",
    "assemble_bundle",
    "bundle_dir",
    "check_matmul_precision",
    "jax_platform",
    "jax_versions",
    "per_tensor_axes",
    "plan_export",
    "tensor_names",
    "variable_letters",
]

"""``export_bundle(frontend, ...)``: one entry point, the frontend named at the call site.

* ``"jax"`` -- a JAX function and its weights (``export.jax_frontend``);
* ``"torch"`` -- a ``torch.nn.Module``, weights taken from the module (``export.torch_frontend``);
* ``"torchscript"`` -- a TorchScript file or ``ScriptModule``, likewise.

The torch frontends import torch (and torchax) only when selected, so neither this module nor
anything the worker or the runtime imports pulls torch in; without the ``kserve_trio[torch]``
extra they fail with an error that says what to install.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kserve_trio.export.iospec import IOSpec

FRONTENDS: tuple[str, ...] = ("jax", "torch", "torchscript")


def export_bundle(
    frontend: str,
    fn: Any,
    example_inputs: Any,
    weights: Any = None,
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
    matmul_precision: str | None = None,
    provenance: Mapping[str, Any] | None = None,
    output_select: Callable[[Any], Any] | None = None,
) -> Path:
    """Export a model to a bundle in ``dir`` and return ``dir``.

    * ``frontend``: ``"jax"`` (``fn`` a JAX-traceable function), ``"torch"`` (``fn`` a
      ``torch.nn.Module``, in eval mode) or ``"torchscript"`` (``fn`` a TorchScript file path or
      a loaded ``ScriptModule``).
    * ``dir`` is the bundle directory (created if missing); its basename is the model name, and
      ``name``, when given, must equal it (else ``ValueError``).
    * ``example_inputs``: a tuple of arrays (a bare array is a 1-tuple; torch tensors for the
      torch frontends); they give the dtypes and, without ``input_shapes``, the shapes.
    * ``weights`` (jax only; the torch frontends take the module's parameters and buffers):
      ``(name, array)`` pairs or a flat mapping -> ``fn(*inputs, *arrays)``; any other pytree ->
      ``fn(*inputs, params)``; ``None`` when ``fn`` takes no weights.
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
    * ``matmul_precision``: jax's default matmul precision while tracing (``highest``,
      ``tensorfloat32``, ``bfloat16``, ``default``, ...); it is frozen into the program. The
      torch frontends default to torch's own ``torch.get_float32_matmul_precision()``.
    * ``output_select`` (jax only): maps ``fn``'s raw result to the tuple (or list) of arrays to
      export, in output order; a result that is not a tuple or list is one output. It is how a
      function that also returns something else (a step count, a dict of extras) is exported:
      the selector drops what is not an array; an element of its result that is not an array
      is a ``TypeError``.
    * ``client_inputs``/``client_outputs`` and ``provenance`` go to ``write_bundle``; the
      provenance is stamped with the framework versions first, and the caller's keys win.

    A program whose arity differs from inputs + weights, or a tensor of a dtype bundles cannot
    carry, is refused (``ValueError``, "UNSERVABLE") before anything is written; the torch
    frontends also refuse modules that mutate their buffers or draw random numbers in forward.
    """
    kwargs: dict[str, Any] = {
        "dir": dir,
        "name": name,
        "batch_sizes": batch_sizes,
        "input_names": input_names,
        "output_names": output_names,
        "input_batch_axes": input_batch_axes,
        "output_batch_axes": output_batch_axes,
        "client_inputs": client_inputs,
        "client_outputs": client_outputs,
        "input_shapes": input_shapes,
        "matmul_precision": matmul_precision,
        "provenance": provenance,
    }
    if frontend == "jax":
        from kserve_trio.export.jax_frontend import export_jax

        return export_jax(fn, example_inputs, weights, output_select=output_select, **kwargs)
    if frontend in ("torch", "torchscript"):
        if output_select is not None:
            raise TypeError(
                f"output_select is a jax frontend argument; the {frontend} frontend exports "
                "what the module's forward returns"
            )
        if weights is not None:
            raise TypeError(
                f"the {frontend} frontend takes the weights from the module; pass weights=None"
            )
        from kserve_trio.export.torch_frontend import export_torch, export_torchscript

        export = export_torch if frontend == "torch" else export_torchscript
        return export(fn, example_inputs, **kwargs)
    raise ValueError(f"unknown export frontend {frontend!r}; available: {', '.join(FRONTENDS)}")


__all__ = ["FRONTENDS", "export_bundle"]

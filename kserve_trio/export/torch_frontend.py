"""The ``torch`` and ``torchscript`` export frontends: a PyTorch module to a bundle.

For every batch size and shape variant the module is exported with
``torch.export.export(module, args, strict=False)``, lowered to a JAX function through torchax
(``export.torch_lowering``: inputs first, then the weights) and re-exported with ``jax.export``
for this platform, so the bundle is the same as the jax frontend writes: the same files, names,
batch-axis and variant rules, the same arity gate (``export.assemble``). The weights are the
module's parameters, buffers and lifted constants that the program reads, named by their
``state_dict`` keys, taken from the first trace and shared by every module of the bundle.

TorchScript: a file (``torch.jit.load(path, map_location="cpu")``) or a ``ScriptModule`` is
wrapped in an ``nn.Module`` whose parameters are real ``nn.Parameter``s again (``torch.export``
requires it) and exported the same way; traced TorchScript calls ``aten._convolution``, which
the lowering maps to ``aten.convolution``.

Served models run in inference mode, so a module (or any submodule) in training mode is refused
with the list of those submodules: train-mode BatchNorm would normalise each request by its own
batch (which the server pads) and dropout would replay one fixed mask.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kserve_trio.export.assemble import (
    assemble_bundle,
    bundle_dir,
    check_matmul_precision,
    jax_platform,
    jax_versions,
    plan_export,
)
from kserve_trio.export.iospec import IOSpec
from kserve_trio.export.torch_lowering import (
    UnservableProgram,
    host_array,
    import_torch,
    import_torchax,
    lower_program,
    numpy_dtype,
)

TORCH_TO_JAX_PRECISION = {"highest": "highest", "high": "tensorfloat32", "medium": "bfloat16"}
"""``torch.get_float32_matmul_precision()`` -> the jax precision that computes the same way."""

_WRAPPER_PREFIX = "inner."


def _versions() -> dict[str, str]:
    from importlib import metadata

    torch = import_torch()
    try:
        torchax_version = metadata.version("torchax")
    except metadata.PackageNotFoundError:  # pragma: no cover - imported from a source tree
        torchax_version = "unknown"
    return {"torch_version": str(torch.__version__), "torchax_version": torchax_version}


def _as_tensors(example_inputs: Any) -> list[Any]:
    torch = import_torch()
    items = list(example_inputs) if isinstance(example_inputs, tuple | list) else [example_inputs]
    out = []
    for i, x in enumerate(items):
        if isinstance(x, torch.Tensor):
            out.append(x.detach())
        elif hasattr(x, "__array__") and hasattr(x, "dtype"):
            out.append(torch.from_numpy(np.asarray(x)))
        else:
            raise TypeError(f"example input {i} is a {type(x).__name__}, not a tensor")
    return out


def _training_submodules(module: Any) -> list[str]:
    return [name or "(the module itself)" for name, m in module.named_modules() if m.training]


def _example_at(x: Any, shape: tuple[int, ...]) -> Any:
    """``x`` itself at its own shape, else zeros of ``x``'s dtype at ``shape`` (export traces
    with fake tensors: only shapes and dtypes matter)."""
    torch = import_torch()
    if tuple(x.shape) == tuple(shape):
        return x
    return torch.zeros(shape, dtype=x.dtype)


def _export_entry(entry: Any, specs: Sequence[Any], platform: str) -> Any:
    """``entry`` exported for ``platform`` with every argument kept (an unused input stays an
    input, so the arity is always inputs + weights)."""
    import jax

    return jax.export.export(jax.jit(entry, keep_unused=True), platforms=(platform,))(*specs)


def default_matmul_precision() -> str:
    """The jax matmul precision matching torch's current float32 matmul precision."""
    torch = import_torch()
    return TORCH_TO_JAX_PRECISION.get(torch.get_float32_matmul_precision(), "highest")


def export_torch(
    module: Any,
    example_inputs: Any,
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
    _stamp: Mapping[str, Any] | None = None,
    _strip_prefix: str = "",
) -> Path:
    """``export_bundle("torch", module, example_inputs, ...)``: see the module docstring and
    ``export.frontends.export_bundle``. Raises before writing anything when the module cannot
    be served (``ValueError`` mentioning UNSERVABLE, or the argument error)."""
    torch = import_torch()
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"the torch frontend exports a torch.nn.Module, got {type(module).__name__}"
        )
    what = f"module '{type(module).__name__}'"
    d = bundle_dir(dir, name)
    training = _training_submodules(module)
    if training:
        shown = ", ".join(training[:8]) + (" ..." if len(training) > 8 else "")
        raise UnservableProgram(
            what,
            f"it is in training mode ({shown}); served models run in inference mode: call "
            "module.eval() before exporting",
        )
    examples = _as_tensors(example_inputs)
    specs = []
    for i, x in enumerate(examples):
        npd = numpy_dtype(x.dtype)
        if npd is None:
            raise UnservableProgram(
                what, f"example input {i} has dtype {x.dtype}, which bundles cannot carry"
            )
        specs.append((tuple(int(s) for s in x.shape), npd))
    plan = plan_export(
        specs,
        dir=d,
        name=name,
        batch_sizes=batch_sizes,
        input_names=input_names,
        input_batch_axes=input_batch_axes,
        input_shapes=input_shapes,
    )
    precision = check_matmul_precision(matmul_precision) or default_matmul_precision()
    import_torchax()

    import jax

    from kserve_trio.export.jax_frontend import precision_scope
    from kserve_trio.runtime.x64 import x64_scope

    platform = jax_platform()
    exported: dict[tuple[int, int], Any] = {}
    weights: tuple[tuple[str, ...], tuple[Any, ...]] | None = None
    single = False
    for vi, n, shapes in plan.traces():
        args = tuple(_example_at(x, s) for x, s in zip(examples, shapes, strict=True))
        with torch.no_grad():
            try:
                ep = torch.export.export(module, args, strict=False)
            except UnservableProgram:
                raise
            except Exception as exc:
                raise ValueError(
                    f"{what}: torch.export failed at input shapes {[list(s) for s in shapes]}: "
                    f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:400]}"
                ) from exc
        lowered = lower_program(ep, what=what, strip_prefix=_strip_prefix)
        if lowered.n_inputs != plan.n_in:
            raise UnservableProgram(
                what,
                f"the program takes {lowered.n_inputs} input(s) but {plan.n_in} example "
                "input(s) were given",
            )
        if weights is None:
            weights = (lowered.weight_names, lowered.weights)
            single = lowered.single_output
        elif lowered.weight_names != weights[0]:
            raise UnservableProgram(
                what,
                f"the program reads different weights at input shapes {[list(s) for s in shapes]} "
                f"({list(lowered.weight_names)}) than at the first ({list(weights[0])})",
            )
        with x64_scope(), precision_scope(precision):
            in_specs = [
                jax.ShapeDtypeStruct(s, dt.numpy)
                for s, dt in zip(shapes, plan.in_dtypes, strict=True)
            ]
            w_specs = [
                jax.ShapeDtypeStruct(tuple(w.shape), numpy_dtype(w.dtype)) for w in weights[1]
            ]
            exported[(vi, n)] = _export_entry(lowered.entry, [*in_specs, *w_specs], platform)

    assert weights is not None
    stamp: dict[str, Any] = {
        "source_framework": "pytorch",
        "converter": "kserve_trio.export.export_bundle (torch.export + torchax)",
        **_versions(),
        **jax_versions(),
        "platform": platform,
        "matmul_precision": precision,
        **dict(_stamp or {}),
    }
    return assemble_bundle(
        plan,
        exported,
        single_output=single,
        output_names=output_names,
        output_batch_axes=output_batch_axes,
        weights=[(n, host_array(w)) for n, w in zip(weights[0], weights[1], strict=True)],
        client_inputs=client_inputs,
        client_outputs=client_outputs,
        stamp=stamp,
        provenance=provenance,
    )


# ----------------------------------------------------------------------------------------------
# TorchScript
# ----------------------------------------------------------------------------------------------


def load_torchscript(source: Any) -> tuple[Any, str | None]:
    """``(nn.Module wrapper, path or None)`` for a TorchScript file path or ``ScriptModule``."""
    torch = import_torch()
    path: str | None = None
    if isinstance(source, str | os.PathLike):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no TorchScript file at {path}")
        try:
            script = torch.jit.load(path, map_location="cpu")
        except Exception as exc:
            raise ValueError(f"{path} is not a loadable TorchScript file: {exc}") from exc
    elif isinstance(source, torch.jit.ScriptModule):
        # round-trip through the serialized form: an in-memory ScriptModule still refers to the
        # Python module it was scripted from, which torch.export would trace instead (and call
        # with the wrong arguments); a loaded one is pure TorchScript, like a file
        buf = io.BytesIO()
        torch.jit.save(source, buf)
        buf.seek(0)
        script = torch.jit.load(buf, map_location="cpu")
    else:
        raise TypeError(
            "the torchscript frontend takes a TorchScript file path or a torch.jit.ScriptModule, "
            f"got {type(source).__name__}"
        )
    # torch.jit.load gives plain tensors where the module had parameters; torch.export needs
    # real nn.Parameter objects to lift them as weights
    for _, sub in script.named_modules():
        for pname, p in list(sub.named_parameters(recurse=False)):
            if not isinstance(p, torch.nn.Parameter):
                setattr(sub, pname, torch.nn.Parameter(p.detach(), requires_grad=False))

    class TorchScriptModule(torch.nn.Module):
        """A ScriptModule as an ``nn.Module`` that ``torch.export`` can trace."""

        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args: Any) -> Any:
            return self.inner(*args)

    wrapper = TorchScriptModule(script)
    wrapper.training = bool(script.training)
    return wrapper, path


def export_torchscript(source: Any, example_inputs: Any, **kwargs: Any) -> Path:
    """``export_bundle("torchscript", path_or_scriptmodule, example_inputs, ...)``."""
    wrapper, path = load_torchscript(source)
    stamp: dict[str, Any] = {"source_subframework": "torchscript"}
    if path is not None:
        stamp["torchscript_path"] = os.path.abspath(path)
    return export_torch(
        wrapper, example_inputs, _stamp=stamp, _strip_prefix=_WRAPPER_PREFIX, **kwargs
    )


__all__ = [
    "TORCH_TO_JAX_PRECISION",
    "default_matmul_precision",
    "export_torch",
    "export_torchscript",
    "load_torchscript",
]

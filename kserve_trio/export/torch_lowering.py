"""Lower a ``torch.export`` program to a JAX function through torchax, with torch's dtype rules.

Only the torch frontends import this module, and it imports torch and torchax lazily, so the
worker, the runtime and ``kserve_trio.export`` itself never load torch.

``lower_program(ep)`` turns an ``ExportedProgram`` into a ``Lowered``: a JAX function
``entry(*inputs, *weights)`` -- inputs first, then the weights, in the decomposed program's
placeholder order with the placeholders the graph never reads left out -- plus the weights'
names and host arrays. On the way it refuses, before anything is traced, programs a stateless
server cannot serve: buffers or inputs mutated in forward, random draws, placeholders that are
neither tensors nor weights, tensors of dtypes bundles cannot carry.

dtype rules. The program is traced in jax's 64-bit mode so that ``int64``/``float64`` tensors
keep their width, but each aten op is lowered in 64-bit mode only when torch says it reads or
produces a 64-bit tensor; every other op is lowered in 32-bit mode, so torchax's own helper
constants (``-inf`` for a max-pool, ``nan`` for a variance) stay ``float32`` where jax would
otherwise make them ``float64`` and widen the whole op. An op whose lowering returns another
dtype than torch's is cast to torch's, and 0-dim ``float64`` constants that only feed 32-bit
ops become ``float32`` (a 0-dim tensor does not widen a ``float32`` one in torch).

torchax 0.0.13 refers, at import time, to the named-tensor (``Dimname``) overloads that torch
2.13 no longer has; ``import_torchax`` lets those lookups yield inert placeholders during the
import (no program can call an op torch does not have) and logs which ones.
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kserve_trio.core.logging import get_logger

log = get_logger(__name__)

EXTRA_HINT = "install the torch extra: pip install 'kserve_trio[torch]'"

_TORCH_TO_NUMPY = {
    "float16": "float16",
    "float32": "float32",
    "float64": "float64",
    "int8": "int8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "uint8": "uint8",
    "uint16": "uint16",
    "uint32": "uint32",
    "uint64": "uint64",
    "bool": "bool",
}
_WIDE = frozenset({"int64", "uint64", "float64", "complex128"})


class UnservableProgram(ValueError):
    """The module's program cannot become a bundle (the message says why and what to change)."""

    def __init__(self, what: str, reason: str) -> None:
        super().__init__(f"{what} is UNSERVABLE and has not been written: {reason}")


def import_torch() -> Any:
    """``torch``, or an ``ImportError`` that says which extra to install."""
    try:
        import torch
    except ImportError as exc:
        raise ImportError(f"the torch export frontends need torch: {EXTRA_HINT}") from exc
    return torch


class _MissingOverload:
    """Stands in for an op overload this torch no longer has (never called, never matched)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<missing overload {self.name}>"


@contextlib.contextmanager
def _tolerate_missing_overloads(missing: list[str]) -> Iterator[None]:
    import torch._ops as tops

    packet = tops.OpOverloadPacket
    original = packet.__getattr__

    def lookup(self: Any, key: str) -> Any:
        try:
            return original(self, key)
        except AttributeError:
            if key.startswith("__"):
                raise
            name = f"{self._qualified_op_name}.{key}"
            missing.append(name)
            return _MissingOverload(name)

    packet.__getattr__ = lookup  # type: ignore[method-assign]
    try:
        yield
    finally:
        packet.__getattr__ = original  # type: ignore[method-assign]


_torchax: Any = None
_skipped: tuple[str, ...] = ()


def import_torchax() -> Any:
    """``torchax`` with its op registry filled (imported once; see the module docstring)."""
    global _torchax, _skipped
    if _torchax is not None:
        return _torchax
    import_torch()
    missing: list[str] = []
    try:
        with _tolerate_missing_overloads(missing):
            import torchax
            import torchax.export
            import torchax.ops.mappings

            torchax.default_env()  # registers the aten lowerings
    except ImportError as exc:
        raise ImportError(f"the torch export frontends need torchax: {EXTRA_HINT}") from exc
    _skipped = tuple(sorted(set(missing)))
    if _skipped:
        log.debug("torchax_missing_overloads", count=len(_skipped), overloads=list(_skipped))
    _torchax = torchax
    return torchax


def skipped_overloads() -> tuple[str, ...]:
    """The op overloads (``aten::prod.dim_Dimname``, ...) torchax named at import that this
    torch does not have, each answered by an inert placeholder; empty before ``import_torchax``.
    A test checks that no lowering the exporters use is among them."""
    return _skipped


def numpy_dtype(torch_dtype: Any) -> np.dtype | None:
    """The numpy dtype of a torch dtype bundles can carry, else ``None``."""
    name = str(torch_dtype).removeprefix("torch.")
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    token = _TORCH_TO_NUMPY.get(name)
    return np.dtype(token) if token else None


def host_array(t: Any) -> np.ndarray:
    """A host numpy copy of a torch tensor (bfloat16 through its bits)."""
    import torch

    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return t.numpy().copy()


# ----------------------------------------------------------------------------------------------
# Which tensors an FX node touches
# ----------------------------------------------------------------------------------------------


def _tensors(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def _used_outputs(node: Any) -> list[Any]:
    """The tensors of ``node``'s result that some user reads (all of them unless every user is
    an ``operator.getitem``, as for ``max_pool2d_with_indices`` whose indices go unused)."""
    val = node.meta.get("val")
    users = list(node.users)
    if isinstance(val, list | tuple) and users and all(_is_getitem(u) for u in users):
        idx = {u.args[1] for u in users}
        return [t for i, v in enumerate(val) if i in idx for t in _tensors(v)]
    return _tensors(val)


def _is_getitem(node: Any) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def _is_wide(tensors: list[Any]) -> bool:
    return any(str(t.dtype).removeprefix("torch.") in _WIDE for t in tensors)


def node_is_wide(node: Any) -> bool:
    """Whether torch says ``node`` reads or produces (a used) 64-bit tensor."""
    ts = _used_outputs(node)
    for a in node.all_input_nodes:
        ts += _tensors(a.meta.get("val"))
    return _is_wide(ts)


def _cast_like(result: Any, val: Any, used: bool = True) -> Any:
    """``result`` with each array cast to the dtype torch gives the matching tensor in ``val``."""
    import torch

    mappings = import_torchax().ops.mappings
    if isinstance(val, torch.Tensor) and hasattr(result, "dtype"):
        want = mappings.t2j_dtype(val.dtype)
        return result.astype(want) if used and result.dtype != want else result
    if (
        isinstance(val, list | tuple)
        and isinstance(result, list | tuple)
        and len(val) == len(result)
    ):
        return type(result)(_cast_like(r, v, used) for r, v in zip(result, val, strict=True))
    return result


def _pass_through_ops() -> frozenset[Any]:
    """Ops that hand a 0-dim tensor on unchanged (torch.export wraps lifted constants in them)."""
    import torch

    aten = torch.ops.aten
    return frozenset(
        {
            aten.clone.default,
            aten.alias.default,
            aten.detach.default,
            aten.lift_fresh_copy.default,
            aten.view.default,
            aten.reshape.default,
            aten.expand.default,
            aten.unsqueeze.default,
            aten.squeeze.default,
        }
    )


def _weak_scalar_chain(node: Any) -> list[Any] | None:
    """The nodes carrying a 0-dim float64 constant to its consumers, when none of those
    consumers produces a float64 result (then torch computes them in float32, as the 0-dim
    tensor does not widen them, and the constant can be float32 too); else ``None``."""
    passing = _pass_through_ops()
    chain = [node]
    todo = list(node.users)
    while todo:
        u = todo.pop()
        if u.op == "call_function" and u.target in passing:
            chain.append(u)
            todo += list(u.users)
        elif _is_wide(_tensors(u.meta.get("val"))) or u.op == "output":
            return None
    return chain


# ----------------------------------------------------------------------------------------------
# The interpreter
# ----------------------------------------------------------------------------------------------


def _extra_lowerings() -> dict[Any, Callable[..., Any]]:
    """Lowerings torchax lacks: ``aten._convolution`` (what traced TorchScript calls) is
    ``aten.convolution`` plus cuDNN flags that do not change the result."""
    import torch

    registry = import_torchax().ops.ops_registry.all_aten_ops
    conv = registry[torch.ops.aten.convolution].func

    def _convolution(inp, weight, bias, stride, padding, dilation, transposed, out_pad, groups, *_):
        return conv(inp, weight, bias, stride, padding, dilation, transposed, out_pad, groups)

    return {torch.ops.aten._convolution.default: _convolution}


def _interpreter_class() -> type:
    import jax
    import torch
    import torch.fx

    registry = import_torchax().ops.ops_registry.all_aten_ops
    extra = _extra_lowerings()

    class Interpreter(torch.fx.Interpreter):
        """Runs an ATen graph on jax values, op by op (see the module docstring)."""

        def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
            if not isinstance(target, torch._ops.OpOverloadPacket | torch._ops.OpOverload):
                return super().call_function(target, args, kwargs)
            fn = extra.get(target)
            if fn is None:
                op = registry.get(target)
                if op is None and isinstance(target, torch._ops.OpOverload):
                    op = registry.get(target.overloadpacket)
                if op is None or not op.is_jax_function:
                    raise UnservableProgram(
                        "the module",
                        f"torchax has no JAX lowering for {target}; the module cannot be "
                        "exported (rewrite that part of forward with other operations)",
                    )
                fn = op.func
            return fn(*args, **kwargs)

        def run_node(self, n: Any) -> Any:
            if n.op != "call_function":
                return super().run_node(n)
            with jax.enable_x64(node_is_wide(n)):
                res = super().run_node(n)
                val = n.meta.get("val")
                if isinstance(val, list | tuple) and isinstance(res, list | tuple):
                    used = {u.args[1] for u in n.users if _is_getitem(u)} or set(range(len(res)))
                    return type(res)(
                        _cast_like(r, v, i in used)
                        for i, (r, v) in enumerate(zip(res, val, strict=False))
                    )
                return _cast_like(res, val)

    return Interpreter


# ----------------------------------------------------------------------------------------------
# Programs
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lowered:
    """A program as a JAX function ``entry(*inputs, *weights) -> tuple`` and its weights."""

    entry: Callable[..., tuple[Any, ...]]
    n_inputs: int
    weight_names: tuple[str, ...]
    weights: tuple[Any, ...]  # torch tensors, in argument order
    single_output: bool
    output_dtypes: tuple[Any, ...]


def check_servable(ep: Any, what: str) -> None:
    """Refuse programs that keep state between calls or draw random numbers.

    Run it on the decomposed program: before decomposition an eval-mode ``dropout`` (or an
    attention with ``dropout_p=0``) is still one op tagged as random; decomposed, it is not.
    """
    import torch

    sig = ep.graph_signature
    mutated = sorted(set(sig.buffers_to_mutate.values()))
    if mutated:
        raise UnservableProgram(
            what,
            f"forward mutates buffer(s) {mutated}, state a stateless server would drop "
            "after every request (a BatchNorm in training mode updates its running statistics: "
            "call module.eval(); a counter in forward must go)",
        )
    inputs_mutated = sorted(set(getattr(sig, "user_inputs_to_mutate", {}).values()))
    if inputs_mutated:
        raise UnservableProgram(what, f"forward writes into its input(s) {inputs_mutated}")
    seeded = torch.Tag.nondeterministic_seeded
    random_ops = sorted(
        {
            str(n.target)
            for n in ep.graph.nodes
            if n.op == "call_function"
            and isinstance(n.target, torch._ops.OpOverload)
            and seeded in n.target.tags
        }
    )
    if random_ops:
        raise UnservableProgram(
            what,
            f"forward draws random numbers ({', '.join(random_ops)}); a bundle would "
            "replay one fixed draw on every request (dropout in training mode does this: call "
            "module.eval())",
        )


def decompose(ep: Any) -> Any:
    """The program in the core ATen op set torchax lowers."""
    torchax = import_torchax()
    from torchax import decompositions

    del torchax
    with warnings.catch_warnings():
        # torch 2.13's own run_decompositions deep-copies a deprecated pytree LeafSpec
        warnings.filterwarnings(
            "ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning
        )
        return ep.run_decompositions().run_decompositions(decompositions.DECOMPOSITIONS)


def lower_program(ep: Any, *, what: str, strip_prefix: str = "") -> Lowered:
    """``ep`` (a ``torch.export.ExportedProgram``) as a ``Lowered``; see the module docstring.

    ``strip_prefix`` is removed from the weight names (the TorchScript wrapper's ``inner.``).
    """
    import torch
    from torch.export.graph_signature import InputKind, OutputKind

    dep = decompose(ep)
    check_servable(dep, what)
    sig = dep.graph_signature
    gm = dep.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    specs = list(sig.input_specs)
    if len(placeholders) != len(specs):
        raise UnservableProgram(
            what, f"the program has {len(placeholders)} placeholders for {len(specs)} inputs"
        )
    state = dict(dep.state_dict)
    state.update(getattr(dep, "constants", None) or {})

    user_slots: list[int] = []
    weight_slots: list[int] = []
    names: list[str] = []
    values: list[Any] = []
    for i, (spec, node) in enumerate(zip(specs, placeholders, strict=True)):
        if spec.kind == InputKind.USER_INPUT:
            if not isinstance(node.meta.get("val"), torch.Tensor):
                raise UnservableProgram(
                    what,
                    f"input '{spec.arg.name}' is not a tensor; a bundle's inputs are "
                    "tensors (bind other arguments in the module)",
                )
            user_slots.append(i)
            continue
        if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            raise UnservableProgram(
                what,
                f"the program takes a {spec.kind.name} '{spec.target}', which a bundle "
                "cannot carry",
            )
        if not node.users:
            continue  # never read: not a weight of the bundle
        value = state[spec.target]
        if (
            spec.kind == InputKind.CONSTANT_TENSOR
            and value.ndim == 0
            and value.dtype == torch.float64
        ):
            chain = _weak_scalar_chain(node)
            if chain is not None:
                value = value.to(torch.float32)
                for n in chain:
                    n.meta["val"] = n.meta["val"].to(torch.float32)
        name = str(spec.target)
        if strip_prefix and name.startswith(strip_prefix):
            name = name[len(strip_prefix) :]
        names.append(name)
        values.append(value)
        weight_slots.append(i)

    for name, value in zip(names, values, strict=True):
        if numpy_dtype(value.dtype) is None:
            raise UnservableProgram(
                what, f"weight '{name}' has dtype {value.dtype}, which bundles cannot carry"
            )
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise UnservableProgram(what, f"weight names collide: {dups}")

    out_specs = list(sig.output_specs)
    if any(s.kind != OutputKind.USER_OUTPUT for s in out_specs):
        kinds = sorted({s.kind.name for s in out_specs if s.kind != OutputKind.USER_OUTPUT})
        raise UnservableProgram(what, f"the program returns {kinds} besides its outputs")
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    out_vals = [a.meta.get("val") if hasattr(a, "meta") else a for a in out_node.args[0]]
    for j, v in enumerate(out_vals):
        if not isinstance(v, torch.Tensor):
            raise UnservableProgram(
                what,
                f"output {j} is {type(v).__name__} {v!r}, not a tensor; forward must "
                "return tensors (a tensor, or a tuple/list of them)",
            )
        if numpy_dtype(v.dtype) is None:
            raise UnservableProgram(
                what, f"output {j} has dtype {v.dtype}, which bundles cannot carry"
            )
    out_spec = dep.call_spec.out_spec
    single = out_spec is not None and out_spec.is_leaf()

    interpreter = _interpreter_class()
    n_slots = len(specs)
    n_in = len(user_slots)

    def entry(*flat: Any) -> tuple[Any, ...]:
        slots: list[Any] = [None] * n_slots
        for slot, v in zip(user_slots, flat[:n_in], strict=True):
            slots[slot] = v
        for slot, v in zip(weight_slots, flat[n_in:], strict=True):
            slots[slot] = v
        res = interpreter(gm).run(*slots, enable_io_processing=False)
        return tuple(res)

    return Lowered(
        entry=entry,
        n_inputs=n_in,
        weight_names=tuple(names),
        weights=tuple(values),
        single_output=bool(single),
        output_dtypes=tuple(v.dtype for v in out_vals),
    )


__all__ = [
    "EXTRA_HINT",
    "Lowered",
    "UnservableProgram",
    "check_servable",
    "decompose",
    "host_array",
    "import_torch",
    "import_torchax",
    "lower_program",
    "node_is_wide",
    "numpy_dtype",
    "skipped_overloads",
]

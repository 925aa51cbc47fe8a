"""The one home of private and semi-private jax/jaxlib APIs in kserve_trio.

Everything here leans on interfaces jax does not promise to keep (``jaxlib.mlir`` bindings, the
private fields of ``jax.export.Exported``, ``jax._src.xla_bridge``); ``pyproject.toml`` pins the
jax minor version that ``tests/runtime/test_xla.py`` passes on, and nothing else in the package
imports these names. The module owns four jobs:

1. StableHLO portable artifacts: turning MLIR text (or an ``ir.Module``) into a portable artifact,
   and reading one back (``as_portable_artifact``, ``parse_module``).
2. The entry signature of a module: the argument and result tensor types of its ``main``
   function (``entry_signature``), which is what the arity checks and the loader rely on.
3. The numerics rewrite behind ``runtime.numerics`` (``rewrite_numerics``).
4. Wrapping a bare module in a ``jax.export.Exported`` (``exported_from_module``) so that a
   bundle carrying only ``.mlir`` files (any StableHLO producer) compiles and runs through jax's
   public ``jax.jit(exp.call).lower(...).compile()`` path, the same fast C++ dispatch path the
   ``.jaxexport`` sidecars use: that path takes host numpy inputs in C++, whereas the raw
   ``Client.compile_and_load`` executable needs its inputs as jax arrays, and a
   ``jax.device_put`` per call costs more than the whole call (docs/benchmarks/history.md,
   "Runtime").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MLIR_BYTECODE_MAGIC = b"ML\xefR"
"""Every MLIR bytecode file (a StableHLO portable artifact included) starts with these bytes."""

# MLIR element type spelling -> manifest dtype token (kserve_trio.core.tensors.dtypes).
_ELEMENT_TOKENS = {
    "i1": "bool",
    "ui8": "u8",
    "ui16": "u16",
    "ui32": "u32",
    "ui64": "u64",
    "i8": "i8",
    "i16": "i16",
    "i32": "i32",
    "i64": "i64",
    "f16": "f16",
    "bf16": "bf16",
    "f32": "f32",
    "f64": "f64",
    "f8E5M2": "f8_e5m2",
    "f8E4M3FN": "f8_e4m3",
}

_MATMUL_OPS = frozenset({"stablehlo.dot_general", "stablehlo.dot", "stablehlo.convolution"})


class ModuleFormatError(ValueError):
    """The bytes are not a StableHLO module this jaxlib can read, or its ``main`` is unusable."""


@dataclass(frozen=True, slots=True)
class TensorType:
    """One argument or result of a module's ``main``: row-major ``shape`` and a dtype token.

    ``token`` is ``None`` for an element type kserve_trio has no DType for (it is shown by its
    MLIR spelling in ``spelling``); ``shape`` entries are ``-1`` for dynamic dimensions.
    """

    shape: tuple[int, ...]
    token: str | None
    spelling: str

    def __str__(self) -> str:
        return self.spelling


@dataclass(frozen=True, slots=True)
class EntrySignature:
    """The argument and result types of a module's ``main`` function, in order."""

    args: tuple[TensorType, ...]
    results: tuple[TensorType, ...]

    @property
    def arity(self) -> int:
        return len(self.args)


@dataclass(frozen=True, slots=True)
class NumericsRewrite:
    """What ``rewrite_numerics`` changed: counts of ops per kind of change."""

    set_highest: int = 0
    tf32_to_f32: int = 0
    tf32_stripped: int = 0

    @property
    def changed(self) -> bool:
        return bool(self.set_highest or self.tf32_to_f32 or self.tf32_stripped)


# ----------------------------------------------------------------------------------------------
# Portable artifacts
# ----------------------------------------------------------------------------------------------


def _stablehlo():
    from jaxlib.mlir.dialects import stablehlo

    return stablehlo


def portable_target_version() -> str:
    """The StableHLO version written into artifacts: four weeks old, as jax.export does, so a
    consumer on a slightly older stack still reads them."""
    sh = _stablehlo()
    return str(
        sh.get_version_from_compatibility_requirement(sh.StablehloCompatibilityRequirement.WEEK_4)
    )


def is_bytecode(data: bytes) -> bool:
    """Whether ``data`` is MLIR bytecode (as opposed to MLIR text)."""
    return bytes(data[:4]) == MLIR_BYTECODE_MAGIC


def as_portable_artifact(module: bytes | bytearray | str | object) -> bytes:
    """A StableHLO portable artifact for ``module``: artifact bytes (returned unchanged after a
    readability check), MLIR text (``str`` or UTF-8 ``bytes``) or a ``jaxlib.mlir.ir.Module``.

    Text is serialized at ``portable_target_version()``; a parse failure is a
    ``ModuleFormatError`` carrying the parser's message.
    """
    sh = _stablehlo()
    if isinstance(module, bytes | bytearray | memoryview):
        data = bytes(module)
        if is_bytecode(data):
            parse_module(data)
            return data
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ModuleFormatError(
                "not a StableHLO module: neither MLIR bytecode nor UTF-8 text"
            ) from None
    elif isinstance(module, str):
        text = module
    else:
        try:
            text = module.operation.get_asm(enable_debug_info=False)  # type: ignore[attr-defined]
        except AttributeError:
            raise TypeError(
                f"cannot make a StableHLO module out of {type(module).__name__}; "
                "pass artifact bytes, MLIR text or a jaxlib.mlir.ir.Module"
            ) from None
    ctx, parsed = parse_module(text)
    with ctx:
        try:
            return bytes(sh.serialize_portable_artifact(parsed, portable_target_version()))
        except Exception as exc:  # jaxlib raises bare ValueError/RuntimeError with diagnostics
            raise ModuleFormatError(
                f"cannot serialize the module as a StableHLO portable artifact: {_first_line(exc)}"
            ) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return " ".join(text.split("\n")[:3])[:400] or type(exc).__name__


def parse_module(data: bytes | str):
    """Parse artifact bytes or MLIR text into a ``jaxlib.mlir.ir.Module`` in a fresh context.

    Returns ``(context, module)``; the module is only usable inside ``with context:``.
    """
    from jax._src.interpreters import mlir as jax_mlir
    from jaxlib.mlir import ir

    sh = _stablehlo()
    # jax's own context: every dialect a jax-produced module may mention (func, sdy, mhlo, ...).
    ctx = jax_mlir.make_ir_context()
    ctx.allow_unregistered_dialects = True
    try:
        if isinstance(data, str):
            with ctx:
                return ctx, ir.Module.parse(data)
        data = bytes(data)
        if is_bytecode(data):
            return ctx, sh.deserialize_portable_artifact(ctx, data)
        with ctx:
            return ctx, ir.Module.parse(data.decode("utf-8"))
    except Exception as exc:
        raise ModuleFormatError(f"cannot read StableHLO module: {_first_line(exc)}") from None


def _main_func(module):
    for op in module.body.operations:
        if op.operation.name == "func.func":
            attrs = op.operation.attributes
            if "sym_name" in attrs and str(attrs["sym_name"]).strip('"') == "main":
                return op
    raise ModuleFormatError("module has no 'main' function")


def _ranked(t):
    """``t`` as an ``ir.RankedTensorType``, or ``None`` for any other type."""
    from jaxlib.mlir import ir

    try:
        return ir.RankedTensorType(t)
    except (ValueError, TypeError):
        return None


def _tensor_type(t) -> TensorType:
    spelling = str(t)
    rt = _ranked(t)
    if rt is None:
        return TensorType((), None, spelling)
    shape = tuple(-1 if rt.is_dynamic_dim(i) else int(rt.get_dim_size(i)) for i in range(rt.rank))
    return TensorType(shape, _ELEMENT_TOKENS.get(str(rt.element_type)), spelling)


def entry_signature(data: bytes | str) -> EntrySignature:
    """The argument/result types of ``main`` in artifact bytes or MLIR text."""
    from jaxlib.mlir import ir

    ctx, module = parse_module(data)
    with ctx:
        main = _main_func(module)
        ftype = ir.FunctionType(ir.TypeAttr(main.operation.attributes["function_type"]).value)
        return EntrySignature(
            tuple(_tensor_type(t) for t in ftype.inputs),
            tuple(_tensor_type(t) for t in ftype.results),
        )


# ----------------------------------------------------------------------------------------------
# Numerics
# ----------------------------------------------------------------------------------------------


def _walk(op, visit) -> None:
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                visit(child.operation)
                _walk(child.operation, visit)


def rewrite_numerics(
    data: bytes, *, force_f32: bool, strip_tf32: bool
) -> tuple[bytes, NumericsRewrite]:
    """Rewrite the precision of f32 matmuls and convolutions in a portable artifact.

    Rules, applied to every ``stablehlo.dot_general``/``dot``/``convolution`` (in every function
    and nested region) whose left operand is f32:

    1. with ``force_f32``: an explicit dot algorithm with TF32 operand precision becomes the
       f32 x f32 -> f32 algorithm; an op without an algorithm gets
       ``precision_config = [HIGHEST, HIGHEST]``;
    2. otherwise, with ``strip_tf32``: an explicit TF32 dot algorithm is removed, so the op runs
       at the backend's default precision (for hardware that has no TF32);
    3. anything else is left alone.

    Returns the new artifact (at the current StableHLO version, since it is compiled in this
    process) and the counts; when nothing changed the input bytes are returned unchanged.
    """
    from jaxlib.mlir import ir

    sh = _stablehlo()
    set_highest = tf32_to_f32 = stripped = 0
    if not (force_f32 or strip_tf32):
        return bytes(data), NumericsRewrite()
    ctx, module = parse_module(data)
    with ctx, ir.Location.unknown():
        f32 = ir.F32Type.get()
        highest = ir.ArrayAttr.get([sh.PrecisionAttr.get("HIGHEST")] * 2)
        f32_algorithm = sh.DotAlgorithm.get(f32, f32, f32, 1, 1, 1, False)

        def visit(op) -> None:
            nonlocal set_highest, tf32_to_f32, stripped
            if op.name not in _MATMUL_OPS or not op.operands:
                return
            lhs = _ranked(op.operands[0].type)
            if lhs is None or str(lhs.element_type) != "f32":
                return
            attrs = op.attributes
            if "algorithm" in attrs:
                alg = sh.DotAlgorithm(attrs["algorithm"])
                if "tf32" not in (str(alg.lhs_precision_type), str(alg.rhs_precision_type)):
                    return
                if force_f32:
                    attrs["algorithm"] = f32_algorithm
                    tf32_to_f32 += 1
                else:
                    del attrs["algorithm"]
                    stripped += 1
                return
            if force_f32:
                if "precision_config" in attrs and str(attrs["precision_config"]) == str(highest):
                    return
                attrs["precision_config"] = highest
                set_highest += 1

        _walk(module.operation, visit)
        counts = NumericsRewrite(set_highest, tf32_to_f32, stripped)
        if not counts.changed:
            return bytes(data), counts
        out = sh.serialize_portable_artifact(module, str(sh.get_current_version()))
    return bytes(out), counts


# ----------------------------------------------------------------------------------------------
# jax glue
# ----------------------------------------------------------------------------------------------


def numpy_dtype(t: TensorType) -> np.dtype:
    """The numpy dtype of a signature entry (``ModuleFormatError`` when it has none)."""
    from kserve_trio.core.tensors import dtype_from_token

    if t.token is None:
        raise ModuleFormatError(f"unsupported tensor type {t.spelling}")
    return dtype_from_token(t.token).numpy


def exported_from_module(data: bytes, signature: EntrySignature, *, platform: str, name: str):
    """A ``jax.export.Exported`` that calls the module's ``main`` with flat positional args.

    The module must be static-shape and single-platform (no platform-index or dimension-variable
    arguments), which is what every bundle module is. ``platform`` is the jax platform the
    module will be lowered for (``cpu``/``cuda``); StableHLO without platform-specific custom
    calls runs anywhere.
    """
    import jax
    from jax import export as jexp
    from jax.core import ShapedArray

    for t in (*signature.args, *signature.results):
        if -1 in t.shape:
            raise ModuleFormatError(
                f"dynamic dimension in {t.spelling}: bundle modules must be static-shape"
            )
    in_avals = tuple(ShapedArray(t.shape, numpy_dtype(t)) for t in signature.args)
    out_avals = tuple(ShapedArray(t.shape, numpy_dtype(t)) for t in signature.results)
    n_in, n_out = len(in_avals), len(out_avals)
    return jexp.Exported(
        fun_name=name,
        in_tree=jax.tree_util.tree_structure((tuple(range(n_in)), {})),
        in_avals=in_avals,
        out_tree=jax.tree_util.tree_structure(tuple(range(n_out))),
        out_avals=out_avals,
        _has_named_shardings=False,
        _in_named_shardings=(None,) * n_in,
        _out_named_shardings=(None,) * n_out,
        in_shardings_hlo=(None,) * n_in,
        out_shardings_hlo=(None,) * n_out,
        nr_devices=1,
        platforms=(platform,),
        ordered_effects=(),
        unordered_effects=(),
        disabled_safety_checks=(),
        mlir_module_serialized=bytes(data),
        calling_convention_version=10,
        module_kept_var_idx=tuple(range(n_in)),
        uses_global_constants=False,
        _get_vjp=None,
    )


def backends_initialized() -> bool:
    """Whether jax has already created its backends (after which platform, memory and XLA flag
    settings no longer apply)."""
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())


def signature_matches(sig: Sequence[TensorType], avals: Sequence[object]) -> bool:
    """Whether a signature's shapes and dtypes equal a sequence of jax avals'."""
    if len(sig) != len(avals):
        return False
    for t, a in zip(sig, avals, strict=True):
        if t.token is None or tuple(a.shape) != t.shape or np.dtype(a.dtype) != numpy_dtype(t):  # type: ignore[attr-defined]
            return False
    return True


__all__ = [
    "MLIR_BYTECODE_MAGIC",
    "EntrySignature",
    "ModuleFormatError",
    "NumericsRewrite",
    "TensorType",
    "as_portable_artifact",
    "backends_initialized",
    "entry_signature",
    "exported_from_module",
    "is_bytecode",
    "numpy_dtype",
    "parse_module",
    "portable_target_version",
    "rewrite_numerics",
    "signature_matches",
]

"""``python -m kserve_trio bundle export-torch``: export a PyTorch model from the command line.

``TARGET`` is ``MODULE:FACTORY`` -- ``FACTORY()`` (importable from ``MODULE``, the working
directory is on the path) returns the ``torch.nn.Module`` in eval mode -- or the path of a
TorchScript file. The example inputs are made from ``--example-shape`` (one shape per input,
``;``-separated, the batch extent included) and ``--dtype`` (one token for every input, or one
per input): standard normal values for floating dtypes, zeros otherwise; only their shapes and
dtypes matter. The argument parsing here is pure; torch is imported when the command runs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from kserve_trio.export.inspection import inspect_bundle

DTYPE_TOKENS: tuple[str, ...] = (
    "f16",
    "bf16",
    "f32",
    "f64",
    "i8",
    "i16",
    "i32",
    "i64",
    "u8",
    "u16",
    "u32",
    "u64",
    "bool",
)
_TORCH_NAMES = {
    "f16": "float16",
    "bf16": "bfloat16",
    "f32": "float32",
    "f64": "float64",
    "i8": "int8",
    "i16": "int16",
    "i32": "int32",
    "i64": "int64",
    "u8": "uint8",
    "u16": "uint16",
    "u32": "uint32",
    "u64": "uint64",
    "bool": "bool",
}


def parse_shapes(text: str, what: str = "--example-shape") -> list[tuple[int, ...]]:
    """``"1,3,32,32;1,10"`` -> ``[(1, 3, 32, 32), (1, 10)]`` (``ValueError`` naming ``what``)."""
    shapes = []
    for part in text.split(";"):
        part = part.strip()
        if not part:
            raise ValueError(f"{what} {text!r}: empty shape")
        try:
            dims = tuple(int(d) for d in part.split(","))
        except ValueError:
            raise ValueError(f"{what} {text!r}: {part!r} is not a list of integers") from None
        if any(d <= 0 for d in dims):
            raise ValueError(f"{what} {text!r}: sizes must be positive")
        shapes.append(dims)
    return shapes


def parse_dtypes(text: str, n: int) -> list[str]:
    """One dtype token per input from ``"f32"`` (every input) or ``"f32,i64"``."""
    tokens = [t.strip().lower() for t in text.split(",")]
    for t in tokens:
        if t not in DTYPE_TOKENS:
            raise ValueError(
                f"--dtype: unknown dtype {t!r}; expected one of {', '.join(DTYPE_TOKENS)}"
            )
    if len(tokens) == 1:
        return tokens * n
    if len(tokens) != n:
        raise ValueError(f"--dtype gives {len(tokens)} dtype(s) for {n} input(s)")
    return tokens


def parse_sizes(text: str | None) -> list[int] | None:
    """``"1,8,32"`` -> ``[1, 8, 32]``; ``None`` stays ``None`` (one unbatched module)."""
    if text is None:
        return None
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--batch-sizes {text!r} is not a list of integers") from None


def _names(text: str | None) -> list[str] | None:
    return None if text is None else [s.strip() for s in text.split(",")]


def add_export_torch_parser(sub: Any) -> None:
    """Add ``export-torch`` to the ``bundle`` sub-parsers."""
    p = sub.add_parser(
        "export-torch",
        help="export a PyTorch module (MODULE:FACTORY) or a TorchScript file to a bundle",
        description=(
            "Export a PyTorch model to a bundle. TARGET is MODULE:FACTORY (FACTORY() returns the "
            "torch.nn.Module in eval mode) or a TorchScript file. Needs the torch extra."
        ),
    )
    p.add_argument("target", help="MODULE:FACTORY, or the path of a TorchScript file")
    p.add_argument(
        "--example-shape",
        required=True,
        metavar="N,C,H,W[;...]",
        help="one example shape per input, ';'-separated, batch extent included",
    )
    p.add_argument(
        "--dtype", default="f32", help="dtype of every input, or one per input (default f32)"
    )
    p.add_argument(
        "--batch-sizes",
        metavar="1,8,32",
        help="compiled batch sizes (default: one unbatched module)",
    )
    p.add_argument(
        "--dir", required=True, type=Path, help="the bundle directory (its name is the model's)"
    )
    p.add_argument("--name", help="the model name (must equal the directory's basename)")
    p.add_argument("--input-names", metavar="A,B", help="input names (default input_0, ...)")
    p.add_argument("--output-names", metavar="A,B", help="output names (default output[_j])")
    p.add_argument(
        "--variant",
        action="append",
        metavar="SHAPES",
        help="a compiled shape variant, shapes as in --example-shape (repeatable)",
    )
    p.add_argument(
        "--matmul-precision",
        help="jax matmul precision frozen into the program (default: torch's float32 setting)",
    )
    p.add_argument(
        "--torchscript",
        action="store_true",
        help="treat TARGET as a TorchScript file even if it looks like MODULE:FACTORY",
    )


def _load_factory(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"TARGET {target!r} is neither MODULE:FACTORY nor a TorchScript file")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    module = importlib.import_module(module_name)
    try:
        factory = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no {attr!r}") from None
    return factory()


def _example(shape: tuple[int, ...], token: str, seed: int) -> Any:
    import torch

    dtype = getattr(torch, _TORCH_NAMES[token])
    if dtype.is_floating_point:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(shape, generator=g).to(dtype)
    return torch.zeros(shape, dtype=dtype)


def export_torch_command(args: argparse.Namespace, *, out: TextIO) -> int:
    """Run ``export-torch``: 0 when the bundle is written, 1 when the export is refused."""
    try:
        shapes = parse_shapes(args.example_shape)
        dtypes = parse_dtypes(args.dtype, len(shapes))
        sizes = parse_sizes(args.batch_sizes)
        variants = [parse_shapes(v, "--variant") for v in args.variant] if args.variant else None
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    is_file = args.torchscript or (os.path.isfile(args.target) and ":" not in args.target)
    try:
        from kserve_trio.export.frontends import export_bundle

        examples = tuple(
            _example(s, t, i) for i, (s, t) in enumerate(zip(shapes, dtypes, strict=True))
        )
        model = args.target if is_file else _load_factory(args.target)
        d = export_bundle(
            "torchscript" if is_file else "torch",
            model,
            examples,
            dir=args.dir,
            name=args.name,
            batch_sizes=sizes,
            input_names=_names(args.input_names),
            output_names=_names(args.output_names),
            input_shapes=variants,
            matmul_precision=args.matmul_precision,
        )
    except (ValueError, TypeError, ImportError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {d}", file=out)
    return 0 if inspect_bundle(Path(d), out=out) else 1


__all__ = [
    "DTYPE_TOKENS",
    "add_export_torch_parser",
    "export_torch_command",
    "parse_dtypes",
    "parse_shapes",
    "parse_sizes",
]

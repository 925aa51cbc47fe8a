"""``python -m kserve_trio bundle ...``: inspect bundles and write the demo repository.

* ``bundle inspect DIR`` -- for a bundle (or every bundle directly under a repository
  directory): the manifest summary, the weights footprint, each module's arity and signature
  check; exit status 1 when any bundle is unservable.
* ``bundle demo DIR [--only NAME ...]`` -- write the demo bundles (``export.demo``).
* ``bundle export-torch MODULE:FACTORY|FILE.pt --example-shape N,C,H,W[;...] --dir DIR ...`` --
  export a PyTorch module (the factory's return value, in eval mode) or a TorchScript file
  (``export.torch_cli``); torch is imported only by this sub-command.

Nothing is compiled: inspection (``export.inspection``) reads headers and module signatures only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from kserve_trio.export.inspection import inspect_bundle, inspect_command
from kserve_trio.export.torch_cli import add_export_torch_parser, export_torch_command


def configure_parser(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """Add the ``bundle`` sub-commands to ``parser``; returns the runner."""
    sub = parser.add_subparsers(dest="bundle_command", metavar="SUBCOMMAND")
    p_inspect = sub.add_parser(
        "inspect",
        help="summarise a bundle (or every bundle in a repository) and check its arity",
        description="Summarise a bundle or a repository of bundles; exit 1 if any is unservable.",
    )
    p_inspect.add_argument("dir", type=Path, help="a bundle directory or a model repository")
    p_demo = sub.add_parser(
        "demo",
        help="write the demo model repository (mlp, cnn, scale4, mlp_bf16, mlp_softmax)",
        description="Write the demo bundles under DIR (weights from numpy default_rng(0)).",
    )
    p_demo.add_argument("dir", type=Path, help="repository directory to write into")
    p_demo.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help="write only this demo model (repeatable); tokenize_sum (BYTES through model.py "
        "hooks) is written only when named",
    )
    add_export_torch_parser(sub)
    parser.set_defaults(_bundle_parser=parser)
    return run


def run(args: argparse.Namespace) -> int:
    """Run the chosen ``bundle`` sub-command; returns the exit status."""
    cmd = getattr(args, "bundle_command", None)
    if cmd == "inspect":
        return inspect_command(args.dir, out=sys.stdout)
    if cmd == "demo":
        return demo_command(args.dir, args.only, out=sys.stdout)
    if cmd == "export-torch":
        return export_torch_command(args, out=sys.stdout)
    parser = getattr(args, "_bundle_parser", None)
    if parser is not None:
        parser.print_help()
    return 2


# ----------------------------------------------------------------------------------------------
# demo
# ----------------------------------------------------------------------------------------------


def demo_command(root: Path, only: list[str] | None, *, out: TextIO) -> int:
    from kserve_trio.export.demo import write_demo_repository

    try:
        written = write_demo_repository(root, only=only)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, path in written.items():
        print(f"wrote {name}: {path}", file=out)
    return 0


__all__ = ["configure_parser", "demo_command", "inspect_bundle", "inspect_command", "run"]

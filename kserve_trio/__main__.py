"""``python -m kserve_trio <command>``: wires the command-line interfaces of every layer.

Each command lives in the package that owns it and is imported only when that command runs, so
``--help`` stays fast and a gateway never imports jax. Commands whose capability has not landed
yet say which capability brings them and exit with status 2; there is no fake behaviour.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

# command -> (help text, "module:function" that adds arguments and returns the runner, or the
# capability that will bring it when it is not built yet)
_COMMANDS: dict[str, tuple[str, str | None, str]] = {
    "worker": (
        "serve a model repository over KServe V2 gRPC on one device",
        "kserve_trio.worker.cli:configure_parser",
        "the Worker core capability",
    ),
    "frontend": (
        "one front-end process of a worker (started by the worker itself when "
        "endpoints.frontend_processes > 1)",
        "kserve_trio.frontend.cli:configure_parser",
        "the worker front ends capability",
    ),
    "gateway": (
        "front many workers: discovery, routing, shedding",
        "kserve_trio.gateway.cli:configure_parser",
        "the Gateway capability",
    ),
    "node": (
        "supervise one worker per device plus the gateway",
        "kserve_trio.node.cli:configure_node_parser",
        "the Node supervisor capability",
    ),
    "probe": (
        "container healthcheck: exit 0 when the node's server reports ready",
        "kserve_trio.node.cli:configure_probe_parser",
        "the Node supervisor capability",
    ),
    "bundle": (
        "inspect bundles, export PyTorch models, write the demo model repository",
        "kserve_trio.export.cli:configure_parser",
        "the Runtime and export capability",
    ),
    "bench": (
        "closed-loop or fixed-rate load generator against a KServe V2 endpoint",
        "kserve_trio.bench:configure_parser",
        "the Client library capability",
    ),
}


def _resolve(
    target: str,
) -> Callable[[argparse.ArgumentParser], Callable[[argparse.Namespace], int]] | None:
    module_name, func_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith(module_name):
            return None
        raise
    return getattr(module, func_name, None)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per command. Every command gets its full
    options when ``command`` is None (the whole CLI, for its help and tests); otherwise only
    ``command`` does and the others are listed by their help line, so that a process imports
    the package of the command it runs and no other (a worker front end or a gateway child
    starts faster by the imports of the other five)."""
    parser = argparse.ArgumentParser(
        prog="python -m kserve_trio",
        description="kserve_trio: a KServe V2 gRPC inference server for compiled StableHLO bundles",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, target, capability) in _COMMANDS.items():
        if command is not None and name != command:
            sub = subparsers.add_parser(name, help=help_text, add_help=False)
            sub.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
            continue
        configure = _resolve(target) if target else None
        if configure is None:
            sub = subparsers.add_parser(
                name, help=f"{help_text} (not built yet: arrives with {capability})"
            )
            sub.set_defaults(_run=_not_built(name, capability))
            sub.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        else:
            sub = subparsers.add_parser(name, help=help_text, description=help_text)
            sub.set_defaults(_run=configure(sub))
    return parser


def _command_named(argv: Sequence[str]) -> str | None:
    """The command ``argv`` runs: its first word, when that names one (the top-level parser
    has no option taking a value, so nothing before the command can be mistaken for it)."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in _COMMANDS else None
    return None


def _not_built(name: str, capability: str) -> Callable[[argparse.Namespace], int]:
    def run(_args: argparse.Namespace) -> int:
        print(f"'{name}' is not built yet: it arrives with {capability}.", file=sys.stderr)
        return 2

    return run


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; returns the process exit code."""
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_command_named(words))
    args = parser.parse_args(words)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0
    return int(args._run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())

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


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per command (built commands get full options)."""
    parser = argparse.ArgumentParser(
        prog="python -m kserve_trio",
        description="kserve_trio: a KServe V2 gRPC inference server for compiled StableHLO bundles",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, target, capability) in _COMMANDS.items():
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


def _not_built(name: str, capability: str) -> Callable[[argparse.Namespace], int]:
    def run(_args: argparse.Namespace) -> int:
        print(f"'{name}' is not built yet: it arrives with {capability}.", file=sys.stderr)
        return 2

    return run


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0
    return int(args._run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())

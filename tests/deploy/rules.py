"""What the project accepts, asked of the project itself: the CLI's argparse parser, the
worker's and the gateway's environment tables, the node planner, the admin HTTP routes.

The deployment tests hold every recipe and manifest against these, so a renamed flag,
variable, port or path breaks a test instead of a deployment.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path

from kserve_trio.__main__ import build_parser
from kserve_trio.core.errors import ConfigError
from kserve_trio.core.process.config import apply_env_overrides
from kserve_trio.gateway.config import apply_gateway_env
from kserve_trio.node import Machine
from kserve_trio.node._files import prepare_node
from kserve_trio.node._plan import NodePlan
from kserve_trio.serving.admin_http import route
from tests.deploy.manifests import FOREIGN_ENV, ROOT


def parse_cli(argv: Sequence[str]) -> argparse.Namespace:
    """``python -m kserve_trio ARGS`` through the real parser (``SystemExit`` on a bad flag)."""
    return build_parser().parse_args(list(argv))


def module_args(argv: Sequence[str]) -> list[str]:
    """The arguments after ``python -m kserve_trio`` (the argv must start that way)."""
    assert list(argv[1:3]) == ["-m", "kserve_trio"], argv
    return list(argv[3:])


@functools.cache
def _package_source() -> str:
    return "\n".join(p.read_text() for p in sorted((ROOT / "kserve_trio").rglob("*.py")))


def unknown_env(env: Mapping[str, str]) -> list[str]:
    """The variables in ``env`` that nothing reads: ``INFERENCE_SERVER_*`` the worker's table
    rejects, ``KSERVE_TRIO_GATEWAY_*`` the gateway's table rejects, other ``KSERVE_TRIO_*`` that
    no module of the package names, and anything else not in ``FOREIGN_ENV``."""
    bad = []
    for name in env:
        probe = {name: env[name]}
        try:
            if name.startswith("INFERENCE_SERVER_"):
                apply_env_overrides({}, probe)
            elif name.startswith("KSERVE_TRIO_GATEWAY_"):
                apply_gateway_env({}, probe)
            elif name.startswith("KSERVE_TRIO_"):
                if f'"{name}"' not in _package_source():
                    bad.append(name)
            elif name not in FOREIGN_ENV:
                bad.append(name)
        except ConfigError:
            bad.append(name)
    return bad


def gpu_machine(count: int) -> Machine:
    """A machine whose nvidia-smi lists ``count`` GPUs (none: no nvidia-smi) and 16 CPUs."""
    smi = "".join(f"{i}\n" for i in range(count)) if count else None
    return Machine(lambda: smi, lambda: [], lambda: list(range(16)), lambda: None)


def plan(
    node_file: str | Path | None,
    env: Mapping[str, str],
    *,
    role: str | None = None,
    gateway_path: str | Path | None = None,
    gpus: int = 0,
) -> NodePlan:
    """The supervisor's plan for a node file and environment (nothing written or started)."""
    node_plan, _ = prepare_node(
        node_file,
        role=role,
        gateway_path=gateway_path,
        env=dict(env),
        machine=gpu_machine(gpus),
        python="/app/.venv/bin/python",
        write=False,
    )
    return node_plan


def admin_path_ok(path: str) -> bool:
    """Whether the admin HTTP server answers ``path`` (not 404) while ready."""
    status, _, _ = route(path, exposition=lambda: b"", ready=lambda: True)
    return status == 200

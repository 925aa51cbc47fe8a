"""``python -m kserve_trio node`` and ``python -m kserve_trio probe``.

``node`` runs the supervisor in the foreground (its exit code is the node's: 0 after
SIGTERM/SIGINT, 1 after a crash loop, 2 for a configuration error). ``probe`` is a container
healthcheck: exit 0 when the node's server reports ready, 1 when it does not, 2 when the node
file cannot be planned. Both read the node file from ``--node``, else ``KSERVE_TRIO_NODE_FILE``,
else ``/etc/kserve_trio/node.yaml``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from kserve_trio.core.errors import ConfigError
from kserve_trio.core.process import ROLES
from kserve_trio.node._files import prepare_node
from kserve_trio.node._probe import PROBE_TIMEOUT_SECONDS, describe_targets, probe_plan
from kserve_trio.node._supervisor import supervise

_NODE_HELP = "node file (default: KSERVE_TRIO_NODE_FILE, else /etc/kserve_trio/node.yaml)"


def configure_node_parser(
    parser: argparse.ArgumentParser,
) -> Callable[[argparse.Namespace], int]:
    """Add the supervisor's flags; returns the runner."""
    parser.add_argument("--node", metavar="FILE", help=_NODE_HELP)
    parser.add_argument(
        "--role",
        choices=ROLES,
        type=str.lower,
        help="what this node runs (default: KSERVE_TRIO_ROLE, else the node's role:, else all)",
    )
    parser.add_argument(
        "--gateway",
        metavar="FILE",
        help="gateway.yml for the embedded gateway (default: KSERVE_TRIO_GATEWAY_FILE, else "
        "the node's gateway: block, else the environment)",
    )
    return run_node


def run_node(args: argparse.Namespace) -> int:
    return supervise(args.node, role=args.role, gateway_path=args.gateway)


def configure_probe_parser(
    parser: argparse.ArgumentParser,
) -> Callable[[argparse.Namespace], int]:
    """Add the probe's flags; returns the runner."""
    parser.add_argument("--node", metavar="FILE", help=_NODE_HELP)
    parser.add_argument(
        "--worker",
        metavar="NAME",
        help="probe this worker (default: the node's public endpoint; in role workers, every "
        "worker)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=PROBE_TIMEOUT_SECONDS,
        help=f"seconds to wait for the answer (default {PROBE_TIMEOUT_SECONDS:g})",
    )
    return run_probe


def run_probe(args: argparse.Namespace) -> int:
    try:
        plan, _ = prepare_node(
            args.node, role=None, gateway_path=None, env=dict(os.environ), write=False
        )
        where = describe_targets(plan, args.worker)
        ready = probe_plan(plan, args.worker, args.timeout)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{'ready' if ready else 'not ready'}: {where}")
    return 0 if ready else 1


__all__ = ["configure_node_parser", "configure_probe_parser", "run_node", "run_probe"]

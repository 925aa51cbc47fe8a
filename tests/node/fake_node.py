"""A supervisor over fake children, for the supervisor tests: ``python fake_node.py SPEC.json``.

SPEC is ``{"max_restarts": N, "children": [{"name", "argv", "grace"?, "cpus"?, "env"?}]}``; the
process runs ``run_plan`` with signal handling on, printing the node's output on stdout.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import anyio

from kserve_trio.node import ChildSpec, NodePlan, run_plan
from kserve_trio.node._logmux import LogSink


def load_plan(path: str) -> NodePlan:
    with open(path) as f:
        spec = json.load(f)
    children = tuple(
        ChildSpec(
            c["name"],
            c.get("kind", "worker"),
            tuple(c["argv"]),
            {**os.environ, **c.get("env", {})},
            float(c.get("grace", 5.0)),
            tuple(c["cpus"]) if c.get("cpus") else None,
        )
        for c in spec["children"]
    )
    return NodePlan(role="workers", children=children, max_restarts=spec.get("max_restarts", 0))


if __name__ == "__main__":
    plan = load_plan(sys.argv[1])
    sys.exit(anyio.run(functools.partial(run_plan, plan, LogSink(sys.stdout)), backend="asyncio"))

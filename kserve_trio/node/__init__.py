"""The node supervisor: one command runs a whole machine (``python -m kserve_trio node``).

It plans the node (devices, one worker per device or ``KSERVE_TRIO_CPU_WORKERS`` on a CPU
node, ports, thread budgets, the embedded gateway when two or more workers share the public
port), starts every child, multiplexes their output with ``[name]`` prefixes, restarts the
ones that die and stops them all on SIGTERM/SIGINT. It never imports jax,
``kserve_trio.runtime`` or ``kserve_trio.worker``: the workers are separate processes.

The public surface, stated once here (a test pins it):

- ``supervise(node_path, *, role=None, gateway_path=None, sink=None, env=None,
  install_signal_handlers=True, runtime_dir=None) -> int``: run the node; the exit code.
- ``probe_worker_ready(node_path, worker=None) -> bool``: KServe ServerReady on the node's
  server (the container healthcheck).
- ``plan_node``, ``NodePlan``, ``ChildSpec``, ``GatewaySource``, ``Machine``: the pure plan,
  for tools and tests that want to see what a node would run; ``run_plan`` runs one inside an
  existing anyio event loop.
- ``thread_budget``, ``detect_devices``, ``gateway_launch``: the rules the plan is made of.
"""

from __future__ import annotations

from kserve_trio.node._devices import Detected, Machine, detect_devices
from kserve_trio.node._plan import ChildSpec, GatewaySource, NodePlan, gateway_launch, plan_node
from kserve_trio.node._probe import probe_worker_ready
from kserve_trio.node._supervisor import run_plan, supervise
from kserve_trio.node._threads import thread_budget

__all__ = [
    "ChildSpec",
    "Detected",
    "GatewaySource",
    "Machine",
    "NodePlan",
    "detect_devices",
    "gateway_launch",
    "plan_node",
    "probe_worker_ready",
    "run_plan",
    "supervise",
    "thread_budget",
]

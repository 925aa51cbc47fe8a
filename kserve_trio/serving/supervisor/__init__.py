"""Keeping processes running: the one loop, restart rule and launcher of every supervisor in the
project (the gateway's parent for its children, a worker's device process for its front ends,
the node for its workers and gateway).

- ``launch(command, ...) -> ChildProcess``: start a process by exec through the trampoline,
  tied to this process's life (``_launch`` says why this way and no other);
- ``keep_running(run_once, policy, stop, on_restart) -> GaveUp | None``: run one process after
  another until stopped or given up (``_keep_running``);
- ``RestartPolicy``: the back-off and the limits, stated by each caller (``_policy``).

How a supervisor finds a process that is stuck without exiting is ``serving.liveness``.
"""

from __future__ import annotations

from kserve_trio.serving.supervisor._keep_running import (
    Exit,
    FailedToStart,
    GaveUp,
    Restart,
    keep_running,
)
from kserve_trio.serving.supervisor._launch import (
    PIPE,
    TRAMPOLINE,
    ChildProcess,
    PipeReader,
    launch,
    trampoline_argv,
)
from kserve_trio.serving.supervisor._policy import RestartPolicy

__all__ = [
    "PIPE",
    "TRAMPOLINE",
    "ChildProcess",
    "Exit",
    "FailedToStart",
    "GaveUp",
    "PipeReader",
    "Restart",
    "RestartPolicy",
    "keep_running",
    "launch",
    "trampoline_argv",
]

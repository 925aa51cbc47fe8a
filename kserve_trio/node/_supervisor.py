"""The running node: one anyio task tree that keeps the planned children alive.

```
run_plan(plan)
└─ root task group                    cancelled once every child task has finished
   ├─ signal watcher                  SIGTERM/SIGINT -> orderly stop; a second one -> SIGKILL now
   └─ children task group
      └─ one task per child           start, watch, stop, restart with backoff, give up
         ├─ stop watcher              on shutdown: SIGTERM, wait the child's grace, SIGKILL
         ├─ stdout pump               whole lines -> "[name] line" on the sink
         └─ stderr pump
```

Every task has a parent that outlives it; shutdown is an event the child tasks react to, and a
cancellation from outside (an embedding program's task group) stops the children the same way
(terminate, grace, kill) in a shielded scope before it propagates. Exit code: 0 after a
signal-initiated stop, 1 when a child exhausted the crash-loop budget (the first requested code
wins); ``supervise`` returns 2 for a configuration error before anything starts.

Each child task is ``serving.supervisor.keep_running`` under the node's ``RestartPolicy``
(``_restart``). Children start by ``serving.supervisor.launch`` (the trampoline: parent-death
signal, CPU affinity, then ``exec``) in their own session, so a terminal's Ctrl-C reaches only
the supervisor, which stops them in order, and a SIGKILL reaches a child's whole process group.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from collections.abc import AsyncIterator, Mapping
from typing import TextIO

import anyio
import anyio.abc

from kserve_trio.core.errors import ConfigError
from kserve_trio.node._files import check_model_repo, prepare_node
from kserve_trio.node._logmux import LineSplitter, LogSink
from kserve_trio.node._plan import ChildSpec, NodePlan
from kserve_trio.node._restart import restart_policy
from kserve_trio.node._threads import format_cpus
from kserve_trio.serving.supervisor import PIPE, ChildProcess, Exit, Restart, keep_running, launch

DRAIN_SECONDS = 2.0
"""How long a dead child's pipes may still deliver output (a grandchild holding them open
cannot keep its pumps alive past this)."""


def describe_exit(name: str, returncode: int | None, uptime: float) -> str:
    """``worker0 exited (code=1, signal=none, uptime=3.2s)``; a signal shows as its name."""
    code, sig = "none", "none"
    if returncode is not None and returncode < 0:
        try:
            sig = signal.Signals(-returncode).name
        except ValueError:
            sig = str(-returncode)
    elif returncode is not None:
        code = str(returncode)
    return f"{name} exited (code={code}, signal={sig}, uptime={uptime:.1f}s)"


class _Node:
    """The state the child tasks share: the shutdown events and the requested exit code."""

    def __init__(self, plan: NodePlan, sink: LogSink, parent_pid: int) -> None:
        self.plan = plan
        self.sink = sink
        self.parent_pid = parent_pid
        self.stopping = anyio.Event()
        self.kill_now = anyio.Event()
        self.exit_code: int | None = None

    def request_stop(self, code: int) -> None:
        if self.exit_code is None:
            self.exit_code = code
        self.stopping.set()

    async def run(self, install_signal_handlers: bool) -> int:
        plan, say = self.plan, self.sink.supervisor
        say(f"role={plan.role} children={', '.join(c.name for c in plan.children)}")
        if plan.node_file and plan.node is not None:
            say(f"node file: {plan.node_file}")
        for note in plan.notes:
            say(note)
        for warning in plan.warnings:
            say(f"warning: {warning}")
        async with anyio.create_task_group() as root:
            if install_signal_handlers:
                await root.start(self._signals)
            async with anyio.create_task_group() as children:
                for spec in plan.children:
                    children.start_soon(self._supervise_child, spec)
            root.cancel_scope.cancel()
        code = self.exit_code or 0
        say(f"node stopped (exit {code})")
        return code

    async def _signals(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
            task_status.started()
            async for signum in received:
                name = signal.Signals(signum).name
                if not self.stopping.is_set():
                    self.sink.supervisor(f"received shutdown signal ({name})")
                    self.request_stop(0)
                else:
                    self.sink.supervisor(f"received {name} again; killing the children now")
                    self.kill_now.set()

    async def _supervise_child(self, spec: ChildSpec) -> None:
        """Start, watch and restart one child until the node stops or the policy gives up."""
        policy = restart_policy(self.plan.max_restarts)

        def restarting(restart: Restart) -> None:
            self.sink.supervisor(f"restarting {spec.name} in {restart.pause:g}s")

        gave_up = await keep_running(
            lambda: self._run_once(spec), policy, self.stopping, restarting
        )
        if gave_up is not None:
            self.sink.supervisor(
                f"{spec.name} failed {gave_up.failures} consecutive times "
                f"(max {policy.max_failures}); shutting the node down"
            )
            self.request_stop(1)

    async def _run_once(self, spec: ChildSpec) -> Exit:
        try:
            proc = launch(
                spec.argv,
                env=spec.env,
                stdout=PIPE,
                stderr=PIPE,
                new_session=True,
                cpus=format_cpus(spec.cpus) if spec.cpus else "",
                parent_pid=self.parent_pid,
            )
        except OSError as exc:
            self.sink.supervisor(f"could not start {spec.name}: {exc}")
            return Exit(None)
        started = anyio.current_time()
        self.sink.supervisor(f"started {spec.name} (pid {proc.pid})")
        try:
            async with anyio.create_task_group() as pumps:
                assert proc.stdout is not None and proc.stderr is not None
                pumps.start_soon(self._pump, spec.name, proc.stdout)
                pumps.start_soon(self._pump, spec.name, proc.stderr)
                async with anyio.create_task_group() as watch:
                    watch.start_soon(self._stop_when_asked, spec, proc)
                    await proc.wait()
                    watch.cancel_scope.cancel()
                pumps.cancel_scope.deadline = anyio.current_time() + DRAIN_SECONDS
        finally:
            with anyio.CancelScope(shield=True):
                if proc.returncode is None:  # cancelled from outside: stop it before leaving
                    await self._terminate(spec, proc)
            proc.close()
            self.sink.supervisor(
                describe_exit(spec.name, proc.returncode, anyio.current_time() - started)
            )
        return Exit(proc.returncode)

    async def _pump(self, name: str, stream: AsyncIterator[bytes]) -> None:
        splitter = LineSplitter()
        try:
            async for chunk in stream:
                for line in splitter.feed(chunk):
                    self.sink.child_bytes(name, line)
        finally:
            for line in splitter.flush():
                self.sink.child_bytes(name, line)

    async def _stop_when_asked(self, spec: ChildSpec, proc: ChildProcess) -> None:
        await self.stopping.wait()
        await self._terminate(spec, proc)

    async def _terminate(self, spec: ChildSpec, proc: ChildProcess) -> None:
        """SIGTERM, up to ``spec.grace`` seconds (cut short by a second signal), SIGKILL."""

        def killing() -> None:
            if not self.kill_now.is_set():
                self.sink.supervisor(
                    f"{spec.name} did not exit within {spec.grace:g}s; sending SIGKILL"
                )

        await proc.stop(spec.grace, sooner=self.kill_now, on_kill=killing)


async def run_plan(
    plan: NodePlan,
    sink: LogSink,
    *,
    install_signal_handlers: bool = True,
    parent_pid: int | None = None,
) -> int:
    """Run ``plan`` until a signal or a crash-loop breach; returns the exit code."""
    node = _Node(plan, sink, os.getpid() if parent_pid is None else parent_pid)
    return await node.run(install_signal_handlers)


def supervise(
    node_path: str | os.PathLike[str] | None,
    *,
    role: str | None = None,
    gateway_path: str | os.PathLike[str] | None = None,
    sink: TextIO | None = None,
    env: Mapping[str, str] | None = None,
    install_signal_handlers: bool = True,
    runtime_dir: str | os.PathLike[str] | None = None,
) -> int:
    """Run the node described by ``node_path`` and return the process exit code.

    Plans the node (devices, workers, gateway; see ``plan_node``), writes the materialized
    node file, starts every child, multiplexes their output onto ``sink`` (default stdout) with
    ``[name]`` prefixes, restarts children that die, and blocks until SIGTERM/SIGINT (with
    ``install_signal_handlers``) or a crash-loop budget breach. ``env`` (default
    ``os.environ``) is what the node reads its settings from and what the children inherit.
    A configuration error (or a node file that cannot be read or written) is reported on
    ``sink`` and returns 2. Signal handlers can only be installed from the main thread.
    """
    environ = dict(os.environ if env is None else env)
    out = LogSink(sink if sink is not None else sys.stdout)
    try:
        plan, rdir = prepare_node(
            node_path, role=role, gateway_path=gateway_path, env=environ, runtime_dir=runtime_dir
        )
        try:
            check_model_repo(plan, environ)
        except ConfigError:
            if rdir is not None:
                rdir.cleanup()
            raise
    except (ConfigError, OSError) as exc:
        out.supervisor(f"configuration error: {exc}")
        out.supervisor("node stopped (exit 2)")
        return 2
    try:
        return anyio.run(
            functools.partial(run_plan, plan, out, install_signal_handlers=install_signal_handlers),
            backend="asyncio",
        )
    finally:
        if rdir is not None:
            rdir.cleanup()


__all__ = ["DRAIN_SECONDS", "describe_exit", "run_plan", "supervise"]

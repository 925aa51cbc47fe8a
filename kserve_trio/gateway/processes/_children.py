"""One supervised gateway child: started by exec, watched, restarted with back-off, stopped.

Each child is ``python -m kserve_trio gateway --config DIR/gateway.json --process-index I
--runtime-dir DIR``, started by ``serving.supervisor.launch`` (tied to the parent's life: no
child outlives a parent killed outright) with the parent's standard output and error, and the
parent's environment less every gateway variable (the configuration file already holds what
they said), plus the environment-only prober knobs.

Rules (``GatewayChild.run``, on ``serving.supervisor.keep_running``):
1. a child is *up* once it announced its admin port (``_layout.read_announcement``) with its
   own pid; the parent routes admin requests to up children only;
2. a child that exits before it was ever up, on the gateway's first start, fails the whole
   gateway with that exit status (a configuration or bind error shows at once, not as a
   restart loop);
3. any other exit is restarted after a back-off (``RESTART_POLICY``:
   ``min(0.25 * 2 ** (k - 1), 10)`` seconds for the ``k``-th consecutive failure, ``k``
   counting again from 1 after a child stayed up 30 s), for ever;
4. an up child that is stuck (stopped, or its event loop blocked) is found by its liveness
   probe (``serving.liveness``: ``GET /healthz`` on its admin port every
   ``process_liveness_interval_seconds``, answered within it; ``process_liveness_misses``
   unanswered in a row) and killed (SIGKILL: a stuck process cannot drain), so its listening
   sockets leave the set the kernel hands new connections to; rule 3 restarts it;
5. ``stop(grace)``: SIGTERM (the child drains), then SIGKILL when it has not exited within
   ``grace``; no restart follows.
"""

from __future__ import annotations

from pathlib import Path

import anyio

from kserve_trio.core.logging import get_logger
from kserve_trio.core.process import LIVENESS_INTERVAL_SECONDS, LIVENESS_MISSES
from kserve_trio.gateway.admin import ScrapeError, fetch
from kserve_trio.gateway.processes._layout import read_announcement
from kserve_trio.serving.liveness import kill_when_stuck
from kserve_trio.serving.supervisor import (
    ChildProcess,
    Exit,
    FailedToStart,
    Restart,
    RestartPolicy,
    keep_running,
    launch,
)

RESTART_POLICY = RestartPolicy(
    first_pause=0.25, max_pause=10.0, stable_after=30.0, must_come_up_first=True
)
"""Rules 2 and 3: restart for ever, quickly, but never a child that did not come up once."""
ANNOUNCE_POLL_SECONDS = 0.05
LOOPBACK = "127.0.0.1"
"""Where every child serves its own admin endpoints."""

_log = get_logger("kserve_trio.gateway.processes")


class ChildFailedToStart(FailedToStart):
    """Rule 2: a child exited before it served, on the gateway's first start."""

    def __init__(self, index: int, returncode: int | None) -> None:
        super().__init__(f"gateway process {index}", returncode)
        self.index = index


class GatewayChild:
    """Child ``index`` (rules in the module docstring)."""

    def __init__(
        self,
        index: int,
        command: list[str],
        env: dict[str, str],
        runtime_dir: Path,
        *,
        liveness_interval: float = LIVENESS_INTERVAL_SECONDS,
        liveness_misses: int = LIVENESS_MISSES,
    ) -> None:
        self.index = index
        self.liveness_interval = liveness_interval
        self.liveness_misses = liveness_misses
        self.command = command
        self.env = env
        self.runtime_dir = runtime_dir
        self.process: ChildProcess | None = None
        self.admin_port: int | None = None
        """Set while the child is up (rule 1)."""
        self.restarts = 0
        self.liveness_kills = 0
        """Times a process of this child was killed for missing its liveness probes."""
        self._stop = anyio.Event()
        self._up = anyio.Event()
        self._up_pid: int | None = None
        """The pid of the last process of this child that came up."""

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    async def wait_up(self) -> None:
        """Return once the child is up for the first time."""
        await self._up.wait()

    async def run(self, parent_pid: int) -> None:
        """Rules 1-4, until ``stop``."""
        gave_up = await keep_running(
            lambda: self._run_once(parent_pid), RESTART_POLICY, self._stop, self._restarting
        )
        if gave_up is not None:
            raise ChildFailedToStart(self.index, gave_up.exit.returncode)

    async def _run_once(self, parent_pid: int) -> Exit:
        """One process of this child, from its start until it has exited."""
        process = launch(self.command, env=self.env, parent_pid=parent_pid)
        self.process = process
        _log.info("gateway_process_started", gateway_process=self.index, pid=process.pid)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch, process)
            returncode = await process.wait()
            tg.cancel_scope.cancel()
        self.admin_port = None
        self.process = None  # cancelled, it stays for ``stop`` to end
        return Exit(returncode, came_up=self._up_pid == process.pid)

    def _restarting(self, restart: Restart) -> None:
        self.restarts += 1
        _log.warning("gateway_process_exited", gateway_process=self.index, **restart.log_fields())

    async def _watch(self, process: ChildProcess) -> None:
        """Rules 1 and 4 for one process of this child, until it exits."""
        port = await self._wait_announcement(process.pid)

        async def healthz() -> bool:
            try:
                status, _ = await fetch(LOOPBACK, port, "/healthz", self.liveness_interval)
            except ScrapeError:
                return False
            return status == 200

        await kill_when_stuck(
            process,
            healthz,
            self.liveness_interval,
            self.liveness_misses,
            stopping=self._stop,  # rule 5 owns the end
            on_kill=self._killed_stuck,
            log=_log,
            event="gateway_process_unresponsive",
            gateway_process=self.index,
        )

    def _killed_stuck(self) -> None:
        self.liveness_kills += 1
        self.admin_port = None  # the admin port asks it no more

    async def _wait_announcement(self, pid: int) -> int:
        while True:
            port = read_announcement(self.runtime_dir, self.index, pid)
            if port is not None:
                self.admin_port = port
                self._up_pid = pid
                self._up.set()
                _log.info(
                    "gateway_process_up", gateway_process=self.index, pid=pid, admin_port=port
                )
                return port
            await anyio.sleep(ANNOUNCE_POLL_SECONDS)

    async def stop(self, grace: float) -> None:
        """Rule 5 (shielded: it runs while the parent is being cancelled)."""
        self._stop.set()
        process = self.process
        if process is not None:
            await process.stop(grace, on_kill=lambda: self._killed(process))

    def _killed(self, process: ChildProcess) -> None:
        _log.warning("gateway_process_killed", gateway_process=self.index, pid=process.pid)


__all__ = ["LOOPBACK", "RESTART_POLICY", "ChildFailedToStart", "GatewayChild"]

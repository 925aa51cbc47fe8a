"""``FrontendProcesses``: a worker's front ends (``endpoints.frontend_processes`` > 1), seen
from its device process.

The device process reserves the gRPC and REST addresses first (``serving.ports``: bound with
SO_REUSEPORT, never listening, so port 0 resolves once and the port stays reserved while a
front end restarts), then starts each front end by exec (``python -m kserve_trio frontend``,
``serving.supervisor.launch``: no Python runs in a forked copy of this process), handing it its
end of a new socket pair and two new memfd arenas (``serving.ipc``) through ``pass_fds``. The front end binds the same
addresses and listens, so the kernel spreads new connections over the front ends.

Rules (``serving.supervisor.keep_running`` runs each front end):

1. the worker is up once every front end said ``READY``; a front end that exits before it
   was ever ready fails the worker's start with its exit status;
2. a front end that exits later (crashed, killed) is restarted after a back-off
   (``RESTART_POLICY``: ``min(0.25 * 2 ** (k - 1), 10)`` seconds for the ``k``-th consecutive
   failure, ``k`` counting again from 1 after a front end stayed up 30 s, as for the gateway's
   processes), for ever; its requests in flight were cancelled with its
   link (its clients' connections died with it, UNAVAILABLE), the other front ends go on;
3. a front end that is ready but stuck (stopped, or its event loop blocked) is found by its
   liveness ping (``serving.liveness``: a ``PING`` over its channel every
   ``endpoints.frontend_liveness_interval_seconds``; ``endpoints.frontend_liveness_misses``
   unanswered in a row) and killed (SIGKILL: a stuck process cannot drain), so its listening
   socket leaves the set the kernel hands new connections to; rule 2 restarts it;
4. ``shutdown(grace)``: every front end is told ``Drain`` (GOAWAY, the calls in flight finish
   within the grace) and exits; one still running after the grace and a second is killed; then
   the reserved addresses are released. No restart follows.

Nothing a front end holds outlives it: the socket pair and the arenas are anonymous (no name
in the file system or in ``/dev/shm``), and the device process drops its ends once the link has
ended.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import sys
import time

import anyio
import anyio.abc

from kserve_trio.core.logging import LogSettings, current_log_settings, get_logger
from kserve_trio.core.memory import reserved_name
from kserve_trio.core.process import ServerConfig
from kserve_trio.serving.ipc import (
    ARENA_BYTES,
    Arena,
    Channel,
    Drain,
    FrontendLink,
    Hello,
    Log,
)
from kserve_trio.serving.liveness import kill_when_stuck
from kserve_trio.serving.metrics_merge import add_label
from kserve_trio.serving.ports import ReservedPort, reserve_port
from kserve_trio.serving.supervisor import (
    ChildProcess,
    Exit,
    FailedToStart,
    Restart,
    RestartPolicy,
    keep_running,
    launch,
)
from kserve_trio.worker.control_service import ControlService
from kserve_trio.worker.forwarded import ForwardedRpcs
from kserve_trio.worker.rest import WorkerRest
from kserve_trio.worker.service import InferenceService

log = get_logger("kserve_trio.worker.frontends")

KILL_AFTER_SECONDS = 1.0
"""How long past the drain's grace a front end may take to exit before it is killed."""
RESTART_POLICY = RestartPolicy(
    first_pause=0.25, max_pause=10.0, stable_after=30.0, must_come_up_first=True
)
"""Rules 1 and 2: restart for ever, quickly, but never a front end that was not ready once."""


class FrontendFailedToStart(FailedToStart):
    """Rule 1: a front end exited before it was ready, on the worker's first start."""

    def __init__(self, index: int, returncode: int | None) -> None:
        super().__init__(f"front end {index}", returncode)
        self.index = index


class _Frontend:
    """One front end's slot: its current process and link, and its restarts."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.process: ChildProcess | None = None
        self.link: FrontendLink | None = None
        self.restarts = 0
        self.liveness_kills = 0
        """Times a process of this front end was killed for missing its liveness pings."""
        self.served_before = 0
        """Requests forwarded by this front end's earlier processes."""
        self.ready = anyio.Event()
        self.stopped = anyio.Event()
        """Set once no process of this front end runs any more (the keeper has returned)."""

    @property
    def served(self) -> int:
        return self.served_before + (self.link.served if self.link is not None else 0)


class FrontendProcesses:
    """The front ends of one worker (module docstring)."""

    def __init__(
        self,
        config: ServerConfig,
        inference: InferenceService,
        control: ControlService,
        rest: WorkerRest | None,
        count: int,
    ) -> None:
        self.config = config
        self.rpcs = ForwardedRpcs(inference, control, rest, self.push_log_settings)
        """What the front ends forward to; a change of log settings it serves reaches them all."""
        self.frontends = [_Frontend(i) for i in range(count)]
        self.port = 0
        self.http_port = 0
        self._reserved: list[ReservedPort] = []
        self._stop = anyio.Event()

    # ---------------------------------------------------------------- start and run

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[tuple[int, int]] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Reserve the ports, run every front end (rules 1-3) until ``shutdown``."""
        ep = self.config.endpoints
        try:
            grpc = reserve_port(ep.host, ep.port, "endpoints.port")
            self._reserved.append(grpc)
            self.port = grpc.port
            if ep.http_port:
                rest = reserve_port(ep.host, ep.http_port, "endpoints.http_port")
                self._reserved.append(rest)
                self.http_port = rest.port
            async with anyio.create_task_group() as tg:
                for frontend in self.frontends:
                    tg.start_soon(self._keep_running, frontend)
                for frontend in self.frontends:
                    await frontend.ready.wait()
                task_status.started((self.port, self.http_port))
        finally:
            for reserved in self._reserved:
                reserved.close()
            self._reserved.clear()

    def _argv(self, channel_fd: int, request_fd: int, reply_fd: int) -> list[str]:
        settings = current_log_settings()
        level = "debug" if settings.log_verbose_level > 0 else "info"
        return [
            sys.executable,
            "-m",
            "kserve_trio",
            "frontend",
            "--channel-fd",
            str(channel_fd),
            "--request-arena-fd",
            str(request_fd),
            "--reply-arena-fd",
            str(reply_fd),
            "--log-format",
            "console" if settings.log_format == "console" else "json",
            "--log-level",
            level,
        ]

    async def _start(self, frontend: _Frontend) -> tuple[ChildProcess, FrontendLink]:
        """One front end's process, its channel and arenas (module docstring)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds: list[int] = []
        try:
            for what in ("requests", "replies"):
                # No name in /dev/shm, but the one rule for the server's own objects all the same
                name = reserved_name(f"frontend{frontend.index}-{what}")
                fds.append(Arena.create_fd(name))
            arenas = [Arena(fd, ARENA_BYTES) for fd in fds]
            argv = self._argv(theirs.fileno(), *fds)
            process = launch(argv, pass_fds=(theirs.fileno(), *fds))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
            for fd in fds:
                os.close(fd)
        channel = Channel(await anyio.abc.SocketStream.from_socket(ours))
        link = FrontendLink(frontend.index, channel, arenas[0], arenas[1], self.rpcs)
        ep = dataclasses.replace(self.config.endpoints, port=self.port, http_port=self.http_port)
        config = dataclasses.replace(self.config, endpoints=ep)
        channel.send(Hello(config, frontend.index, self.rpcs.listing(), self.rpcs.shutting_down))
        return process, link

    async def _keep_running(self, frontend: _Frontend) -> None:
        """Rules 1 to 3 for one front end, until ``shutdown``."""
        try:
            gave_up = await keep_running(
                lambda: self._run_once(frontend),
                RESTART_POLICY,
                self._stop,
                lambda restart: self._restarting(frontend, restart),
            )
        finally:
            frontend.stopped.set()
        if gave_up is not None:
            raise FrontendFailedToStart(frontend.index, gave_up.exit.returncode)

    async def _run_once(self, frontend: _Frontend) -> Exit:
        """One process of ``frontend``, from its start until its channel closed and it exited."""
        process, link = await self._start(frontend)
        frontend.process, frontend.link = process, link
        if self._stop.is_set():  # the shutdown came while it was being started
            link.channel.send(Drain())
        log.info("frontend_started", frontend_process=frontend.index, pid=process.pid)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._mark_ready, frontend, link)
            tg.start_soon(self._watch, frontend, process, link)
            await link.serve()  # until the front end's end of the channel closes
            tg.cancel_scope.cancel()
        # the exit status of a front end whose channel closed (killed if it lingers)
        returncode = await process.stop(KILL_AFTER_SECONDS, ask=None)
        frontend.served_before += link.served
        frontend.process, frontend.link = None, None
        return Exit(returncode, came_up=link.ready.is_set())

    def _restarting(self, frontend: _Frontend, restart: Restart) -> None:
        frontend.restarts += 1
        log.warning("frontend_exited", frontend_process=frontend.index, **restart.log_fields())

    async def _mark_ready(self, frontend: _Frontend, link: FrontendLink) -> None:
        await link.ready.wait()
        frontend.ready.set()
        log.info("frontend_ready", frontend_process=frontend.index, port=link.ports[0])

    async def _watch(self, frontend: _Frontend, process: ChildProcess, link: FrontendLink) -> None:
        """Rule 3 for one process of ``frontend``, from its ``READY`` until its link ends."""
        ep = self.config.endpoints
        await link.ready.wait()

        def killed() -> None:
            frontend.liveness_kills += 1

        await kill_when_stuck(
            process,
            link.ping,
            ep.frontend_liveness_interval_seconds,
            ep.frontend_liveness_misses,
            stopping=self._stop,  # rule 4 owns the end
            on_kill=killed,
            log=log,
            event="frontend_unresponsive",
            frontend_process=frontend.index,
        )

    # ---------------------------------------------------------------- while serving

    def push_log_settings(self, settings: LogSettings) -> None:
        """Every front end takes the log settings the device process now has."""
        for frontend in self.frontends:
            if frontend.link is not None:
                frontend.link.channel.send(Log(settings))

    def expositions(self) -> list[str]:
        """What the worker's ``/metrics`` adds for its front ends: the requests each forwarded
        and its restarts (counted here; those that followed a liveness kill are counted apart
        too), and each running front end's edge counters as it last
        sent them, every sample labelled ``frontend_process``."""
        counts = [
            "# HELP worker_frontend_requests Requests a front end forwarded to the device process",
            "# TYPE worker_frontend_requests counter",
            *(
                f'worker_frontend_requests_total{{frontend_process="{f.index}"}} {f.served}'
                for f in self.frontends
            ),
            "# HELP worker_frontend_restarts Times a front end was started again",
            "# TYPE worker_frontend_restarts counter",
            *(
                f'worker_frontend_restarts_total{{frontend_process="{f.index}"}} {f.restarts}'
                for f in self.frontends
            ),
            "# HELP worker_frontend_liveness_kills Times a front end was killed for missing "
            "its liveness pings",
            "# TYPE worker_frontend_liveness_kills counter",
            *(
                f'worker_frontend_liveness_kills_total{{frontend_process="{f.index}"}} '
                f"{f.liveness_kills}"
                for f in self.frontends
            ),
        ]
        out = ["\n".join(counts) + "\n"]
        for frontend in self.frontends:
            link = frontend.link
            if link is not None and link.edge_exposition:
                out.append(add_label(link.edge_exposition, "frontend_process", str(frontend.index)))
        return out

    # ---------------------------------------------------------------- the end

    async def shutdown(self, grace: float) -> int:
        """Rule 4 (shielded: it runs while the worker is being cancelled); returns the number
        of front ends that had to be killed."""
        self._stop.set()
        killed: list[int] = []
        with anyio.CancelScope(shield=True):
            for frontend in self.frontends:
                if frontend.link is not None:
                    frontend.link.channel.send(Drain())
            wait_until = time.monotonic() + (grace if math.isfinite(grace) else 3600.0)
            for frontend in self.frontends:
                process = frontend.process
                if process is None:
                    continue
                left = max(0.0, wait_until - time.monotonic()) + KILL_AFTER_SECONDS

                def kill(frontend: _Frontend = frontend, pid: int = process.pid) -> None:
                    log.warning("frontend_killed", frontend_process=frontend.index, pid=pid)
                    killed.append(frontend.index)

                await process.stop(left, ask=None, on_kill=kill)
            for frontend in self.frontends:  # their links end with them
                await frontend.stopped.wait()
        return len(killed)


__all__ = ["FrontendFailedToStart", "FrontendProcesses"]

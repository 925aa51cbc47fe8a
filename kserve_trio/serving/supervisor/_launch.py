"""``launch``: the one way our processes start another process (a gateway child, a worker's
front end, a node's worker or gateway), and ``ChildProcess``, the handle it returns.

Why not ``anyio.open_process``: a worker's device process has XLA's threads running, and a
forked copy of a process has only the thread that forked, so any lock another thread held at
that moment stays held forever in the copy: the copy may run no Python between its fork and
its exec. uvloop's process support runs Python there (``PyOS_AfterFork_Child`` and the
at-fork hooks), and trio's calls ``subprocess.Popen`` from a worker thread, which ends on its
own and takes the parent-death signal with it (the kernel ties that signal to the thread that
started the child). So every child is started the same way:

1. ``subprocess.Popen`` without a ``preexec_fn`` (CPython runs only C between its vfork and the
   exec), called on the event loop's own thread: a vfork pauses only that thread, until the
   exec, and the parent-death signal is tied to a thread that lives as long as the loop;
2. through the trampoline (``_trampoline.py``: the parent-death signal, CPU affinity, then
   ``exec`` of the command, same pid), so no child outlives a parent killed outright;
3. its exit is awaited on a pidfd (readable once the process has exited), so waiting blocks
   no thread and can be cancelled like any other wait.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

import anyio

TRAMPOLINE = str(Path(__file__).with_name("_trampoline.py"))
PIPE = subprocess.PIPE
PIPE_READ_BYTES = 65536


def trampoline_argv(
    command: Sequence[str],
    parent_pid: int,
    cpus: str = "",
    python: str = sys.executable,
) -> list[str]:
    """The command that runs ``command`` through the trampoline (step 2 of the module
    docstring): ``python -I -S _trampoline.py --parent PID [--cpus LIST] -- COMMAND...``."""
    argv = [python, "-I", "-S", TRAMPOLINE, "--parent", str(parent_pid)]
    if cpus:
        argv += ["--cpus", cpus]
    return [*argv, "--", *command]


class PipeReader:
    """A child's standard output or error, read as it comes (an async iterator of chunks,
    ending at end of file)."""

    def __init__(self, file: IO[bytes]) -> None:
        self._file = file
        self._fd = file.fileno()
        os.set_blocking(self._fd, False)

    def __aiter__(self) -> PipeReader:
        return self

    async def __anext__(self) -> bytes:
        while True:
            try:
                chunk = os.read(self._fd, PIPE_READ_BYTES)
            except BlockingIOError:
                await anyio.wait_readable(self._fd)
                continue
            if not chunk:
                raise StopAsyncIteration
            return chunk

    def close(self) -> None:
        self._file.close()


class ChildProcess:
    """A process ``launch`` started: its pid, exit status, signals and pipes."""

    def __init__(self, popen: subprocess.Popen[bytes], *, leads_group: bool) -> None:
        self._popen = popen
        self._pidfd: int | None = os.pidfd_open(popen.pid)
        self._leads_group = leads_group
        self._waiter_done: anyio.Event | None = None
        self.stdout = PipeReader(popen.stdout) if popen.stdout is not None else None
        self.stderr = PipeReader(popen.stderr) if popen.stderr is not None else None

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once ``wait`` has seen the exit (negative: the ending signal)."""
        return self._popen.returncode

    async def wait(self) -> int:
        """The exit status, once the process has exited. Any number of tasks may wait at once:
        one waits on the pidfd, the others for it (and take over if it is cancelled)."""
        while self._popen.poll() is None:
            if self._waiter_done is not None:
                await self._waiter_done.wait()
                continue
            self._waiter_done = done = anyio.Event()
            try:
                assert self._pidfd is not None
                await anyio.wait_readable(self._pidfd)
            finally:
                self._waiter_done = None
                done.set()
        self._close_pidfd()
        return self._popen.returncode

    def send_signal(self, signum: int) -> None:
        """``signum`` to the process (nothing once it has been reaped)."""
        self._popen.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL: to its whole process group when it leads one (``new_session``)."""
        if self._leads_group and self._popen.returncode is None:
            try:
                os.killpg(self._popen.pid, signal.SIGKILL)
                return
            except (ProcessLookupError, PermissionError):
                pass
        self._popen.kill()

    async def stop(
        self,
        grace: float,
        *,
        ask: int | None = signal.SIGTERM,
        sooner: anyio.Event | None = None,
        on_kill: Callable[[], None] | None = None,
    ) -> int:
        """Send ``ask`` (None: it was asked to exit another way), wait up to ``grace`` seconds
        (cut short once ``sooner`` is set), then ``on_kill()`` and ``kill``; returns the exit
        status. Shielded: it runs while its caller is being cancelled."""
        with anyio.CancelScope(shield=True):
            if self._popen.poll() is None:
                await self._ask_then_kill(grace, ask, sooner, on_kill)
            returncode = await self.wait()
        return returncode

    async def _ask_then_kill(
        self,
        grace: float,
        ask: int | None,
        sooner: anyio.Event | None,
        on_kill: Callable[[], None] | None,
    ) -> None:
        if ask is not None:
            self.send_signal(ask)
        with anyio.move_on_after(grace if math.isfinite(grace) else None):
            async with anyio.create_task_group() as tg:
                if sooner is not None:

                    async def cut_short() -> None:
                        await sooner.wait()
                        tg.cancel_scope.cancel()

                    tg.start_soon(cut_short)
                await self.wait()
                tg.cancel_scope.cancel()
        if self._popen.poll() is None:
            if on_kill is not None:
                on_kill()
            self.kill()

    def close(self) -> None:
        """Close its pipes (once nothing reads them) and the pidfd."""
        for pipe in (self.stdout, self.stderr):
            if pipe is not None:
                pipe.close()
        self._close_pidfd()

    def _close_pidfd(self) -> None:
        if self._pidfd is not None and self._waiter_done is None:
            os.close(self._pidfd)
            self._pidfd = None


def launch(
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    stdout: int | None = None,
    stderr: int | None = None,
    pass_fds: Sequence[int] = (),
    new_session: bool = False,
    cpus: str = "",
    parent_pid: int | None = None,
) -> ChildProcess:
    """Start ``command`` (module docstring) and return at once.

    ``env``: its environment (None: this process's); ``stdout``, ``stderr``: inherited or
    ``PIPE``; ``pass_fds``: descriptors it inherits; ``new_session``: a session of its own (a
    terminal's Ctrl-C then reaches only its supervisor, and ``kill`` reaches its whole group);
    ``cpus``: the CPUs it is pinned to (``Cpus_allowed_list`` notation, ``0-2,5``);
    ``parent_pid``: whose life it is tied to (default: this process). Call it from the event
    loop's thread. It raises ``OSError`` when Python itself cannot be started; a command that
    cannot be executed exits 127 instead.
    """
    argv = trampoline_argv(command, os.getpid() if parent_pid is None else parent_pid, cpus)
    popen = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        env=None if env is None else dict(env),
        pass_fds=tuple(pass_fds),
        start_new_session=new_session,
    )
    try:
        return ChildProcess(popen, leads_group=new_session)
    except OSError:
        popen.kill()
        popen.wait()
        raise


__all__ = [
    "PIPE",
    "TRAMPOLINE",
    "ChildProcess",
    "PipeReader",
    "launch",
    "trampoline_argv",
]

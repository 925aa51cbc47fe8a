"""The runtime directory of a gateway in several processes: what lives there, who removes it,
and the one thing a child tells its parent (that it serves, on which admin port).

The parent makes the directory (``create_runtime_dir``: ``kserve_trio-gateway-<its pid>-*`` in
the temporary directory) and removes it at exit. So that no directory outlives its gateway,
however the gateway ended, every process of the gateway holds a shared ``flock`` on the
directory while it lives (the kernel drops it however the process ends, SIGKILL included):

1. *The last to leave removes*: a child that exits removes the directory when no other process of
   its gateway holds it (``leave_runtime_dir``): the parent was killed outright and its children,
   which the kernel stopped with it (the trampoline's parent-death signal), were the last;
2. *A starting parent sweeps*: a parent that starts removes every ``kserve_trio-gateway-<pid>-*``
   directory whose pid is not a live process and that no process holds
   (``remove_stale_runtime_dirs``): the case where every process of a gateway was killed outright. A
   live owner's directory, or one a process still holds, is never touched, nor is any other name.

Nothing else creates files there but the children, and only these:

- ``gateway.json``: the resolved configuration every child serves (written by the parent);
- ``process-<i>.json``: child ``i``'s announcement, ``{"pid": ..., "admin_port": ...}``,
  written once its ports are open; the parent trusts it only while the pid is that child's;
- ``shm-registrations.json`` and its ``.lock``: the shared-memory registrations made through
  any child (``gateway.shm_record``).

Every file is replaced whole (write a temporary file, then ``os.replace``), so a reader never
sees half of one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kserve_trio.core.logging import get_logger

CONFIG_FILE = "gateway.json"
SHM_RECORD_FILE = "shm-registrations.json"
RUNTIME_DIR_PREFIX = "kserve_trio-gateway-"
_OWNED_NAME = re.compile(re.escape(RUNTIME_DIR_PREFIX) + r"([0-9]+)-[^-]+$")
"""A runtime directory's name: the prefix, its parent's pid, ``mkdtemp``'s random part."""

_log = get_logger("kserve_trio.gateway.processes")


def _hold(runtime_dir: Path, how: int) -> int:
    """A descriptor of ``runtime_dir`` holding ``flock`` ``how`` (``BlockingIOError`` when
    ``how`` does not wait and another process holds it)."""
    fd = os.open(runtime_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, how)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def remove_stale_runtime_dirs(temp_dir: Path | None = None) -> list[Path]:
    """*A starting parent sweeps* (module docstring), in ``temp_dir`` (default:
    ``tempfile.gettempdir()``); the directories removed."""
    root = Path(temp_dir if temp_dir is not None else tempfile.gettempdir())
    removed: list[Path] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        match = _OWNED_NAME.match(entry.name)
        if match is None or _alive(int(match.group(1))):
            continue  # not ours, or its parent lives (it may not hold its lock yet)
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            fd = _hold(Path(entry.path), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held (its children still drain), another user's, or gone
            continue
        try:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
        finally:
            os.close(fd)
    return removed


def create_runtime_dir() -> tuple[Path, int]:
    """The parent's runtime directory, made after removing the stale ones (*a starting parent
    sweeps*), and the descriptor holding it (give both to ``remove_runtime_dir`` at exit)."""
    for stale in remove_stale_runtime_dirs():
        _log.info("gateway_stale_runtime_dir_removed", runtime_dir=str(stale))
    runtime_dir = Path(tempfile.mkdtemp(prefix=f"{RUNTIME_DIR_PREFIX}{os.getpid()}-"))
    try:
        return runtime_dir, _hold(runtime_dir, fcntl.LOCK_SH)
    except BaseException:
        shutil.rmtree(runtime_dir, ignore_errors=True)
        raise


def remove_runtime_dir(runtime_dir: Path, fd: int) -> None:
    """The parent's exit: its children are stopped, the directory goes."""
    shutil.rmtree(runtime_dir, ignore_errors=True)
    os.close(fd)


PARENT_EXIT_WAIT_SECONDS = 5.0
"""How long a leaving child waits for a dying parent's last thread (see ``leave_runtime_dir``)."""
_PF_EXITING = 0x4
"""The kernel's per-task flag, in ``/proc/<pid>/stat``, of a thread that has begun to exit."""


def _exiting(pid: int) -> bool:
    """Whether process ``pid`` has begun to exit (its main thread is exiting or gone while
    other threads still run) or is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return True
    state, flags = fields[0], int(fields[6])
    return state in ("Z", "X") or bool(flags & _PF_EXITING)


def leave_runtime_dir(runtime_dir: Path, fd: int, parent: int) -> bool:
    """A child's exit: *the last to leave removes* (the lock is dropped first, so of several
    children leaving at once the last to try finds no holder); whether it removed the directory.

    A parent killed outright signals its children when the thread that started them dies,
    which can be before its last thread has closed its descriptors (and dropped its lock).
    So a child that finds the lock held while ``parent`` is exiting waits until the kernel
    has handed it to another parent (every thread of the old one gone), then tries once more.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not _exiting(parent):
                return False  # the parent lives: it removes the directory at its exit
            deadline = time.monotonic() + PARENT_EXIT_WAIT_SECONDS
            while os.getppid() == parent and time.monotonic() < deadline:
                time.sleep(0.01)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # a sibling still holds it: the last one out removes it
        shutil.rmtree(runtime_dir, ignore_errors=True)
        return True
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` whole, or keeps what it held (never a partial write)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def announcement_path(runtime_dir: Path, index: int) -> Path:
    return runtime_dir / f"process-{index}.json"


def read_announcement(runtime_dir: Path, index: int, pid: int) -> int | None:
    """Child ``index``'s admin port, once the child whose pid is ``pid`` has announced it
    (``None`` before, or when the file is an earlier incarnation's)."""
    try:
        data = json.loads(announcement_path(runtime_dir, index).read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("pid") != pid:
        return None
    port = data.get("admin_port")
    return port if isinstance(port, int) and port > 0 else None


@dataclass(frozen=True)
class ProcessRole:
    """What a child gateway knows of its place: its index among ``count`` siblings and the
    runtime directory they share. A gateway given one binds its public ports with
    SO_REUSEPORT, keeps its shared-memory registrations in the shared record and announces
    its admin port to the parent."""

    index: int
    count: int
    runtime_dir: Path

    @property
    def shm_record(self) -> Path:
        return self.runtime_dir / SHM_RECORD_FILE

    def announce(self, admin_port: int) -> None:
        body = json.dumps({"pid": os.getpid(), "admin_port": admin_port}).encode()
        write_atomically(announcement_path(self.runtime_dir, self.index), body)

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Hold the runtime directory while this child lives; on the way out, remove it when
        no process of the gateway holds it any longer (*the last to leave removes*)."""
        parent = os.getppid()
        fd = _hold(self.runtime_dir, fcntl.LOCK_SH)
        try:
            yield
        finally:
            if leave_runtime_dir(self.runtime_dir, fd, parent):
                _log.info("gateway_runtime_dir_removed", runtime_dir=str(self.runtime_dir))


__all__ = [
    "CONFIG_FILE",
    "RUNTIME_DIR_PREFIX",
    "SHM_RECORD_FILE",
    "ProcessRole",
    "announcement_path",
    "create_runtime_dir",
    "leave_runtime_dir",
    "read_announcement",
    "remove_runtime_dir",
    "remove_stale_runtime_dirs",
    "write_atomically",
]

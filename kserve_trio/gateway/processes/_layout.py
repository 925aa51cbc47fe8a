"""The runtime directory of a gateway in several processes: what lives there, and the one
thing a child tells its parent (that it serves, on which admin port).

The parent makes the directory (``tempfile.mkdtemp``) and removes it at exit; nothing else
creates files there but the children, and only these:

- ``gateway.json``: the resolved configuration every child serves (written by the parent);
- ``process-<i>.json``: child ``i``'s announcement, ``{"pid": ..., "admin_port": ...}``,
  written once its ports are open; the parent trusts it only while the pid is that child's;
- ``shm-registrations.json`` and its ``.lock``: the shared-memory registrations made through
  any child (``gateway.shm_record``).

Every file is replaced whole (write a temporary file, then ``os.replace``), so a reader never
sees half of one.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "gateway.json"
SHM_RECORD_FILE = "shm-registrations.json"


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


__all__ = [
    "CONFIG_FILE",
    "SHM_RECORD_FILE",
    "ProcessRole",
    "announcement_path",
    "read_announcement",
    "write_atomically",
]

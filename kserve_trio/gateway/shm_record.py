"""The shared-memory registrations of a gateway in several processes: one record, in a file.

A client may register a region through one gateway process and unregister it through another
(its connections reach whichever process the kernel picked). Each process keeping its own
list would replay a region to a restarted worker that another process already unregistered.
So the processes keep one record: ``SharedShmRegistrations``, a ``ShmRegistrations`` whose
contents live in a file of the runtime directory (``processes._layout``).

Rules:
1. *Whole record*: the record is a JSON list of ``[region name, base64 of the Register request]`` in
   registration order, replaced whole on every change (``os.replace``), so a reader always
   sees a complete record; every read outside ``exclusive`` reads the file again.
2. *Exclusive*: ``exclusive()`` holds the record for one process and one task: an ``anyio.Lock``
   within the process, then ``fcntl.flock`` on the record's ``.lock`` file across processes (taken
   by polling a non-blocking attempt, so a waiting task never blocks its event loop and stays
   cancellable). Inside, the record is read once at entry and written at each change.
3. *Held around changes*: ``ShmFanout`` holds ``exclusive`` around a Register's or Unregister's
   fan-out and record update, and around a replay, so a replay never interleaves with a change made
   through another process: a region unregistered through process B is never replayed by process A.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import anyio

from kserve_trio.gateway.processes._layout import write_atomically
from kserve_trio.gateway.request_path import ShmRegistrations

LOCK_POLL_SECONDS = 0.005


class SharedShmRegistrations(ShmRegistrations):
    """The record shared by a gateway's processes (rules in the module docstring)."""

    shared = True

    def __init__(self, record: Path) -> None:
        super().__init__()
        self.record = Path(record)
        self.lock_path = self.record.with_name(self.record.name + ".lock")
        self._local: anyio.Lock | None = None
        self._held = False

    def _load(self) -> None:
        try:
            entries = json.loads(self.record.read_bytes())
        except FileNotFoundError:
            entries = []
        self._regions = {name: base64.b64decode(data) for name, data in entries}

    def _save(self) -> None:
        entries = [[name, base64.b64encode(data).decode()] for name, data in self._regions.items()]
        write_atomically(self.record, json.dumps(entries).encode())

    def _fresh(self) -> None:
        if not self._held:
            self._load()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """*Exclusive*."""
        if self._local is None:
            self._local = anyio.Lock()
        async with self._local:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        await anyio.sleep(LOCK_POLL_SECONDS)
                self._load()
                self._held = True
                try:
                    yield
                finally:
                    self._held = False
            finally:
                os.close(fd)  # closing the descriptor releases the lock

    def registered(self, name: str, request: bytes) -> None:
        self._fresh()
        super().registered(name, request)
        self._save()

    def unregistered(self, name: str) -> None:
        self._fresh()
        super().unregistered(name)
        self._save()

    def items(self) -> list[tuple[str, bytes]]:
        self._fresh()
        return super().items()

    def __contains__(self, name: object) -> bool:
        self._fresh()
        return super().__contains__(name)

    def __len__(self) -> int:
        self._fresh()
        return super().__len__()


__all__ = ["SharedShmRegistrations"]

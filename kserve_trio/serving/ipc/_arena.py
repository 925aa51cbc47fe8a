"""Shared memory between a device process and one front end: memfd arenas and their slots.

Each front end has two arenas, both created by the device process before it starts the front
end and inherited by it as descriptors: the *request arena*, whose slots the front end
allocates (a ModelInfer message is copied in once, the device process parses it in place and
its tensors are read from there), and the *reply arena*, whose slots the device process
allocates (the encoded reply is written in once and the front end copies it out, then names
the slot in a ``FREE`` message). Each side allocates only in the arena it writes, so an
allocator never needs a lock or a second process's view.

A memfd has no name: nothing is left in ``/dev/shm`` whatever happens, and the kernel frees
the memory once the last mapping and descriptor are gone (a SIGKILLed front end's mappings go
with it; the device process drops its own once the front end's requests have ended). Pages are
allocated on first touch, so an arena costs the memory its traffic has used, at most its size.

``Ring`` is the allocator: slots are handed out in order around the arena and come back in any
order; the space behind the oldest slot still held is reused once every slot before it has
come back. A message that does not fit (larger than the arena, or the arena full of slots
still held) is not an error: the caller sends it inside the frame instead.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections import deque

ARENA_BYTES = 64 << 20
"""Each arena's size (virtual: pages are allocated as traffic touches them). Holds the
messages of several hundred image-sized requests in flight; a larger message travels in the
frame."""

_ALIGN = 64


class Ring:
    """Slots of ``size`` bytes handed out around a ring (module docstring)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._head = 0
        """Absolute position of the next slot (grows without wrapping; ``% size`` is the
        offset)."""
        self._tail = 0
        """Absolute position of the oldest slot still held (everything before it is free)."""
        self._held: deque[tuple[int, int]] = deque()
        self._returned: set[int] = set()

    @property
    def used(self) -> int:
        """Bytes between the oldest slot held and the next one: what cannot be handed out."""
        return self._head - self._tail

    def alloc(self, nbytes: int) -> int | None:
        """A slot of at least ``nbytes`` contiguous bytes (its absolute position), or None."""
        need = max(_ALIGN, (nbytes + _ALIGN - 1) & ~(_ALIGN - 1))
        if need > self.size:
            return None
        offset = self._head % self.size
        skip = self.size - offset if offset + need > self.size else 0
        if self._head + skip + need - self._tail > self.size:
            return None
        if skip:  # the end of the ring is too short: a filler slot, returned at once
            self._held.append((self._head, self._head + skip))
            self._returned.add(self._head)
            self._head += skip
        slot = self._head
        self._head += need
        self._held.append((slot, self._head))
        return slot

    def free(self, slot: int) -> None:
        """Give ``slot`` back; the space is reusable once every older slot is back too."""
        self._returned.add(slot)
        held, returned = self._held, self._returned
        while held and held[0][0] in returned:
            start, end = held.popleft()
            returned.discard(start)
            self._tail = end
        if not held:  # empty: start again at the arena's beginning (slots stay unique)
            self._head = self._tail = -(-self._head // self.size) * self.size


class Arena:
    """One memfd mapping (module docstring): ``write`` and ``view`` by slot."""

    def __init__(self, fd: int, size: int) -> None:
        """Map ``fd`` (``size`` bytes); the mapping keeps its own descriptor, so the caller
        may close ``fd`` once it has been passed on."""
        self.size = size
        self._map = mmap.mmap(fd, size)
        self._view = memoryview(self._map)

    @staticmethod
    def create_fd(name: str, size: int = ARENA_BYTES) -> int:
        """A new memfd of ``size`` bytes (close-on-exec: a front end gets it through
        ``pass_fds``, no other child does)."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def write(self, slot: int, pieces) -> int:
        """Copy ``pieces`` (buffers) into ``slot`` one after the other; returns the bytes
        written."""
        offset = start = slot % self.size
        view = self._view
        for piece in pieces:
            data = memoryview(piece).cast("B")
            end = offset + data.nbytes
            view[offset:end] = data
            offset = end
        return offset - start

    def view(self, slot: int, nbytes: int) -> memoryview:
        """The ``nbytes`` at ``slot``, in place (valid while the slot is held)."""
        offset = slot % self.size
        return self._view[offset : offset + nbytes]

    def close(self) -> None:
        """Unmap now if nothing still views the arena; otherwise the mapping goes with the
        last view (a request whose tensors a cancelled batch still holds)."""
        with contextlib.suppress(BufferError):
            self._view.release()
            self._map.close()


__all__ = ["ARENA_BYTES", "Arena", "Ring"]

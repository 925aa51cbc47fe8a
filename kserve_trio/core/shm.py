"""The server's system shared-memory registry.

``ShmRegistry`` owns every client region this process has attached: it maps a client-chosen
region *name* to a window ``[offset, offset+byte_size)`` of an existing POSIX shared-memory object
*key*, hands out zero-copy leased views of it to the codec (``read_view``), copies outputs into it
(``write``) and detaches regions on ``unregister``/``close``. It never creates or unlinks a
client's object. ``same_ipc_namespace`` answers the client's "can you see my object?" probe.

Concurrency: one registry lock guards the name table; each region has its own lock guarding its
mapping, its lease count and its ``retired`` flag. No code path holds both locks at once. An
unregister removes the name at once (new operations raise ``UnregisteredRegionError``) and
unmaps when the last lease is released, so a request that is decoding from a region never sees
the mapping vanish underneath it. Python's buffer protocol backs this up: ``mmap.close`` refuses
(``BufferError``) while views are exported; we then drop our reference and the mapping goes away
with the last view.

Attachment goes through ``posix_ipc`` only, never ``multiprocessing.shared_memory``, whose
resource tracker would unlink the client's object when this process exits (stack_probe section 5).
"""

from __future__ import annotations

import gc
import mmap
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import posix_ipc

from kserve_trio.core.errors import InvalidArgument, Unavailable, UnregisteredRegionError
from kserve_trio.core.logging import get_logger

log = get_logger("kserve_trio.core.shm")

INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class RegionStatus:
    """One registered region as reported by ``SystemSharedMemoryStatus``."""

    name: str
    key: str
    offset: int
    byte_size: int


def posix_name(key: str) -> str:
    """The name ``posix_ipc`` needs for ``key``: tritonclient passes ``"/name"``, other clients
    pass ``"name"``; both mean the same object in ``/dev/shm``."""
    return key if key.startswith("/") else "/" + key


def same_ipc_namespace(name: str) -> bool:
    """Whether this process can open the POSIX shared-memory object ``name``.

    The object is opened read-only and its descriptor closed at once; nothing is mapped or
    registered. Any failure (empty name, no such object because we live in another IPC
    namespace, permissions, a malformed name) answers ``False``.
    """
    if not name:
        return False
    try:
        shm = posix_ipc.SharedMemory(posix_name(name), read_only=True)
    except Exception:
        return False
    try:
        shm.close_fd()
    except Exception:
        pass
    return True


class _Region:
    """One attached window; every mutable field is guarded by ``lock``."""

    __slots__ = ("base", "byte_size", "key", "leases", "lock", "mm", "name", "offset", "retired")

    def __init__(
        self, name: str, key: str, offset: int, byte_size: int, mm: mmap.mmap, base: int
    ) -> None:
        self.name = name
        self.key = key
        self.offset = offset
        self.byte_size = byte_size
        self.mm: mmap.mmap | None = mm
        self.base = base  # where the region's byte 0 sits inside ``mm`` (mmap offsets are aligned)
        self.lock = threading.Lock()
        self.leases = 0
        self.retired = False

    def status(self) -> RegionStatus:
        return RegionStatus(self.name, self.key, self.offset, self.byte_size)

    def unmap(self) -> None:
        """Drop the mapping (caller holds ``lock``). With views still exported, ``mmap.close``
        raises ``BufferError``; the mapping is then released by the last view's deallocation."""
        mm, self.mm = self.mm, None
        if mm is None:
            return
        try:
            mm.close()
            return
        except BufferError:
            pass
        # No lease is outstanding, so every remaining view is garbage; some may sit in a
        # reference cycle (seen with views handed to jax). Collect once and retry: unregister
        # is a control-plane operation, so the cost stays off the request path.
        gc.collect(1)
        try:
            mm.close()
        except BufferError:
            log.debug("shm_unmap_deferred", region=self.name, key=self.key)

    def check_bounds(self, offset: int, byte_size: int) -> None:
        """``[offset, offset+byte_size)`` must lie in ``[0, self.byte_size)`` (subtraction form)."""
        if offset < 0 or byte_size < 0:
            raise InvalidArgument(
                f"shared memory region '{self.name}': offset {offset} and byte_size {byte_size} "
                "must be non-negative"
            )
        if byte_size > self.byte_size or offset > self.byte_size - byte_size:
            raise InvalidArgument(
                f"shared memory region '{self.name}': offset {offset} + byte_size {byte_size} "
                f"exceeds the region size ({self.byte_size})"
            )


def _attach(name: str, key: str, offset: int, byte_size: int) -> _Region:
    """Open the existing object ``key`` read-write and map the window the region covers."""
    try:
        shm = posix_ipc.SharedMemory(posix_name(key))
    except posix_ipc.ExistentialError:
        raise InvalidArgument(f"shared memory object '{key}' does not exist") from None
    except Exception as exc:
        raise InvalidArgument(f"cannot open shared memory object '{key}': {exc}") from None
    try:
        size = shm.size  # read before close_fd: posix_ipc fstat()s the descriptor
        if byte_size > size or offset > size - byte_size:
            raise InvalidArgument(
                f"region '{name}' offset+byte_size exceeds shared memory object '{key}' "
                f"size ({size})"
            )
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        try:
            mm = mmap.mmap(shm.fd, offset - start + byte_size, offset=start)
        except (OSError, ValueError) as exc:
            raise InvalidArgument(
                f"cannot map shared memory object '{key}' for region '{name}': {exc}"
            ) from None
    finally:
        shm.close_fd()
    return _Region(name, key, offset, byte_size, mm, offset - start)


def _as_bytes(data: memoryview | bytes | bytearray | np.ndarray) -> memoryview:
    """A flat ``'B'`` view of ``data`` (copying only when it is not C-contiguous)."""
    if isinstance(data, np.ndarray):
        arr = np.ascontiguousarray(data)
        return memoryview(arr.reshape(-1).view(np.uint8))
    mv = memoryview(data)
    if not mv.c_contiguous:
        mv = memoryview(mv.tobytes())
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


class ShmRegistry:
    """Named windows of client POSIX shared-memory objects.

    Satisfies the codec's ``ShmRegistryLike`` protocol (``read_view``, ``write``). All methods
    are thread-safe: the event loop and worker threads call them concurrently.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[str, _Region] = {}
        self._closed = False

    # -- registration ------------------------------------------------------------------------

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Attach the existing object ``key`` read-write and register ``[offset,
        offset+byte_size)`` of it as ``name``.

        Rules (each failure is ``InvalidArgument``, so a bad region surfaces at register time):
        1. ``name`` and ``key`` are non-empty; ``0 <= offset <= INT64_MAX``; ``0 < byte_size <=
           INT64_MAX``.
        2. ``key`` (with or without its leading ``/``) names an existing object.
        3. ``byte_size <= size`` and ``offset <= size - byte_size`` (subtraction form).
        4. A name already registered is replaced; the old mapping is detached once its
           outstanding leases are released.
        """
        if not name:
            raise InvalidArgument("shared memory region name must not be empty")
        if not key:
            raise InvalidArgument(f"region '{name}' has an empty shared memory key")
        if offset < 0 or offset > INT64_MAX:
            raise InvalidArgument(f"region '{name}' offset {offset} is out of range [0, 2^63-1]")
        if byte_size <= 0 or byte_size > INT64_MAX:
            raise InvalidArgument(
                f"region '{name}' byte_size {byte_size} is out of range [1, 2^63-1]"
            )
        with self._lock:
            if self._closed:
                raise Unavailable("shared memory registry is closed (server is shutting down)")
        region = _attach(name, key, offset, byte_size)
        with self._lock:
            closed = self._closed
            old = None if closed else self._regions.get(name)
            if not closed:
                self._regions[name] = region
        if closed:  # lost a race with close(): detach what we just mapped
            self._retire(region)
            raise Unavailable("shared memory registry is closed (server is shutting down)")
        if old is not None:
            self._retire(old)
        log.debug("shm_registered", region=name, key=key, offset=offset, byte_size=byte_size)

    def unregister(self, name: str = "") -> None:
        """Remove ``name`` (``""`` = every region). Unknown names are a successful no-op.

        The name disappears at once; each mapping is detached when its last lease is released.
        The client's object is never unlinked.
        """
        with self._lock:
            if name:
                region = self._regions.pop(name, None)
                victims = [region] if region is not None else []
            else:
                victims = list(self._regions.values())
                self._regions.clear()
        for region in victims:
            self._retire(region)
            log.debug("shm_unregistered", region=region.name, key=region.key)

    def status(self, name: str = "") -> dict[str, RegionStatus]:
        """Registered regions by name (``""`` = all; an unknown name gives an empty dict)."""
        with self._lock:
            if name:
                region = self._regions.get(name)
                return {name: region.status()} if region is not None else {}
            return {n: r.status() for n, r in sorted(self._regions.items())}

    def close(self) -> None:
        """Detach every region (shutdown). Mappings go away now, or, where a caller still
        holds a view of one, as soon as that view is dropped; later registrations fail."""
        with self._lock:
            self._closed = True
            victims = list(self._regions.values())
            self._regions.clear()
        for region in victims:
            with region.lock:
                region.retired = True
                region.unmap()

    def same_ipc_namespace(self, name: str) -> bool:
        """See the module-level ``same_ipc_namespace``; no registry side effects."""
        return same_ipc_namespace(name)

    # -- data path ---------------------------------------------------------------------------

    def read_view(
        self, region: str, offset: int, byte_size: int
    ) -> tuple[memoryview, Callable[[], None]]:
        """A zero-copy view of ``[offset, offset+byte_size)`` of ``region`` and its lease.

        The view aliases the client's mapping (later client writes show through). The mapping
        stays attached, even across an unregister, until the returned callback runs; calling it
        more than once is harmless. Raises ``UnregisteredRegionError`` or ``InvalidArgument``.
        """
        r = self._lock_live(region)
        try:
            r.check_bounds(offset, byte_size)
            assert r.mm is not None
            start = r.base + offset
            view = memoryview(r.mm)[start : start + byte_size]
            r.leases += 1
        finally:
            r.lock.release()
        released = False

        def release() -> None:
            nonlocal released
            with r.lock:
                if released:
                    return
                released = True
                r.leases -= 1
                if r.retired and r.leases == 0:
                    r.unmap()

        return view, release

    def read(self, region: str, offset: int, byte_size: int) -> bytes:
        """A copy of ``[offset, offset+byte_size)`` of ``region``, taken under its lock."""
        r = self._lock_live(region)
        try:
            r.check_bounds(offset, byte_size)
            assert r.mm is not None
            start = r.base + offset
            return r.mm[start : start + byte_size]
        finally:
            r.lock.release()

    def write(self, region: str, offset: int, data: memoryview | bytes | np.ndarray) -> None:
        """Copy ``data`` (any dtype or shape; its C-order bytes) into ``region`` at ``offset``
        under the region's lock. More bytes than fit is ``InvalidArgument``; a region that is
        not (or no longer) registered is ``UnregisteredRegionError``."""
        src = _as_bytes(data)
        n = src.nbytes
        r = self._lock_live(region)
        try:
            if offset < 0 or n > r.byte_size or offset > r.byte_size - n:
                raise InvalidArgument(
                    f"shared memory region '{region}': writing {n} bytes at offset {offset} "
                    f"exceeds the region size ({r.byte_size})"
                )
            assert r.mm is not None
            start = r.base + offset
            r.mm[start : start + n] = src
        finally:
            r.lock.release()

    # -- internals ---------------------------------------------------------------------------

    def _lock_live(self, name: str) -> _Region:
        """The live region registered as ``name``, returned with its lock HELD.

        A region retired between the lookup and the lock (unregistered or replaced) is looked
        up again: a replacement is used, a plain unregister raises ``UnregisteredRegionError``.
        """
        for _ in range(8):
            with self._lock:
                r = self._regions.get(name)
            if r is None:
                break
            r.lock.acquire()
            if not r.retired:
                return r
            r.lock.release()
        raise UnregisteredRegionError(name)

    @staticmethod
    def _retire(region: _Region) -> None:
        with region.lock:
            region.retired = True
            if region.leases == 0:
                region.unmap()


__all__ = ["INT64_MAX", "RegionStatus", "ShmRegistry", "posix_name", "same_ipc_namespace"]

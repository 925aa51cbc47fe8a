"""The server's system shared-memory registry.

``ShmRegistry`` owns every client region this process has attached: it maps a client-chosen
region *name* to a window ``[offset, offset+byte_size)`` of an existing POSIX shared-memory object
*key*, copies inputs out of it for the codec (``read_view``), copies outputs into it (``write``)
and detaches regions on ``unregister``/``close``. It never creates or unlinks a client's object.
``same_ipc_namespace`` answers the client's "can you see my object?" probe. Every name and key
is validated (``core/memory/shm_names.py``) before any ``posix_ipc`` or OS call, and the registry's
``ClientShmPolicy`` decides what a client may do at all: with client shared memory off the RPCs
are UNAVAILABLE and the probe answers no; a reserved key (the server's own objects), another
name of a reserved object, or a key outside the allow-list is never registered, so the server
never writes outputs into, or reads inputs out of, memory it owns.

The registry keeps one file descriptor per region and never maps the object. All data moves
through that descriptor: ``os.preadv`` into a private buffer for inputs, ``os.fstat`` then
``os.pwrite`` for outputs. The object belongs to the client, who may ``ftruncate`` it at any
moment; a load or store through a mapping past the new end would kill the process with SIGBUS,
whereas the kernel answers a read past the end with a short count, and a write, which would
extend the file, is refused after the ``fstat``. So a shrunk region costs the one request an
error naming the region and the sizes (FAILED_PRECONDITION), never the worker. A shrink landing
between that ``fstat`` and the ``pwrite`` makes the ``pwrite`` grow the object back over the
window: the client's own object, never the worker's memory. The price is one more copy of each
input and a slower copy of each output (measured in docs/benchmarks/history.md, "Shared memory
hardening"). A side effect is that no decoded tensor, live or garbage, ever pins the client's
object: once the name is unregistered and the last copy in progress ends, the descriptor is closed.

Concurrency: one registry lock guards the name table; each region has its own lock guarding its
descriptor, its lease count and its ``retired`` flag. No code path holds both locks at once. A
lease covers one copy, and is taken and released inside the same synchronous call, so no
cancelled or abandoned request can hold one. An unregister removes the name at once (new
operations raise ``UnregisteredRegionError``) and closes the descriptor when the last lease ends,
so a copy running on another thread never sees its descriptor closed (or reused) underneath it.

Attachment goes through ``posix_ipc`` only, never ``multiprocessing.shared_memory``, whose
resource tracker would unlink the client's object when this process exits.
"""

from __future__ import annotations

import os
import resource
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import posix_ipc

from kserve_trio.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    UnregisteredRegionError,
)
from kserve_trio.core.logging import get_logger
from kserve_trio.core.memory.shm_names import (
    RESERVED_RULE,
    SHM_DIR,
    ClientShmPolicy,
    check_key,
    check_region_name,
    key_problem,
    region_name_problem,
    reserved_alias,
    shown,
)

log = get_logger("kserve_trio.core.memory.shm")

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
    registered. A name that is not a valid key answers ``False`` without any OS call (the RPC
    handler rejects it as INVALID_ARGUMENT before asking); so does any failure to open (no such
    object because we live in another IPC namespace, permissions).
    """
    if key_problem(name) is not None:
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


def default_max_regions() -> int:
    """A quarter of the process's open-file limit: each region holds one descriptor, and the
    rest must stay free for connections, model files and the runtime. (The worker passes the
    same share of its descriptor budget, ``serving.fd_budget``, which splits the rest.)"""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return 1 << 16
    return max(16, soft // 4)


class ShrunkRegionError(FailedPrecondition):
    """The client's object is now smaller than the window a request reads or writes."""


class _Region:
    """One attached window; ``fd``, ``leases`` and ``retired`` are guarded by ``lock``."""

    __slots__ = ("byte_size", "fd", "key", "leases", "lock", "name", "offset", "retired")

    def __init__(self, name: str, key: str, offset: int, byte_size: int, fd: int) -> None:
        self.name = name
        self.key = key
        self.offset = offset
        self.byte_size = byte_size
        self.fd = fd
        self.lock = threading.Lock()
        self.leases = 0
        self.retired = False

    def status(self) -> RegionStatus:
        return RegionStatus(self.name, self.key, self.offset, self.byte_size)

    def close_fd(self) -> None:
        """Close the descriptor (caller holds ``lock``, no lease outstanding)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError as exc:  # pragma: no cover - a closed fd here would be our bug
                log.warning("shm_close_failed", region=self.name, error=str(exc))

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

    def shrunk(self, what: str, start: int, n: int, size: int) -> ShrunkRegionError:
        """The error for an object found smaller than ``start + n`` bytes (its size ``size``)."""
        return ShrunkRegionError(
            f"shared memory region '{self.name}': object '{self.key}' is {size} bytes, smaller "
            f"than offset + byte_size = {start} + {n} needed to {what} (was it truncated after "
            "it was registered?)"
        )


def _attach(name: str, key: str, offset: int, byte_size: int, shm_dir: Path) -> _Region:
    """Open the existing object ``key`` read-write and keep its descriptor for the region,
    unless it is a reserved object under another name (``shm_names.reserved_alias``: the check
    is on the opened descriptor, so no rename after it changes what was checked)."""
    try:
        shm = posix_ipc.SharedMemory(posix_name(key))
    except posix_ipc.ExistentialError:
        raise InvalidArgument(f"shared memory object '{key}' does not exist") from None
    except Exception as exc:
        raise InvalidArgument(f"cannot open shared memory object '{key}': {exc}") from None
    fd = shm.fd  # ours from here on: posix_ipc does not close it when ``shm`` goes away
    try:
        st = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise InvalidArgument(f"cannot stat shared memory object '{key}': {exc}") from None
    if reserved_alias(st, shm_dir) is not None:
        os.close(fd)
        raise InvalidArgument(
            f"SystemSharedMemoryRegister: shared memory key {shown(key)} is another name (a hard "
            f"link) of a reserved object: {RESERVED_RULE}"
        )
    size = st.st_size
    if byte_size > size or offset > size - byte_size:
        os.close(fd)
        raise InvalidArgument(
            f"region '{name}' offset+byte_size exceeds shared memory object '{key}' size ({size})"
        )
    return _Region(name, key, offset, byte_size, fd)


def _as_bytes(data: memoryview | bytes | bytearray | np.ndarray) -> memoryview:
    """A flat ``'B'`` view of ``data`` (copying only when it is not C-contiguous)."""
    if isinstance(data, np.ndarray):
        arr = np.ascontiguousarray(data)
        return arr.reshape(-1).view(np.uint8).data
    mv = memoryview(data)
    if not mv.c_contiguous:
        mv = memoryview(mv.tobytes())
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


ALIGNMENT = 64
"""Byte alignment of the larger input copies: jax on the CPU uses a 64-byte aligned host array
in place and copies any other, so an aligned copy costs the request one copy, not two."""

ALIGN_FROM = 64 << 10
"""Copies below this size are not aligned: finding the address costs more than jax copying a
small array."""


def _aligned_empty(n: int) -> np.ndarray:
    """An uninitialised ``uint8`` array of ``n`` bytes, on an ``ALIGNMENT`` boundary from
    ``ALIGN_FROM`` bytes up."""
    if n < ALIGN_FROM:
        return np.empty(n, np.uint8)
    raw = np.empty(n + ALIGNMENT, np.uint8)
    skip = -raw.ctypes.data % ALIGNMENT
    return raw[skip : skip + n]


def _pread_into(r: _Region, dst: memoryview, start: int) -> None:
    """Fill ``dst`` from byte ``start`` of the object; a short read means it shrank."""
    done, n = 0, dst.nbytes
    while done < n:
        got = os.preadv(r.fd, [dst[done:]], start + done)
        if got == 0:
            raise r.shrunk("read", start, n, os.fstat(r.fd).st_size)
        done += got


def _pwrite_from(r: _Region, src: memoryview, start: int) -> None:
    """Write ``src`` at byte ``start``, refusing when the object no longer covers the window."""
    n = src.nbytes
    size = os.fstat(r.fd).st_size
    if size < start + n:
        raise r.shrunk("write", start, n, size)
    done = 0
    while done < n:
        done += os.pwrite(r.fd, src[done:], start + done)


class ShmRegistry:
    """Named windows of client POSIX shared-memory objects.

    Satisfies the codec's ``ShmRegistryLike`` protocol (``read_view``, ``write``). All methods
    are thread-safe: the event loop and worker threads call them concurrently.
    """

    def __init__(
        self,
        max_regions: int | None = None,
        policy: ClientShmPolicy | None = None,
        *,
        shm_dir: Path = SHM_DIR,
    ) -> None:
        self._lock = threading.Lock()
        self._regions: dict[str, _Region] = {}
        self._closed = False
        self.max_regions = default_max_regions() if max_regions is None else max_regions
        self.policy = policy if policy is not None else ClientShmPolicy()
        self.shm_dir = Path(shm_dir)

    # -- registration ------------------------------------------------------------------------

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Attach the existing object ``key`` read-write and register ``[offset,
        offset+byte_size)`` of it as ``name``.

        Rules (each failure is ``InvalidArgument``, so a bad region surfaces at register time):
        0. with client shared memory off, ``Unavailable`` naming the setting, before anything.
        1. ``name`` is a valid region name and ``key`` a valid key (``core/memory/shm_names.py``)
           that the policy allows (not reserved, within the allow-list);
           ``0 <= offset <= INT64_MAX``; ``0 < byte_size <= INT64_MAX``.
        2. ``key`` (with or without its leading ``/``) names an existing object, which is not
           a reserved object under another name.
        3. ``byte_size <= size`` and ``offset <= size - byte_size`` (subtraction form).
        4. A name already registered is replaced; the old descriptor is closed once no copy
           through it is in progress.
        5. A new name needs room under ``max_regions`` (each region holds a descriptor), else
           ``ResourceExhausted``.
        """
        rpc = "SystemSharedMemoryRegister"
        self.policy.check_enabled(rpc)
        check_region_name(name, rpc=rpc)
        check_key(key, rpc=rpc)
        self.policy.check_key(key, rpc=rpc)
        for field, value in (("offset", offset), ("byte_size", byte_size)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidArgument(
                    f"{rpc}: region '{name}' {field} is not an integer (malformed request)"
                )
        if offset < 0 or offset > INT64_MAX:
            raise InvalidArgument(f"region '{name}' offset {offset} is out of range [0, 2^63-1]")
        if byte_size <= 0 or byte_size > INT64_MAX:
            raise InvalidArgument(
                f"region '{name}' byte_size {byte_size} is out of range [1, 2^63-1]"
            )
        with self._lock:
            if self._closed:
                raise Unavailable("shared memory registry is closed (server is shutting down)")
            self._check_room(name)
        region = _attach(name, key, offset, byte_size, self.shm_dir)
        with self._lock:
            closed = self._closed
            full = not closed and name not in self._regions and self._full()
            old = None if closed or full else self._regions.get(name)
            if not (closed or full):
                self._regions[name] = region
        if closed or full:  # lost a race with close() or another register: detach it again
            self._retire(region)
            if full:
                raise self._room_error()
            raise Unavailable("shared memory registry is closed (server is shutting down)")
        if old is not None:
            self._retire(old)
        log.debug("shm_registered", region=name, key=key, offset=offset, byte_size=byte_size)

    def unregister(self, name: str = "") -> None:
        """Remove ``name`` (``""`` = every region). Unknown names are a successful no-op.

        The name disappears at once; each descriptor is closed when no copy through it is in
        progress any more. The client's object is never unlinked.
        """
        self.policy.check_enabled("SystemSharedMemoryUnregister")
        check_region_name(name, rpc="SystemSharedMemoryUnregister", allow_empty=True)
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
        self.policy.check_enabled("SystemSharedMemoryStatus")
        check_region_name(name, rpc="SystemSharedMemoryStatus", allow_empty=True)
        with self._lock:
            if name:
                region = self._regions.get(name)
                return {name: region.status()} if region is not None else {}
            return {n: r.status() for n, r in sorted(self._regions.items())}

    def close(self) -> None:
        """Detach every region (shutdown): descriptors close now, or when the copy in progress
        through them ends; later registrations fail."""
        with self._lock:
            self._closed = True
            victims = list(self._regions.values())
            self._regions.clear()
        for region in victims:
            self._retire(region)

    def same_ipc_namespace(self, name: str) -> bool:
        """The module-level ``same_ipc_namespace``, and no for a key the policy would not let
        a client register (client shared memory off, a reserved key, one outside the
        allow-list): the client then sends its tensors inline. No registry side effects."""
        return self.policy.may_register(name) and same_ipc_namespace(name)

    # -- data path ---------------------------------------------------------------------------

    def read_view(
        self, region: str, offset: int, byte_size: int
    ) -> tuple[memoryview, Callable[[], None]]:
        """A read-only private copy of ``[offset, offset+byte_size)`` of ``region``, and a
        release callback (the codec's lease protocol; here it has nothing left to release,
        because the region is only leased while the copy runs).

        Raises ``UnregisteredRegionError``, ``InvalidArgument`` (outside the registered window)
        or ``ShrunkRegionError`` (the client truncated the object below the window).
        """
        r = self._lease(region, offset, byte_size, reading=True)
        try:
            buf = _aligned_empty(byte_size)
            self._transfer(r, buf.data, offset, reading=True)
        finally:
            self._end_lease(r)
        return buf.data.toreadonly(), _released

    def read(self, region: str, offset: int, byte_size: int) -> bytes:
        """A copy of ``[offset, offset+byte_size)`` of ``region`` as ``bytes``."""
        r = self._lease(region, offset, byte_size, reading=True)
        try:
            buf = bytearray(byte_size)
            self._transfer(r, memoryview(buf), offset, reading=True)
        finally:
            self._end_lease(r)
        return bytes(buf)

    def write(self, region: str, offset: int, data: memoryview | bytes | np.ndarray) -> None:
        """Copy ``data`` (any dtype or shape; its C-order bytes) into ``region`` at ``offset``.
        More bytes than fit is ``InvalidArgument``; a region that is not (or no longer)
        registered is ``UnregisteredRegionError``; an object truncated below the window is
        ``ShrunkRegionError``."""
        src = _as_bytes(data)
        r = self._lease(region, offset, src.nbytes, reading=False)
        try:
            self._transfer(r, src, offset, reading=False)
        finally:
            self._end_lease(r)

    # -- internals ---------------------------------------------------------------------------

    def _full(self) -> bool:
        return len(self._regions) >= self.max_regions

    def _check_room(self, name: str) -> None:
        """A new name needs room under ``max_regions`` (caller holds the registry lock)."""
        if name not in self._regions and self._full():
            raise self._room_error()

    def _room_error(self) -> ResourceExhausted:
        return ResourceExhausted(
            f"SystemSharedMemoryRegister: the worker holds the most shared memory regions it "
            f"allows ({self.max_regions}, a quarter of its open-file limit, one descriptor "
            "each); unregister some first"
        )

    def _lease(self, name: str, offset: int, n: int, *, reading: bool) -> _Region:
        """The live region ``name`` with one more lease, once ``[offset, offset+n)`` is known
        to lie in its window (nothing is allocated for a window that does not)."""
        r = self._lock_live(name)
        try:
            if reading:
                r.check_bounds(offset, n)
            elif offset < 0 or n > r.byte_size or offset > r.byte_size - n:
                raise InvalidArgument(
                    f"shared memory region '{name}': writing {n} bytes at offset {offset} "
                    f"exceeds the region size ({r.byte_size})"
                )
            r.leases += 1
        finally:
            r.lock.release()
        return r

    @staticmethod
    def _end_lease(r: _Region) -> None:
        with r.lock:
            r.leases -= 1
            if r.retired and r.leases == 0:
                r.close_fd()

    @staticmethod
    def _transfer(r: _Region, buf: memoryview, offset: int, *, reading: bool) -> None:
        """Move ``buf.nbytes`` bytes between ``buf`` and the window at ``offset`` (leased)."""
        if not buf.nbytes:
            return
        try:
            if reading:
                _pread_into(r, buf, r.offset + offset)
            else:
                _pwrite_from(r, buf, r.offset + offset)
        except OSError as exc:
            raise FailedPrecondition(
                f"shared memory region '{r.name}': cannot {'read' if reading else 'write'} "
                f"object '{r.key}': {exc.strerror or exc}"
            ) from None

    def _lock_live(self, name: str) -> _Region:
        """The live region registered as ``name``, returned with its lock HELD.

        A region retired between the lookup and the lock (unregistered or replaced) is looked
        up again: a replacement is used, a plain unregister raises ``UnregisteredRegionError``.
        A name that could never have been registered (control characters, too long) is
        ``InvalidArgument`` instead, so the message never quotes it raw.
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
        problem = region_name_problem(name)
        if problem is not None:  # never registered: say why, without echoing it raw
            raise InvalidArgument(f"shared memory region name {shown(name)} {problem}")
        raise UnregisteredRegionError(name)

    @staticmethod
    def _retire(region: _Region) -> None:
        with region.lock:
            region.retired = True
            if region.leases == 0:
                region.close_fd()


def _released() -> None:
    """The release callback ``read_view`` hands out: the copy holds no lease."""


__all__ = [
    "INT64_MAX",
    "RegionStatus",
    "ShmRegistry",
    "ShrunkRegionError",
    "default_max_regions",
    "posix_name",
    "same_ipc_namespace",
]

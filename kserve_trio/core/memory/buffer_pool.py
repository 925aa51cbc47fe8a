"""Staging buffer pools: fixed-size slots over one backing buffer.

A ``BufferPool`` divides ``n_bytes`` into ``n_slots`` equal slots and lends runs of contiguous
slots (``PoolSlot``) to concurrent callers: the client stages request chunks in them (a
shared-memory backing is registered with the server, so tensors travel without a copy through
gRPC), and a meta model's ``call.scratch`` carves its typed scratch arrays from one.

The allocator is one state machine guarded by one ``threading.Lock`` and shared by two front
ends: ``acquire`` (async, anyio; asyncio and trio) and ``acquire_blocking`` (plain threads, e.g.
the device thread). Waiters of both kinds queue in one FIFO; see ``BufferPool.acquire`` for the
rules. Carving (``subslot``, ``scratch``) and viewing (``pool_view``) are plain functions over a
slot the caller owns.

Backings are pluggable: a heap buffer (region name ``""``) or a POSIX shared-memory object
created here (key ``/shm-<name>-<pid>-<16 hex>``, region name = key without ``/``) that
``close`` unlinks.
"""

from __future__ import annotations

import math
import mmap
import os
import secrets
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, overload

import anyio
import anyio.lowlevel
import numpy as np
import posix_ipc

from kserve_trio.core.errors import PoolAcquireTimeout
from kserve_trio.core.tensors import DType

DEFAULT_POOL_NAME = "kserve_trio_pool"

# --------------------------------------------------------------------------------------------
# Pure allocation logic


def first_fit(free: Sequence[bool], span: int) -> int | None:
    """The 0-based start of the first run of ``span`` consecutive free slots, or ``None``."""
    run = 0
    for i, is_free in enumerate(free):
        run = run + 1 if is_free else 0
        if run == span:
            return i - span + 1
    return None


def _np_dtype(dtype: Any) -> np.dtype:
    return dtype.numpy if isinstance(dtype, DType) else np.dtype(dtype)


def _shape(shape: int | Iterable[int]) -> tuple[int, ...]:
    dims = (int(shape),) if isinstance(shape, int | np.integer) else tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise ValueError(f"scratch shape {dims} has a negative dimension")
    return dims


def scratch_nbytes(specs: Iterable[tuple[Any, Any]]) -> int:
    """Bytes that always suffice to ``scratch`` buffers of these ``(shape, dtype)`` pairs in
    order from any cursor: their sizes plus the worst-case alignment padding of each."""
    total = 0
    for shape, dtype in specs:
        dt = _np_dtype(dtype)
        total += math.prod(_shape(shape)) * dt.itemsize + dt.itemsize - 1
    return total


# --------------------------------------------------------------------------------------------
# Backings


class _Backing(Protocol):
    buffer: Any  # a writable object exposing the buffer protocol, ``nbytes`` long
    key: str
    region_name: str

    def close(self) -> None: ...


class _HeapBacking:
    """A plain process-private buffer (the inline transport and the meta scratch pool)."""

    key = ""
    region_name = ""

    def __init__(self, nbytes: int) -> None:
        self.buffer: Any = np.zeros(nbytes, dtype=np.uint8)

    def close(self) -> None:
        """Nothing to release: live views keep the array alive, the pool refuses new ones."""


class _ShmBacking:
    """A POSIX shared-memory object this process creates, maps and finally unlinks."""

    def __init__(self, nbytes: int, name: str, mode: int) -> None:
        self.key = f"/shm-{name}-{os.getpid()}-{secrets.token_hex(8)}"
        self.region_name = self.key[1:]
        shm = posix_ipc.SharedMemory(self.key, flags=posix_ipc.O_CREX, mode=mode, size=nbytes)
        try:
            self.buffer: Any = mmap.mmap(shm.fd, nbytes)
        except BaseException:
            shm.unlink()
            raise
        finally:
            shm.close_fd()

    def close(self) -> None:
        """Unlink the object at once; unmap now, or when the last live view is dropped."""
        try:
            posix_ipc.unlink_shared_memory(self.key)
        except posix_ipc.ExistentialError:
            pass
        try:
            self.buffer.close()
        except BufferError:
            pass


# --------------------------------------------------------------------------------------------
# Slots and scratch descriptors


@dataclass(eq=False)
class PoolSlot:
    """A run of ``span`` slots lent by ``pool``: bytes ``[offset, offset+capacity)`` of its
    backing. ``index`` is the 1-based first slot (0 for a derived subslot, which is never
    released on its own); ``cursor`` is how much of it ``subslot``/``scratch`` have carved."""

    pool: BufferPool = field(repr=False)
    index: int
    offset: int
    capacity: int
    span: int
    cursor: int = 0

    @property
    def remaining(self) -> int:
        """Bytes not carved yet."""
        return self.capacity - self.cursor

    def view(self) -> memoryview:
        """The slot's bytes (zero copy)."""
        return self.pool.view(self.offset, self.capacity)

    def release(self) -> None:
        """Return the run to the pool (see ``BufferPool.release``)."""
        self.pool.release(self)


@dataclass(frozen=True)
class ScratchBuffer:
    """A typed buffer carved by ``scratch``: ``shape`` (row-major) elements of ``dtype`` at
    absolute byte ``offset`` of the pool's backing, which is also the offset within the shm
    region ``region`` (``""`` for a heap pool). ``pool_view`` turns it into an array."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    region: str
    pool: BufferPool = field(repr=False, compare=False)


def subslot(parent: PoolSlot, n: int) -> PoolSlot:
    """Carve ``n`` bytes at ``parent``'s cursor into a derived slot (index 0) and advance the
    cursor. Overrunning the parent is a ``ValueError`` and carves nothing."""
    if n < 0 or n > parent.capacity - parent.cursor:
        raise ValueError(
            f"subslot of {n} bytes overruns the slot (cursor {parent.cursor}, "
            f"capacity {parent.capacity})"
        )
    child = PoolSlot(parent.pool, 0, parent.offset + parent.cursor, n, 0, 0)
    parent.cursor += n
    return child


def _is_shape(value: Any) -> bool:
    """A row-major shape: a bare int or a sequence of ints (what tells the nameless
    ``scratch`` forms from the named ones)."""
    if isinstance(value, int | np.integer) and not isinstance(value, bool):
        return True
    return isinstance(value, tuple | list) and all(
        isinstance(d, int | np.integer) and not isinstance(d, bool) for d in value
    )


@overload
def scratch(slot: PoolSlot, spec: str, shape: Any, dtype: Any) -> ScratchBuffer: ...
@overload
def scratch(slot: PoolSlot, spec: Sequence[tuple[str, Any, Any]]) -> list[ScratchBuffer]: ...
@overload
def scratch(slot: PoolSlot, spec: int | Sequence[int], shape: Any) -> np.ndarray: ...
@overload
def scratch(slot: PoolSlot, spec: Sequence[tuple[Any, Any]]) -> list[np.ndarray]: ...


def scratch(
    slot: PoolSlot,
    spec: Any,
    shape: Any = None,
    dtype: Any = None,
) -> ScratchBuffer | list[ScratchBuffer] | np.ndarray | list[np.ndarray]:
    """Carve typed buffers from ``slot`` in one call.

    Named, for the tensors a request sends: ``scratch(slot, name, shape, dtype)`` returns one
    descriptor, ``scratch(slot, [(name, shape, dtype), ...])`` a list (``pool_view`` turns them
    into arrays). Nameless, for buffers that are only written and read here (a meta model's
    scratch, a staging area): ``scratch(slot, shape, dtype)`` returns the writable array itself,
    ``scratch(slot, [(shape, dtype), ...])`` a list of arrays. Rules:
    1. Buffers are carved in order from the slot's cursor; each starts at the next absolute
       offset aligned to its dtype's itemsize, so the ranges are disjoint and contiguous up to
       that padding.
    2. ``shape`` is a row-major numpy shape or a bare int; ``dtype`` a numpy dtype-like or a
       ``DType``. A first argument that is a shape (an int or a sequence of ints) is the
       nameless form.
    3. If any buffer would overrun the slot, ``ValueError`` is raised and nothing is carved.
    """
    if _is_shape(spec):
        if shape is None:
            raise TypeError("scratch(slot, shape, dtype) needs a dtype")
        return pool_view(scratch(slot, "", spec, shape))
    if isinstance(spec, str):
        if shape is None or dtype is None:
            raise TypeError("scratch(slot, name, shape, dtype) needs a shape and a dtype")
        specs: list[tuple[str, Any, Any]] = [(spec, shape, dtype)]
    else:
        items = list(spec)
        if items and all(isinstance(it, tuple | list) and len(it) == 2 for it in items):
            views = pool_view(*scratch(slot, [("", dims, dt) for dims, dt in items]))
            return [views] if isinstance(views, np.ndarray) else list(views)
        specs = items
    region = slot.pool.region_name
    cursor = slot.cursor
    carved: list[ScratchBuffer] = []
    for name, dims, dt_like in specs:
        dt = _np_dtype(dt_like)
        shp = _shape(dims)
        nbytes = math.prod(shp) * dt.itemsize
        start = cursor + (-(slot.offset + cursor)) % dt.itemsize
        if nbytes > slot.capacity - start:
            label = f"'{name}' " if name else ""
            raise ValueError(
                f"scratch buffer {label}({nbytes} bytes of {dt.name} {shp}) overruns the "
                f"slot: {max(0, slot.capacity - start)} of {slot.capacity} bytes left"
            )
        carved.append(ScratchBuffer(name, dt, shp, slot.offset + start, nbytes, region, slot.pool))
        cursor = start + nbytes
    slot.cursor = cursor
    return carved[0] if isinstance(spec, str) else carved


@overload
def pool_view(desc: ScratchBuffer, /) -> np.ndarray: ...
@overload
def pool_view(slot: PoolSlot, shape: Any, dtype: Any, /) -> np.ndarray: ...
@overload
def pool_view(*descs: ScratchBuffer) -> np.ndarray | tuple[np.ndarray, ...]: ...


def pool_view(*args: Any) -> np.ndarray | tuple[np.ndarray, ...]:
    """Writable zero-copy arrays over pool memory.

    ``pool_view(desc, ...)``: one array per scratch descriptor (one array for one, else a tuple
    in argument order: ``feats, mask = pool_view(*scratch(slot, [...]))``).
    ``pool_view(slot, shape, dtype)``: the array of ``shape`` and ``dtype`` at the start of a
    slot, typically one ``subslot`` carved by hand (the lower-level path; the array must fit).
    """
    if args and isinstance(args[0], PoolSlot):
        if len(args) != 3:
            raise TypeError("pool_view(slot, shape, dtype) takes a slot, a shape and a dtype")
        slot, dims, dt_like = args
        dt, shp = _np_dtype(dt_like), _shape(dims)
        nbytes = math.prod(shp) * dt.itemsize
        if nbytes > slot.capacity:
            raise ValueError(
                f"pool_view of {nbytes} bytes ({dt.name} {shp}) overruns the slot of "
                f"{slot.capacity} bytes"
            )
        return slot.pool.array(slot.offset, dt, shp)
    arrays = tuple(d.pool.array(d.offset, d.dtype, d.shape) for d in args)
    return arrays[0] if len(arrays) == 1 else arrays


def pool_offset(pool: BufferPool, arr: np.ndarray) -> int | None:
    """The byte offset of ``arr`` in ``pool``'s backing when it is a C-contiguous view of it,
    else ``None`` (a client then sends the array inline instead of by reference)."""
    if not arr.flags.c_contiguous or arr.nbytes == 0 or pool.closed:
        return None
    base = np.frombuffer(pool.view(0, pool.nbytes), dtype=np.uint8).ctypes.data
    start = arr.ctypes.data - base
    if 0 <= start and start + arr.nbytes <= pool.nbytes:
        return start
    return None


# --------------------------------------------------------------------------------------------
# Waiters


class _AsyncWaiter:
    """A task parked in ``acquire``: woken through its event, from any thread."""

    __slots__ = ("event", "span", "thread", "token")

    def __init__(self, span: int) -> None:
        self.span = span
        self.event = anyio.Event()
        self.token = anyio.lowlevel.current_token()
        self.thread = threading.get_ident()

    def wake(self) -> None:
        """Set the current event; from a foreign thread, schedule that on the waiter's loop
        (never blocks, so it is safe under the pool lock)."""
        if threading.get_ident() == self.thread:
            self.event.set()
            return
        try:
            self.token.backend_class.run_sync_soon(self.event.set, (), self.token.native_token)
        except anyio.RunFinishedError:
            pass  # its loop is gone; the waiter was or will be dequeued by its own cleanup


class _ThreadWaiter:
    """A thread parked in ``acquire_blocking`` on a condition bound to the pool lock."""

    __slots__ = ("cond", "span")

    def __init__(self, span: int, lock: threading.Lock) -> None:
        self.span = span
        self.cond = threading.Condition(lock)

    def wake(self) -> None:
        self.cond.notify()  # caller holds the pool lock


# --------------------------------------------------------------------------------------------
# The pool


class BufferPool:
    """``n_slots`` equal slots over one backing buffer, lent as contiguous runs.

    ``BufferPool(n_bytes, n_slots=8, use_shm=False, name=...)``: ``slot_bytes = n_bytes //
    n_slots`` (must be > 0), usable bytes ``slot_bytes * n_slots``. With ``use_shm`` the
    backing is a fresh POSIX object (``key``, ``region_name``) other processes can map.

    The backing defaults to the heap: a POSIX object is a system resource that outlives a
    process killed before ``close`` and needs a server in the same IPC namespace to be of any
    use, so a pool is shared only when asked. The client's drivers ask for it themselves when
    the server confirms it shares the namespace (``kserve_init``'s pools); a meta model's
    scratch pool is never shared.
    """

    def __init__(
        self,
        n_bytes: int,
        n_slots: int = 8,
        use_shm: bool = False,
        name: str = DEFAULT_POOL_NAME,
        *,
        shm_mode: int = 0o600,
    ) -> None:
        if n_slots < 1:
            raise ValueError(f"buffer pool needs at least one slot, got n_slots={n_slots}")
        if n_bytes // n_slots <= 0:
            raise ValueError(
                f"buffer pool of {n_bytes} bytes cannot be split into {n_slots} slots "
                "(slot_bytes would be 0)"
            )
        if use_shm and (not name or "/" in name):
            raise ValueError(f"shm buffer pool name {name!r} must be non-empty without '/'")
        self.name = name
        self.n_slots = n_slots
        self.slot_bytes = n_bytes // n_slots
        self.nbytes = self.slot_bytes * n_slots
        self.use_shm = use_shm
        backing: _Backing = (
            _ShmBacking(self.nbytes, name, shm_mode) if use_shm else _HeapBacking(self.nbytes)
        )
        self._backing = backing
        # unlinks a forgotten shm pool's object when the pool is collected or at exit
        self._finalizer = weakref.finalize(self, backing.close)
        self._lock = threading.Lock()
        self._free = [True] * n_slots
        self._live: dict[int, PoolSlot] = {}
        self._waiters: deque[_AsyncWaiter | _ThreadWaiter] = deque()
        self._closed = False

    # -- identity and views ------------------------------------------------------------------

    @property
    def key(self) -> str:
        """The POSIX object key (``/shm-...``), ``""`` for a heap pool."""
        return self._backing.key

    @property
    def region_name(self) -> str:
        """The name to register the pool under with a server (key without ``/``; ``""``)."""
        return self._backing.region_name

    @property
    def closed(self) -> bool:
        return self._closed

    def free_slots(self) -> int:
        """How many slots are free right now (a snapshot)."""
        with self._lock:
            return sum(self._free)

    def waiting(self) -> int:
        """How many callers are queued for slots right now (a snapshot)."""
        with self._lock:
            return len(self._waiters)

    def view(self, offset: int, nbytes: int) -> memoryview:
        """Bytes ``[offset, offset+nbytes)`` of the backing (zero copy, writable)."""
        self._check_range(offset, nbytes)
        return memoryview(self._backing.buffer)[offset : offset + nbytes]

    def array(self, offset: int, dtype: Any, shape: int | Iterable[int]) -> np.ndarray:
        """A writable row-major array of ``shape`` ``dtype`` elements at byte ``offset``."""
        dt = _np_dtype(dtype)
        shp = _shape(shape)
        count = math.prod(shp)
        self._check_range(offset, count * dt.itemsize)
        if count == 0:
            return np.empty(shp, dtype=dt)
        arr = np.frombuffer(self._backing.buffer, dtype=dt, count=count, offset=offset)
        return arr.reshape(shp)

    def _check_range(self, offset: int, nbytes: int) -> None:
        if self._closed:
            raise RuntimeError(f"buffer pool '{self.name}' is closed")
        if offset < 0 or nbytes < 0 or nbytes > self.nbytes or offset > self.nbytes - nbytes:
            raise ValueError(
                f"range [{offset}, {offset}+{nbytes}) is outside buffer pool '{self.name}' "
                f"({self.nbytes} bytes)"
            )

    # -- allocation --------------------------------------------------------------------------

    def _check_span(self, span: int) -> None:
        if span < 1 or span > self.n_slots:
            raise ValueError(
                f"span {span} is outside [1, {self.n_slots}] for buffer pool '{self.name}' "
                f"({self.n_slots} slots): it could never be satisfied"
            )

    def _take(self, waiter: _AsyncWaiter | _ThreadWaiter | None, span: int) -> PoolSlot | None:
        """Allocate for ``waiter`` if it may (lock held).

        1. A closed pool raises ``RuntimeError``.
        2. Only the head of the FIFO may allocate; a caller that is not queued (``None``) may
           only when nobody is queued, so no one ever jumps the line.
        3. It takes the first-fit run of ``span`` free slots and leaves the queue; with no such
           run it keeps its place and nothing changes.
        """
        if self._closed:
            raise RuntimeError(f"buffer pool '{self.name}' is closed")
        head = self._waiters[0] if self._waiters else None
        if head is not waiter:
            return None
        start = first_fit(self._free, span)
        if start is None:
            return None
        for i in range(start, start + span):
            self._free[i] = False
        slot = PoolSlot(self, start + 1, start * self.slot_bytes, span * self.slot_bytes, span)
        self._live[slot.index] = slot
        if waiter is not None:
            self._waiters.popleft()
        return slot

    def _wake_head(self) -> None:
        """Wake the head of the queue, which may now be able to allocate (lock held)."""
        if self._waiters:
            self._waiters[0].wake()

    def _leave(self, waiter: _AsyncWaiter | _ThreadWaiter) -> None:
        """Dequeue a waiter that gave up (timeout, cancellation, error; lock held)."""
        if self._waiters and self._waiters[0] is waiter:
            self._waiters.popleft()
            self._wake_head()
        else:
            try:
                self._waiters.remove(waiter)
            except ValueError:
                pass

    def acquire_nowait(self, span: int = 1) -> PoolSlot | None:
        """A run of ``span`` slots if one is free and nobody is queued, else ``None``."""
        self._check_span(span)
        with self._lock:
            return self._take(None, span)

    async def acquire(self, span: int = 1, *, deadline_ns: int = 0) -> PoolSlot:
        """Wait for ``span`` contiguous free slots and lend them as one ``PoolSlot``.

        1. ``span`` outside ``[1, n_slots]`` raises ``ValueError`` at once (it could never be
           satisfied).
        2. Strict FIFO: callers queue in arrival order and only the head may allocate (the
           first-fit run of ``span`` free slots); the rest wait even if their smaller span
           would fit. This head-of-line blocking is deliberate: a large span is never starved
           by a stream of small ones.
        3. ``deadline_ns`` is an absolute ``time.monotonic_ns()`` (0 = no deadline). A waiter
           that has not allocated by then raises ``PoolAcquireTimeout(span, waited_ns)``.
        4. Every exit (success, timeout, cancellation) leaves the queue and wakes the next head.
        """
        self._check_span(span)
        await anyio.lowlevel.checkpoint_if_cancelled()
        started = time.monotonic_ns()
        with self._lock:
            slot = self._take(None, span)
            if slot is not None:
                return slot
            waiter = _AsyncWaiter(span)
            self._waiters.append(waiter)
        try:
            while True:
                with self._lock:
                    slot = self._take(waiter, span)
                    if slot is not None:
                        self._wake_head()
                        return slot
                    waiter.event = event = anyio.Event()
                if not deadline_ns:
                    await event.wait()
                    continue
                remaining = deadline_ns - time.monotonic_ns()
                if remaining <= 0:
                    raise PoolAcquireTimeout(span, time.monotonic_ns() - started)
                with anyio.move_on_after(remaining / 1e9):
                    await event.wait()
        finally:
            with self._lock:
                self._leave(waiter)

    def acquire_blocking(self, span: int = 1, deadline_ns: int = 0) -> PoolSlot:
        """``acquire`` for plain threads (the device thread, meta scratch): same queue, same
        rules, parked on a ``threading.Condition``. Never call it on an event loop thread."""
        self._check_span(span)
        started = time.monotonic_ns()
        with self._lock:
            slot = self._take(None, span)
            if slot is not None:
                return slot
            waiter = _ThreadWaiter(span, self._lock)
            self._waiters.append(waiter)
            try:
                while True:
                    slot = self._take(waiter, span)
                    if slot is not None:
                        self._wake_head()
                        return slot
                    if not deadline_ns:
                        waiter.cond.wait()
                        continue
                    remaining = deadline_ns - time.monotonic_ns()
                    if remaining <= 0:
                        raise PoolAcquireTimeout(span, time.monotonic_ns() - started)
                    waiter.cond.wait(remaining / 1e9)
            finally:
                self._leave(waiter)

    def release(self, slot: PoolSlot) -> None:
        """Free every slot of ``slot``'s run and wake the queue's head.

        Releasing a derived subslot (index 0) is a no-op. Releasing a run twice raises
        ``RuntimeError`` (also when its slots were lent again meanwhile: the check is by
        identity, so a stale handle can never free someone else's slots).
        """
        if slot.index == 0:
            return
        if slot.pool is not self:
            raise ValueError(f"slot {slot.index} does not belong to buffer pool '{self.name}'")
        with self._lock:
            if self._live.get(slot.index) is not slot:
                raise RuntimeError(
                    f"double release of buffer pool '{self.name}' slot {slot.index} "
                    f"(span {slot.span})"
                )
            del self._live[slot.index]
            for i in range(slot.index - 1, slot.index - 1 + slot.span):
                self._free[i] = True
            self._wake_head()

    def close(self) -> None:
        """Refuse further use, fail every waiter with ``RuntimeError`` and release the backing
        (a shm pool's object is unlinked). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for waiter in self._waiters:
                waiter.wake()
        self._finalizer()

    def __enter__(self) -> BufferPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = f"shm {self.key}" if self.use_shm else "heap"
        return (
            f"BufferPool({self.name!r}, {self.n_slots} x {self.slot_bytes} bytes, {kind}"
            f"{', closed' if self._closed else ''})"
        )


def release(slot: PoolSlot) -> None:
    """Return ``slot`` to its pool."""
    slot.pool.release(slot)


__all__ = [
    "DEFAULT_POOL_NAME",
    "BufferPool",
    "PoolSlot",
    "ScratchBuffer",
    "first_fit",
    "pool_offset",
    "pool_view",
    "release",
    "scratch",
    "scratch_nbytes",
    "subslot",
]

"""Host-RAM homes for a model's materialised weights: private arrays or node-shared regions.

The weight cache (``runtime/weight_cache.py``) keeps a model's *host tier* -- its weights copied
out of ``weights.safetensors`` into RAM once -- in a ``WeightStore``:

* ``PrivateWeightStore`` (the default) gives each worker its own numpy arrays;
* ``SharedWeightStore`` (``runtime.shared_host_weights: true``) backs them with one POSIX
  shared-memory region per model and weights-file version, so the workers of a node hold one
  copy: the first worker materialises it, the others attach zero-copy.

This module owns the region format and the coordination protocol, with no jax:

* ``weights_digest`` / ``weights_file_token`` -- a 64-bit FNV-1a over the model name, the weight
  layout and a content token (size and mtime of the weights file), so a weights-only update gets
  a new region and nobody is ever handed the previous version's bytes;
* region ``/kst-w-<sanitised model>-<16 hex digits of the digest>``, lock file
  ``/dev/shm/kst-w-<...>.lock`` beside it, both created with ``shared_host_weights_mode``; both
  names are reserved (``shm_names.reserved_name``), so no client can register either and have a
  worker write its outputs over the weights every worker of the node serves;
* every process maps a finished region read-only, its creator too once it has filled it, so a
  stray write faults in the process that makes it instead of changing what every reader serves;
* layout: a 64-byte header ``{u32 magic, u32 ready, u64 digest}``, then each tensor at a
  64-byte-aligned offset, in weight order.

Locking (``flock`` on the lock file; a crashed holder's locks vanish with it): every holder of a
region keeps a shared lock for as long as it is attached. See ``SharedWeightStore.materialize``
for the acquire rules and ``SharedWeightStore.release`` for the last-holder unlink.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import mmap
import os
import re
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import posix_ipc

from kserve_trio.core.logging import get_logger
from kserve_trio.core.memory import SHM_DIR, reserved_name

log = get_logger("kserve_trio.runtime.weight_store")

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1

DIGEST_FORMAT = "kstw1"
"""Format tag folded into every digest; bump it when the region layout changes."""

REGION_PREFIX = reserved_name("w-")
MAGIC = 0x4B535731  # "KSW1"
HEADER_BYTES = 64
ALIGN = 64
_HEADER = struct.Struct("<IIQ")  # magic, ready, digest
RETRY_SLEEP_SECONDS = 0.005

Spec = tuple[Any, Sequence[int]]
"""One tensor of a layout: ``(dtype, shape)``; the dtype is anything ``np.dtype`` accepts or a
``core.tensors.dtypes.DType``."""

Fill = Callable[[list[np.ndarray]], None]
"""Writes the weights into the (writable) arrays it is given, in weight order."""


# ----------------------------------------------------------------------------------------------
# Pure naming and layout
# ----------------------------------------------------------------------------------------------


def fnv1a64(data: bytes) -> int:
    """64-bit FNV-1a of ``data``."""
    h = FNV_OFFSET
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & _MASK64
    return h


def _np_dtype(dtype: Any) -> np.dtype:
    return np.dtype(getattr(dtype, "numpy", dtype))


def weights_file_token(path: str | os.PathLike[str] | None) -> int:
    """Identity of a weights file's on-disk version: FNV-1a of ``"<size>:<mtime_ns>"``.

    Cheap (a ``stat``, no content read, so attaching stays zero-read) and the same in every
    worker of the node. 0 for an empty or missing path, which gives the layout-only digest.
    """
    if not path:
        return 0
    try:
        st = os.stat(path)
    except OSError:
        return 0
    return fnv1a64(f"{st.st_size}:{st.st_mtime_ns}".encode())


def weights_digest(key: str, specs: Sequence[Spec], *, content: int = 0) -> int:
    """Digest over a model's name, weight layout and weights-file version.

    The string hashed is ``"kstw1|<key>|c<content as 16 hex>"`` followed, per tensor, by
    ``"|<numpy dtype name>:<itemsize>:<row-major dims comma-joined>"``. Two workers computing it
    for the same model and file agree on the region; a weights-only update (same layout, new
    file) changes ``content`` and therefore the region, so stale bytes are never attached.
    """
    parts = [f"{DIGEST_FORMAT}|{key}|c{content & _MASK64:016x}"]
    for dtype, shape in specs:
        dt = _np_dtype(dtype)
        parts.append(f"|{dt.name}:{dt.itemsize}:{','.join(str(int(d)) for d in shape)}")
    return fnv1a64("".join(parts).encode())


def sanitize_model_name(name: str) -> str:
    """The model name as it appears in a region name: ``[^A-Za-z0-9_]`` become ``_``."""
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def region_name(model: str, digest: int) -> str:
    """``/kst-w-<sanitised model>-<16 hex digits>``, the POSIX shared-memory name."""
    return f"/{REGION_PREFIX}{sanitize_model_name(model)}-{digest & _MASK64:016x}"


def lock_path(region: str, shm_dir: Path = SHM_DIR) -> Path:
    """The lock file beside a region: ``/dev/shm/<region without '/'>.lock``."""
    return shm_dir / f"{region.lstrip('/')}.lock"


def tensor_nbytes(spec: Spec) -> int:
    dtype, shape = spec
    return int(np.prod(tuple(shape), dtype=np.int64)) * _np_dtype(dtype).itemsize


def region_layout(specs: Sequence[Spec]) -> tuple[tuple[int, ...], int]:
    """``(offsets, total bytes)``: tensors from byte 64, each at a 64-byte-aligned offset."""
    offsets: list[int] = []
    pos = HEADER_BYTES
    for spec in specs:
        pos = -(-pos // ALIGN) * ALIGN
        offsets.append(pos)
        pos += tensor_nbytes(spec)
    return tuple(offsets), max(pos, HEADER_BYTES)


def _views(buf: Any, specs: Sequence[Spec], offsets: Sequence[int]) -> list[np.ndarray]:
    out = []
    for (dtype, shape), off in zip(specs, offsets, strict=True):
        dt = _np_dtype(dtype)
        count = int(np.prod(tuple(shape), dtype=np.int64))
        out.append(np.frombuffer(buf, dtype=dt, count=count, offset=off).reshape(tuple(shape)))
    return out


def _read_only(arrays: list[np.ndarray]) -> list[np.ndarray]:
    for a in arrays:
        a.flags.writeable = False
    return arrays


# ----------------------------------------------------------------------------------------------
# The stores
# ----------------------------------------------------------------------------------------------


class WeightStore(Protocol):
    """Where a model's host weights live; keys are model names (the cache's bookkeeping)."""

    shared: bool

    def materialize(
        self, key: str, digest: int, specs: Sequence[Spec], fill: Fill
    ) -> list[np.ndarray]: ...

    def release(self, key: str) -> None: ...

    def rename(self, old: str, new: str) -> None: ...

    def holds(self, key: str) -> bool: ...

    def close(self) -> None: ...


class PrivateWeightStore:
    """Each worker materialises its own host copy: fresh arrays, filled once, read-only."""

    shared = False

    def __init__(self) -> None:
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def materialize(
        self, key: str, digest: int, specs: Sequence[Spec], fill: Fill
    ) -> list[np.ndarray]:
        """Allocate the arrays, ``fill`` them and hand them over (the caller keeps them)."""
        arrays = [np.empty(tuple(shape), dtype=_np_dtype(dt)) for dt, shape in specs]
        fill(arrays)
        nbytes = sum(a.nbytes for a in arrays)
        with self._lock:
            self._held[key] = nbytes
        log.debug("host_weights_materialized", model=key, region=None, bytes=nbytes)
        return _read_only(arrays)

    def release(self, key: str) -> None:
        """Forget ``key``; the memory goes with the caller's last reference."""
        with self._lock:
            self._held.pop(key, None)

    def rename(self, old: str, new: str) -> None:
        with self._lock:
            if old in self._held:
                self._held[new] = self._held.pop(old)

    def holds(self, key: str) -> bool:
        with self._lock:
            return key in self._held

    def close(self) -> None:
        with self._lock:
            self._held.clear()


@dataclass(eq=False)
class _Attachment:
    """One region this process is attached to; ``fd`` is the lock file, held LOCK_SH."""

    region: str
    lock: Path
    fd: int
    mm: mmap.mmap
    digest: int
    nbytes: int
    created: bool


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``fd`` is still the file at ``path`` (a last holder may have unlinked it)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _unlink_region(region: str) -> None:
    with contextlib.suppress(posix_ipc.ExistentialError):
        posix_ipc.unlink_shared_memory(region)


def _close_mapping(mm: mmap.mmap) -> None:
    """Unmap now if no view is alive; otherwise the mapping goes with the last view."""
    try:
        mm.close()
    except BufferError:
        gc.collect()
        try:
            mm.close()
        except BufferError:
            log.debug("host_weights_unmap_deferred", reason="views still alive")


class SharedWeightStore:
    """Host weights in node-shared POSIX shared memory, one region per (model, digest).

    ``mode`` sets the permission bits of the regions and lock files (``0o660`` is the advice
    for multi-user machines; the default ``0o666`` lets workers of different UIDs share).
    """

    shared = True

    def __init__(self, mode: int = 0o666, *, shm_dir: Path = SHM_DIR) -> None:
        self.mode = int(mode)
        self.shm_dir = Path(shm_dir)
        self._attached: dict[str, _Attachment] = {}
        self._lock = threading.Lock()

    # -- public surface --------------------------------------------------------------------

    def materialize(
        self, key: str, digest: int, specs: Sequence[Spec], fill: Fill
    ) -> list[np.ndarray]:
        """Attach to (or create) the region of ``(key, digest)`` and return read-only views.

        Rules (``flock`` on the lock file beside the region):

        1. open the lock file (creating it with ``mode``) and take ``LOCK_SH``; if the file at
           the path is no longer the one locked (a last holder unlinked it), start over;
        2. if the region exists, is at least the layout's size and its header says
           magic / ready=1 / this digest: map it read-only and keep ``LOCK_SH`` while attached
           (``host_weights_attached``);
        3. otherwise drop the lock and try ``LOCK_EX|LOCK_NB``; when another worker holds the
           lock, sleep 5 ms and go back to 1 (its ``LOCK_SH`` waits while a creator fills);
        4. with ``LOCK_EX``: check again (another creator may just have finished); else unlink
           any unfinished remnant, create the region with ``mode``, write the header with
           ready=0, ``fill`` the tensors, ``msync``, set ready=1, ``msync``, map it again
           read-only as in 2 and unmap the writable mapping (``host_weights_materialized``),
           then downgrade to ``LOCK_SH``;
        5. afterwards sweep this model's other versions: each ``kst-w-<model>-<hex>`` whose
           lock can be taken ``LOCK_EX|LOCK_NB`` (nobody attached) is unlinked with its lock.

        ``key`` (the model name) is this process's bookkeeping key; materialising a key that is
        already attached to the same digest returns fresh views of the same mapping, and one
        attached to another digest is released first.
        """
        offsets, total = region_layout(specs)
        with self._lock:
            held = self._attached.get(key)
            if held is not None and held.digest == digest and held.nbytes == total:
                return _read_only(_views(held.mm, specs, offsets))
        if held is not None:
            self.release(key)
        region = region_name(key, digest)
        att = self._acquire(region, digest, total, offsets, specs, fill)
        arrays = _read_only(_views(att.mm, specs, offsets))
        with self._lock:
            self._attached[key] = att
        log.info(
            "host_weights_materialized" if att.created else "host_weights_attached",
            model=key,
            region=region,
            bytes=att.nbytes,
        )
        self._sweep(key, digest)
        return arrays

    def release(self, key: str) -> None:
        """Detach ``key``'s region; the last holder on the node unlinks it and its lock file.

        Rules: unmap (the caller has dropped its views; a surviving view defers the unmap to
        its own collection), then try ``LOCK_EX|LOCK_NB``: success means no other process is
        attached, so the region and the lock file are unlinked before the lock is dropped
        (anyone who locked the old lock file meanwhile sees it is gone and starts over).
        A no-op for a key that is not attached.
        """
        with self._lock:
            att = self._attached.pop(key, None)
        if att is None:
            return
        _close_mapping(att.mm)
        last = False
        try:
            fcntl.flock(att.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            last = _same_file(att.fd, att.lock)
        except BlockingIOError:
            pass
        try:
            if last:
                _unlink_region(att.region)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(att.lock)
        finally:
            os.close(att.fd)
        log.debug("host_weights_released", model=key, region=att.region, unlinked=last)

    def rename(self, old: str, new: str) -> None:
        """Rekey an attachment (a model rename); the region keeps its content-addressed name."""
        with self._lock:
            if old in self._attached and new not in self._attached:
                self._attached[new] = self._attached.pop(old)

    def holds(self, key: str) -> bool:
        with self._lock:
            return key in self._attached

    def region_of(self, key: str) -> str | None:
        """The region ``key`` is attached to (None when it is not)."""
        with self._lock:
            att = self._attached.get(key)
            return att.region if att is not None else None

    def close(self) -> None:
        """Release every attachment (what a worker does at shutdown)."""
        with self._lock:
            keys = list(self._attached)
        for key in keys:
            self.release(key)

    # -- the protocol ----------------------------------------------------------------------

    def _open_lock(self, path: Path) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, self.mode)
        with contextlib.suppress(OSError):  # not the owner: the creator already set it
            os.fchmod(fd, self.mode)
        return fd

    def _acquire(
        self,
        region: str,
        digest: int,
        total: int,
        offsets: Sequence[int],
        specs: Sequence[Spec],
        fill: Fill,
    ) -> _Attachment:
        lock = lock_path(region, self.shm_dir)
        while True:
            fd = self._open_lock(lock)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                if not _same_file(fd, lock):
                    os.close(fd)
                    continue
                mm = _try_attach(region, total, digest)
                if mm is not None:
                    return _Attachment(region, lock, fd, mm, digest, total, created=False)
                fcntl.flock(fd, fcntl.LOCK_UN)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    time.sleep(RETRY_SLEEP_SECONDS)
                    continue
                if not _same_file(fd, lock):
                    os.close(fd)
                    continue
                mm = _try_attach(region, total, digest)
                created = mm is None
                if mm is None:
                    try:
                        mm = self._create(region, digest, total, offsets, specs, fill)
                    except BaseException:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(lock)  # we hold LOCK_EX: nobody else is attached
                        raise
                fcntl.flock(fd, fcntl.LOCK_SH)
                return _Attachment(region, lock, fd, mm, digest, total, created=created)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise

    def _create(
        self,
        region: str,
        digest: int,
        total: int,
        offsets: Sequence[int],
        specs: Sequence[Spec],
        fill: Fill,
    ) -> mmap.mmap:
        _unlink_region(region)  # an unfinished remnant of a crashed creator
        shm = posix_ipc.SharedMemory(region, posix_ipc.O_CREX, mode=self.mode, size=total)
        try:
            with contextlib.suppress(OSError):
                os.fchmod(shm.fd, self.mode)
            mm = mmap.mmap(shm.fd, total)
        finally:
            shm.close_fd()
        try:
            _HEADER.pack_into(mm, 0, MAGIC, 0, digest)
            mm.flush()
            arrays = _views(mm, specs, offsets)
            fill(arrays)
            del arrays
            mm.flush()
            _HEADER.pack_into(mm, 0, MAGIC, 1, digest)
            mm.flush()
            readonly = _try_attach(region, total, digest)
            if readonly is None:  # pragma: no cover - we hold LOCK_EX: nobody else touched it
                raise RuntimeError(f"host weight region {region} is not readable after filling")
        except BaseException:
            _close_mapping(mm)
            _unlink_region(region)
            raise
        _close_mapping(mm)
        return readonly

    def _sweep(self, key: str, keep: int) -> None:
        """Unlink this model's other versions that no process is attached to."""
        pattern = re.compile(
            rf"^{re.escape(REGION_PREFIX + sanitize_model_name(key))}-([0-9a-f]{{16}})(\.lock)?$"
        )
        try:
            names = os.listdir(self.shm_dir)
        except OSError:
            return
        versions = {m.group(1) for n in names if (m := pattern.match(n))}
        versions.discard(f"{keep & _MASK64:016x}")
        for hexd in sorted(versions):
            region = f"/{REGION_PREFIX}{sanitize_model_name(key)}-{hexd}"
            lock = lock_path(region, self.shm_dir)
            try:
                fd = self._open_lock(lock)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if _same_file(fd, lock):
                    _unlink_region(region)
                    os.unlink(lock)
                    log.info("host_weights_stale_removed", model=key, region=region)
            except (BlockingIOError, FileNotFoundError):
                pass
            finally:
                os.close(fd)


def _try_attach(region: str, total: int, digest: int) -> mmap.mmap | None:
    """Map ``region`` read-only if it is complete (size, magic, ready, digest); else None."""
    try:
        shm = posix_ipc.SharedMemory(region, read_only=True)
    except posix_ipc.ExistentialError:
        return None
    try:
        size = shm.size  # read before close_fd: posix_ipc fstat()s the descriptor
        if size < total or size < HEADER_BYTES:
            return None
        mm = mmap.mmap(shm.fd, size, access=mmap.ACCESS_READ)
    finally:
        shm.close_fd()
    magic, ready, got = _HEADER.unpack_from(mm, 0)
    if magic != MAGIC or ready != 1 or got != digest:
        mm.close()
        return None
    return mm


def make_weight_store(shared: bool, mode: int = 0o666) -> PrivateWeightStore | SharedWeightStore:
    """The store ``runtime.shared_host_weights`` asks for."""
    return SharedWeightStore(mode) if shared else PrivateWeightStore()


__all__ = [
    "ALIGN",
    "HEADER_BYTES",
    "MAGIC",
    "REGION_PREFIX",
    "PrivateWeightStore",
    "SharedWeightStore",
    "WeightStore",
    "fnv1a64",
    "lock_path",
    "make_weight_store",
    "region_layout",
    "region_name",
    "sanitize_model_name",
    "weights_digest",
    "weights_file_token",
]

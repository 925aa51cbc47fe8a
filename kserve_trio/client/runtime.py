"""Process-wide client state: staging pools, shared-memory routes, the blocking loop.

One ``ClientState`` per process owns:

- the settings of ``kserve_init(pool_bytes, n_slots, shm_reprobe_interval)`` and at most two
  ``BufferPool`` s, created on first use: one backed by POSIX shared memory, one on the heap
  (inline transport);
- one ``EndpointState`` per server ``(host, port)``: whether our shm pool is registered there,
  the registration generation, the decided route per ``shared_memory`` mode, and the latch that
  sends it inline after an unrecoverable stale registration;
- the client loop thread (``client/loop_thread.py``), where blocking calls run; the background
  re-probe task is a child of that loop, so ``kserve_shutdown`` cancels it with the loop.

Thread safety: ``ClientState.lock`` (a ``threading.Lock``, never held across an ``await``) guards
every mutation; async single-flight sections (probing, registering) use one ``anyio.Lock`` per
endpoint and event loop. An ``atexit`` hook runs ``kserve_shutdown()``, so interpreter exit
unregisters every region from every server and unlinks the POSIX objects.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.from_thread

from kserve_trio.client.errors import RpcError, SharedMemoryUnavailable, ShmUnrecoverableError
from kserve_trio.client.loop_thread import LoopThread, current_loop_key, loop_closed
from kserve_trio.client.transport import Endpoint, Transport, TransportFactory, method_path
from kserve_trio.core.errors import StatusCode
from kserve_trio.core.logging import get_logger
from kserve_trio.core.memory import BufferPool
from kserve_trio.proto import inference as pb

log = get_logger("kserve_trio.client")

T = TypeVar("T")

DEFAULT_POOL_BYTES = 256 << 20
DEFAULT_POOL_SLOTS = 8
DEFAULT_REPROBE_INTERVAL = 60.0
PROBE_TIMEOUT = 10.0
REPROBE_TIMEOUT = 3.0
SHUTDOWN_UNREGISTER_TIMEOUT = 2.0
SHM_POOL_NAME = "kserve_trio_client"


class Route(enum.Enum):
    """How chunks travel to an endpoint."""

    SHM = "shm"
    INLINE = "inline"


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """``kserve_init`` parameters: pool size and slot count (each pool), re-probe interval."""

    pool_bytes: int = DEFAULT_POOL_BYTES
    n_slots: int = DEFAULT_POOL_SLOTS
    shm_reprobe_interval: float = DEFAULT_REPROBE_INTERVAL

    def __post_init__(self) -> None:
        if self.n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {self.n_slots}")
        if self.pool_bytes // self.n_slots <= 0:
            raise ValueError(
                f"pool_bytes={self.pool_bytes} cannot be split into {self.n_slots} slots"
            )


@dataclass(eq=False)
class EndpointState:
    """What this process knows about one server."""

    endpoint: Endpoint
    factory: TransportFactory
    registered: bool = False
    generation: int = 0
    latched: bool = False
    routes: dict[str, Route] = field(default_factory=dict)
    locks: list[tuple[object, anyio.Lock]] = field(default_factory=list)
    registrations: int = 0  # how many Register calls succeeded (observability, tests)

    @property
    def key(self) -> tuple[str, int]:
        return self.endpoint.key


# --------------------------------------------------------------------------------------------
# Control RPCs


async def probe_same_namespace(transport: Transport, key: str, timeout: float) -> bool | None:
    """``IsSameIPCNamespace(key)``: True/False, or ``None`` when the server does not implement
    it (UNIMPLEMENTED, e.g. stock Triton). Any other error propagates."""
    try:
        reply = await transport.unary(
            method_path("IsSameIPCNamespace"),
            pb.IsSameIpcNamespaceRequest(name=key),
            pb.IsSameIpcNamespaceResponse,
            timeout=timeout,
        )
    except RpcError as exc:
        if exc.status is StatusCode.UNIMPLEMENTED:
            return None
        raise
    return bool(reply.same)


async def register_region(transport: Transport, pool: BufferPool, timeout: float) -> None:
    """Register the whole pool with the server: a best-effort ``Unregister`` of the name first
    (a previous run's stale entry), then ``Register(name, key, 0, nbytes)``."""
    with contextlib.suppress(RpcError):
        await transport.unary(
            method_path("SystemSharedMemoryUnregister"),
            pb.SystemSharedMemoryUnregisterRequest(name=pool.region_name),
            pb.SystemSharedMemoryUnregisterResponse,
            timeout=timeout,
        )
    await transport.unary(
        method_path("SystemSharedMemoryRegister"),
        pb.SystemSharedMemoryRegisterRequest(
            name=pool.region_name, key=pool.key, offset=0, byte_size=pool.nbytes
        ),
        pb.SystemSharedMemoryRegisterResponse,
        timeout=timeout,
    )


async def unregister_region(transport: Transport, region: str, timeout: float) -> None:
    await transport.unary(
        method_path("SystemSharedMemoryUnregister"),
        pb.SystemSharedMemoryUnregisterRequest(name=region),
        pb.SystemSharedMemoryUnregisterResponse,
        timeout=timeout,
    )


# --------------------------------------------------------------------------------------------
# The state


class ClientState:
    """Everything process-wide; see the module docstring."""

    def __init__(self, settings: ClientSettings | None = None) -> None:
        self.lock = threading.Lock()
        self.settings = settings or ClientSettings()
        self._shm_pool: BufferPool | None = None
        self._inline_pool: BufferPool | None = None
        self.endpoints: dict[tuple[str, int], EndpointState] = {}
        self._loop: LoopThread | None = None
        self._reprober = False

    # -- pools -------------------------------------------------------------------------------

    def shm_pool(self) -> BufferPool:
        with self.lock:
            if self._shm_pool is None:
                s = self.settings
                self._shm_pool = BufferPool(s.pool_bytes, s.n_slots, True, SHM_POOL_NAME)
            return self._shm_pool

    def inline_pool(self) -> BufferPool:
        with self.lock:
            if self._inline_pool is None:
                s = self.settings
                self._inline_pool = BufferPool(s.pool_bytes, s.n_slots, False, "kserve_trio_inline")
            return self._inline_pool

    def pools(self) -> list[BufferPool]:
        with self.lock:
            return [p for p in (self._shm_pool, self._inline_pool) if p is not None]

    # -- the loop thread ---------------------------------------------------------------------

    def loop(self) -> LoopThread:
        with self.lock:
            if self._loop is None or not self._loop.thread.is_alive():
                self._loop = LoopThread()
            return self._loop

    def run_blocking(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the client loop and wait for its result (plain threads only)."""
        loop = self.loop()
        if threading.current_thread() is loop.thread:
            raise RuntimeError("a blocking kserve_trio call was made on the client loop itself")
        return loop.call(fn, *args)

    # -- endpoints and routes ----------------------------------------------------------------

    def endpoint(self, endpoint: Endpoint, factory: TransportFactory) -> EndpointState:
        with self.lock:
            ep = self.endpoints.get(endpoint.key)
            if ep is None:
                ep = EndpointState(endpoint, factory)
                self.endpoints[endpoint.key] = ep
            return ep

    def _async_lock(self, ep: EndpointState) -> anyio.Lock:
        key = current_loop_key()
        with self.lock:
            for owner, lock in ep.locks:
                if owner is key:
                    return lock
            # locks of event loops that have ended go (asyncio loops say so; trio tokens don't)
            ep.locks = [(o, lk) for o, lk in ep.locks if not loop_closed(o)]
            lock = anyio.Lock()
            ep.locks.append((key, lock))
            return lock

    async def route(
        self, ep: EndpointState, mode: str, transport: Transport, timeout: float
    ) -> Route:
        """The route for ``mode`` to ``ep``, decided once and cached.

        1. ``off``: inline, no probe.
        2. Otherwise probe ``IsSameIPCNamespace(shm pool key)``: yes -> register the pool (once
           per server) and use shared memory; no -> ``auto`` inline, ``on`` raises
           ``SharedMemoryUnavailable``; not implemented -> ``auto`` inline, ``on`` registers
           anyway. Any other probe error propagates.
        3. A failed registration raises for ``on``; for ``auto`` the route is shared memory but
           latched inline, so the background re-probe can restore it.
        The route says what was decided; whether a chunk really goes through shared memory is
        ``use_shm(ep, route)`` (the latch can change at any time).
        """
        if mode == "off":
            return Route.INLINE
        cached = ep.routes.get(mode)
        if cached is not None:
            return cached
        async with self._async_lock(ep):
            cached = ep.routes.get(mode)
            if cached is not None:
                return cached
            pool = self.shm_pool()
            same = await probe_same_namespace(transport, pool.key, min(timeout, PROBE_TIMEOUT))
            if same is False:
                if mode == "on":
                    raise SharedMemoryUnavailable(
                        f"server {ep.endpoint.address} is in another IPC namespace: it cannot "
                        "map this client's shared memory (shared_memory='on' has no fall-back; "
                        "use 'auto' or 'off')"
                    )
                route = Route.INLINE
            elif same is None and mode == "auto":
                route = Route.INLINE
            else:
                if not ep.registered:
                    try:
                        await self._register(ep, transport, pool, timeout)
                    except RpcError as exc:
                        if mode == "on":
                            raise
                        log.warning(
                            "shm_register_failed",
                            endpoint=ep.endpoint.address,
                            error=str(exc),
                            fallback="inline",
                        )
                        self.latch(ep)
                route = Route.SHM
            ep.routes[mode] = route
            log.debug("route_decided", endpoint=ep.endpoint.address, mode=mode, route=route.value)
            return route

    @staticmethod
    def use_shm(ep: EndpointState, route: Route) -> bool:
        return route is Route.SHM and not ep.latched

    async def _register(
        self, ep: EndpointState, transport: Transport, pool: BufferPool, timeout: float
    ) -> None:
        await register_region(transport, pool, timeout)
        with self.lock:
            ep.registered = True
            ep.generation += 1
            ep.registrations += 1
        log.debug("shm_registered", endpoint=ep.endpoint.address, region=pool.region_name)

    async def reregister(
        self, ep: EndpointState, transport: Transport, seen_generation: int, timeout: float
    ) -> None:
        """Re-register after a stale-registration error, once for all concurrent failures.

        Under the endpoint's lock: an endpoint latched meanwhile (a concurrent attempt failed)
        raises ``ShmUnrecoverableError`` without another try; a generation that moved on since
        the failing send means someone already re-registered (nothing to do); otherwise
        register, and on failure latch and raise ``ShmUnrecoverableError``.
        """
        async with self._async_lock(ep):
            if ep.latched:
                raise ShmUnrecoverableError(
                    f"shared memory with {ep.endpoint.address} is latched inline after a "
                    "failed re-registration"
                )
            if ep.generation != seen_generation:
                return
            try:
                await self._register(ep, transport, self.shm_pool(), timeout)
            except RpcError as exc:
                self.latch(ep)
                raise ShmUnrecoverableError(
                    f"re-registering shared memory with {ep.endpoint.address} failed: {exc}"
                ) from exc

    def latch(self, ep: EndpointState) -> None:
        """Send ``ep``'s shared-memory traffic inline until the re-probe restores it."""
        with self.lock:
            already = ep.latched
            ep.latched = True
        if not already:
            log.warning("shm_latched_inline", endpoint=ep.endpoint.address)
        self._ensure_reprober()

    # -- background re-probe -----------------------------------------------------------------

    def _ensure_reprober(self) -> None:
        interval = self.settings.shm_reprobe_interval
        if interval <= 0:
            return
        with self.lock:
            if self._reprober:
                return
            self._reprober = True
        self.loop().start_task_soon(self._reprobe_forever, interval)

    async def _reprobe_forever(self, interval: float) -> None:
        while True:
            await anyio.sleep(interval)
            await self.reprobe_once()

    async def reprobe_once(self) -> None:
        """Probe each latched endpoint (3 s deadline); where the server can map our pool again,
        force a fresh registration and unlatch. Failures leave the latch in place."""
        with self.lock:
            latched = [ep for ep in self.endpoints.values() if ep.latched]
            pool = self._shm_pool
        if pool is None:
            return
        for ep in latched:
            transport = ep.factory(ep.endpoint)
            try:
                same = await probe_same_namespace(transport, pool.key, REPROBE_TIMEOUT)
                if same is False:
                    continue
                await self._register(ep, transport, pool, REPROBE_TIMEOUT)
                with self.lock:
                    ep.latched = False
                log.info("shm_restored", endpoint=ep.endpoint.address)
            except Exception as exc:
                log.debug("shm_reprobe_failed", endpoint=ep.endpoint.address, error=str(exc))
            finally:
                with contextlib.suppress(Exception):
                    await transport.aclose()

    # -- shutdown ----------------------------------------------------------------------------

    def refuse_on_loop_thread(self) -> None:
        """Shutting down from the client loop's own thread would wait on itself."""
        loop = self._loop
        if loop is not None and threading.current_thread() is loop.thread:
            raise RuntimeError(
                "kserve_shutdown() cannot run on the client loop itself (e.g. from inside an "
                "IO method driven by infer_sync); call it after the driver returns"
            )

    def shutdown(self) -> None:
        """Unregister the shm pool from every server it was registered with, stop the loop
        (cancelling the re-probe), unlink the POSIX object, forget pools and routes."""
        self.refuse_on_loop_thread()
        with self.lock:
            registered = [ep for ep in self.endpoints.values() if ep.registered]
            shm_pool = self._shm_pool
            pools = [p for p in (self._shm_pool, self._inline_pool) if p is not None]
            loop = self._loop
            self._shm_pool = self._inline_pool = None
            self.endpoints = {}
            self._loop = None
            self._reprober = False
        try:
            if registered and shm_pool is not None:
                if loop is None or not loop.thread.is_alive():
                    loop = LoopThread()
                loop.call(_unregister_all, registered, shm_pool.region_name)
        finally:
            if loop is not None:
                loop.stop()
            for pool in pools:
                pool.close()


async def _unregister_all(endpoints: list[EndpointState], region: str) -> None:
    async def one(ep: EndpointState) -> None:
        transport = ep.factory(ep.endpoint)
        try:
            await unregister_region(transport, region, SHUTDOWN_UNREGISTER_TIMEOUT)
            log.debug("shm_unregistered", endpoint=ep.endpoint.address, region=region)
        except Exception as exc:
            log.debug("shm_unregister_failed", endpoint=ep.endpoint.address, error=str(exc))
        finally:
            with contextlib.suppress(Exception):
                await transport.aclose()

    async with anyio.create_task_group() as tg:
        for ep in endpoints:
            tg.start_soon(one, ep)


# --------------------------------------------------------------------------------------------
# The process-wide instance and its public entry points

_state_lock = threading.Lock()
_state: ClientState | None = None
_settings = ClientSettings()


def get_state() -> ClientState:
    """The process's client state (created on first use with the ``kserve_init`` settings)."""
    global _state
    with _state_lock:
        if _state is None:
            _state = ClientState(_settings)
        return _state


def kserve_init(
    pool_bytes: int = DEFAULT_POOL_BYTES,
    n_slots: int = DEFAULT_POOL_SLOTS,
    shm_reprobe_interval: float = DEFAULT_REPROBE_INTERVAL,
) -> None:
    """Set the staging-pool parameters (each pool: ``pool_bytes`` in ``n_slots`` slots, which
    bounds how many chunks are in flight) and the re-probe interval (``<= 0`` disables it).

    Optional: the defaults apply without it. Called after the client was used, it first shuts
    the current state down (``kserve_shutdown``), so new pools are created with the new sizes.
    """
    global _settings
    settings = ClientSettings(pool_bytes, n_slots, shm_reprobe_interval)
    kserve_shutdown()
    with _state_lock:
        _settings = settings


def kserve_shutdown() -> None:
    """Tear the client down: unregister the shared-memory pool from every server it was
    registered with, unlink it, drop pools and routes, stop the client loop. Idempotent; the
    next call through the client starts afresh. Runs at interpreter exit too."""
    global _state
    with _state_lock:
        state = _state
        if state is not None:
            state.refuse_on_loop_thread()
        _state = None
    if state is not None:
        state.shutdown()


def _atexit_shutdown() -> None:
    try:
        kserve_shutdown()
    except Exception as exc:  # interpreter exit: report, never raise
        log.warning("client_shutdown_failed", error=str(exc))


atexit.register(_atexit_shutdown)


__all__ = [
    "DEFAULT_POOL_BYTES",
    "DEFAULT_POOL_SLOTS",
    "DEFAULT_REPROBE_INTERVAL",
    "ClientSettings",
    "ClientState",
    "Route",
    "get_state",
    "kserve_init",
    "kserve_shutdown",
]

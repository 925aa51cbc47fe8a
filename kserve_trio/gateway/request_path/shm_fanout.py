"""System shared memory through the gateway: Register and Unregister fanned out to the workers,
and the registrations remembered so a worker that comes back gets them replayed.

A client registers a region once, with the gateway; any worker may then serve its requests, so
every routable worker must know the region. The requests are forwarded as the received bytes
(only the region name is peeked), each holding that worker's register gate so no ModelInfer to
it overtakes the registration.

Rules (``ShmFanout``):
0. *Client policy*: the gateway's own ``ClientShmPolicy`` (``client_shared_memory``, its prefixes)
   comes first: with client shared memory off, Register and Unregister are UNAVAILABLE naming the
   setting; a Register of a reserved key (the workers' own objects) or of one outside the allow-list
   is INVALID_ARGUMENT naming the rule, and reaches no worker. Replay skips (and forgets) any
   recorded registration the policy refuses, so no worker is ever asked to register one.
1. *Register everywhere*: a Register goes to every routable worker concurrently. All succeed: the
   region is remembered and the first reply returned. Any fails: the workers that succeeded are
   rolled back (Unregister, best effort) and the first failure is raised with its own status, its
   message naming the worker (a region that one worker cannot map must not be half-registered). An
   empty region name is INVALID_ARGUMENT; no routable worker is UNAVAILABLE.
2. *Unregister everywhere*: an Unregister (an empty name means every region) goes to every routable
   worker concurrently and is forgotten. At least one success: the first reply is returned and the
   failures are logged; every worker failed: the first failure is raised.
3. *Replay*: ``replay`` (the prober's admission hook) re-registers every remembered region, in
   registration order, on a worker that became ready, before it is routed to; a worker that
   already has a region (ALREADY_EXISTS) counts as done. A failure fails the admission, and the
   prober retries at its next round.
4. *Stale replay*: ``replay_stale`` (the request path's hook) handles a worker that restarted
   between two prober rounds: its ``unregistered shared memory region: r`` for a region ``r`` the
   gateway registered triggers ``replay`` on that worker (single-flight: requests that hit the same
   loss together wait for one replay) and says whether the request may be retried there. A region
   the gateway never registered is the client's own business: no replay.
5. *One record*: one record for several gateway processes (``shm_record.SharedShmRegistrations``):
   *register everywhere*, *unregister everywhere* and *replay* run holding the record
   (``registrations.exclusive()``), so changes made through different processes and replays are
   serialized; a shared record's replay first asks the worker (SystemSharedMemoryStatus) and
   registers only the regions it lacks or holds differently, so the first process to admit a
   restarted worker replays, and the others find nothing left to do.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import anyio

from kserve_trio.client.errors import RpcError
from kserve_trio.client.transport import method_path
from kserve_trio.core.errors import InvalidArgument, StatusCode, Unavailable
from kserve_trio.core.logging import get_logger
from kserve_trio.core.memory import ClientShmPolicy, check_key
from kserve_trio.gateway.fleet import WorkerClient
from kserve_trio.gateway.metrics import GatewayMetrics, ObservedRequest
from kserve_trio.gateway.request_path.forward import RegisterGates
from kserve_trio.gateway.request_path.peek import peek_region_name
from kserve_trio.proto import inference as pb

REGISTER = method_path("SystemSharedMemoryRegister")
UNREGISTER = method_path("SystemSharedMemoryUnregister")
STATUS = method_path("SystemSharedMemoryStatus")

_log = get_logger(__name__)


class ShmRegistrations:
    """The registrations the gateway forwarded: region name -> the Register request bytes, in
    registration order (a re-registration moves the region to the end). This one lives in
    the process's memory; ``shm_record.SharedShmRegistrations`` is the shared one."""

    shared = False
    """Whether other gateway processes change the same record (*one record*)."""

    def __init__(self) -> None:
        self._regions: dict[str, bytes] = {}

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold the record against other processes' changes (nothing to hold here)."""
        yield

    def registered(self, name: str, request: bytes) -> None:
        self._regions.pop(name, None)
        self._regions[name] = bytes(request)

    def unregistered(self, name: str) -> None:
        """Forget ``name``; ``""`` forgets every region."""
        if name:
            self._regions.pop(name, None)
        else:
            self._regions.clear()

    def items(self) -> list[tuple[str, bytes]]:
        return list(self._regions.items())

    def __contains__(self, name: object) -> bool:
        return name in self._regions

    def __len__(self) -> int:
        return len(self._regions)


def _failure(rpc: str, label: str, exc: RpcError) -> RpcError:
    return RpcError(exc.status, f"{rpc} failed on worker {label}: {exc.message}", method=rpc)


class ShmFanout:
    """Register / Unregister fan-out and replay (the rules are in the module docstring)."""

    def __init__(
        self,
        *,
        targets: Callable[[], Sequence[WorkerClient]],
        gates: RegisterGates,
        registrations: ShmRegistrations | None = None,
        metrics: GatewayMetrics | None = None,
        policy: ClientShmPolicy | None = None,
    ) -> None:
        self._targets = targets
        self.gates = gates
        self.registrations = registrations if registrations is not None else ShmRegistrations()
        self.metrics = metrics
        self.policy = policy if policy is not None else ClientShmPolicy()  # on, any key
        self._replays: dict[str, anyio.Event] = {}

    async def _call(
        self, client: WorkerClient, method: str, data: bytes, deadline: float | None
    ) -> bytes:
        started = anyio.current_time()
        try:
            async with self.gates.hold(client.label):
                return await client.call_raw(method, data, deadline=deadline)
        finally:
            if self.metrics is not None:
                self.metrics.observe_worker_call(
                    "SystemSharedMemory", client.label, anyio.current_time() - started
                )

    async def _fan_out(
        self, clients: Sequence[WorkerClient], method: str, data: bytes, deadline: float | None
    ) -> dict[str, bytes | RpcError]:
        results: dict[str, bytes | RpcError] = {}

        async def one(client: WorkerClient) -> None:
            try:
                results[client.label] = await self._call(client, method, data, deadline)
            except RpcError as exc:
                results[client.label] = exc

        async with anyio.create_task_group() as tg:
            for client in clients:
                tg.start_soon(one, client)
        return {c.label: results[c.label] for c in clients}

    async def register(self, data: bytes, *, deadline: float | None = None) -> bytes:
        """*Register everywhere*."""
        return await self._observed("SystemSharedMemoryRegister", data, self._register, deadline)

    async def unregister(self, data: bytes, *, deadline: float | None = None) -> bytes:
        """*Unregister everywhere*."""
        return await self._observed(
            "SystemSharedMemoryUnregister", data, self._unregister, deadline
        )

    async def _observed(
        self,
        rpc: str,
        data: bytes,
        fn: Callable[[str, bytes, float | None], Awaitable[bytes]],
        deadline: float | None,
    ) -> bytes:
        with ObservedRequest(self.metrics, rpc) as seen:
            self.policy.check_enabled(rpc)
            seen.name = peek_region_name(data, rpc)
            return await fn(seen.name, data, deadline)

    async def _register(self, name: str, data: bytes, deadline: float | None) -> bytes:
        """*Client policy* and *register everywhere*."""
        rpc = "SystemSharedMemoryRegister"
        if not name:
            raise InvalidArgument(f"{rpc} needs a region name")
        key = _key_of(data, rpc)
        check_key(key, rpc=rpc)
        self.policy.check_key(key, rpc=rpc)
        async with self.registrations.exclusive():
            return await self._register_held(name, data, deadline)

    async def _register_held(self, name: str, data: bytes, deadline: float | None) -> bytes:
        rpc = "SystemSharedMemoryRegister"
        clients = list(self._targets())
        if not clients:
            raise Unavailable(f"no ready worker to register shared memory region '{name}' with")
        results = await self._fan_out(clients, REGISTER, data, deadline)
        failed = [(label, r) for label, r in results.items() if isinstance(r, RpcError)]
        if not failed:
            self.registrations.registered(name, data)
            return next(r for r in results.values() if isinstance(r, bytes))
        succeeded = [c for c in clients if isinstance(results[c.label], bytes)]
        undo = bytes(pb.SystemSharedMemoryUnregisterRequest(name=name))
        rolled_back = await self._fan_out(succeeded, UNREGISTER, undo, None)
        _log.warning(
            "shm_register_failed",
            region=name,
            failed={label: str(exc) for label, exc in failed},
            rolled_back=sorted(rolled_back),
        )
        label, first = failed[0]
        raise _failure(rpc, label, first)

    async def _unregister(self, name: str, data: bytes, deadline: float | None) -> bytes:
        async with self.registrations.exclusive():
            return await self._unregister_held(name, data, deadline)

    async def _unregister_held(self, name: str, data: bytes, deadline: float | None) -> bytes:
        rpc = "SystemSharedMemoryUnregister"
        self.registrations.unregistered(name)
        clients = list(self._targets())
        if not clients:
            raise Unavailable("no ready worker to unregister shared memory with")
        results = await self._fan_out(clients, UNREGISTER, data, deadline)
        failed = [(label, r) for label, r in results.items() if isinstance(r, RpcError)]
        replies = [r for r in results.values() if isinstance(r, bytes)]
        if failed:
            _log.warning(
                "shm_unregister_failed",
                region=name,
                failed={label: str(exc) for label, exc in failed},
            )
        if replies:
            return replies[0]
        label, first = failed[0]
        raise _failure(rpc, label, first)

    async def replay_stale(self, client: WorkerClient, exc: RpcError) -> bool:
        """*Stale replay*."""
        _, sep, name = exc.message.partition(": ")
        if not sep or name not in self.registrations:
            return False
        running = self._replays.get(client.label)
        if running is not None:
            await running.wait()
            return True
        done = self._replays[client.label] = anyio.Event()
        try:
            await self.replay(client)
        except RpcError as failure:
            _log.warning("shm_replay_failed", worker=client.label, error=str(failure))
            return False
        finally:
            del self._replays[client.label]
            done.set()
        _log.info("shm_replayed_after_worker_lost_them", worker=client.label, region=name)
        return True

    async def replay(self, client: WorkerClient) -> None:
        """*Client policy*, *replay* and *one record* (raises the first failure)."""
        async with self.registrations.exclusive():
            items = self._replayable(self.registrations.items())
            if self.registrations.shared and items:
                items = await self._lacking(client, items)
            await self._replay_held(client, items)

    def _replayable(self, items: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
        """The recorded registrations the policy allows (*client policy*); the others are
        forgotten."""
        out = []
        for name, request in items:
            try:
                key = _key_of(request, "SystemSharedMemoryRegister")
            except InvalidArgument:
                key = ""
            if self.policy.may_register(key):
                out.append((name, request))
                continue
            if name:  # "" would forget every region
                self.registrations.unregistered(name)
            _log.warning("shm_replay_refused", region=name, key=key)
        return out

    async def _lacking(
        self, client: WorkerClient, items: list[tuple[str, bytes]]
    ) -> list[tuple[str, bytes]]:
        """The registrations ``client`` does not hold as recorded (*one record*)."""
        try:
            data = await self._call(
                client, STATUS, bytes(pb.SystemSharedMemoryStatusRequest()), None
            )
        except RpcError as exc:
            raise _failure("SystemSharedMemoryStatus", client.label, exc) from None
        held = {
            name: (r.key, r.offset, r.byte_size)
            for name, r in pb.SystemSharedMemoryStatusResponse().parse(data).regions.items()
        }
        out = []
        for name, request in items:
            wanted = pb.SystemSharedMemoryRegisterRequest().parse(request)
            if held.get(name) != (wanted.key, wanted.offset, wanted.byte_size):
                out.append((name, request))
        return out

    async def _replay_held(self, client: WorkerClient, items: list[tuple[str, bytes]]) -> None:
        for name, data in items:
            try:
                await self._call(client, REGISTER, data, None)
            except RpcError as exc:
                if exc.status is StatusCode.ALREADY_EXISTS:
                    continue
                raise _failure("SystemSharedMemoryRegister", client.label, exc) from None
            _log.info("shm_region_replayed", worker=client.label, region=name)


def _key_of(data: bytes, rpc: str) -> str:
    """The ``key`` of a serialized ``SystemSharedMemoryRegisterRequest``."""
    try:
        return pb.SystemSharedMemoryRegisterRequest().parse(data).key
    except Exception as exc:
        raise InvalidArgument(f"malformed {rpc} request: {exc}") from None


__all__ = ["REGISTER", "UNREGISTER", "ShmFanout", "ShmRegistrations"]

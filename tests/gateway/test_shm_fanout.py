"""Shared-memory Register/Unregister through the gateway against real gRPC servers: fan-out to
every routable worker, rollback on a partial failure with the worker's own status, unregister,
and the replay to a worker that comes back (through the prober's admission hook); the
gateway's own policy: reserved keys and keys outside the allow-list never reach a worker, not
even in a replay, and client shared memory off is UNAVAILABLE."""

from __future__ import annotations

import anyio
import pytest

from kserve_trio.client.errors import RpcError
from kserve_trio.core.errors import InvalidArgument, StatusCode, Unavailable
from kserve_trio.core.memory.shm_names import RESERVED_RULE, ClientShmPolicy
from kserve_trio.gateway.request_path.forward import RegisterGates
from kserve_trio.gateway.request_path.shm_fanout import ShmFanout, ShmRegistrations
from kserve_trio.proto import inference as pb
from tests.gateway.test_forward import counts
from tests.gateway.test_prober import fleet, labels_of, make_prober

pytestmark = pytest.mark.anyio


def register(name: str, key: str = "/k") -> bytes:
    return bytes(pb.SystemSharedMemoryRegisterRequest(name=name, key=key, offset=0, byte_size=64))


def unregister(name: str = "") -> bytes:
    return bytes(pb.SystemSharedMemoryUnregisterRequest(name=name))


async def setup(workers, policy: ClientShmPolicy | None = None):
    fanout_box: list[ShmFanout] = []

    async def replay(client) -> None:
        await fanout_box[0].replay(client)

    prober, _dns, metrics = make_prober(workers, on_ready=replay)
    fanout = ShmFanout(
        targets=prober.routable_clients, gates=RegisterGates(), metrics=metrics, policy=policy
    )
    fanout_box.append(fanout)
    await prober.round()
    return fanout, prober, metrics


def test_the_registrations_keep_the_order_and_forget():
    regs = ShmRegistrations()
    regs.registered("a", b"1")
    regs.registered("b", b"2")
    regs.registered("a", b"3")  # re-registered: moves to the end
    assert regs.items() == [("b", b"2"), ("a", b"3")]
    regs.unregistered("b")
    assert "b" not in regs and len(regs) == 1
    regs.unregistered("")
    assert regs.items() == []


async def test_register_reaches_every_worker_and_is_remembered():
    with fleet(2) as (a, b):
        fanout, prober, metrics = await setup([a, b])
        assert await fanout.register(register("r0", "/shm0")) == b""
        assert a.regions == b.regions == {"r0": "/shm0"}
        assert "r0" in fanout.registrations
        assert (
            counts(metrics, "gateway_requests", "gateway_requests_total")[
                ("SystemSharedMemoryRegister", "r0", "OK")
            ]
            == 1.0
        )
        await prober.pool.aclose()


async def test_a_partial_failure_is_rolled_back_and_keeps_the_workers_status():
    with fleet(2) as (a, b):
        fanout, prober, _ = await setup([a, b])
        b.register_fail_with = (int(StatusCode.INVALID_ARGUMENT), "cannot open /bad")
        with pytest.raises(RpcError) as info:
            await fanout.register(register("r1", "/bad"))
        assert info.value.status is StatusCode.INVALID_ARGUMENT
        assert info.value.message.startswith(
            f"SystemSharedMemoryRegister failed on worker {labels_of([b])[0]}:"
        )
        assert "cannot open /bad" in info.value.message
        assert a.register_calls == ["r1"] and a.regions == {}  # rolled back
        assert "r1" not in fanout.registrations
        await prober.pool.aclose()


async def test_register_needs_a_name_and_a_ready_worker():
    with fleet(1) as (a,):
        fanout, prober, _ = await setup([a])
        with pytest.raises(InvalidArgument, match="needs a region name"):
            await fanout.register(register(""))
        a.ready = False
        await prober.round()
        with pytest.raises(Unavailable, match="no ready worker"):
            await fanout.register(register("r"))
        await prober.pool.aclose()


async def test_unregister_fans_out_forgets_and_an_empty_name_means_all():
    with fleet(2) as (a, b):
        fanout, prober, _ = await setup([a, b])
        await fanout.register(register("r0"))
        await fanout.register(register("r1"))
        await fanout.unregister(unregister("r0"))
        assert a.regions == b.regions == {"r1": "/k"}
        assert [n for n, _ in fanout.registrations.items()] == ["r1"]
        await fanout.unregister(unregister())
        assert a.regions == b.regions == {} and len(fanout.registrations) == 0
        await prober.pool.aclose()


async def test_unregister_succeeds_if_one_worker_does():
    with fleet(2) as (a, b):
        fanout, prober, _ = await setup([a, b])
        await fanout.register(register("r0"))
        b.stop()
        assert await fanout.unregister(unregister("r0")) == b""
        assert a.regions == {}
        await prober.pool.aclose()


async def test_a_worker_that_comes_back_gets_the_regions_replayed_before_traffic():
    with fleet(2) as (a, b):
        fanout, prober, _ = await setup([a, b])
        await fanout.register(register("r0", "/zero"))
        await fanout.register(register("r1", "/one"))
        b.ready = False
        await prober.round()
        b.regions.clear()  # it restarted: its registrations are gone
        b.register_calls.clear()
        b.ready = True
        report = await prober.round()
        assert report.admitted == (labels_of([b])[0],)
        assert b.register_calls == ["r0", "r1"]  # in registration order
        assert b.regions == {"r0": "/zero", "r1": "/one"}
        await prober.pool.aclose()


async def test_a_failed_replay_keeps_the_worker_out_of_the_table_until_it_works():
    with fleet(2) as (a, b):
        fanout, prober, _ = await setup([a, b])
        await fanout.register(register("r0"))
        b.ready = False
        await prober.round()
        b.ready = True
        b.register_fail_with = (int(StatusCode.INTERNAL), "disk on fire")
        report = await prober.round()
        assert report.admitted == () and report.table.models == {"m": (labels_of([a])[0],)}
        b.register_fail_with = None
        report = await prober.round()
        assert report.admitted == (labels_of([b])[0],) and "r0" in b.regions
        await prober.pool.aclose()


async def test_already_registered_counts_as_replayed():
    with fleet(1) as (a,):
        fanout, prober, _ = await setup([a])
        await fanout.register(register("r0"))
        a.register_fail_with = (int(StatusCode.ALREADY_EXISTS), "exists")
        await fanout.replay(prober.pool.get(labels_of([a])[0]))  # does not raise
        await prober.pool.aclose()


async def test_a_register_holds_the_workers_gate():
    with fleet(1) as (a,):
        fanout, prober, _ = await setup([a])
        (label,) = labels_of([a])
        seen = []

        async def watch() -> None:
            while not fanout.gates.held(label):
                await anyio.sleep(0)
            seen.append(True)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            await fanout.register(register("r0"))
        assert seen and not fanout.gates.held(label)
        await prober.pool.aclose()


async def test_a_reserved_key_is_refused_by_the_gateway_and_reaches_no_worker():
    with fleet(2) as (a, b):
        fanout, prober, _ = await setup([a, b])
        for key in ("/kst-w-mlp-00000000000000ab", "kst-w-mlp-00000000000000ab.lock"):
            with pytest.raises(InvalidArgument) as info:
                await fanout.register(register("evil", key))
            assert info.value.message == (
                f"SystemSharedMemoryRegister: shared memory key '{key}' is reserved: "
                f"{RESERVED_RULE}"
            )
        assert a.register_calls == b.register_calls == [] and len(fanout.registrations) == 0
        await prober.pool.aclose()


async def test_the_gateways_allow_list_and_its_off_switch():
    with fleet(1) as (a,):
        policy = ClientShmPolicy(prefixes=("app-",), setting="client_shared_memory")
        fanout, prober, _ = await setup([a], policy)
        with pytest.raises(InvalidArgument, match=r"\(client_shared_memory_prefixes\)$"):
            await fanout.register(register("r", "/other"))
        await fanout.register(register("r", "/app-1"))
        assert a.register_calls == ["r"]
        await prober.pool.aclose()
    with fleet(1) as (a,):
        off = ClientShmPolicy(enabled=False, setting="client_shared_memory")
        fanout, prober, _ = await setup([a], off)
        for call, rpc in (
            (lambda: fanout.register(register("r")), "SystemSharedMemoryRegister"),
            (lambda: fanout.unregister(unregister()), "SystemSharedMemoryUnregister"),
        ):
            with pytest.raises(Unavailable) as info:
                await call()
            assert info.value.message == (
                f"{rpc}: client shared memory is off on this server (client_shared_memory: "
                "false); send tensors inline"
            )
        assert a.register_calls == []
        await prober.pool.aclose()


async def test_a_replay_never_registers_a_reserved_key_and_forgets_it():
    """A record the gateway would refuse today (an older gateway's, or a shared record file
    someone wrote) is skipped and dropped: the worker that comes back never sees it."""
    with fleet(1) as (a,):
        fanout, prober, _ = await setup([a])
        await fanout.register(register("r0", "/zero"))
        fanout.registrations.registered("evil", register("evil", "/kst-w-mlp-00000000000000ab"))
        a.ready = False
        await prober.round()
        a.regions.clear()
        a.register_calls.clear()
        a.ready = True
        report = await prober.round()
        assert report.admitted == tuple(labels_of([a]))
        assert a.register_calls == ["r0"] and a.regions == {"r0": "/zero"}
        assert [n for n, _ in fanout.registrations.items()] == ["r0"]
        await prober.pool.aclose()

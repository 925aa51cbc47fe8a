"""The worker pool: the pure health state machine, and real calls to real gRPC servers on
loopback addresses (raw bytes both ways, exact deadlines, the in-flight bound, status
passthrough, cancellation, probes and channel resets, reconciliation with discovery, TLS)."""

from __future__ import annotations

import anyio
import pytest

from kserve_trio.client.errors import RpcError
from kserve_trio.core.errors import DeadlineExceeded, StatusCode
from kserve_trio.core.process.config import TlsConfig
from kserve_trio.gateway.config import GatewayConfig, WorkerClientConfig, WorkerTlsConfig
from kserve_trio.gateway.fleet.discovery import Discovery, WorkerDiff, WorkerSpec
from kserve_trio.gateway.fleet.pool import (
    HealthStep,
    PoolSettings,
    ProbeOutcome,
    WorkerClient,
    WorkerHealth,
    WorkerPool,
    compact_timeout,
    forward_deadline,
    probe_step,
)
from kserve_trio.gateway.tls import public_ssl_context
from kserve_trio.proto import reactant_control as rc
from tests.gateway.fake_worker import INFER, FakeWorker
from tests.gateway.test_discovery import FakeDns
from tests.waiting import until

pytestmark = pytest.mark.anyio
READY, NOT_READY, FAILED, TIMED_OUT = (
    ProbeOutcome.READY,
    ProbeOutcome.NOT_READY,
    ProbeOutcome.FAILED,
    ProbeOutcome.TIMED_OUT,
)


# --------------------------------------------------------------------------------------------
# the pure state machine


def test_probe_steps():
    h = WorkerHealth()
    step = probe_step(h, READY)
    assert step == HealthStep(WorkerHealth(True, True, 0, ""), became_ready=True)
    again = probe_step(step.health, READY)
    assert not again.became_ready and again.health.ready
    down = probe_step(again.health, NOT_READY, "draining")
    assert down.became_unready and down.health == WorkerHealth(False, True, 0, "draining")
    refused = probe_step(WorkerHealth(), FAILED, "UNAVAILABLE: cannot reach")
    assert refused.health == WorkerHealth(False, False, 0, "UNAVAILABLE: cannot reach")
    assert not refused.reset_channel


def test_a_timed_out_probe_resets_the_channel_and_counts_the_streak():
    h = WorkerHealth(ready=True, answered=True)
    first = probe_step(h, TIMED_OUT, "no answer")
    assert first.reset_channel and first.became_unready
    second = probe_step(first.health, TIMED_OUT)
    assert second.health.consecutive_timeouts == 2 and second.reset_channel
    assert probe_step(second.health, FAILED).health.consecutive_timeouts == 0


def test_forward_deadline_is_exact_and_refuses_a_passed_one():
    assert forward_deadline(10.25, 10.0, 60.0, "m") == 10.25
    assert forward_deadline(None, 10.0, 60.0, "m") == 70.0
    with pytest.raises(DeadlineExceeded, match=r"^deadline exceeded at gateway for model 'm'$"):
        forward_deadline(10.0, 10.0, 60.0, "m")
    assert compact_timeout(60.0) == 300.0 and compact_timeout(900.0) == 900.0


# --------------------------------------------------------------------------------------------
# real calls


@pytest.fixture
def worker():
    with FakeWorker() as w:
        yield w


def spec_for(w: FakeWorker, label: str = "w0", host: str | None = None) -> WorkerSpec:
    return WorkerSpec(w.host, w.port, host or w.host, 0, label)


def client_for(w: FakeWorker, streams: int = 32, timeout: float = 60.0) -> WorkerClient:
    settings = PoolSettings(streams, timeout, 64 << 20, 64 << 20)
    return WorkerClient(spec_for(w), settings)


async def test_raw_bytes_travel_unchanged_both_ways(worker):
    client = client_for(worker)
    payload = bytes(range(256)) * 8192  # 2 MiB, not a valid message: nobody parses it
    reply = await client.call_raw(INFER, payload)
    assert worker.requests == [payload]
    assert reply == b"reply:" + payload
    await client.aclose()


async def test_the_clients_deadline_is_forwarded_exactly(worker):
    client = client_for(worker)
    started = anyio.current_time()
    await client.call_raw(INFER, b"x", deadline=started + 20.25)
    took = anyio.current_time() - started
    await client.call_raw(INFER, b"y")  # no deadline: the request timeout
    took_default = anyio.current_time() - started - took
    short, default = worker.deadlines
    # what the worker has left is short of what was given by the call's own time at most, and
    # never more (a timeout rounded up to whole seconds would be)
    assert 20.25 - took <= short <= 20.25
    assert 60.0 - took_default <= default <= 60.0
    await client.aclose()


async def test_in_flight_calls_per_worker_are_bounded(worker):
    worker.infer_delay = 0.3
    client = client_for(worker, streams=2)
    async with anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(client.call_raw, INFER, b"%d" % i)
        await until(lambda: worker.in_flight == 2)
        assert client.in_flight == 2
    assert worker.max_in_flight == 2 and len(worker.requests) == 6
    assert client.in_flight == 0
    await client.aclose()


async def test_waiting_for_a_slot_counts_against_the_deadline(worker):
    client = client_for(worker, streams=1)
    async with anyio.create_task_group() as tg:
        # the slow call holds the one stream until the test cancels it
        tg.start_soon(lambda: client.call_raw(INFER, b"slow", metadata={"x-sleep": "60"}))
        await until(lambda: worker.in_flight == 1)
        with pytest.raises(RpcError) as info:
            await client.call_raw(INFER, b"late", deadline=anyio.current_time() + 0.1)
        tg.cancel_scope.cancel()
    assert info.value.status is StatusCode.DEADLINE_EXCEEDED
    assert "waiting for a free stream to w0" in info.value.message
    assert worker.requests == [b"slow"]  # the late one was never sent
    await client.aclose()


@pytest.mark.parametrize(
    "status", [StatusCode.INVALID_ARGUMENT, StatusCode.NOT_FOUND, StatusCode.RESOURCE_EXHAUSTED]
)
async def test_worker_statuses_pass_through_unchanged(worker, status):
    client = client_for(worker)
    with pytest.raises(RpcError) as info:
        await client.call_raw(
            INFER, b"x", metadata={"x-status": str(int(status)), "x-message": "said the worker"}
        )
    assert info.value.status is status and info.value.message == "said the worker"
    await client.aclose()


async def test_a_worker_deadline_is_deadline_exceeded_and_a_gone_worker_unavailable(worker):
    client = client_for(worker)
    with pytest.raises(RpcError) as info:
        await client.call_raw(
            INFER, b"x", deadline=anyio.current_time() + 0.1, metadata={"x-sleep": "60"}
        )
    assert info.value.status is StatusCode.DEADLINE_EXCEEDED
    worker.stop()
    with pytest.raises(RpcError) as info:
        await client.call_raw(INFER, b"x")
    assert info.value.status is StatusCode.UNAVAILABLE
    await client.aclose()


async def test_a_cancelled_call_is_cancelled_on_the_worker(worker):
    client = client_for(worker)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: client.call_raw(INFER, b"x", metadata={"x-sleep": "60"}))
        await until(lambda: worker.in_flight == 1, what="the call on the worker")
        tg.cancel_scope.cancel()
    await until(lambda: worker.cancelled, what="the worker's handler cancelled")
    assert worker.cancelled == 1 and client.in_flight == 0
    assert await client.call_raw(INFER, b"next") == b"reply:next"  # the connection lives on
    await client.aclose()


async def test_probes_read_readiness(worker):
    client = client_for(worker)
    outcome, step = await client.probe(timeout=2)
    assert outcome is READY and step.became_ready and client.health.ready
    worker.ready = False
    outcome, step = await client.probe(timeout=2)
    assert outcome is NOT_READY and step.became_unready and not client.health.ready
    await client.aclose()


async def test_probes_bypass_the_stream_slots(worker):
    client = client_for(worker, streams=1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: client.call_raw(INFER, b"busy", metadata={"x-sleep": "60"}))
        await until(lambda: worker.in_flight == 1)
        with anyio.fail_after(30):  # a probe queued for the stream would wait out the 60 s
            outcome, _ = await client.probe(timeout=30)
        tg.cancel_scope.cancel()  # the busy call has served its purpose
    assert outcome is READY
    await client.aclose()


async def test_a_timed_out_probe_resets_the_connection(worker):
    client = client_for(worker)
    await client.probe(timeout=2)
    worker.probe_delay = 60.0  # far past the 0.2 s timeout, however loaded the machine
    outcome, step = await client.probe(timeout=0.2)
    assert outcome is TIMED_OUT and step.reset_channel and client.resets == 1
    worker.probe_delay = 0.0
    await client.call_raw(INFER, b"after")
    first, *_, last = worker.peers
    assert first != last  # the call went out on a fresh connection (another client port)
    await client.aclose()


async def test_an_unreachable_worker_fails_its_probe_quickly():
    with FakeWorker() as w:
        spec = spec_for(w)
    client = WorkerClient(spec, PoolSettings(1, 1.0, 1 << 20, 1 << 20))
    with anyio.fail_after(3):
        outcome, step = await client.probe(timeout=2)
    assert outcome is FAILED and "UNAVAILABLE" in step.health.last_error
    assert client.resets == 0


async def test_control_calls_parse_their_reply_and_a_timeout_resets(worker):
    worker.control = rc.ModelControlStatusResponse(
        discipline="fifo", models=[rc.ModelStatus(name="m", requests_served=3)]
    )
    client = client_for(worker)
    reply = await client.call(
        "/reactant_control.ControlService/ModelControlStatus",
        rc.ModelControlStatusRequest(),
        rc.ModelControlStatusResponse,
        timeout=2,
    )
    assert reply.models[0].requests_served == 3
    worker.stop()
    with FakeWorker() as slow:
        slow.probe_delay = 60.0  # far past the 0.2 s timeout, however loaded the machine
        slow_client = client_for(slow)
        with pytest.raises(RpcError) as info:
            await slow_client.call(
                "/inference.GRPCInferenceService/ServerReady",
                b"",
                rc.ModelControlStatusResponse,
                timeout=0.2,
            )
        assert info.value.status is StatusCode.DEADLINE_EXCEEDED and slow_client.resets == 1
        await slow_client.aclose()
    await client.aclose()


# --------------------------------------------------------------------------------------------
# the pool and discovery


def settings(**kw) -> PoolSettings:
    return PoolSettings(max_concurrent_streams=4, request_timeout=5, **kw)


async def test_one_name_on_two_loopback_addresses_is_two_pooled_workers():
    # A headless Service: one name, one port, two pod addresses.
    with FakeWorker("127.0.0.1") as a:
        b = FakeWorker("127.0.0.2")
        b.port = a.port
        with b:
            dns = FakeDns({"workers.test": ["127.0.0.1", "127.0.0.2"]})
            discovery = Discovery([f"workers.test:{a.port}"], resolver=dns)
            pool = WorkerPool(settings())
            await pool.apply((await discovery.refresh()).diff)
            la, lb = f"127.0.0.1:{a.port}", f"127.0.0.2:{a.port}"
            probes = await pool.probe_all(timeout=2)
            assert {label: outcome for label, (outcome, _) in probes.items()} == {
                la: READY,
                lb: READY,
            }
            assert pool.ready_labels() == [la, lb]
            await pool.get(lb).call_raw(INFER, b"to-b")
            await pool.get(la).call_raw(INFER, b"to-a")
            assert b.requests == [b"to-b"] and a.requests == [b"to-a"]

            dns.table["workers.test"] = ["127.0.0.2"]  # the 127.0.0.1 pod went away
            await pool.apply((await discovery.refresh()).diff)
            assert list(pool.clients) == [lb]
            await pool.aclose()
            assert pool.clients == {}


async def test_apply_keeps_the_connection_of_a_relabelled_worker(worker):
    pool = WorkerPool(settings())
    old = spec_for(worker, "127.0.0.1:x")
    await pool.apply(WorkerDiff(added=(old,)))
    client = pool.get("127.0.0.1:x")
    await client.call_raw(INFER, b"1")
    renamed = spec_for(worker, "gpu0")
    await pool.apply(WorkerDiff(changed=((old, renamed),)))
    assert pool.get("gpu0") is client and pool.get("127.0.0.1:x") is None
    assert client.label == "gpu0"
    other_host = spec_for(worker, "gpu0", host="elsewhere.test")
    await pool.apply(WorkerDiff(changed=((renamed, other_host),)))
    assert pool.get("gpu0") is not client  # its TLS name changed: a new client
    await pool.apply(WorkerDiff(removed=(other_host,)))
    assert pool.clients == {}


def test_pool_settings_from_the_config(pki):
    cfg = GatewayConfig(
        endpoints=("a:1",),
        worker_client=WorkerClientConfig(7.5, 3, WorkerTlsConfig(ca_file=str(pki / "ca.pem"))),
    )
    s = PoolSettings.from_config(cfg)
    assert (s.max_concurrent_streams, s.request_timeout) == (3, 7.5)
    assert s.ssl_context is not None
    assert PoolSettings.from_config(GatewayConfig(endpoints=("a:1",))).ssl_context is None


# --------------------------------------------------------------------------------------------
# TLS to the workers


def worker_tls(pki, cert: str = "named", mutual: bool = False):
    ca = str(pki / "ca.pem") if mutual else ""
    return public_ssl_context(TlsConfig(str(pki / f"{cert}.pem"), str(pki / f"{cert}.key"), ca))


def tls_pool(pki, *, client_cert: bool = False) -> WorkerPool:
    tls = WorkerTlsConfig(
        ca_file=str(pki / "ca.pem"),
        cert_file=str(pki / "client.pem") if client_cert else "",
        key_file=str(pki / "client.key") if client_cert else "",
    )
    cfg = GatewayConfig(endpoints=("a:1",), worker_client=WorkerClientConfig(tls=tls))
    return WorkerPool(PoolSettings.from_config(cfg))


async def test_tls_to_a_worker_is_checked_against_the_configured_name(pki):
    # The certificate names worker.test only; the pool connects to 127.0.0.1.
    with FakeWorker(ssl_context=worker_tls(pki)) as w:
        dns = FakeDns({"worker.test": ["127.0.0.1"]})
        discovery = Discovery([f"worker.test:{w.port}"], resolver=dns)
        pool = tls_pool(pki)
        await pool.apply((await discovery.refresh()).diff)
        ((label, (outcome, _)),) = (await pool.probe_all(timeout=3)).items()
        assert outcome is READY, pool.get(label).health
        assert await pool.get(label).call_raw(INFER, b"sealed") == b"reply:sealed"
        await pool.aclose()

        by_address = tls_pool(pki)  # the same worker, configured by address: the name fails
        await by_address.apply(WorkerDiff(added=(spec_for(w),)))
        ((_, (outcome, step)),) = (await by_address.probe_all(timeout=3)).items()
        assert outcome is FAILED and "TLS handshake" in step.health.last_error
        await by_address.aclose()


async def test_mutual_tls_to_a_worker_needs_the_client_certificate(pki):
    with FakeWorker(ssl_context=worker_tls(pki, cert="server", mutual=True)) as w:
        spec = spec_for(w, host="localhost")
        with_cert = tls_pool(pki, client_cert=True)
        await with_cert.apply(WorkerDiff(added=(spec,)))
        assert [o for o, _ in (await with_cert.probe_all(timeout=3)).values()] == [READY]
        await with_cert.aclose()
        without = tls_pool(pki)
        await without.apply(WorkerDiff(added=(spec,)))
        assert [o for o, _ in (await without.probe_all(timeout=3)).values()] == [FAILED]
        await without.aclose()

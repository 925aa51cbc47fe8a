"""The prober and the route refresher against real gRPC servers on loopback addresses: rounds
(discovery, probes, admission with on_ready, the routing table, routing metadata), the
single-flight refresh, timeouts that never stop it, and the background tasks."""

from __future__ import annotations

import contextlib

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kserve_trio.core.errors import NotFound, Unavailable
from kserve_trio.gateway.config import WorkBasis
from kserve_trio.gateway.fleet.discovery import Discovery
from kserve_trio.gateway.fleet.pool import PoolSettings, ProbeOutcome, WorkerPool
from kserve_trio.gateway.fleet.prober import Prober, RouteRefresher
from kserve_trio.gateway.fleet.routing import LeastOutstanding, RoundRobin, RoutingState
from kserve_trio.gateway.metrics import GatewayMetrics
from kserve_trio.proto import reactant_control as rc
from tests.gateway.fake_worker import FakeWorker
from tests.gateway.test_discovery import FakeDns
from tests.waiting import until

pytestmark = pytest.mark.anyio


@contextlib.contextmanager
def fleet(n: int = 2):
    """``n`` fake workers on 127.0.0.1, 127.0.0.2, ... sharing one port (one headless name)."""
    with contextlib.ExitStack() as stack:
        first = stack.enter_context(FakeWorker("127.0.0.1"))
        workers = [first]
        for i in range(2, n + 1):
            w = FakeWorker(f"127.0.0.{i}")
            w.port = first.port
            workers.append(stack.enter_context(w))
        yield workers


def labels_of(workers) -> list[str]:
    return [f"{w.host}:{w.port}" for w in workers]


def make_prober(workers, *, policy=None, on_ready=None, **kw):
    dns = FakeDns({"fleet.test": [w.host for w in workers]})
    metrics = GatewayMetrics()
    prober = Prober(
        discovery=Discovery([f"fleet.test:{workers[0].port}"], resolver=dns),
        pool=WorkerPool(PoolSettings(max_concurrent_streams=4, request_timeout=5)),
        state=RoutingState(),
        policy=policy or RoundRobin(),
        interval=kw.pop("interval", 60.0),
        metrics=metrics,
        on_ready=on_ready,
        probe_timeout=kw.pop("probe_timeout", 2.0),
        **kw,
    )
    return prober, dns, metrics


def gauge(metrics: GatewayMetrics, name: str) -> dict:
    text = metrics.exposition().decode()
    for fam in text_string_to_metric_families(text):
        if fam.name == name:
            return {tuple(s.labels.values()): s.value for s in fam.samples}
    return {}


async def test_a_round_admits_ready_workers_and_builds_the_table():
    with fleet(2) as (a, b):
        b.models = ["m", "only_b"]
        prober, _, metrics = make_prober([a, b])
        report = await prober.round()
        la, lb = labels_of([a, b])
        assert report.outcomes == {la: ProbeOutcome.READY, lb: ProbeOutcome.READY}
        assert sorted(report.admitted) == [la, lb]
        assert prober.routable_labels == {la, lb} and prober.ready
        assert report.table.models == {"m": (la, lb), "only_b": (lb,)}
        assert gauge(metrics, "gateway_worker_ready") == {(la,): 1.0, (lb,): 1.0}
        assert gauge(metrics, "gateway_routing_table_size") == {(): 2.0}
        assert report.metadata_polled == ()  # round robin needs no metadata
        await prober.pool.aclose()


async def test_an_unready_worker_leaves_the_table_and_comes_back_through_on_ready():
    admitted: list[str] = []

    async def on_ready(client) -> None:
        admitted.append(client.label)

    with fleet(2) as (a, b):
        la, lb = labels_of([a, b])
        prober, _, metrics = make_prober([a, b], on_ready=on_ready)
        await prober.round()
        assert sorted(admitted) == [la, lb]
        b.ready = False
        report = await prober.round()
        assert report.table.models == {"m": (la,)}
        assert prober.routable_labels == {la}
        assert gauge(metrics, "gateway_worker_ready")[(lb,)] == 0.0
        b.ready = True
        report = await prober.round()
        assert report.admitted == (lb,) and admitted.count(lb) == 2  # replayed on its return
        assert report.table.models == {"m": (la, lb)}
        await prober.pool.aclose()


async def test_a_failed_on_ready_keeps_the_worker_out_until_it_succeeds():
    calls = {"n": 0}

    async def flaky(client) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("replay failed")

    with fleet(1) as (a,):
        prober, _, _ = make_prober([a], on_ready=flaky)
        first = await prober.round()
        assert first.admitted == () and first.table.models == {}
        assert prober.ready and not prober.routable_labels  # ready, but not routed to yet
        second = await prober.round()
        assert second.admitted == tuple(labels_of([a]))
        assert second.table.replicas("m") == tuple(labels_of([a]))
        await prober.pool.aclose()


async def test_a_vanished_address_is_dropped_from_pool_table_and_metrics():
    with fleet(2) as (a, b):
        la, lb = labels_of([a, b])
        prober, dns, metrics = make_prober([a, b])
        await prober.round()
        dns.table["fleet.test"] = ["127.0.0.1"]
        report = await prober.round()
        assert [w.label for w in report.discovery.removed] == [lb]
        assert list(prober.pool.clients) == [la] and prober.routable_labels == {la}
        assert report.table.models == {"m": (la,)}
        assert (lb,) not in gauge(metrics, "gateway_worker_ready")
        await prober.pool.aclose()


async def test_routing_metadata_is_polled_for_a_work_based_policy():
    with fleet(2) as (a, b):
        for w, served in ((a, 4), (b, 6)):
            w.control = rc.ModelControlStatusResponse(
                discipline="fifo",
                models=[
                    rc.ModelStatus(
                        name="m",
                        total_compute_seconds=0.1 * served,
                        requests_served=served,
                        rows_served=4 * served,
                        batch_input_name="x",
                        batch_axis=1,
                    )
                ],
            )
        policy = LeastOutstanding(WorkBasis.COMPUTE)
        prober, _, _ = make_prober([a, b], policy=policy)
        report = await prober.round()
        assert report.metadata_polled == tuple(sorted(labels_of([a, b])))
        cost = prober.metadata.models["m"]
        assert cost.cost_per_request == pytest.approx(0.1)
        assert cost.cost_per_item == pytest.approx(0.025)
        assert policy.batch_input("m") == ("x", 1)  # the policy got the metadata
        assert policy.charge("m", 4) == pytest.approx(0.1)
        await prober.pool.aclose()


async def test_refresh_is_single_flight_and_rate_limited():
    with fleet(1) as (a,):
        prober, _, _ = make_prober([a])
        await prober.round()
        refresher = prober.refresher
        scans, indexed = refresher.scans, a.indexed
        await refresher.refresh_now()  # the round's scan finished just now: skipped
        assert (refresher.scans, a.indexed) == (scans, indexed)

        a.models = ["m", "fresh"]
        a.index_delay = 0.3
        fast = RouteRefresher(refresher.state, prober.routable_clients, min_interval=0.0)
        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(fast.refresh_now)
        assert fast.scans == 1 and a.indexed == indexed + 1  # five callers, one scan
        assert fast.state.table.replicas("fresh") == tuple(labels_of([a]))
        await prober.pool.aclose()


async def test_request_refresh_scans_in_the_background_task():
    with fleet(1) as (a,):
        prober, _, _ = make_prober([a])
        await prober.round()
        refresher = RouteRefresher(prober.refresher.state, prober.routable_clients, min_interval=0)
        a.models = ["later"]
        async with anyio.create_task_group() as tg:
            tg.start_soon(refresher.run)
            refresher.request_refresh()
            await until(lambda: refresher.state.table.replicas("later"), what="'later' routed")
            tg.cancel_scope.cancel()
        assert "m" not in refresher.state.table.models
        await prober.pool.aclose()


async def test_an_unreachable_worker_contributes_nothing_to_a_scan():
    with fleet(2) as (a, b):
        la, _ = labels_of([a, b])
        prober, _, _ = make_prober([a, b], watchdog=0.3)
        await prober.round()
        b.index_delay = 60.0  # answers probes, but its index is too slow this time
        with anyio.fail_after(30):  # the scan gave up on b long before its index came
            await prober.refresher.scan()
        assert prober.refresher.state.table.models == {"m": (la,)}
        await prober.pool.aclose()


async def test_a_fleet_that_stops_answering_is_never_a_wedge_and_is_taken_back():
    with fleet(1) as (a,):
        prober, _, _ = make_prober([a], probe_timeout=0.2)
        await prober.round()
        state = prober.refresher.state
        assert state.table.models == {"m": tuple(labels_of([a]))}
        a.probe_delay = 60.0  # far past the 0.2 s probe timeout, however loaded the machine
        for _ in range(4):  # round after round of timeouts: the prober goes on
            report = await prober.round()
            assert report.outcomes == {labels_of([a])[0]: ProbeOutcome.TIMED_OUT}
        assert not prober.ready and report.table.models == {}
        assert state.known("m") and not state.known("nope")  # the fleet has it, unready
        assert isinstance(state.missing("m"), Unavailable)
        assert isinstance(state.missing("nope"), NotFound)
        a.probe_delay = 0.0
        report = await prober.round()
        assert report.table.models == {"m": tuple(labels_of([a]))}
        await prober.pool.aclose()


async def test_run_starts_after_the_first_round_and_wake_runs_one_early():
    with fleet(1) as (a,):
        prober, _, _ = make_prober([a], interval=30.0)
        async with anyio.create_task_group() as tg:
            await tg.start(prober.run)
            assert prober.rounds == 1 and prober.refresher.state.table.replicas("m")
            a.models = ["next"]
            prober.wake()
            # long before the 30 s interval
            await until(lambda: prober.refresher.state.table.replicas("next"), what="'next' routed")
            assert prober.rounds == 2
            tg.cancel_scope.cancel()
        await prober.pool.aclose()

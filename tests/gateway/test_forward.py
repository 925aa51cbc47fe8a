"""The ModelInfer request path against real gRPC servers on loopback: raw bytes through,
spreading, failover on transport failure and NOT_FOUND, statuses passed through unchanged,
unknown models, exact deadlines, work-based routing with reservations, the register gate and
the metrics."""

from __future__ import annotations

import threading

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kserve_trio.client.errors import RpcError
from kserve_trio.core.errors import DeadlineExceeded, InvalidArgument, NotFound, StatusCode
from kserve_trio.gateway.config import WorkBasis
from kserve_trio.gateway.fleet.routing import LeastOutstanding
from kserve_trio.gateway.request_path.forward import Forwarder
from kserve_trio.proto import inference as pb
from kserve_trio.proto import reactant_control as rc
from tests.gateway.test_prober import fleet, labels_of, make_prober
from tests.waiting import until

pytestmark = pytest.mark.anyio


def request(model: str = "m", rows: int = 1, request_id: str = "") -> bytes:
    return bytes(
        pb.ModelInferRequest(
            model_name=model,
            id=request_id,
            inputs=[
                pb.ModelInferRequestInferInputTensor(name="x", datatype="FP32", shape=[rows, 4])
            ],
            raw_input_contents=[b"\x00" * (16 * rows)],
        )
    )


async def gateway(workers, **kw):
    prober, _dns, metrics = make_prober(workers, **kw)
    await prober.round()
    forwarder = Forwarder(
        pool=prober.pool,
        state=prober.refresher.state,
        policy=prober.policy,
        refresher=prober.refresher,
        routable=lambda: prober.routable_labels,
        metrics=metrics,
    )
    return forwarder, prober, metrics


def counts(metrics, family: str, sample: str, keys=("rpc", "model", "status")) -> dict:
    """``sample``'s values keyed by the values of the labels ``keys``, in that order."""
    for fam in text_string_to_metric_families(metrics.exposition().decode()):
        if fam.name == family:
            return {
                tuple(s.labels[k] for k in keys): s.value for s in fam.samples if s.name == sample
            }
    return {}


async def test_requests_go_through_as_raw_bytes_and_spread_over_replicas():
    with fleet(2) as (a, b):
        fw, prober, metrics = await gateway([a, b])
        for i in range(10):
            data = request(request_id=f"r{i}")
            assert await fw.infer(data) == b"reply:" + data
        assert len(a.requests) == len(b.requests) == 5
        assert counts(metrics, "gateway_requests", "gateway_requests_total") == {
            ("ModelInfer", "m", "OK"): 10.0
        }
        per_worker = counts(
            metrics,
            "gateway_worker_latency_seconds",
            "gateway_worker_latency_seconds_count",
            ("rpc", "worker"),
        )
        assert per_worker == {("ModelInfer", w): 5.0 for w in labels_of([a, b])}
        await prober.pool.aclose()


async def test_a_dead_worker_fails_over_to_the_next_replica():
    with fleet(2) as (a, b):
        fw, prober, _ = await gateway([a, b])
        b.stop()  # killed: its connections drop, its port refuses
        for _ in range(6):
            assert (await fw.infer(request())).startswith(b"reply:")
        assert len(a.requests) == 6
        await prober.pool.aclose()


async def test_not_found_on_one_worker_fails_over_and_asks_for_a_refresh():
    with fleet(2) as (a, b):
        fw, prober, _ = await gateway([a, b])
        a.fail_with = (int(StatusCode.NOT_FOUND), "model 'm' is not loaded")
        asked = []
        prober.refresher.request_refresh = lambda: asked.append(1)  # type: ignore[method-assign]
        for _ in range(4):
            assert (await fw.infer(request())).startswith(b"reply:")
        assert len(b.requests) == 4 and asked  # every request reached b in the end
        await prober.pool.aclose()


@pytest.mark.parametrize(
    "status",
    [
        StatusCode.INVALID_ARGUMENT,
        StatusCode.DEADLINE_EXCEEDED,
        StatusCode.RESOURCE_EXHAUSTED,
        StatusCode.FAILED_PRECONDITION,
        StatusCode.INTERNAL,
    ],
)
async def test_a_workers_status_reaches_the_client_unchanged_without_failover(status):
    with fleet(2) as (a, b):
        fw, prober, metrics = await gateway([a, b])
        a.fail_with = b.fail_with = (int(status), f"{status.name} from the worker")
        with pytest.raises(RpcError) as info:
            await fw.infer(request())
        assert info.value.status is status
        assert info.value.message == f"{status.name} from the worker"
        assert len(a.requests) + len(b.requests) == 1  # not retried elsewhere
        label = "".join(p.capitalize() for p in status.name.split("_"))
        assert counts(metrics, "gateway_requests", "gateway_requests_total") == {
            ("ModelInfer", "m", label): 1.0
        }
        await prober.pool.aclose()


async def test_unavailable_everywhere_is_the_last_error():
    with fleet(2) as (a, b):
        fw, prober, _ = await gateway([a, b])
        a.fail_with = (int(StatusCode.UNAVAILABLE), "draining a")
        b.fail_with = (int(StatusCode.UNAVAILABLE), "draining b")
        with pytest.raises(RpcError) as info:
            await fw.infer(request())
        assert info.value.status is StatusCode.UNAVAILABLE
        assert len(a.requests) == len(b.requests) == 1  # both tried
        await prober.pool.aclose()


async def test_an_unknown_model_refreshes_once_then_is_not_found():
    with fleet(1) as (a,):
        fw, prober, metrics = await gateway([a])
        scans = prober.refresher.scans
        with pytest.raises(NotFound, match=r"^model 'nope' not found on any worker$"):
            await fw.infer(request("nope"))
        a.models = ["m", "new"]
        prober.refresher._finished_at = -1e9  # as if the last scan were long ago
        assert (await fw.infer(request("new"))).startswith(b"reply:")  # found by the refresh
        assert prober.refresher.scans == scans + 1
        assert (
            counts(metrics, "gateway_requests", "gateway_requests_total")[
                ("ModelInfer", "<unknown>", "NotFound")
            ]
            == 1.0
        )
        await prober.pool.aclose()


async def test_malformed_requests_are_invalid_argument():
    with fleet(1) as (a,):
        fw, prober, _ = await gateway([a])
        with pytest.raises(InvalidArgument):
            await fw.infer(b"\x0a\x05ab")
        assert a.requests == []
        await prober.pool.aclose()


async def test_the_deadline_is_forwarded_exactly_and_a_passed_one_is_not_sent():
    with fleet(1) as (a,):
        fw, prober, _ = await gateway([a])
        started = anyio.current_time()
        await fw.infer(request(), deadline=started + 20.3)
        took = anyio.current_time() - started
        assert 20.3 - took <= a.deadlines[-1] <= 20.3  # short only by the call's own time
        with pytest.raises(DeadlineExceeded, match="deadline exceeded at gateway for model 'm'"):
            await fw.infer(request(), deadline=anyio.current_time() - 0.01)
        assert len(a.requests) == 1
        await prober.pool.aclose()


async def test_least_outstanding_by_items_reserves_and_releases_the_items():
    with fleet(2) as (a, b):
        for w in (a, b):  # the workers say which input and axis count the items
            w.control = rc.ModelControlStatusResponse(
                models=[rc.ModelStatus(name="m", batch_input_name="x", batch_axis=1)]
            )
        policy = LeastOutstanding(WorkBasis.ITEMS)
        fw, prober, _ = await gateway([a, b], policy=policy)
        assert policy.batch_input("m") == ("x", 1)  # from the prober's metadata poll
        a.infer_gate = b.infer_gate = gate = threading.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(fw.infer, request(rows=8))  # 8 items on a (tie -> smaller label)
            await until(lambda: a.in_flight == 1)
            assert policy.inflight_work() == {labels_of([a])[0]: 8.0}
            tg.start_soon(fw.infer, request(rows=1))  # b is emptier
            tg.start_soon(fw.infer, request(rows=1))  # b again (1 < 8)
            await until(lambda: b.in_flight == 2)
            assert policy.inflight_work() == {labels_of([a])[0]: 8.0, labels_of([b])[0]: 2.0}
            gate.set()
        assert policy.inflight_work() == {}  # every reservation released
        assert (len(a.requests), len(b.requests)) == (1, 2)
        await prober.pool.aclose()


async def test_a_reservation_is_released_when_the_request_fails():
    with fleet(1) as (a,):
        policy = LeastOutstanding(WorkBasis.REQUESTS)
        fw, prober, _ = await gateway([a], policy=policy)
        a.fail_with = (int(StatusCode.INVALID_ARGUMENT), "no")
        with pytest.raises(RpcError):
            await fw.infer(request())
        assert policy.inflight_work() == {}
        await prober.pool.aclose()


async def test_inference_to_a_worker_waits_for_its_register_gate():
    with fleet(1) as (a,):
        fw, prober, _ = await gateway([a])
        (label,) = labels_of([a])
        done = []
        async with anyio.create_task_group() as tg:
            async with fw.gates.hold(label):

                async def call() -> None:
                    await fw.infer(request())
                    done.append(anyio.current_time())

                tg.start_soon(call)
                await anyio.sleep(0.2)
                assert done == [] and a.requests == []  # held back
                released = anyio.current_time()
        assert done and done[0] >= released and len(a.requests) == 1
        await prober.pool.aclose()


async def test_a_cancelled_client_cancels_the_worker_call():
    with fleet(1) as (a,):
        fw, prober, _ = await gateway([a])
        a.infer_delay = 60.0
        async with anyio.create_task_group() as tg:
            tg.start_soon(fw.infer, request())
            await until(lambda: a.in_flight == 1, what="the call on the worker")
            tg.cancel_scope.cancel()
        await until(lambda: a.cancelled, what="the worker's handler cancelled")
        assert a.cancelled == 1
        await prober.pool.aclose()

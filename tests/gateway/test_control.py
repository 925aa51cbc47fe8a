"""GatewayControlService on a real in-process gateway (``serve_gateway(blocking=False)``) in front
of scripted fake workers (real gRPC servers on loopback addresses): start-up preconditions,
every RPC's statuses and warnings, operator repacks (waiting, coalescing), the lpt_packing
metrics, and the other modes' answers."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import urllib.request

import anyio
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from kserve_trio.client.errors import RpcError
from kserve_trio.client.h2_transport import H2Transport
from kserve_trio.client.transport import Endpoint
from kserve_trio.core.errors import StatusCode
from kserve_trio.gateway.config import (
    GatewayConfig,
    ListenConfig,
    ModelPlacementConfig,
    ProberConfig,
    SchedulingConfig,
    SchedulingMode,
)
from kserve_trio.gateway.placement.scheduler import LptStartupError
from kserve_trio.gateway.server import serve_gateway, stop
from kserve_trio.proto import reactant_control as rc
from tests.gateway.procs import Gateway as GatewayProc
from tests.gateway.test_prober import fleet
from tests.ports import free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
LPT = SchedulingMode.LPT_PACKING
SERVICE = "/reactant_control.GatewayControlService/"
REPLY = {
    "GetSchedulingStatus": rc.GetSchedulingStatusResponse,
    "SetSchedulingPolicy": rc.SetSchedulingPolicyResponse,
    "SetModelPlacement": rc.SetModelPlacementResponse,
    "Repack": rc.RepackResponse,
}


def status_of(name: str, nbytes: int = 100) -> rc.ModelStatus:
    return rc.ModelStatus(name=name, weight_nbytes=nbytes, max_batch_size=8)


def scripted(workers, models=("a", "b"), budget=0, discipline="fifo") -> None:
    for w in workers:
        w.models = list(models)
        w.echo = True
        w.control = rc.ModelControlStatusResponse(
            residency_mode="self_managed",
            discipline=discipline,
            weight_cache_max_bytes=budget,
            models=[status_of(m) for m in models],
        )


@contextlib.contextmanager
def running(workers, scheduling: SchedulingConfig | None = None, **kw):
    cfg = GatewayConfig(
        listen=ListenConfig("127.0.0.1:0", "127.0.0.1:0"),
        endpoints=tuple(f"{w.host}:{w.port}" for w in workers),
        scheduling=scheduling or SchedulingConfig(mode=LPT),
        prober=kw.pop("prober", ProberConfig(health_interval_seconds=0.3)),
        **kw,
    )
    gateway = serve_gateway(cfg, blocking=False)
    try:
        yield gateway
    finally:
        stop(gateway)


async def _calls(address: str, calls):
    host, port = address.rsplit(":", 1)
    transport = H2Transport(Endpoint(host=host, port=int(port)))
    try:
        return await asyncio.gather(
            *(transport.unary(SERVICE + rpc, req, REPLY[rpc], timeout=30) for rpc, req in calls),
            return_exceptions=True,
        )
    finally:
        await transport.aclose()


def call(gateway, rpc: str, request):
    (result,) = anyio.run(_calls, gateway.address, [(rpc, request)])
    if isinstance(result, Exception):
        raise result
    return result


def fails(gateway, rpc: str, request, status: StatusCode, message: str) -> str:
    with pytest.raises(RpcError) as info:
        call(gateway, rpc, request)
    assert info.value.status is status, info.value
    assert re.search(message, info.value.message), info.value.message
    return info.value.message


def status(gateway) -> rc.GetSchedulingStatusResponse:
    return call(gateway, "GetSchedulingStatus", rc.GetSchedulingStatusRequest())


def metrics(gateway) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{gateway.metrics_port}/metrics") as r:
        return r.read().decode()


# ---- start-up -------------------------------------------------------------------------------


def test_start_up_fails_on_a_fair_worker_naming_it():
    with fleet(2) as workers:
        scripted(workers)
        workers[1].control.discipline = "fair"
        label = f"{workers[1].host}:{workers[1].port}"
        with pytest.raises(LptStartupError, match=rf"worker {label} runs the 'fair'.*fifo or edf"):
            with running(workers):
                pass


def test_start_up_fails_on_differing_model_sets():
    with fleet(2) as workers:
        scripted(workers)
        workers[1].control.models = [status_of("a")]
        with pytest.raises(LptStartupError, match="report different model sets"):
            with running(workers):
                pass


def test_start_up_fails_fast_on_a_worker_the_control_plane_cannot_reach():
    with fleet(1) as workers:
        scripted(workers)
        dead = f"127.0.0.1:{free_port()}"  # nothing listens there
        cfg = GatewayConfig(
            listen=ListenConfig("127.0.0.1:0", "127.0.0.1:0"),
            endpoints=(f"127.0.0.1:{workers[0].port}", dead),
            scheduling=SchedulingConfig(mode=LPT),
            prober=ProberConfig(health_interval_seconds=0.3),
        )
        with pytest.raises(LptStartupError, match=rf"worker\(s\) \['{dead}'\] unreachable"):
            serve_gateway(cfg, blocking=False)


# ---- the RPCs on a running lpt_packing gateway ------------------------------------------------


@pytest.fixture(scope="module")
def lpt():
    with fleet(2) as workers:
        scripted(workers, budget=150)  # one 100-byte model fits a worker, two do not
        scheduling = SchedulingConfig(
            mode=LPT, models={"b": ModelPlacementConfig(fill_mode=None, fill_factor=2.0)}
        )
        with running(workers, scheduling) as gateway:
            yield gateway, workers


def test_status_reports_the_startup_repack_models_workers_and_knobs(lpt):
    gateway, workers = lpt
    st = status(gateway)
    assert st.mode == "lpt_packing" and st.repack.last_trigger == "startup"
    assert st.repack.repack_count >= 1
    assert [m.name for m in st.models] == ["a", "b"]
    a, b = st.models
    assert a.placed and b.placed and a.configured_replicas == 1 and a.effective_replicas == 1
    # forbid_memory_oversubscription: the two 100-byte models go to different 150-byte workers
    assert {a.replicas[0].worker, b.replicas[0].worker} == {f"{w.host}:{w.port}" for w in workers}
    assert b.fill_quantum == 16 and a.fill_quantum == 8  # fill_factor 2 x max batch 8
    assert [w.weight_budget_bytes for w in st.workers] == [150, 150]
    assert not any(w.oversubscribed for w in st.workers)
    assert st.policy.ema_halflife_compute_seconds == 300 and st.policy.max_worker_share == 0.8


def test_set_scheduling_policy_is_validated_whole_and_bumps_the_generation(lpt):
    gateway, _ = lpt
    before = status(gateway).policy
    bad = rc.SetSchedulingPolicyRequest(
        update_mask=["hysteresis", "routing_fill_factor"],
        policy=rc.SchedulingPolicy(hysteresis=0.3, routing_fill_factor=0.0),
    )
    fails(gateway, "SetSchedulingPolicy", bad, StatusCode.INVALID_ARGUMENT, "routing_fill_fac")
    assert status(gateway).policy == before  # nothing applied
    for mask, message in (
        ([], "non-empty update_mask"),
        (["max_worker_share"], "cannot be changed at runtime"),
        (["mode"], "cannot be changed at runtime"),
        (["colour"], "accepted: rebalance_compute_seconds"),
    ):
        req = rc.SetSchedulingPolicyRequest(update_mask=mask, policy=rc.SchedulingPolicy())
        fails(gateway, "SetSchedulingPolicy", req, StatusCode.INVALID_ARGUMENT, message)
    ok = rc.SetSchedulingPolicyRequest(
        update_mask=["hysteresis", "ema_halflife_compute_seconds", "routing_fill_mode"],
        policy=rc.SchedulingPolicy(
            hysteresis=0.3, ema_halflife_compute_seconds=0.0, routing_fill_mode="inflight"
        ),
    )
    reply = call(gateway, "SetSchedulingPolicy", ok)
    assert reply.applied.generation == before.generation + 1 and not reply.persisted
    assert reply.applied.hysteresis == 0.3 and reply.applied.ema_halflife_compute_seconds == 300
    assert any("parks a closed loop" in w for w in reply.warnings)
    assert any("parks a closed loop" in w for w in status(gateway).warnings)
    back = rc.SetSchedulingPolicyRequest(
        update_mask=["routing_fill_mode"], policy=rc.SchedulingPolicy(routing_fill_mode="run")
    )
    assert call(gateway, "SetSchedulingPolicy", back).applied.generation == before.generation + 2


def test_set_model_placement_statuses_and_warnings(lpt):
    gateway, _ = lpt
    for req, code, message in (
        (rc.SetModelPlacementRequest(name=" "), StatusCode.INVALID_ARGUMENT, "needs a model"),
        (rc.SetModelPlacementRequest(name="zz"), StatusCode.NOT_FOUND, "allow_unknown_model"),
        (
            rc.SetModelPlacementRequest(name="a", replicas=-2, fill_factor=-1),
            StatusCode.INVALID_ARGUMENT,
            "replicas must be",
        ),
    ):
        fails(gateway, "SetModelPlacement", req, code, message)
    stored = call(
        gateway,
        "SetModelPlacement",
        rc.SetModelPlacementRequest(
            name="zz", replicas=1, fill_factor=-1, allow_unknown_model=True
        ),
    )
    assert any("not served yet" in w for w in stored.warnings)
    reply = call(
        gateway,
        "SetModelPlacement",
        rc.SetModelPlacementRequest(name="a", replicas=5, fill_mode="spread", fill_factor=-1),
    )
    assert (reply.configured_replicas, reply.effective_replicas) == (5, 2)
    assert reply.fill_mode == "spread" and reply.fill_quantum == 8 and not reply.persisted
    warnings = " | ".join(reply.warnings)
    assert "clamped to 2" in warnings and "call Repack to apply it now" in warnings
    assert "oversubscription" in warnings  # a's 100 bytes on top of b's, over 150
    cleared = call(
        gateway, "SetModelPlacement", rc.SetModelPlacementRequest(name="a", fill_mode="inherit")
    )
    assert cleared.configured_replicas == 1 and cleared.fill_mode == "run"


def test_repack_waits_coalesces_and_counts(lpt):
    gateway, workers = lpt
    fails(gateway, "Repack", rc.RepackRequest(wait_seconds=-1), StatusCode.INVALID_ARGUMENT, ">=")
    before = status(gateway).repack
    # a round held at its probes: the three requests all arrive before its tick
    gate = threading.Event()
    probes = [w.probes for w in workers]
    for w in workers:
        w.probe_gate = gate
    replies: list = []
    repacks = threading.Thread(
        target=lambda: replies.extend(
            anyio.run(_calls, gateway.address, [("Repack", rc.RepackRequest(wait_seconds=30))] * 3)
        )
    )
    try:
        # a probe that began after the gate closed: its round (the next to tick) is held
        held = lambda: any(w.probes > n for w, n in zip(workers, probes, strict=True))  # noqa: E731
        wait_until(held, what="a held round")
        repacks.start()
        requested = before.operator_repacks_requested + 3
        wait_until(lambda: status(gateway).repack.operator_repacks_requested == requested)
    finally:
        gate.set()
        for w in workers:
            w.probe_gate = None
        if repacks.ident is not None:  # started
            repacks.join(60)
    assert all(r.completed for r in replies), replies
    assert sorted(r.sequence for r in replies) == [
        before.operator_repacks_requested + i for i in (1, 2, 3)
    ]
    after = status(gateway).repack
    assert after.repack_count == before.repack_count + 1  # one repack for the three
    assert after.last_trigger == "operator"
    assert after.operator_repacks_completed == before.operator_repacks_requested + 3
    clamped = call(gateway, "Repack", rc.RepackRequest(wait_seconds=500))
    assert clamped.completed and any("clamped to 120" in w for w in clamped.warnings)
    assert clamped.waited_seconds < 30
    no_wait = call(gateway, "Repack", rc.RepackRequest(wait_seconds=0))
    assert not no_wait.completed and no_wait.sequence > no_wait.completed_sequence


def test_requests_follow_the_placement_and_the_metrics_show_it(lpt):
    gateway, workers = lpt
    placed = {m.name: m.replicas[0].worker for m in status(gateway).models if m.placed}
    client = grpcclient.InferenceServerClient(gateway.address)
    before = {f"{w.host}:{w.port}": dict(w.stats) for w in workers}
    x = grpcclient.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.ones((1, 4), np.float32))
    for _ in range(4):
        client.infer("a", [x])
    for w in workers:
        label = f"{w.host}:{w.port}"
        grew = w.stats.get("a", 0) - before[label].get("a", 0)
        assert grew == (4 if placed["a"] == label else 0)
    text = metrics(gateway)
    a_home = placed["a"]
    assert f'gateway_placement_weight{{model="a",worker="{a_home}"}} 1.0' in text
    assert re.search(rf'gateway_replica_routed_total{{model="a",worker="{a_home}"}} [4-9]', text)
    assert 'gateway_repacks_total{trigger="startup"} 1.0' in text
    for name in (
        "gateway_model_utilization",
        "gateway_model_replicas",
        "gateway_replica_outstanding",
        "gateway_model_fill_quantum",
        'gateway_worker_inflight_work{basis="compute"',
    ):
        assert name in text, name


# ---- other modes --------------------------------------------------------------------------


def test_other_modes_report_only_their_mode_and_refuse_the_mutators():
    with fleet(1) as workers:
        scripted(workers)
        with running(workers, SchedulingConfig()) as gateway:
            assert status(gateway) == rc.GetSchedulingStatusResponse(mode="round_robin")
            message = "scheduling mode is 'round_robin'; the scheduler control RPCs require lpt"
            for rpc, req in (
                ("SetSchedulingPolicy", rc.SetSchedulingPolicyRequest()),
                ("SetModelPlacement", rc.SetModelPlacementRequest(name="a")),
                ("Repack", rc.RepackRequest()),
            ):
                fails(gateway, rpc, req, StatusCode.FAILED_PRECONDITION, message)
            assert "gateway_placement_weight" not in metrics(gateway)


def test_control_service_compact_memory_is_still_served_beside_it(lpt):
    gateway, workers = lpt
    before = [w.compactions for w in workers]
    host, port = gateway.address.rsplit(":", 1)

    async def compact():
        transport = H2Transport(Endpoint(host=host, port=int(port)))
        try:
            return await transport.unary(
                "/reactant_control.ControlService/CompactMemory",
                rc.CompactMemoryRequest(),
                rc.CompactMemoryResponse,
                timeout=30,
            )
        finally:
            await transport.aclose()

    reply = anyio.run(compact)
    assert reply.reloaded_models == 2  # the fakes' 1 each, summed
    assert [w.compactions for w in workers] == [n + 1 for n in before]


def test_the_gateway_cli_exits_2_naming_a_fair_worker(tmp_path):
    with fleet(1) as workers:
        scripted(workers, discipline="fair")
        g = "KSERVE_TRIO_GATEWAY_"
        env = {
            g + "WORKERS": f"{workers[0].host}:{workers[0].port}",
            g + "SCHEDULING_MODE": "lpt_packing",
            g + "STARTUP_WAIT_SECONDS": "0",
        }
        proc = GatewayProc(tmp_path, env)
        assert proc.proc.wait(60) == 2
        logs = proc.logs()
        assert "runs the 'fair' discipline" in logs and "fifo or edf" in logs
        proc.stop()

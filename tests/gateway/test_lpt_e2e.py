"""lpt_packing end to end: two CLI worker processes (fifo, a 7000-byte device-memory budget on the
CPU: mlp's 6432 weight bytes or cnn's 1256 plus scale4's 16, not all three) and the gateway CLI
in lpt_packing, driven by the stock tritonclient and the GatewayControlService.

After traffic to three models and ``Repack(wait_seconds)``, GetSchedulingStatus reports each
model on its configured number of replicas, each model's requests reach only its placed worker
(the workers' own Triton statistics), ``SetModelPlacement(replicas=-1)`` and a Repack put mlp on
both workers, and the compaction that follows reaches exactly the workers whose assignment
changed (the workers' own logs and the gateway's per-worker CompactMemory series)."""

from __future__ import annotations

import re
import time
import types

import anyio
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from kserve_trio.client.h2_transport import H2Transport
from kserve_trio.client.transport import Endpoint
from kserve_trio.proto import reactant_control as rc
from tests.gateway.procs import Gateway, Worker
from tests.ports import free_port
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
G = "KSERVE_TRIO_GATEWAY_"
W = "INFERENCE_SERVER_"
MODELS = ("mlp", "cnn", "scale4")
BUDGET_ENV = {
    W + "SCHEDULER_DISCIPLINE": "fifo",
    W + "RUNTIME_CPU_DEVICE_MEMORY_BYTES": "10000000",
    W + "RUNTIME_WEIGHT_CACHE_FRACTION": "0.0007",  # a 7000-byte on-demand budget
}
SERVICE = "/reactant_control.GatewayControlService/"
REPLY = {
    "GetSchedulingStatus": rc.GetSchedulingStatusResponse,
    "SetSchedulingPolicy": rc.SetSchedulingPolicyResponse,
    "SetModelPlacement": rc.SetModelPlacementResponse,
    "Repack": rc.RepackResponse,
}


def control(url: str, rpc: str, request):
    """One GatewayControlService call with the generated messages over our h2 transport."""
    host, port = url.rsplit(":", 1)

    async def go():
        transport = H2Transport(Endpoint(host=host, port=int(port)))
        try:
            return await transport.unary(SERVICE + rpc, request, REPLY[rpc], timeout=30)
        finally:
            await transport.aclose()

    return anyio.run(go)


@pytest.fixture(scope="module")
def fleet(demo_repo, tmp_path_factory):
    work = tmp_path_factory.mktemp("lpt_e2e")
    ports = [free_port(), free_port()]
    workers = [
        Worker(demo_repo, "127.0.0.1", p, models=":".join(MODELS), env=BUDGET_ENV) for p in ports
    ]
    gw = None
    try:
        for w in workers:
            w.wait_ready()
        env = {
            G + "WORKERS": ",".join(w.url for w in workers),
            G + "SCHEDULING_MODE": "lpt_packing",
            G + "SCHEDULING_MAX_WORKER_SHARE": "1",
            # no compute-triggered repack during the test: only startup and operator ones
            G + "SCHEDULING_FIRST_REBALANCE_COMPUTE_SECONDS": "100000",
            G + "SCHEDULING_REBALANCE_COMPUTE_SECONDS": "100000",
        }
        gw = Gateway(work, env)
        gw.wait_ready()
        yield types.SimpleNamespace(workers=workers, gw=gw)
    finally:
        if gw is not None:
            assert gw.stop() == 0, gw.logs()
        for w in workers:
            w.stop()


def inputs(model: str, rows: int = 1) -> list[grpcclient.InferInput]:
    name, shape = {"mlp": ("input_0", [rows, 16]), "cnn": ("input_0", [rows, 3, 32, 32])}.get(
        model, ("x", [4])
    )
    inp = grpcclient.InferInput(name, shape, "FP32")
    inp.set_data_from_numpy(np.ones(shape, np.float32))
    return [inp]


def successes(worker: Worker, model: str) -> int:
    stats = worker.client().get_inference_statistics(model, as_json=True)["model_stats"][0]
    return int(stats["inference_stats"].get("success", {}).get("count", 0))


def placement(status: rc.GetSchedulingStatusResponse) -> dict[str, list[str]]:
    return {m.name: sorted(r.worker for r in m.replicas) for m in status.models if m.placed}


def compactions(worker: Worker) -> int:
    return worker.logs().count('"memory_compacted"')


def compact_calls(gw: Gateway) -> dict[str, int]:
    _, text = gw.admin("/metrics")
    pattern = r'gateway_worker_latency_seconds_count\{rpc="CompactMemory",worker="([^"]+)"\} (\S+)'
    return {w: int(float(n)) for w, n in re.findall(pattern, text)}


def tick_after(gw: Gateway, after: float) -> float | None:
    """The wall-clock time of the scheduler's last tick (a prober round) if it came after
    ``after``."""
    status = control(gw.url, "GetSchedulingStatus", rc.GetSchedulingStatusRequest())
    tick = status.repack.last_tick_unix_seconds
    return tick if tick > after else None


def test_placement_follows_traffic_and_an_all_replicas_override(fleet):
    gw, (a, b) = fleet.gw, fleet.workers
    labels = sorted(w.url for w in fleet.workers)
    start = control(gw.url, "GetSchedulingStatus", rc.GetSchedulingStatusRequest())
    assert start.mode == "lpt_packing" and start.repack.last_trigger == "startup"
    assert [w.worker for w in start.workers] == labels and all(w.ready for w in start.workers)
    assert {w.weight_budget_bytes for w in start.workers} == {7000}
    assert start.policy.max_worker_share == 1.0 and start.policy.generation == 0

    client = gw.client()
    for model, n in (("mlp", 24), ("cnn", 12), ("scale4", 4)):
        for _ in range(n):
            client.infer(model, inputs(model))

    # two prober rounds poll the workers' counters after the traffic
    traffic_end = time.time()
    first = wait_until(lambda: tick_after(gw, traffic_end), 60, "a prober round")
    wait_until(lambda: tick_after(gw, first), 60, "a second prober round")
    reply = control(gw.url, "Repack", rc.RepackRequest(wait_seconds=20))
    assert reply.completed and reply.completed_sequence >= reply.sequence, reply
    assert reply.repack.last_trigger == "operator"
    status = control(gw.url, "GetSchedulingStatus", rc.GetSchedulingStatusRequest())
    placed = placement(status)
    # every model on its configured replica count (default 1), and memory decides the pairing:
    # mlp's 6432 bytes leave no room for cnn's 1256 on the same 7000-byte worker
    assert set(placed) == set(MODELS) and all(len(ws) == 1 for ws in placed.values()), placed
    assert placed["mlp"] != placed["cnn"], placed
    by_model = {m.name: m for m in status.models}
    # the traffic orders the models (24 mlp requests against 4 of scale4); utilization is that
    # rate times each model's measured execution time, which a loaded machine can turn around
    assert by_model["mlp"].arrival_rate > by_model["scale4"].arrival_rate > 0
    assert by_model["mlp"].utilization > 0 and by_model["scale4"].utilization > 0
    assert by_model["mlp"].configured_replicas == 1 and by_model["mlp"].effective_replicas == 1
    assert not any(w.oversubscribed for w in status.workers)

    # requests of each model now reach only its placed worker (the workers' own statistics)
    before = {(w.url, m): successes(w, m) for w in (a, b) for m in MODELS}
    for model in MODELS:
        for _ in range(6):
            client.infer(model, inputs(model))
    for model in MODELS:
        for w in (a, b):
            delta = successes(w, model) - before[(w.url, model)]
            assert delta == (6 if placed[model] == [w.url] else 0), (model, w.url, delta)

    # mlp on every worker: the override, then a repack
    grown = control(
        gw.url, "SetModelPlacement", rc.SetModelPlacementRequest(name="mlp", replicas=-1)
    )
    assert grown.configured_replicas == -1 and grown.effective_replicas == 2
    assert any("call Repack" in w for w in grown.warnings)
    old_home = placed["mlp"][0]
    other = next(label for label in labels if label != old_home)
    worker_logs = {w.url: compactions(w) for w in (a, b)}
    calls_before = compact_calls(gw)
    reply = control(gw.url, "Repack", rc.RepackRequest(wait_seconds=20))
    assert reply.completed
    after = control(gw.url, "GetSchedulingStatus", rc.GetSchedulingStatusRequest())
    now = placement(after)
    assert now["mlp"] == labels, now
    (mlp,) = [m for m in after.models if m.name == "mlp"]
    assert [r.weight for r in mlp.replicas] == [0.5, 0.5]
    changed = {w for m in MODELS for w in set(placed[m]) ^ set(now[m])}
    assert other in changed

    # compaction reached exactly the workers whose assignment changed
    def compacted() -> bool:  # the gateway's series and the workers' own logs
        calls = compact_calls(gw)
        return all(calls.get(w, 0) > calls_before.get(w, 0) for w in changed) and all(
            compactions(w) > worker_logs[w.url] for w in (a, b) if w.url in changed
        )

    wait_until(compacted, 30, "the compactions of the changed workers")
    time.sleep(0.5)  # an absence: a compaction no unchanged worker may get, looked for a while
    calls = compact_calls(gw)
    for label in labels:
        grew = calls.get(label, 0) - calls_before.get(label, 0)
        assert grew == (1 if label in changed else 0), (label, calls_before, calls)
    for w in (a, b):
        grew = compactions(w) - worker_logs[w.url]
        assert grew == (1 if w.url in changed else 0), (w.url, grew)

    # the fill plan now spreads mlp over both workers
    before = {w.url: successes(w, "mlp") for w in (a, b)}
    for _ in range(8):
        client.infer("mlp", inputs("mlp"))
    assert all(successes(w, "mlp") > before[w.url] for w in (a, b))


def test_model_load_through_the_gateway_names_set_model_placement(fleet):
    client = fleet.gw.client()
    for call in (client.load_model, client.unload_model):
        with pytest.raises(InferenceServerException) as info:
            call("cnn")
        assert "StatusCode.FAILED_PRECONDITION" in str(info.value.status())
        assert "SetModelPlacement" in info.value.message()
    assert client.is_model_ready("cnn")  # nothing was unloaded

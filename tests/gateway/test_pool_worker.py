"""The gateway's foundation against a real worker (the demo repository, compiled by JAX): the
name ``localhost`` discovered by the system resolver, probed ready, its repository index built
into a routing table, ModelInfer forwarded as raw bytes built by the stock tritonclient protobuf
classes (the reply is byte-identical to a direct call and numerically right), statuses passed
through, and routing metadata from its real control plane."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as sp

from kserve_trio.client.errors import RpcError
from kserve_trio.client.h2_transport import H2Transport
from kserve_trio.client.transport import Endpoint, method_path
from kserve_trio.core.errors import StatusCode
from kserve_trio.gateway.config import WorkBasis
from kserve_trio.gateway.fleet.discovery import Discovery
from kserve_trio.gateway.fleet.pool import (
    PROBE_TIMEOUT_SECONDS,
    PoolSettings,
    ProbeOutcome,
    RawReply,
    WorkerPool,
)
from kserve_trio.gateway.fleet.routing import (
    Failover,
    LeastOutstanding,
    build_routing_table,
    failover_action,
    ready_model_names,
)
from kserve_trio.gateway.fleet.routing_metadata import EMPTY_METADATA, aggregate_poll, fold_poll
from kserve_trio.gateway.request_path.peek import peek_infer_request
from kserve_trio.proto import inference as pb
from kserve_trio.proto import reactant_control as rc
from kserve_trio.worker.server import serve, stop
from tests.e2e import reference as ref

pytestmark = pytest.mark.anyio
INFER = method_path("ModelInfer")
CONTROL = "/reactant_control.ControlService/ModelControlStatus"


@pytest.fixture(scope="module")
def worker(demo_repo):
    running = serve(
        None,
        blocking=False,
        model_dirs=[str(demo_repo)],
        model_control_mode="static",
        models_include=["mlp"],
        endpoints={"host": "127.0.0.1", "port": 0},
    )
    yield running
    stop(running)


def mlp_request(x: np.ndarray, request_id: str) -> bytes:
    msg = sp.ModelInferRequest(model_name="mlp", id=request_id)
    t = msg.inputs.add()
    t.name, t.datatype = "input_0", "FP32"
    t.shape.extend(x.shape)
    msg.outputs.add().name = "output"
    msg.raw_input_contents.append(x.astype(np.float32).tobytes())
    return msg.SerializeToString()


async def pooled(worker) -> tuple[WorkerPool, str]:
    discovery = Discovery([f"localhost:{worker.port}"])
    pool = WorkerPool(PoolSettings(max_concurrent_streams=8, request_timeout=30))
    await pool.apply((await discovery.refresh()).diff)
    label = f"127.0.0.1:{worker.port}"
    assert label in pool.clients
    return pool, label


async def test_a_real_worker_is_discovered_probed_and_indexed(worker):
    pool, label = await pooled(worker)
    (outcome, step) = (await pool.probe_all())[label]
    assert outcome is ProbeOutcome.READY and step.became_ready
    index = await pool.get(label).call(
        method_path("RepositoryIndex"),
        pb.RepositoryIndexRequest(ready=True),
        pb.RepositoryIndexResponse,
        timeout=PROBE_TIMEOUT_SECONDS,
    )
    table = build_routing_table({label: ready_model_names(index)})
    assert table.replicas("mlp") == (label,)
    await pool.aclose()


async def test_model_infer_is_forwarded_as_raw_bytes(worker, demo_repo):
    pool, label = await pooled(worker)
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    request = mlp_request(x, "req-7")
    head = peek_infer_request(request, "input_0")
    assert (head.model_name, head.id, head.shape) == ("mlp", "req-7", (4, 16))
    through_pool = await pool.get(label).call_raw(INFER, request)
    async with H2Transport(Endpoint("127.0.0.1", worker.port)) as direct:
        straight = await direct.unary(INFER, request, RawReply, timeout=30)
    assert through_pool == straight  # the worker's bytes, untouched
    reply = sp.ModelInferResponse.FromString(through_pool)
    assert reply.id == "req-7" and list(reply.outputs[0].shape) == [4, 8]
    y = np.frombuffer(reply.raw_output_contents[0], dtype=np.float32).reshape(4, 8)
    np.testing.assert_allclose(y, ref.mlp(x, ref.weights(demo_repo, "mlp")), rtol=1e-5, atol=1e-5)
    await pool.aclose()


async def test_worker_errors_pass_through_with_their_status(worker):
    pool, label = await pooled(worker)
    client = pool.get(label)
    bad = sp.ModelInferRequest(model_name="mlp")
    t = bad.inputs.add()
    t.name, t.datatype = "input_0", "FP32"
    t.shape.extend([2, 15])  # the model takes 16 features
    bad.raw_input_contents.append(b"\x00" * (2 * 15 * 4))
    with pytest.raises(RpcError) as info:
        await client.call_raw(INFER, bad.SerializeToString())
    assert info.value.status is StatusCode.INVALID_ARGUMENT
    assert failover_action(info.value.status) is Failover.RETURN
    with pytest.raises(RpcError) as info:
        await client.call_raw(INFER, mlp_request(np.zeros((1, 16)), "x").replace(b"mlp", b"nop", 1))
    assert info.value.status is StatusCode.NOT_FOUND
    assert failover_action(info.value.status) is Failover.NEXT_AND_REFRESH
    await pool.aclose()


async def test_routing_metadata_from_the_real_control_plane(worker):
    pool, label = await pooled(worker)
    client = pool.get(label)

    async def poll():
        reply = await client.call(
            CONTROL, rc.ModelControlStatusRequest(), rc.ModelControlStatusResponse, timeout=5
        )
        return aggregate_poll({label: reply})

    meta = fold_poll(EMPTY_METADATA, await poll())
    before = meta.last_poll.models["mlp"]
    for i in range(5):
        await client.call_raw(INFER, mlp_request(np.ones((4, 16)), f"r{i}"))
    meta = fold_poll(meta, await poll())
    after = meta.last_poll.models["mlp"]
    assert after.requests_served - before.requests_served == 5
    assert after.rows_served - before.rows_served == 20
    assert meta.batch_input("mlp") == ("input_0", 1)  # 1-based, wire order: [n, 16]
    cost = meta.models["mlp"]
    assert cost.cost_per_request > 0 and cost.cost_per_item > 0
    # Every request this worker served had 4 rows, so every sample, and so the averages, keep
    # the per-item cost at a quarter of the per-request cost.
    assert cost.cost_per_item == pytest.approx(cost.cost_per_request / 4)
    lo = LeastOutstanding(WorkBasis.ITEMS, meta)
    name, _axis = lo.batch_input("mlp")
    peeked = peek_infer_request(mlp_request(np.ones((6, 16)), "p"), name)
    assert lo.request_units("mlp", peeked.shape) == 6
    await pool.aclose()

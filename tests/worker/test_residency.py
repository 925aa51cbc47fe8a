"""Residency on a live worker: the on-demand cache, explicit mode, the ControlService, metrics.

Servers run in-process on the CPU, where ``runtime.cpu_device_memory_bytes`` stands for the
device arena. The ControlService is called with our own h2 client transport and the generated messages;
explicit mode is driven through ``tritonclient`` as a Triton user would.
"""

from __future__ import annotations

import shutil
import uuid

import anyio
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from structlog.testing import capture_logs
from tritonclient.utils import InferenceServerException

from kserve_trio.client.endpoint import Endpoint
from kserve_trio.client.errors import RpcError
from kserve_trio.client.h2_transport import H2Transport
from kserve_trio.core.memory.shm_names import SHM_DIR
from kserve_trio.core.process.config import ResidencyState, SchedulerConfig
from kserve_trio.proto import reactant_control as pb
from kserve_trio.runtime.weight_cache import NEEDS_CACHE, SELF_MANAGED, WeightCache, weight_budget
from kserve_trio.runtime.weight_store import SharedWeightStore
from kserve_trio.worker.scheduler import Scheduler
from kserve_trio.worker.server import serve, stop
from tests.e2e import reference as ref

ARENA = 10_000_000
FRACTION = 0.0007  # a 7000-byte on-demand budget: mlp (6432 B) or cnn (1256 B), not both
CONTROL = "/reactant_control.ControlService/"
RESPONSES = {
    "ModelControlStatus": pb.ModelControlStatusResponse,
    "SetModelResidency": pb.SetModelResidencyResponse,
    "SetModelPolicy": pb.SetModelPolicyResponse,
    "CompactMemory": pb.CompactMemoryResponse,
}


def control(address: str, rpc: str, request):
    """One ControlService call; a failed one returns ``(status name, message)``."""

    async def call():
        host, port = address.rsplit(":", 1)
        async with H2Transport(Endpoint(host, int(port))) as transport:
            try:
                return await transport.unary(CONTROL + rpc, request, RESPONSES[rpc], timeout=30)
            except RpcError as exc:
                return exc.status.name, exc.message

    return anyio.run(call)


def rows(address: str) -> dict[str, pb.ModelStatus]:
    status = control(address, "ModelControlStatus", pb.ModelControlStatusRequest())
    return {m.name: m for m in status.models}


def mlp_x(rows_: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows_, 16), dtype=np.float32)


def cnn_x(rows_: int = 1, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows_, 3, 32, 32), dtype=np.float32)


def infer(c, model: str, x: np.ndarray) -> np.ndarray:
    inp = grpcclient.InferInput("input_0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return c.infer(model, [inp]).as_numpy("output")


def status_of(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as err:
        call()
    return err.value.status(), err.value.message()


def sample(exposition: bytes, name: str) -> float:
    for line in exposition.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exposed")


# -- self-managed: the on-demand cache --------------------------------------------------------


@pytest.fixture(scope="module")
def ondemand(demo_repo):
    running = serve(
        None,
        blocking=False,
        model_dirs=[str(demo_repo)],
        models_include=["mlp", "cnn"],
        model_control_mode="static",
        endpoints={"port": 0},
        runtime={"cpu_device_memory_bytes": ARENA, "weight_cache_fraction": FRACTION},
    )
    yield running
    stop(running)


def test_budget_is_resolved_from_the_probe(ondemand):
    st = ondemand.scheduler.cache.stats()
    assert st.enabled and st.probed and st.arena_bytes == ARENA
    # scratch was measured on the CPU (live arrays of the largest batches): positive
    assert st.max_scratch_bytes > 64 * (16 + 8) * 4
    expected = weight_budget(
        arena=ARENA, fraction=FRACTION, wiggle=0.1, max_scratch=st.max_scratch_bytes, pinned_bytes=0
    )
    assert st.max_bytes == expected.on_demand_budget == 7000
    # the probe seeded the learned costs of every compiled program (no fair warmup ran)
    assert set(ondemand.scheduler.cost_estimates("mlp")) == {(None, k) for k in (1, 8, 32, 64)}


def test_alternating_models_evict_and_reload_with_exact_counters(ondemand, demo_repo):
    c = grpcclient.InferenceServerClient(ondemand.address)
    cache = ondemand.scheduler.cache
    w_mlp, w_cnn = ref.weights(demo_repo, "mlp"), ref.weights(demo_repo, "cnn")
    before = cache.stats()
    sequence = ["mlp", "mlp", "cnn", "mlp", "cnn", "cnn", "mlp", "cnn"]
    resident = before.lru[-1] if before.lru else None
    switches = 0
    for i, model in enumerate(sequence):
        if model != resident:
            switches += 1
            resident = model
        if model == "mlp":
            x = mlp_x(3, seed=i)
            np.testing.assert_allclose(infer(c, "mlp", x), ref.mlp(x, w_mlp), rtol=1e-5, atol=1e-5)
        else:
            x = cnn_x(2, seed=i)
            np.testing.assert_allclose(infer(c, "cnn", x), ref.cnn(x, w_cnn), rtol=1e-4, atol=1e-4)
        st = cache.stats()
        assert st.lru == (model,), "the budget holds one of the two models at a time"
        assert st.resident_bytes == ondemand.bundles[model].model.weight_nbytes
    after = cache.stats()
    assert after.loads - before.loads == switches == 6
    evictions = switches - (1 if before.lru == () else 0)
    assert after.evicts - before.evicts == evictions
    metrics = ondemand.state.metrics.exposition()
    assert sample(metrics, "worker_weight_loads_total") == after.loads
    assert sample(metrics, "worker_weight_evicts_total") == after.evicts
    assert sample(metrics, "worker_weight_cache_max_bytes") == 7000
    assert sample(metrics, "worker_weight_cache_resident_bytes") == after.resident_bytes
    assert sample(metrics, "worker_device_memory_limit_bytes") == ARENA
    assert 'worker_model_resident{model="cnn"} 1.0' in metrics.decode()
    assert 'worker_model_resident{model="mlp"} 0.0' in metrics.decode()
    assert 'worker_model_pinned{model="mlp"} 0.0' in metrics.decode()


def test_control_status_in_self_managed_mode(ondemand):
    status = control(ondemand.address, "ModelControlStatus", pb.ModelControlStatusRequest())
    assert (status.residency_mode, status.discipline) == ("self_managed", "fair")
    assert status.weight_cache_max_bytes == 7000
    by_name = {m.name: m for m in status.models}
    assert sorted(by_name) == ["cnn", "mlp"]
    mlp = by_name["mlp"]
    assert mlp.residency == pb.Residency.PINNED_SYSTEM and mlp.host_resident
    assert mlp.weight_nbytes == 6432 and mlp.weight == 1.0
    assert (mlp.batch_input_name, mlp.batch_axis, mlp.max_batch_size) == ("input_0", 1, 64)
    m = ondemand.scheduler.scheduler_metrics()["mlp"]
    assert (mlp.requests_served, mlp.dispatch_count, mlp.rows_served) == (
        m.requests_served,
        m.dispatch_count,
        m.rows_served,
    )
    assert m.state == "pinned_system" and m.host_resident and not m.pinned


def test_residency_rpcs_are_refused_outside_explicit_mode(ondemand):
    got = control(
        ondemand.address,
        "SetModelResidency",
        pb.SetModelResidencyRequest(name="mlp", target=pb.Residency.PINNED_DEVICE),
    )
    assert got == ("FAILED_PRECONDITION", SELF_MANAGED)
    c = grpcclient.InferenceServerClient(ondemand.address)
    assert status_of(lambda: c.load_model("mlp")) == (
        "StatusCode.FAILED_PRECONDITION",
        "RepositoryModelLoad requires model_control_mode 'explicit' (this worker runs 'static')",
    )
    assert status_of(lambda: c.unload_model("mlp")) == (
        "StatusCode.FAILED_PRECONDITION",
        "RepositoryModelUnload requires model_control_mode 'explicit' (this worker runs 'static')",
    )


def test_compact_memory_frees_and_reloads(ondemand):
    c = grpcclient.InferenceServerClient(ondemand.address)
    infer(c, "cnn", cnn_x())
    reply = control(ondemand.address, "CompactMemory", pb.CompactMemoryRequest())
    assert (reply.reloaded_models, reply.resident_bytes_after) == (0, 0)
    assert not ondemand.bundles["cnn"].model.weights_resident()
    reply = control(
        ondemand.address, "CompactMemory", pb.CompactMemoryRequest(reload_models=["mlp"])
    )
    assert (reply.reloaded_models, reply.resident_bytes_after) == (1, 6432)
    assert ondemand.bundles["mlp"].model.weights_resident()
    got = control(
        ondemand.address, "CompactMemory", pb.CompactMemoryRequest(reload_models=["nope"])
    )
    assert got == ("NOT_FOUND", "unknown model: nope")


def test_set_model_policy(ondemand):
    addr = ondemand.address
    req = pb.SetModelPolicyRequest
    assert control(addr, "SetModelPolicy", req(name="mlp", has_weight=True, weight=-1.0)) == (
        "INVALID_ARGUMENT",
        "weight for model 'mlp' must be a positive number (got -1.0)",
    )
    assert control(addr, "SetModelPolicy", req(name="mlp", has_weight=True, weight=0.0))[0] == (
        "INVALID_ARGUMENT"
    )
    assert control(addr, "SetModelPolicy", req(name="nope", has_weight=True, weight=2.0)) == (
        "NOT_FOUND",
        "unknown model: nope",
    )
    assert isinstance(
        control(addr, "SetModelPolicy", req(name="mlp", has_weight=True, weight=2.5)),
        pb.SetModelPolicyResponse,
    )
    control(addr, "SetModelPolicy", req(name="mlp", has_weight=False, weight=-5.0))  # no-op
    assert rows(addr)["mlp"].weight == 2.5


def test_a_device_pinned_model_stays_put_and_shrinks_the_on_demand_budget(demo_repo):
    running = serve(
        None,
        blocking=False,
        model_dirs=[str(demo_repo)],
        models_include=["mlp", "cnn"],
        model_control_mode="static",
        endpoints={"port": 0},
        runtime={"cpu_device_memory_bytes": ARENA, "weight_cache_fraction": 0.0008},
        scheduler={"models": {"mlp": {"residency": "device"}}},
    )
    try:
        cache = running.scheduler.cache
        st = cache.stats()
        assert st.pinned_bytes == 6432 and st.max_bytes == 8000 - 6432
        assert running.bundles["mlp"].model.weights_resident()
        c = grpcclient.InferenceServerClient(running.address)
        for i in range(3):
            infer(c, "mlp", mlp_x(1, seed=i))
            infer(c, "cnn", cnn_x(1, seed=i))
        st = cache.stats()
        assert (st.loads, st.evicts, st.lru) == (1, 0, ("cnn",))
        assert running.bundles["mlp"].model.weights_resident()
        row = rows(running.address)["mlp"]
        assert row.residency == pb.Residency.PINNED_DEVICE and not row.host_resident
        metrics = running.state.metrics.exposition().decode()
        assert 'worker_model_pinned{model="mlp"} 1.0' in metrics
        assert "worker_weight_cache_pinned_bytes 6432.0" in metrics
    finally:
        stop(running)


# -- explicit mode, driven by tritonclient ------------------------------------------------------

FRONT_MANIFEST = """\
format_version: "2.0"
kind: meta
meta:
  calls: [mlp]
client_inputs:
  - {name: x, dtype: f32, shape: cn, dims: {c: 16}}
client_outputs:
  - {name: y, dtype: f32, shape: cn, dims: {c: 8}}
"""

BOTH_MANIFEST = FRONT_MANIFEST.replace("calls: [mlp]", "calls: [mlp, cnn]")

META_PY = """
import numpy as np
from kserve_trio.core.tensors.tensor import NamedTensor

def run(inputs, call):
    (x,) = inputs
    y = call("mlp", [NamedTensor.from_array("input_0", np.asarray(x.data))])[0].data
    if "cnn" in call.calls:
        call("cnn", [NamedTensor.from_array("input_0", np.zeros((1, 3, 32, 32), np.float32))])
    return [NamedTensor.from_array("y", np.asarray(y))]

register_meta_model(NAME, run=run)
"""


@pytest.fixture(scope="module")
def explicit(demo_repo):
    running = serve(
        None,
        blocking=False,
        model_dirs=[str(demo_repo)],
        models_include=["mlp", "cnn"],
        model_control_mode="explicit",
        endpoints={"port": 0},
        runtime={"cpu_device_memory_bytes": ARENA},
    )
    yield running
    stop(running)


def test_explicit_mode_serves_only_loaded_models(explicit, demo_repo):
    c = grpcclient.InferenceServerClient(explicit.address)
    w = ref.weights(demo_repo, "mlp")
    x = mlp_x()
    assert c.is_server_ready(), "compiled models make the server ready, residency does not"
    assert not c.is_model_ready("mlp")
    index = {m.name: m.state for m in c.get_model_repository_index().models}
    assert index == {"cnn": "UNAVAILABLE", "mlp": "UNAVAILABLE"}
    assert status_of(lambda: infer(c, "mlp", x)) == (
        "StatusCode.FAILED_PRECONDITION",
        "model 'mlp' is not resident",
    )
    c.load_model("mlp")
    assert c.is_model_ready("mlp") and not c.is_model_ready("cnn")
    np.testing.assert_allclose(infer(c, "mlp", x), ref.mlp(x, w), rtol=1e-5, atol=1e-5)
    index = {m.name: m.state for m in c.get_model_repository_index().models}
    assert index == {"cnn": "UNAVAILABLE", "mlp": "READY"}
    row = rows(explicit.address)["mlp"]
    assert row.residency == pb.Residency.PINNED_DEVICE and row.device_resident
    c.load_model("mlp")  # loading a loaded model is a no-op
    c.unload_model("mlp")
    assert not c.is_model_ready("mlp")
    assert status_of(lambda: infer(c, "mlp", x))[0] == "StatusCode.FAILED_PRECONDITION"
    row = rows(explicit.address)["mlp"]
    assert row.residency == pb.Residency.UNPINNED
    assert not row.device_resident and not row.host_resident
    c.load_model("mlp")  # back from the weights file this time
    np.testing.assert_allclose(infer(c, "mlp", x), ref.mlp(x, w), rtol=1e-5, atol=1e-5)
    c.unload_model("mlp")
    st = explicit.scheduler.cache.stats()
    assert st.loads == 0 and st.evicts == 0, "explicit mode never loads on its own"


def test_explicit_mode_statuses_through_tritonclient(explicit):
    c = grpcclient.InferenceServerClient(explicit.address)
    assert status_of(lambda: c.load_model("nope")) == (
        "StatusCode.NOT_FOUND",
        "unknown model: nope",
    )
    assert status_of(lambda: c.unload_model("nope"))[0] == "StatusCode.NOT_FOUND"
    code, msg = status_of(lambda: c.load_model("mlp", config='{"max_batch_size": 4}'))
    assert code == "StatusCode.INVALID_ARGUMENT"
    assert msg == (
        "RepositoryModelLoad parameters are not supported (config): models load from the repository"
    )


def test_explicit_mode_control_service(explicit):
    addr = explicit.address
    req = pb.SetModelResidencyRequest
    assert control(addr, "SetModelResidency", req(name="cnn")) == (
        "INVALID_ARGUMENT",
        "residency target must be UNPINNED, PINNED_SYSTEM or PINNED_DEVICE "
        "(got RESIDENCY_UNSPECIFIED)",
    )
    assert control(
        addr, "SetModelResidency", req(name="nope", target=pb.Residency.PINNED_DEVICE)
    ) == ("NOT_FOUND", "unknown model: nope")
    got = control(addr, "SetModelResidency", req(name="cnn", target=pb.Residency.UNPINNED))
    assert got.residency == pb.Residency.UNPINNED
    assert not rows(addr)["cnn"].host_resident
    got = control(addr, "SetModelResidency", req(name="cnn", target=pb.Residency.PINNED_SYSTEM))
    assert got.residency == pb.Residency.PINNED_SYSTEM
    row = rows(addr)["cnn"]
    assert row.host_resident and not row.device_resident
    status = control(addr, "ModelControlStatus", pb.ModelControlStatusRequest())
    assert status.residency_mode == "externally_managed"
    assert status.weight_cache_max_bytes == explicit.scheduler.cache.max_bytes > 0
    # compaction in explicit mode never reloads: the control plane re-pins what it needs
    reply = control(addr, "CompactMemory", pb.CompactMemoryRequest(reload_models=["cnn"]))
    assert reply.reloaded_models == 0


@pytest.fixture(scope="module")
def meta_explicit(demo_repo, tmp_path_factory):
    repo = tmp_path_factory.mktemp("residency_meta") / "models"
    repo.mkdir()
    for name in ("mlp", "cnn"):
        shutil.copytree(demo_repo / name, repo / name)
    for name, manifest in (("front", FRONT_MANIFEST), ("both", BOTH_MANIFEST)):
        (repo / name).mkdir()
        (repo / name / "manifest.yaml").write_text(manifest + f"name: {name}\n")
        (repo / name / "model.py").write_text(META_PY.replace("NAME", repr(name)))
    running = serve(
        None,
        blocking=False,
        model_dirs=[str(repo)],
        model_control_mode="explicit",
        endpoints={"port": 0},
        runtime={"cpu_device_memory_bytes": ARENA},
    )
    yield running
    stop(running)


def test_meta_residency_applies_to_its_sub_models(meta_explicit, demo_repo):
    addr = meta_explicit.address
    c = grpcclient.InferenceServerClient(addr)
    status = rows(addr)
    assert sorted(status) == ["both", "front"], "sub-models are folded into their metas"
    both = status["both"]
    assert both.weight_nbytes == 6432 + 1256
    assert both.residency == pb.Residency.PINNED_SYSTEM and both.host_resident
    assert not both.device_resident and (both.batch_input_name, both.batch_axis) == ("", 0)
    assert not c.is_model_ready("both") and not c.is_model_ready("front")
    x = mlp_x()
    inp = grpcclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    assert status_of(lambda: c.infer("front", [inp])) == (
        "StatusCode.FAILED_PRECONDITION",
        "model 'mlp' is not resident",
    )
    c.load_model("both")  # pins mlp and cnn
    assert c.is_model_ready("both") and c.is_model_ready("front")
    w = ref.weights(demo_repo, "mlp")
    np.testing.assert_allclose(
        c.infer("both", [inp]).as_numpy("y"), ref.mlp(x, w), rtol=1e-5, atol=1e-5
    )
    row = rows(addr)["both"]
    assert row.residency == pb.Residency.PINNED_DEVICE and row.device_resident
    assert row.requests_served == 1 and row.rows_served == 1
    # unpinning 'both' leaves mlp alone: 'front' also declares it
    got = control(
        addr,
        "SetModelResidency",
        pb.SetModelResidencyRequest(name="both", target=pb.Residency.UNPINNED),
    )
    assert got.residency == pb.Residency.UNPINNED  # cnn's floor, the least resident
    cache = meta_explicit.scheduler.cache
    assert cache.residency("mlp").floor is ResidencyState.PINNED_DEVICE
    assert cache.residency("cnn").floor is ResidencyState.UNPINNED
    assert c.is_model_ready("front") and not c.is_model_ready("both")
    c.unload_model("front")  # 'both' declares mlp too: still left alone
    assert cache.residency("mlp").floor is ResidencyState.PINNED_DEVICE
    c.unload_model("mlp")  # a sub-model is still addressable by its own name
    assert cache.residency("mlp").floor is ResidencyState.UNPINNED
    assert not c.is_model_ready("front")


# -- explicit mode without the cache, and the cache in the scheduler ------------------------------


def test_explicit_mode_without_a_cache_warns_and_refuses_residency_control(demo_repo):
    with capture_logs() as logs:
        running = serve(
            None,
            blocking=False,
            model_dirs=[str(demo_repo)],
            models_include=["scale4"],
            model_control_mode="explicit",
            endpoints={"port": 0, "metrics_port": 0},
        )
    try:
        assert any(e["event"] == "explicit_mode_without_weight_cache" for e in logs)
        c = grpcclient.InferenceServerClient(running.address)
        assert c.is_model_ready("scale4"), "every model stays resident without the cache"
        assert status_of(lambda: c.load_model("scale4")) == (
            "StatusCode.FAILED_PRECONDITION",
            NEEDS_CACHE,
        )
        status = control(running.address, "ModelControlStatus", pb.ModelControlStatusRequest())
        assert status.weight_cache_max_bytes == 0
        (row,) = status.models
        assert row.residency == pb.Residency.UNPINNED and row.device_resident
        reply = control(running.address, "CompactMemory", pb.CompactMemoryRequest())
        assert reply.reloaded_models == 0
        metrics = running.state.metrics.exposition().decode()
        assert "worker_weight_cache_max_bytes" not in metrics
        assert "worker_device_memory_limit_bytes" not in metrics
    finally:
        stop(running)


@pytest.mark.anyio
async def test_scheduler_releases_and_rekeys_residency(backend_cpu, demo_repo):
    """Unload releases device and (shared) host weights; rename rekeys; reload replaces."""
    from kserve_trio.runtime.model import load_compiled_model

    name = f"r{uuid.uuid4().hex[:8]}"
    cache = WeightCache(backend_cpu, store=SharedWeightStore(), arena=ARENA)
    sched = Scheduler(SchedulerConfig(), cache=cache)

    def region_files(model: str) -> list[str]:
        return sorted(p.name for p in SHM_DIR.glob(f"kst-w-{model}-*"))

    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        model = load_compiled_model(demo_repo / "mlp", backend_cpu, name=name, resident=False)
        await sched.add_model(model)
        assert cache.residency(name).floor is ResidencyState.PINNED_SYSTEM
        assert len(region_files(name)) == 2  # region + lock
        out = await sched.infer(name, [_tensor(mlp_x(1))])
        assert out[0].data.shape == (1, 8) and model.weights_resident()
        sched.rename_model(name, name + "x")
        assert cache.has(name + "x") and cache.store.holds(name + "x")
        assert cache.stats().lru == (name + "x",)
        newer = load_compiled_model(demo_repo / "mlp", backend_cpu, name=name + "x", resident=False)
        await sched.replace_model(newer)
        assert not model.weights_resident(), "the old version's buffers are freed"
        assert cache._records[name + "x"].entry is newer
        await sched.infer(name + "x", [_tensor(mlp_x(1))])
        await sched.remove_model(name + "x")
        assert not cache.has(name + "x") and not newer.weights_resident()
        assert region_files(name) == [] and region_files(name + "x") == [], (
            "the last holder unlinked the shared regions"
        )
        await sched.stop()
    cache.close()


def _tensor(x):
    from kserve_trio.core.tensors.tensor import NamedTensor

    return NamedTensor.from_array("input_0", x)


@pytest.fixture(scope="module")
def backend_cpu():
    from kserve_trio.runtime import JaxBackend

    return JaxBackend.create("cpu")

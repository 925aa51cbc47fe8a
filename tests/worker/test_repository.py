"""The model repository: one owner for the bundles and the scheduler's membership.

Real compiled demo bundles (JAX on the CPU) and a running ``Scheduler``: every membership change
through ``ModelRepository`` leaves the repository and the scheduler agreeing, a refused change
leaves both as they were, and lookups give one message per fault.
"""

from __future__ import annotations

import shutil
import textwrap

import anyio
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter

from kserve_trio.core.errors import FailedPrecondition, InvalidArgument, NotFound
from kserve_trio.core.process.config import SchedulerConfig
from kserve_trio.core.tensors.tensor import NamedTensor
from kserve_trio.worker.registry import load_bundle, load_repository
from kserve_trio.worker.repository import ModelRepository
from kserve_trio.worker.scheduler import Scheduler
from tests.e2e import reference as ref

pytestmark = pytest.mark.anyio

PIPE_MANIFEST = """\
format_version: "2.0"
kind: meta
meta:
  calls: [mlp]
client_inputs:
  - {name: x, dtype: f32, shape: cn, dims: {c: 16}}
client_outputs:
  - {name: y, dtype: f32, shape: cn, dims: {c: 8}}
"""

PIPE_PY = """
from kserve_trio.core.tensors.tensor import NamedTensor

def run(inputs, call):
    out = call("mlp", [NamedTensor.from_array("input_0", inputs[0].data)])
    return [NamedTensor.from_array("y", out[0].data)]

register_meta_model("pipe", run=run)
"""


@pytest.fixture(scope="module")
def backend():
    from kserve_trio.runtime import JaxBackend

    return JaxBackend.create("cpu")


@pytest.fixture(scope="module")
def models(demo_repo, tmp_path_factory):
    root = tmp_path_factory.mktemp("repository") / "models"
    root.mkdir()
    shutil.copytree(demo_repo / "mlp", root / "mlp")
    (root / "pipe").mkdir()
    (root / "pipe" / "manifest.yaml").write_text(PIPE_MANIFEST)
    (root / "pipe" / "model.py").write_text(textwrap.dedent(PIPE_PY))
    return root


def compilations() -> Counter:
    return Counter("c", "compilations", ["model"], registry=CollectorRegistry())


def x16(rows: int) -> np.ndarray:
    return np.random.default_rng(rows).standard_normal((rows, 16), dtype=np.float32)


async def test_start_up_and_reload_install_through_one_path(backend, models, demo_repo):
    sched = Scheduler(SchedulerConfig(), warmup=False)
    counter = compilations()
    repo = ModelRepository(sched, compilations=counter)
    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        bundles, failures = await anyio.to_thread.run_sync(
            lambda: load_repository([models], backend)
        )
        assert failures == {}
        for bundle in bundles.values():
            assert await repo.install(bundle) is None
        assert repo.names() == ["mlp", "pipe"]
        assert sched.model_names() == ["mlp"]  # the meta has no scheduler entry
        assert repo.routable_names() == ["pipe"]  # mlp is a declared sub-model
        assert repo.ready() and repo.model_ready("mlp") and repo.model_ready("pipe")
        w = ref.weights(demo_repo, "mlp")
        out = await sched.infer("mlp", [NamedTensor.from_array("input_0", x16(2))])
        np.testing.assert_allclose(out[0].data, ref.mlp(x16(2), w), rtol=1e-5, atol=1e-5)

        first = repo.get("mlp")
        newer = await anyio.to_thread.run_sync(lambda: load_bundle(models / "mlp", backend))
        assert await repo.install(newer) is first
        assert repo.get("mlp") is newer and repo.bundles["mlp"] is newer
        with pytest.raises(FailedPrecondition, match="has been unloaded"):
            first.model.execute(None, 1, [x16(1)])  # the replaced version was closed
        out = await sched.infer("mlp", [NamedTensor.from_array("input_0", x16(3))])
        np.testing.assert_allclose(out[0].data, ref.mlp(x16(3), w), rtol=1e-5, atol=1e-5)
        assert counter.labels(model="mlp")._value.get() == 2
        assert counter.labels(model="pipe")._value.get() == 0  # nothing compiled for a meta

        removed = await repo.remove("mlp")
        assert removed is newer and "mlp" not in repo and not sched.has_model("mlp")
        assert repo.names() == ["pipe"] and sched.model_names() == []
        assert not repo.model_ready("mlp") and not repo.model_compiled("mlp")
        assert await repo.remove("mlp") is None
        await sched.stop()
    repo.close()


async def test_lookup_has_one_message_per_fault(backend, models):
    sched = Scheduler(SchedulerConfig(), warmup=False)
    repo = ModelRepository(sched)
    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        bundle = await anyio.to_thread.run_sync(lambda: load_bundle(models / "mlp", backend))
        await repo.install(bundle)
        assert repo.lookup("mlp") is bundle and repo.lookup("mlp", "1") is bundle
        with pytest.raises(InvalidArgument, match=r"^model_name is empty$"):
            repo.lookup("")
        with pytest.raises(NotFound, match=r"^unknown model: nope$"):
            repo.lookup("nope")
        with pytest.raises(NotFound, match="model 'mlp' has no version '2'"):
            repo.lookup("mlp", "2")
        assert repo.model_ready("mlp", "1") and not repo.model_ready("mlp", "2")
        await sched.stop()
    repo.close()


async def test_a_refused_rename_changes_neither_side(backend, models):
    sched = Scheduler(SchedulerConfig(), warmup=False)
    repo = ModelRepository(sched)
    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        for name in ("a", "b"):
            bundle = await anyio.to_thread.run_sync(
                lambda n=name: load_bundle(models / "mlp", backend, name=n)
            )
            await repo.install(bundle)
        with pytest.raises(FailedPrecondition, match="'b' is loaded"):
            repo.rename("a", "b")
        assert repo.names() == sched.model_names() == ["a", "b"]
        assert repo.get("a").name == "a"
        renamed = repo.rename("a", "c")
        assert renamed.name == "c" and repo.names() == sched.model_names() == ["b", "c"]
        out = await sched.infer("c", [NamedTensor.from_array("input_0", x16(1))])
        assert out[0].data.shape == (1, 8)
        with pytest.raises(NotFound, match=r"^unknown model: a$"):
            repo.rename("a", "d")

        meta = await anyio.to_thread.run_sync(
            lambda: load_bundle(models / "pipe", backend, name="b")
        )
        replaced = await repo.install(meta)  # a meta under a regular model's name
        assert replaced is not None and replaced.model is not None
        assert repo.get("b") is meta and not sched.has_model("b")
        assert sched.model_names() == ["c"]
        await sched.stop()
    repo.close()

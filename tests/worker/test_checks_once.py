"""Each check on a ModelInfer request runs exactly once, through the real in-process worker.

The worker serves the demo ``mlp`` twice: as it is (no model.py) and as ``mlp_hooked`` with a
preprocess and a postprocess hook. Every function that looks a model up, decodes, validates or
re-checks dtype and shape is wrapped with a counter, then one tritonclient request is sent and
the exact counts are asserted: one repository lookup, one decode, one validation pass, one
encode; the scheduler's dtype/shape check on executable inputs runs only where a hook produced
them. Start-up validates each manifest once (not again in the runtime loader). A request
cancelled while it queues releases its shared-memory leases exactly once and is recorded once.
"""

from __future__ import annotations

import collections
import os
import shutil
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from kserve_trio.core.bundles.manifest import TensorSpec
from kserve_trio.runtime import model as runtime_model
from kserve_trio.worker import inference, layout, registry, validation
from kserve_trio.worker.layout import ModelLayout
from kserve_trio.worker.repository import ModelRepository
from kserve_trio.worker.server import RunningServer, serve, stop
from tests.device_hold import hold_device
from tests.e2e import reference as ref
from tests.waiting import wait_until

HOOKS_PY = """
import numpy as np
from kserve_trio.core.tensors.tensor import NamedTensor

def pre(inputs):
    (x,) = inputs
    return [NamedTensor.from_array("input_0", np.asarray(x.data) * np.float32(2.0))]

def post(outputs):
    return outputs

register_model("mlp_hooked", preprocess=pre, postprocess=post)
"""


class Counts:
    """Wraps callables with call counters (undone by the monkeypatch that installed them)."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        self.n: collections.Counter[str] = collections.Counter()
        self._mp = mp

    def wrap(self, owner: object, name: str, label: str) -> None:
        original: Callable = getattr(owner, name)

        def counted(*args, **kwargs):
            self.n[label] += 1
            return original(*args, **kwargs)

        self._mp.setattr(owner, name, counted)


def wrap_request_path(counts: Counts) -> None:
    counts.wrap(ModelRepository, "lookup", "lookup")
    counts.wrap(inference, "decode_infer_request", "decode")
    counts.wrap(validation, "validate_request", "validate_request")
    counts.wrap(validation, "validate_inputs", "validate_inputs")
    counts.wrap(validation, "check_requested_outputs", "check_requested_outputs")
    counts.wrap(ModelLayout, "check_wire", "check_wire")
    counts.wrap(ModelLayout, "prepare", "prepare")
    counts.wrap(layout, "check_executable_input", "check_executable_input")
    counts.wrap(TensorSpec, "matches", "spec_matches")
    counts.wrap(inference, "encode_infer_response", "encode")


@pytest.fixture(scope="module")
def loaded(demo_repo, tmp_path_factory) -> Iterator[tuple[RunningServer, collections.Counter]]:
    repo = tmp_path_factory.mktemp("checks") / "models"
    repo.mkdir()
    shutil.copytree(demo_repo / "mlp", repo / "mlp")
    shutil.copytree(demo_repo / "mlp", repo / "mlp_hooked")
    (repo / "mlp_hooked" / "model.py").write_text(HOOKS_PY)
    with pytest.MonkeyPatch.context() as mp:
        counts = Counts(mp)
        counts.wrap(registry, "validate_manifest", "worker_validate_manifest")
        counts.wrap(runtime_model, "validate_manifest", "runtime_validate_manifest")
        running = serve(
            None,
            blocking=False,
            model_dirs=[str(repo)],
            model_control_mode="static",
            endpoints={"port": 0},
        )
    try:
        yield running, counts.n
    finally:
        stop(running)


@pytest.fixture
def server(loaded) -> RunningServer:
    return loaded[0]


def mlp_input(x: np.ndarray, name: str = "input_0", datatype: str = "FP32"):
    inp = grpcclient.InferInput(name, list(x.shape), datatype)
    inp.set_data_from_numpy(x)
    return inp


def test_startup_validates_each_manifest_once(loaded):
    _, counts = loaded
    assert counts["worker_validate_manifest"] == 2  # mlp and mlp_hooked
    assert counts["runtime_validate_manifest"] == 0  # the loader got the validated manifest


def test_model_without_hooks_runs_each_check_once(server, demo_repo, monkeypatch):
    counts = Counts(monkeypatch)
    wrap_request_path(counts)
    x = np.random.default_rng(0).standard_normal((3, 16), dtype=np.float32)
    c = grpcclient.InferenceServerClient(server.address)
    out = c.infer("mlp", [mlp_input(x)], outputs=[grpcclient.InferRequestedOutput("output")])
    np.testing.assert_allclose(
        out.as_numpy("output"), ref.mlp(x, ref.weights(demo_repo, "mlp")), rtol=1e-5, atol=1e-5
    )
    assert dict(counts.n) == {
        "lookup": 1,
        "decode": 1,
        "validate_request": 1,
        "validate_inputs": 1,
        "check_requested_outputs": 1,
        "prepare": 1,  # admission (rows, variant) only: the inputs are the validated ones
        "encode": 1,
    }


def test_model_with_hooks_checks_what_the_hook_returned_once(server, demo_repo, monkeypatch):
    counts = Counts(monkeypatch)
    wrap_request_path(counts)
    x = np.random.default_rng(1).standard_normal((2, 16), dtype=np.float32)
    c = grpcclient.InferenceServerClient(server.address)
    out = c.infer("mlp_hooked", [mlp_input(x)])
    np.testing.assert_allclose(
        out.as_numpy("output"),
        ref.mlp(2.0 * x, ref.weights(demo_repo, "mlp")),
        rtol=1e-5,
        atol=1e-5,
    )
    assert dict(counts.n) == {
        "lookup": 1,
        "decode": 1,
        "validate_request": 1,
        "validate_inputs": 1,  # the wire inputs, before the hook
        "check_wire": 1,  # admission before the hook runs
        "prepare": 1,
        "check_executable_input": 1,  # the hook's output, the model's one executable input
        "spec_matches": 1,
        "encode": 1,
    }


def test_a_refused_request_stops_at_its_one_validation(server, monkeypatch):
    counts = Counts(monkeypatch)
    wrap_request_path(counts)
    c = grpcclient.InferenceServerClient(server.address)
    with pytest.raises(InferenceServerException) as err:
        c.infer("mlp", [mlp_input(np.ones((1, 16), np.float64), datatype="FP64")])
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert err.value.message() == "input 'input_0' of model 'mlp' has datatype FP64, expected FP32"
    assert dict(counts.n) == {
        "lookup": 1,
        "decode": 1,
        "validate_request": 1,
        "validate_inputs": 1,
    }


def test_an_unknown_model_is_looked_up_once_and_never_decoded(server, monkeypatch):
    counts = Counts(monkeypatch)
    wrap_request_path(counts)
    c = grpcclient.InferenceServerClient(server.address)
    with pytest.raises(InferenceServerException) as err:
        c.infer("nope", [mlp_input(np.ones((1, 16), np.float32))])
    assert err.value.status() == "StatusCode.NOT_FOUND"
    assert err.value.message() == "unknown model: nope"
    assert dict(counts.n) == {"lookup": 1}


def requests_with_status(running: RunningServer, status: str) -> float:
    assert running.state.metrics is not None
    return running.state.metrics.requests.labels(model="mlp", status=status)._value.get()


def test_a_cancelled_shm_request_releases_its_leases_once(server, monkeypatch):
    released: collections.Counter[int] = collections.Counter()
    leased: list[int] = []
    decode = inference.decode_infer_request

    def decode_counting_leases(*args, **kwargs):
        request = decode(*args, **kwargs)

        def counted(release: Callable[[], None], key: int) -> Callable[[], None]:
            def run() -> None:
                released[key] += 1
                release()

            return run

        request.leases = [counted(r, len(leased) + i) for i, r in enumerate(request.leases)]
        leased.extend(range(len(leased), len(leased) + len(request.leases)))
        return request

    monkeypatch.setattr(inference, "decode_infer_request", decode_counting_leases)
    x = np.random.default_rng(2).standard_normal((1, 16), dtype=np.float32)
    name, key = f"lease_{os.getpid()}_{uuid.uuid4().hex[:8]}", f"/lease_{uuid.uuid4().hex[:8]}"
    handle = shm.create_shared_memory_region(name, key, x.nbytes)
    c = grpcclient.InferenceServerClient(server.address)
    try:
        shm.set_shared_memory_region(handle, [x])
        c.register_system_shared_memory(name, key, x.nbytes)
        cancelled_before = requests_with_status(server, "CANCELLED")
        served_before = server.scheduler.scheduler_metrics()["mlp"].requests_served
        blocker = hold_device(server)
        inp = grpcclient.InferInput("input_0", [1, 16], "FP32")
        inp.set_shared_memory(name, x.nbytes)
        call = c.async_infer("mlp", [inp], callback=lambda result, error: None)
        wait_until(lambda: leased, what="the request decoded and queued")
        assert leased == [0]
        call.cancel()
        wait_until(
            lambda: requests_with_status(server, "CANCELLED") != cancelled_before,
            what="the cancelled request recorded",
        )
        blocker.release()
        assert dict(released) == {0: 1}
        assert requests_with_status(server, "CANCELLED") == cancelled_before + 1
        assert server.scheduler.scheduler_metrics()["mlp"].requests_served == served_before
        c.unregister_system_shared_memory(name)
        out = c.infer("mlp", [mlp_input(x)])  # and the worker serves on
        assert out.as_numpy("output").shape == (1, 8)
    finally:
        c.close()
        shm.destroy_shared_memory_region(handle)

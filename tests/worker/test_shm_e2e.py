"""System shared memory end to end with tritonclient's own shared-memory utilities."""

from __future__ import annotations

import os
import threading
import uuid

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from kserve_trio.worker.server import serve, stop
from tests.e2e import reference as ref


@pytest.fixture(scope="module")
def server(demo_repo):
    running = serve(
        None,
        blocking=False,
        model_dirs=[str(demo_repo)],
        model_control_mode="static",
        endpoints={"port": 0},
    )
    yield running
    stop(running)


def unique(prefix: str) -> str:
    return f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"


class Region:
    """A tritonclient-created region, destroyed on exit."""

    def __init__(self, nbytes: int) -> None:
        self.name = unique("r")
        self.key = "/" + unique("k")
        self.nbytes = nbytes
        self.handle = shm.create_shared_memory_region(self.name, self.key, nbytes)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        shm.destroy_shared_memory_region(self.handle)


def maps_of(key: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if key.lstrip("/") in line)


def shm_infer(c, model, in_name, x, in_region, out_name, out_shape, out_region):
    inp = grpcclient.InferInput(in_name, list(x.shape), "FP32")
    inp.set_shared_memory(in_region.name, x.nbytes)
    out = grpcclient.InferRequestedOutput(out_name)
    out.set_shared_memory(out_region.name, int(np.prod(out_shape)) * 4)
    return c.infer(model, [inp], outputs=[out])


@pytest.mark.parametrize(
    ("model", "in_shape", "out_shape"), [("mlp", (4, 16), (4, 8)), ("cnn", (3, 3, 32, 32), (3, 10))]
)
def test_inputs_and_outputs_through_shared_memory(server, demo_repo, model, in_shape, out_shape):
    c = grpcclient.InferenceServerClient(server.address)
    x = np.random.default_rng(0).standard_normal(in_shape, dtype=np.float32)
    with Region(x.nbytes) as rin, Region(int(np.prod(out_shape)) * 4) as rout:
        shm.set_shared_memory_region(rin.handle, [x])
        c.register_system_shared_memory(rin.name, rin.key, rin.nbytes)
        c.register_system_shared_memory(rout.name, rout.key, rout.nbytes)
        status = c.get_system_shared_memory_status(as_json=True)
        names = set(status.get("regions", {}))
        assert {rin.name, rout.name} <= names
        r = shm_infer(c, model, "input_0", x, rin, "output", out_shape, rout)
        out_meta = r.get_output("output")
        assert out_meta.parameters["shared_memory_region"].string_param == rout.name
        assert r.get_response().raw_output_contents == [b""]  # Triton's shm placeholder
        y = shm.get_contents_as_numpy(rout.handle, np.float32, list(out_shape))
        expected = (
            ref.mlp(x, ref.weights(demo_repo, "mlp"))
            if model == "mlp"
            else ref.cnn(x, ref.weights(demo_repo, "cnn"))
        )
        np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)
        c.unregister_system_shared_memory(rin.name)
        with pytest.raises(InferenceServerException) as err:
            shm_infer(c, model, "input_0", x, rin, "output", out_shape, rout)
        assert err.value.status() == "StatusCode.FAILED_PRECONDITION"
        assert err.value.message() == f"unregistered shared memory region: {rin.name}"
        c.unregister_system_shared_memory(rout.name)
        c.unregister_system_shared_memory(rout.name)  # idempotent
        assert rin.name not in c.get_system_shared_memory_status(as_json=True).get("regions", {})


def test_bad_registrations_are_invalid_argument(server):
    c = grpcclient.InferenceServerClient(server.address)
    with Region(1024) as r:
        cases = [
            (r.name, "/" + unique("missing"), 0, 64, "does not exist"),
            (r.name, r.key, 2048, 64, "exceeds"),
            (r.name, r.key, 0, 4096, "exceeds"),
            ("", r.key, 0, 64, ""),
        ]
        for name, key, offset, size, needle in cases:
            with pytest.raises(InferenceServerException) as err:
                c.register_system_shared_memory(name, key, size, offset=offset)
            assert err.value.status() == "StatusCode.INVALID_ARGUMENT", (name, key, offset, size)
            assert needle in err.value.message()
        assert c.is_server_live()


def test_output_larger_than_its_region_is_invalid_argument(server):
    c = grpcclient.InferenceServerClient(server.address)
    x = np.ones((4, 16), np.float32)
    with Region(x.nbytes) as rin, Region(16) as rout:
        shm.set_shared_memory_region(rin.handle, [x])
        c.register_system_shared_memory(rin.name, rin.key, rin.nbytes)
        c.register_system_shared_memory(rout.name, rout.key, rout.nbytes)
        try:
            inp = grpcclient.InferInput("input_0", [4, 16], "FP32")
            inp.set_shared_memory(rin.name, x.nbytes)
            out = grpcclient.InferRequestedOutput("output")
            out.set_shared_memory(rout.name, 16)
            with pytest.raises(InferenceServerException) as err:
                c.infer("mlp", [inp], outputs=[out])
            assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
        finally:
            c.unregister_system_shared_memory()


def test_register_infer_unregister_cycles_leave_no_mapping(server):
    c = grpcclient.InferenceServerClient(server.address)
    x = np.ones((1, 16), np.float32)
    with Region(x.nbytes) as rin, Region(8 * 4) as rout:
        shm.set_shared_memory_region(rin.handle, [x])
        before_in, before_out = maps_of(rin.key), maps_of(rout.key)  # the client's own maps
        for _ in range(200):
            c.register_system_shared_memory(rin.name, rin.key, rin.nbytes)
            c.register_system_shared_memory(rout.name, rout.key, rout.nbytes)
            shm_infer(c, "mlp", "input_0", x, rin, "output", (1, 8), rout)
            c.unregister_system_shared_memory(rin.name)
            c.unregister_system_shared_memory(rout.name)
        assert maps_of(rin.key) == before_in
        assert maps_of(rout.key) == before_out


def test_concurrent_unregister_never_crashes_the_worker(server):
    c = grpcclient.InferenceServerClient(server.address)
    x = np.ones((2, 16), np.float32)
    outcomes: list[str] = []
    with Region(x.nbytes) as rin, Region(2 * 8 * 4) as rout:
        shm.set_shared_memory_region(rin.handle, [x])
        c.register_system_shared_memory(rout.name, rout.key, rout.nbytes)
        stop_flag = threading.Event()

        def churn():
            cc = grpcclient.InferenceServerClient(server.address)
            while not stop_flag.is_set():
                cc.register_system_shared_memory(rin.name, rin.key, rin.nbytes)
                cc.unregister_system_shared_memory(rin.name)

        t = threading.Thread(target=churn)
        t.start()
        try:
            for _ in range(150):
                try:
                    shm_infer(c, "mlp", "input_0", x, rin, "output", (2, 8), rout)
                    outcomes.append("OK")
                except InferenceServerException as exc:
                    outcomes.append(exc.status())
        finally:
            stop_flag.set()
            t.join()
            c.unregister_system_shared_memory()
    assert set(outcomes) <= {"OK", "StatusCode.FAILED_PRECONDITION"}, set(outcomes)
    assert c.is_server_ready()

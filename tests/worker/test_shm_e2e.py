"""System shared memory end to end with tritonclient's own shared-memory utilities, and
hypothesis fuzzing of the four shared-memory RPCs (hostile names, keys, windows, raw bytes)
through the real in-process server: only OK / INVALID_ARGUMENT / NOT_FOUND /
FAILED_PRECONDITION / ALREADY_EXISTS, never a crash, and the server keeps serving."""

from __future__ import annotations

import os
import threading
import unicodedata
import uuid

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from hypothesis import event, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from kserve_trio.proto import inference as pb
from kserve_trio.worker.server import serve, stop
from tests.e2e import reference as ref


@pytest.fixture(scope="module")
def server(demo_repo):
    """A worker of its own, not the suite's shared ``demo_worker``: this module registers and
    unregisters regions on it."""
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


def fds_on(key: str) -> int:
    """Descriptors this process (client and in-process server) holds on the object."""
    target = "/dev/shm/" + key.lstrip("/")
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").split(" (deleted)")[0] == target
        except OSError:
            pass
    return n


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
        fds_in, fds_out = fds_on(rin.key), fds_on(rout.key)
        for _ in range(200):
            c.register_system_shared_memory(rin.name, rin.key, rin.nbytes)
            c.register_system_shared_memory(rout.name, rout.key, rout.nbytes)
            shm_infer(c, "mlp", "input_0", x, rin, "output", (1, 8), rout)
            c.unregister_system_shared_memory(rin.name)
            c.unregister_system_shared_memory(rout.name)
        assert maps_of(rin.key) == before_in
        assert maps_of(rout.key) == before_out
        assert (fds_on(rin.key), fds_on(rout.key)) == (fds_in, fds_out)


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


# --------------------------------------------------------------------------------------------
# fuzzing the shared-memory RPCs

ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
}
FUZZ = settings(max_examples=200, deadline=None)
SHM_RPCS = [
    "SystemSharedMemoryRegister",
    "SystemSharedMemoryUnregister",
    "SystemSharedMemoryStatus",
    "IsSameIPCNamespace",
]
FUZZ_KEY = "/" + unique("fuzzk")
FUZZ_SIZE = 4096


@pytest.fixture(scope="module")
def fuzz_region():
    """A real object the fuzzed registrations may name (so some of them succeed)."""
    handle = shm.create_shared_memory_region("fuzz", FUZZ_KEY, FUZZ_SIZE)
    yield handle
    shm.destroy_shared_memory_region(handle)


@pytest.fixture(scope="module")
def channel(server, fuzz_region):
    with grpc.insecure_channel(server.address) as ch:
        yield ch
        service_pb2_grpc.GRPCInferenceServiceStub(ch).SystemSharedMemoryUnregister(
            service_pb2.SystemSharedMemoryUnregisterRequest(name=""), timeout=10
        )


hostile_text = st.one_of(
    st.text(max_size=40),
    st.text(st.characters(max_codepoint=0xA0), max_size=12),  # control characters, mostly
    st.text(st.sampled_from("/.\x00a\n"), max_size=6),
    st.sampled_from(["", "/", "//", ".", "..", "/..", "/" + "k" * 255, "/" + "k" * 256, "x" * 300]),
    st.sampled_from([FUZZ_KEY, FUZZ_KEY.lstrip("/"), FUZZ_KEY + "\x00", "fuzz"]),
    st.text(max_size=300).map(lambda t: "/" + t),
)
sizes = st.one_of(st.integers(0, FUZZ_SIZE + 1), st.integers(0, 2**64 - 1))


def call_rpc(channel, rpc: str, name: str, key: str, offset: int, size: int):
    """One shared-memory RPC with the given fields (IsSameIPCNamespace is our extension and
    not in tritonclient's protos: sent with ours)."""
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    if rpc == "SystemSharedMemoryRegister":
        req = service_pb2.SystemSharedMemoryRegisterRequest(
            name=name, key=key, offset=offset, byte_size=size
        )
        return stub.SystemSharedMemoryRegister(req, timeout=10)
    if rpc == "SystemSharedMemoryUnregister":
        req = service_pb2.SystemSharedMemoryUnregisterRequest(name=name)
        return stub.SystemSharedMemoryUnregister(req, timeout=10)
    if rpc == "SystemSharedMemoryStatus":
        req = service_pb2.SystemSharedMemoryStatusRequest(name=name)
        return stub.SystemSharedMemoryStatus(req, timeout=10)
    call = channel.unary_unary("/inference.GRPCInferenceService/IsSameIPCNamespace")
    return call(bytes(pb.IsSameIpcNamespaceRequest(name=key)), timeout=10)


def no_controls(text: str) -> bool:
    """A hostile value comes back escaped: no control character reaches a status message."""
    return not any(unicodedata.category(c) == "Cc" for c in text)


def outcome(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def assert_serving(channel, demo_repo) -> None:
    req = service_pb2.ModelInferRequest(model_name="mlp")
    req.inputs.add(name="input_0", datatype="FP32", shape=[2, 16])
    x = np.ones((2, 16), np.float32)
    req.raw_input_contents.append(x.tobytes())
    reply = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=10)
    out = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(2, 8)
    np.testing.assert_allclose(out, ref.mlp(x, ref.weights(demo_repo, "mlp")), rtol=1e-5, atol=1e-5)


@FUZZ
@given(
    rpc=st.sampled_from(SHM_RPCS),
    name=st.sampled_from(["fuzz", "a", "b"]) | hostile_text,
    key=st.just(FUZZ_KEY) | hostile_text,
    offset=sizes,
    size=sizes,
)
def test_fuzzed_shm_rpcs_never_crash_or_answer_internal(
    channel, demo_repo, rpc, name, key, offset, size
):
    code, details = outcome(lambda: call_rpc(channel, rpc, name, key, offset, size))
    event(f"{rpc} {code.name}")
    assert code in ALLOWED, (rpc, name, key, offset, size, code, details)
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        assert details and no_controls(details) and len(details) < 600, details


@FUZZ
@given(rpc=st.sampled_from(SHM_RPCS), payload=st.binary(max_size=400))
def test_arbitrary_bytes_to_shm_rpcs_never_answer_internal(channel, rpc, payload):
    """Raw protobuf bodies: invalid UTF-8 in the string fields, wrong wire types, garbage."""
    call = channel.unary_unary(f"/inference.GRPCInferenceService/{rpc}")
    code, details = outcome(lambda: call(payload, timeout=10))
    event(f"{rpc} {code.name}")
    assert code in ALLOWED, (rpc, payload, code, details)


@FUZZ
@given(region=hostile_text, offset=sizes, size=sizes, as_output=st.booleans())
def test_fuzzed_shm_parameters_on_infer_are_refused(channel, region, offset, size, as_output):
    """ModelInfer naming a hostile (or unregistered) region, window or size."""
    req = service_pb2.ModelInferRequest(model_name="mlp")
    t = req.inputs.add(name="input_0", datatype="FP32", shape=[2, 16])
    params = {
        "shared_memory_region": service_pb2.InferParameter(string_param=region),
        "shared_memory_offset": service_pb2.InferParameter(int64_param=offset % 2**63),
        "shared_memory_byte_size": service_pb2.InferParameter(int64_param=size % 2**63),
    }
    if as_output:
        req.raw_input_contents.append(np.ones((2, 16), np.float32).tobytes())
        target = req.outputs.add(name="output").parameters
    else:
        target = t.parameters
    for k, v in params.items():
        target[k].CopyFrom(v)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    code, details = outcome(lambda: stub.ModelInfer(req, timeout=10))
    event(code.name)
    assert code in {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}, (
        region,
        code,
        details,
    )
    assert no_controls(details) and len(details) < 600, details


def test_server_serves_after_the_fuzz(channel, demo_repo, fuzz_region, server):
    """Runs after the fuzz tests (file order): inline and shared-memory inference still work,
    and unregister-all leaves no descriptor on the fuzzed object."""
    assert_serving(channel, demo_repo)
    x = np.arange(32, dtype=np.float32).reshape(2, 16)
    shm.set_shared_memory_region(fuzz_region, [x])
    c = grpcclient.InferenceServerClient(server.address)
    c.unregister_system_shared_memory()
    before = fds_on(FUZZ_KEY)  # the client's own (tritonclient keeps descriptors open)
    c.register_system_shared_memory("fuzz", FUZZ_KEY, FUZZ_SIZE)
    assert fds_on(FUZZ_KEY) == before + 1  # the server's one descriptor
    with Region(2 * 8 * 4) as rout:
        before_out = fds_on(rout.key)
        c.register_system_shared_memory(rout.name, rout.key, rout.nbytes)
        inp = grpcclient.InferInput("input_0", [2, 16], "FP32")
        inp.set_shared_memory("fuzz", x.nbytes)
        out = grpcclient.InferRequestedOutput("output")
        out.set_shared_memory(rout.name, rout.nbytes)
        c.infer("mlp", [inp], outputs=[out])
        y = shm.get_contents_as_numpy(rout.handle, np.float32, [2, 8])
        np.testing.assert_allclose(
            y, ref.mlp(x, ref.weights(demo_repo, "mlp")), rtol=1e-4, atol=1e-4
        )
        c.unregister_system_shared_memory()
        assert (fds_on(FUZZ_KEY), fds_on(rout.key)) == (before, before_out)

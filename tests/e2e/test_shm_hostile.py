"""A hostile or careless shared-memory client against the CLI worker, with stock tritonclient.

Hostile names and keys (a NUL byte used to kill the worker inside posix_ipc) are
INVALID_ARGUMENT; a client that shrinks its registered region gets FAILED_PRECONDITION naming
the sizes (it used to be SIGBUS); cancelled in-flight shared-memory requests followed by an
unregister leave no mapping and no descriptor of the region in the worker. After each, the
worker process is alive and serving.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
import uuid

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from kserve_trio.proto import inference as pb
from tests.e2e import reference as ref

pytestmark = pytest.mark.slow

ROWS = 4
IN_BYTES = ROWS * 16 * 4
OUT_BYTES = ROWS * 8 * 4


def unique(prefix: str) -> str:
    return f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"


class Region:
    """A tritonclient-created region; ``truncate`` resizes the object as its owner may."""

    def __init__(self, nbytes: int) -> None:
        self.name = unique("r")
        self.key = "/" + unique("k")
        self.nbytes = nbytes
        self.handle = shm.create_shared_memory_region(self.name, self.key, nbytes)

    def truncate(self, size: int) -> None:
        fd = os.open("/dev/shm" + self.key, os.O_RDWR)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def size(self) -> int:
        return os.stat("/dev/shm" + self.key).st_size

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.truncate(self.nbytes)  # our own mapping must be covered before it is torn down
        shm.destroy_shared_memory_region(self.handle)


def maps_of(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if "/dev/shm" + key in line)


def fds_on(pid: int, key: str) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        n += target.split(" (deleted)")[0] == "/dev/shm" + key
    return n


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def assert_alive_and_serving(worker, demo_repo) -> None:
    assert worker.proc.poll() is None, f"worker died:\n{worker.logs()[-3000:]}"
    c = grpcclient.InferenceServerClient(worker.url)
    x = np.ones((2, 16), np.float32)
    inp = grpcclient.InferInput("input_0", [2, 16], "FP32")
    inp.set_data_from_numpy(x)
    out = c.infer("mlp", [inp]).as_numpy("output")
    np.testing.assert_allclose(out, ref.mlp(x, ref.weights(demo_repo, "mlp")), rtol=1e-5, atol=1e-5)


def shm_infer(c, rin: Region | None, rout: Region | None, x: np.ndarray, **kw):
    inp = grpcclient.InferInput("input_0", list(x.shape), "FP32")
    if rin is None:
        inp.set_data_from_numpy(x)
    else:
        inp.set_shared_memory(rin.name, x.nbytes)
    out = grpcclient.InferRequestedOutput("output")
    if rout is not None:
        out.set_shared_memory(rout.name, x.shape[0] * 8 * 4)
    return c.infer("mlp", [inp], outputs=[out], **kw)


def status_of(call) -> tuple[str, str]:
    try:
        call()
    except InferenceServerException as exc:
        return str(exc.status()), exc.message() or ""
    return "OK", ""


# --------------------------------------------------------------------------------------------
# hostile names and keys


HOSTILE_KEYS = [
    "/ab\x00cd",
    "\x00",
    "/k\x00",
    "/k\n",
    "/k\x7f",
    "/\x1b[2J",
    "",
    "/",
    "//k",
    "/a/b",
    "/.",
    "..",
    "/" + "k" * 256,
]
HOSTILE_NAMES = ["r\x00", "\x00", "r\n", "\x9b", "n" * 256]


def test_hostile_keys_are_invalid_argument_and_the_worker_lives(demo_worker, demo_repo):
    c = grpcclient.InferenceServerClient(demo_worker.url)
    with Region(64) as r, grpc.insecure_channel(demo_worker.url) as ch:
        same = ch.unary_unary("/inference.GRPCInferenceService/IsSameIPCNamespace")
        for key in HOSTILE_KEYS:
            status, message = status_of(lambda k=key: c.register_system_shared_memory("r", k, 64))
            assert status == "StatusCode.INVALID_ARGUMENT", (key, status, message)
            assert message.startswith("SystemSharedMemoryRegister: shared memory key "), message
            assert "\x00" not in message
            with pytest.raises(grpc.RpcError) as err:
                same(bytes(pb.IsSameIpcNamespaceRequest(name=key)), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, key
            assert err.value.details().startswith("IsSameIPCNamespace: shared memory name ")
            assert demo_worker.proc.poll() is None, (key, demo_worker.logs()[-3000:])
        # the real key still registers, and the probe answers for it
        c.register_system_shared_memory(r.name, r.key, 64)
        reply = pb.IsSameIpcNamespaceResponse.parse(
            same(bytes(pb.IsSameIpcNamespaceRequest(name=r.key)), timeout=10)
        )
        assert reply.same is True
        c.unregister_system_shared_memory(r.name)
    assert c.get_system_shared_memory_status(as_json=True).get("regions", {}) == {}
    assert_alive_and_serving(demo_worker, demo_repo)


def test_hostile_region_names_are_invalid_argument_and_the_worker_lives(demo_worker, demo_repo):
    c = grpcclient.InferenceServerClient(demo_worker.url)
    with Region(64) as r:
        for name in HOSTILE_NAMES:
            calls = {
                "SystemSharedMemoryRegister": lambda n=name: c.register_system_shared_memory(
                    n, r.key, 64
                ),
                "SystemSharedMemoryUnregister": lambda n=name: c.unregister_system_shared_memory(n),
                "SystemSharedMemoryStatus": lambda n=name: c.get_system_shared_memory_status(n),
            }
            for rpc, call in calls.items():
                status, message = status_of(call)
                assert status == "StatusCode.INVALID_ARGUMENT", (rpc, name, status, message)
                assert message.startswith(f"{rpc}: shared memory region name "), message
            # an inference naming it is refused too, the name escaped in the message
            inp = grpcclient.InferInput("input_0", [ROWS, 16], "FP32")
            inp.set_shared_memory(name, IN_BYTES)
            status, message = status_of(lambda i=inp: c.infer("mlp", [i]))
            assert status == "StatusCode.INVALID_ARGUMENT", (name, status, message)
            assert "\x00" not in message and "\n" not in message
            assert demo_worker.proc.poll() is None
    assert_alive_and_serving(demo_worker, demo_repo)


# --------------------------------------------------------------------------------------------
# a client that shrinks its region


def test_shrunk_input_region_is_failed_precondition(demo_worker, demo_repo):
    c = grpcclient.InferenceServerClient(demo_worker.url)
    w = ref.weights(demo_repo, "mlp")
    x = np.random.default_rng(0).standard_normal((ROWS, 16), dtype=np.float32)
    with Region(IN_BYTES) as rin:
        shm.set_shared_memory_region(rin.handle, [x])
        c.register_system_shared_memory(rin.name, rin.key, IN_BYTES)
        try:
            ok = shm_infer(c, rin, None, x).as_numpy("output")
            np.testing.assert_allclose(ok, ref.mlp(x, w), rtol=1e-5, atol=1e-5)
            for size in (100, 0):
                rin.truncate(size)
                status, message = status_of(lambda: shm_infer(c, rin, None, x))
                assert status == "StatusCode.FAILED_PRECONDITION", (status, message)
                assert f"shared memory region '{rin.name}'" in message
                assert f"is {size} bytes, smaller than offset + byte_size = 0 + {IN_BYTES}" in (
                    message
                )
                assert_alive_and_serving(demo_worker, demo_repo)
            rin.truncate(IN_BYTES)  # regrown (zeros), refilled: served again
            shm.set_shared_memory_region(rin.handle, [x])
            again = shm_infer(c, rin, None, x).as_numpy("output")
            np.testing.assert_allclose(again, ref.mlp(x, w), rtol=1e-5, atol=1e-5)
        finally:
            c.unregister_system_shared_memory(rin.name)


def test_shrunk_output_region_is_failed_precondition(demo_worker, demo_repo):
    c = grpcclient.InferenceServerClient(demo_worker.url)
    x = np.ones((ROWS, 16), np.float32)
    with Region(OUT_BYTES) as rout:
        c.register_system_shared_memory(rout.name, rout.key, OUT_BYTES)
        try:
            rout.truncate(OUT_BYTES // 2)
            status, message = status_of(lambda: shm_infer(c, None, rout, x))
            assert status == "StatusCode.FAILED_PRECONDITION", (status, message)
            assert (
                f"is {OUT_BYTES // 2} bytes, smaller than offset + byte_size = 0 + {OUT_BYTES} "
                "needed to write"
            ) in message
            assert rout.size() == OUT_BYTES // 2  # the worker did not grow the object back
            assert_alive_and_serving(demo_worker, demo_repo)
        finally:
            c.unregister_system_shared_memory(rout.name)


def test_shrinking_and_regrowing_during_inference_never_crashes(demo_worker, demo_repo):
    """A thread resizes both regions between empty, half and full while inferences read their
    input from one and write their output to the other."""
    c = grpcclient.InferenceServerClient(demo_worker.url)
    x = np.random.default_rng(1).standard_normal((ROWS, 16), dtype=np.float32)
    outcomes: dict[str, int] = {}
    with Region(IN_BYTES) as rin, Region(OUT_BYTES) as rout:
        shm.set_shared_memory_region(rin.handle, [x])
        c.register_system_shared_memory(rin.name, rin.key, IN_BYTES)
        c.register_system_shared_memory(rout.name, rout.key, OUT_BYTES)
        stop = threading.Event()

        def resize() -> None:
            rng = random.Random(7)
            while not stop.is_set():
                frac = rng.choice((0, 1, 2))
                rin.truncate(IN_BYTES * frac // 2)
                rout.truncate(OUT_BYTES * frac // 2)
                time.sleep(rng.uniform(0, 0.002))  # random timing: the hostile resizer

        t = threading.Thread(target=resize)
        t.start()
        try:
            give_up = time.monotonic() + 30
            i = 0
            while i < 150 or (
                not (outcomes.get("OK") and outcomes.get("StatusCode.FAILED_PRECONDITION"))
                and time.monotonic() < give_up
            ):
                status, message = status_of(lambda: shm_infer(c, rin, rout, x))
                outcomes[status] = outcomes.get(status, 0) + 1
                if status != "OK":
                    assert "smaller than offset + byte_size" in message, message
                i += 1
        finally:
            stop.set()
            t.join(10)
        assert set(outcomes) <= {"OK", "StatusCode.FAILED_PRECONDITION"}, outcomes
        assert outcomes.get("OK") and outcomes.get("StatusCode.FAILED_PRECONDITION"), outcomes
        assert_alive_and_serving(demo_worker, demo_repo)
        rin.truncate(IN_BYTES)
        rout.truncate(OUT_BYTES)
        shm.set_shared_memory_region(rin.handle, [x])
        shm_infer(c, rin, rout, x)
        y = shm.get_contents_as_numpy(rout.handle, np.float32, [ROWS, 8])
        np.testing.assert_allclose(
            y, ref.mlp(x, ref.weights(demo_repo, "mlp")), rtol=1e-5, atol=1e-5
        )
        c.unregister_system_shared_memory()


# --------------------------------------------------------------------------------------------
# cancelled in-flight requests, then unregister


async def cancelled_burst(url: str, rin: Region, rout: Region, rows: int) -> dict[str, int]:
    """Rounds of concurrent shm inferences, most cut short by a tiny client timeout or by
    cancelling the task while it is in flight."""
    client = aioclient.InferenceServerClient(url)
    counts: dict[str, int] = {}
    rng = random.Random(3)

    async def one() -> str:
        inp = aioclient.InferInput("input_0", [rows, 16], "FP32")
        inp.set_shared_memory(rin.name, rows * 16 * 4)
        out = aioclient.InferRequestedOutput("output")
        out.set_shared_memory(rout.name, rows * 8 * 4)
        try:
            await client.infer(
                "mlp", [inp], outputs=[out], client_timeout=rng.uniform(0.0005, 0.01)
            )
        except InferenceServerException as exc:
            return str(exc.status())
        return "OK"

    try:
        for _ in range(8):
            tasks = [asyncio.ensure_future(one()) for _ in range(40)]
            await asyncio.sleep(rng.uniform(0.001, 0.005))  # cancel at random points
            for task in tasks[::3]:
                task.cancel()
            for res in await asyncio.gather(*tasks, return_exceptions=True):
                key = "cancelled" if isinstance(res, asyncio.CancelledError) else str(res)
                counts[key] = counts.get(key, 0) + 1
    finally:
        await client.close()
    return counts


def poll(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.parametrize("how", ["by-name", "unregister-all-from-another-client"])
def test_cancelled_requests_then_unregister_leave_no_mapping_or_descriptor(
    demo_worker, demo_repo, how
):
    pid = demo_worker.proc.pid
    rows = 64
    c = grpcclient.InferenceServerClient(demo_worker.url)
    assert c.is_server_live()
    with Region(rows * 16 * 4) as rin, Region(rows * 8 * 4) as rout:
        shm.set_shared_memory_region(rin.handle, [np.ones((rows, 16), np.float32)])
        base_maps = (maps_of(pid, rin.key), maps_of(pid, rout.key))
        base_fds = (fds_on(pid, rin.key), fds_on(pid, rout.key))
        total_fds = fd_count(pid)
        c.register_system_shared_memory(rin.name, rin.key, rin.nbytes)
        c.register_system_shared_memory(rout.name, rout.key, rout.nbytes)
        assert (fds_on(pid, rin.key), fds_on(pid, rout.key)) == (base_fds[0] + 1, base_fds[1] + 1)
        counts = asyncio.run(cancelled_burst(demo_worker.url, rin, rout, rows))
        cut_short = sum(n for k, n in counts.items() if k != "OK")
        assert cut_short >= 40, counts  # the test means nothing unless requests were cut short
        if how == "by-name":
            c.unregister_system_shared_memory(rin.name)
            c.unregister_system_shared_memory(rout.name)
        else:
            grpcclient.InferenceServerClient(demo_worker.url).unregister_system_shared_memory()
        assert poll(
            lambda: (
                (maps_of(pid, rin.key), maps_of(pid, rout.key)) == base_maps
                and (fds_on(pid, rin.key), fds_on(pid, rout.key)) == base_fds
            )
        ), (counts, maps_of(pid, rin.key), fds_on(pid, rin.key))
        assert poll(lambda: fd_count(pid) <= total_fds), (fd_count(pid), total_fds)
    assert_alive_and_serving(demo_worker, demo_repo)

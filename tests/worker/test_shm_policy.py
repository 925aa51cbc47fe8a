"""The worker's client shared-memory policy end to end, in-process workers driven by stock
tritonclient (gRPC and REST) and by the project's own client.

Off (``endpoints.client_shared_memory: false``): Register, Unregister and Status answer
UNAVAILABLE (REST 503) naming the key, ``IsSameIPCNamespace`` says no for an object the worker
can see, ``ServerMetadata`` drops the extension, and ``KServeModel(shared_memory="auto")``
falls back to inline tensors with the right answers. An allow-list
(``endpoints.client_shared_memory_prefixes``): a key outside it is INVALID_ARGUMENT (REST 400)
naming the key setting and probed no; one inside registers, and the project's own client,
whose pool key the list admits, still goes through shared memory.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
import uuid

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from kserve_trio.client import KServeModel, SharedMemoryUnavailable, infer_sync
from kserve_trio.client.runtime import SHM_POOL_NAME, Route, get_state
from kserve_trio.proto import inference as pb
from tests.client.test_worker_e2e import ArrayIO
from tests.e2e import reference as ref
from tests.inprocess import in_process_worker
from tests.ports import free_port

OFF = "client shared memory is off on this server (endpoints.client_shared_memory: false)"


def worker(demo_repo, **endpoints):
    endpoints.update(port=0, http_port=free_port())
    return in_process_worker(demo_repo, models_include=["mlp"], endpoints=endpoints)


@pytest.fixture(scope="module")
def off(demo_repo):
    with worker(demo_repo, client_shared_memory=False) as running:
        yield running


@pytest.fixture(scope="module")
def allow_listed(demo_repo):
    prefixes = ["triton_", f"shm-{SHM_POOL_NAME}-"]
    with worker(demo_repo, client_shared_memory_prefixes=prefixes) as running:
        yield running


class Region:
    """A tritonclient-created region under ``key_prefix``, destroyed on exit."""

    def __init__(self, key_prefix: str, nbytes: int = 64) -> None:
        self.key = f"/{key_prefix}{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.handle = shm.create_shared_memory_region("r", self.key, nbytes)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        shm.destroy_shared_memory_region(self.handle)


def grpc_client(running) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(f"127.0.0.1:{running.port}")


def same_ipc(running, key: str) -> bool:
    """``IsSameIPCNamespace(key)`` (tritonclient has no method for it)."""
    with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        probe = channel.unary_unary("/inference.GRPCInferenceService/IsSameIPCNamespace")
        reply = probe(bytes(pb.IsSameIpcNamespaceRequest(name=key)), timeout=10)
    return pb.IsSameIpcNamespaceResponse().parse(reply).same


def rest(running, path: str, body: dict | None = None) -> tuple[int, str]:
    """A REST call (GET without ``body``, else POST): its status and its error message (""
    when it succeeded)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{running.http_port}{path}", data)
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, ""
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["error"]


def refused(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as info:
        call()
    return str(info.value.status()), info.value.message()


def test_off_answers_the_shm_rpcs_unavailable_naming_the_key(off):
    c = grpc_client(off)
    with Region("k_") as region:
        for call in (
            lambda: c.register_system_shared_memory("r", region.key, 64),
            lambda: c.unregister_system_shared_memory("r"),
            lambda: c.get_system_shared_memory_status(),
        ):
            status, message = refused(call)
            assert status == "StatusCode.UNAVAILABLE" and OFF in message, message
        register = {"key": region.key, "offset": 0, "byte_size": 64}
        for path, body in (
            ("/v2/systemsharedmemory/region/r/register", register),
            ("/v2/systemsharedmemory/region/r/unregister", {}),
            ("/v2/systemsharedmemory/status", None),
        ):
            code, message = rest(off, path, body)
            assert code == 503 and OFF in message, (path, code, message)
        assert same_ipc(off, region.key) is False  # it exists and the worker could open it
    assert "system_shared_memory" not in c.get_server_metadata().extensions
    assert off.state.shm_registry is not None and off.state.shm_registry.policy.enabled is False


def test_off_sends_our_clients_tensors_inline_with_the_right_answers(off, demo_repo):
    x = np.random.default_rng(3).standard_normal((40, 16), dtype=np.float32)
    io = ArrayIO(x, (8,))
    model = KServeModel(f"127.0.0.1:{off.port}", "mlp", max_batch_size=16, shared_memory="auto")
    infer_sync(model, io)
    want = ref.mlp(x, ref.weights(demo_repo, "mlp"))
    np.testing.assert_allclose(io.y, want, rtol=1e-5, atol=1e-5)
    (ep,) = [e for e in get_state().endpoints.values() if e.endpoint.port == off.port]
    assert ep.routes["auto"] is Route.INLINE and not ep.registered
    forced = KServeModel(f"127.0.0.1:{off.port}", "mlp", max_batch_size=16, shared_memory="on")
    with pytest.raises(SharedMemoryUnavailable):
        infer_sync(forced, ArrayIO(x, (8,)))


def test_a_key_outside_the_allow_list_is_refused_naming_the_setting(allow_listed):
    c = grpc_client(allow_listed)
    setting = "(endpoints.client_shared_memory_prefixes)"
    with Region("other_") as other, Region("triton_") as ok:
        status, message = refused(lambda: c.register_system_shared_memory("r", other.key, 64))
        assert status == "StatusCode.INVALID_ARGUMENT"
        assert message.endswith(f"starts with none of the allowed prefixes 'triton_', "
                                f"'shm-{SHM_POOL_NAME}-' {setting}")  # fmt: skip
        code, message = rest(
            allow_listed,
            "/v2/systemsharedmemory/region/r/register",
            {"key": other.key, "offset": 0, "byte_size": 64},
        )
        assert code == 400 and message.endswith(setting)
        assert same_ipc(allow_listed, other.key) is False
        assert same_ipc(allow_listed, ok.key) is True
        c.register_system_shared_memory("r", ok.key, 64)
        assert list(c.get_system_shared_memory_status(as_json=True)["regions"]) == ["r"]
        c.unregister_system_shared_memory("r")


def test_our_client_still_uses_shared_memory_when_the_list_admits_its_pool(allow_listed, demo_repo):
    x = np.random.default_rng(4).standard_normal((24, 16), dtype=np.float32)
    io = ArrayIO(x, (8,))
    port = allow_listed.port
    infer_sync(KServeModel(f"127.0.0.1:{port}", "mlp", max_batch_size=8), io)
    np.testing.assert_allclose(
        io.y, ref.mlp(x, ref.weights(demo_repo, "mlp")), rtol=1e-5, atol=1e-5
    )
    (ep,) = [e for e in get_state().endpoints.values() if e.endpoint.port == port]
    assert ep.routes["auto"] is Route.SHM and ep.registered

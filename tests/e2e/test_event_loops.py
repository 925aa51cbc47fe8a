"""The servers on each event loop and HTTP/2 engine: the same end-to-end set on uvloop and on
trio, each on ngh2 and on h2.

Per event loop and engine, two CLI workers (the first with its REST port open) and a CLI gateway
in front of both (its public port on TLS), driven by stock tritonclient: unary inference, a
stream, system shared memory, an expired deadline, a cancelled call, gzip compression, TLS and
REST (with its HTTP/1.1 rules and chunk-extension bound). Every server must keep serving after
each of them.
"""

from __future__ import annotations

import json
import pathlib
import queue
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm

from kserve_trio.core.errors import StatusCode
from kserve_trio.http2 import ENGINES
from kserve_trio.proto import inference as pb
from tests.edge.rest_peer import chunk_extensions_are_bounded, http11_rules_hold
from tests.gateway.conftest import pki  # noqa: F401  (the session's throwaway PKI)
from tests.gateway.procs import Gateway, Worker
from tests.ports import free_port
from tests.worker.raw_h2 import grpc_frame, raw_grpc_call

READY_PATH = "/inference.GRPCInferenceService/ServerReady"


def ready_request() -> pb.ServerReadyRequest:
    return pb.ServerReadyRequest()


pytestmark = pytest.mark.slow

STACKS = [(loop, engine) for loop in ("uvloop", "trio") for engine in ENGINES]


class _Stack:
    def __init__(
        self, loop: str, engine: str, workers: list[Worker], http_port: int, gateway: Gateway
    ):
        self.loop, self.engine, self.workers = loop, engine, workers
        self.http_port, self.gateway = http_port, gateway


@pytest.fixture(scope="module", params=STACKS, ids=[f"{loop}-{engine}" for loop, engine in STACKS])
def stack(request, demo_repo: pathlib.Path, pki: pathlib.Path):  # noqa: F811
    loop, engine = request.param
    http_port = free_port()
    # Without the suite's shared compilation cache: XLA's CPU loader writes a plain-text line to
    # stderr for every executable it loads from a cache, and this stack checks that every line
    # the servers write is JSON.
    common = {
        "INFERENCE_SERVER_ENDPOINTS_EVENT_LOOP": loop,
        "INFERENCE_SERVER_ENDPOINTS_HTTP2_ENGINE": engine,
        "JAX_COMPILATION_CACHE_DIR": "",
    }
    first = Worker(
        demo_repo,
        "127.0.0.1",
        free_port(),
        env={
            **common,
            "INFERENCE_SERVER_ENDPOINTS_HTTP_PORT": str(http_port),
            "KSERVE_TRIO_GRPC_FAST_UNARY": "0",  # a switch that no longer exists
        },
    )
    second = Worker(demo_repo, "127.0.0.1", free_port(), env=common)
    workers = [first, second]
    gateway = None
    try:
        for worker in workers:
            worker.wait_ready()
        g = "KSERVE_TRIO_GATEWAY_"
        gateway = Gateway(
            demo_repo.parent,
            {
                g + "WORKERS": ",".join(w.url for w in workers),
                g + "TLS_CERT_FILE": str(pki / "server.pem"),
                g + "TLS_KEY_FILE": str(pki / "server.key"),
            },
            "--event-loop",
            loop,
            "--http2-engine",
            engine,
        )
        gateway.wait_ready()
        yield _Stack(loop, engine, workers, http_port, gateway)
    finally:  # every process is stopped before any exit status is judged
        codes = [(gateway, gateway.stop())] if gateway is not None else []
        codes += [(worker, worker.stop()) for worker in workers]
        for proc, code in codes:
            assert code == 0, proc.logs()


def _input(rows: int = 3, seed: int = 0) -> tuple[np.ndarray, grpcclient.InferInput]:
    x = np.random.default_rng(seed).standard_normal((rows, 16), dtype=np.float32)
    inp = grpcclient.InferInput("input_0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return x, inp


def _gateway_client(stack: _Stack, pki: pathlib.Path) -> grpcclient.InferenceServerClient:  # noqa: F811
    return grpcclient.InferenceServerClient(
        stack.gateway.url, ssl=True, root_certificates=str(pki / "ca.pem")
    )


def _reference(stack: _Stack, x: np.ndarray) -> np.ndarray:
    _, inp = _input()
    inp.set_data_from_numpy(x)
    return stack.workers[1].client().infer("mlp", [inp]).as_numpy("output")


def test_the_servers_run_on_the_event_loop_and_engine_asked_for(stack: _Stack):
    for proc in (*stack.workers, stack.gateway):
        up = [
            line
            for line in proc.logs().splitlines()
            if '"event": "server_up"' in line or '"event": "gateway_up"' in line
        ]
        assert up, proc.logs()
        said = json.loads(up[-1])
        assert (said["event_loop"], said["http2_engine"]) == (stack.loop, stack.engine)


def test_unary_inference_through_a_worker_and_the_tls_gateway(stack: _Stack, pki):  # noqa: F811
    _, inp = _input()
    direct = stack.workers[0].client().infer("mlp", [inp]).as_numpy("output")
    assert direct.shape == (3, 8)
    through = _gateway_client(stack, pki).infer("mlp", [inp]).as_numpy("output")
    np.testing.assert_allclose(through, direct, rtol=1e-6)


def test_a_stream_answers_every_request(stack: _Stack, pki):  # noqa: F811
    answers: queue.Queue = queue.Queue()
    for client in (stack.workers[0].client(), _gateway_client(stack, pki)):
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            _, inp = _input()
            for k in range(6):
                client.async_stream_infer("mlp", [inp], request_id=f"r{k}")
            got = [answers.get(timeout=60) for _ in range(6)]
        finally:
            client.stop_stream()
        assert [error for _, error in got] == [None] * 6
        assert sorted(result.get_response().id for result, _ in got) == [f"r{k}" for k in range(6)]


def test_system_shared_memory_inputs(stack: _Stack):
    x, _ = _input(seed=1)
    client = stack.workers[0].client()
    key = f"/kt_loops_{stack.loop}"
    handle = shm.create_shared_memory_region("loops_in", key, x.nbytes)
    try:
        shm.set_shared_memory_region(handle, [x])
        client.register_system_shared_memory("loops_in", key, x.nbytes)
        inp = grpcclient.InferInput("input_0", list(x.shape), "FP32")
        inp.set_shared_memory("loops_in", x.nbytes)
        out = client.infer("mlp", [inp]).as_numpy("output")
        np.testing.assert_allclose(out, _reference(stack, x), rtol=1e-6)
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(handle)


def test_an_expired_deadline_is_deadline_exceeded(stack: _Stack, pki):  # noqa: F811
    """An explicit ``grpc-timeout`` of one nanosecond, sent by a raw client (a stock client may
    round a tiny timeout up, or never send the call), is over before the call is read."""
    _, inp = _input()
    body = grpc_frame(bytes(ready_request()))
    for worker in stack.workers:
        reply = raw_grpc_call(worker.url, READY_PATH, body, headers=(("grpc-timeout", "1n"),))
        assert reply.status == int(StatusCode.DEADLINE_EXCEEDED)
        assert worker.client().infer("mlp", [inp]).as_numpy("output").shape == (3, 8)
    assert _gateway_client(stack, pki).is_server_ready()


def test_a_cancelled_call_leaves_the_server_serving(stack: _Stack):
    client = stack.workers[0].client()
    _, inp = _input()
    done: queue.Queue = queue.Queue()
    calls = [
        client.async_infer("mlp", [inp], lambda result, error: done.put(error)) for _ in range(8)
    ]
    for call in calls:
        call.cancel()
    outcomes = [done.get(timeout=60) for _ in calls]
    assert all(e is None or "CANCELLED" in str(e.status()) for e in outcomes)
    assert client.infer("mlp", [inp]).as_numpy("output").shape == (3, 8)


def test_gzip_requests_and_replies(stack: _Stack, pki):  # noqa: F811
    x, inp = _input(seed=2)
    want = _reference(stack, x)
    for client in (stack.workers[0].client(), _gateway_client(stack, pki)):
        out = client.infer("mlp", [inp], compression_algorithm="gzip").as_numpy("output")
        np.testing.assert_allclose(out, want, rtol=1e-6)


def test_rest_inference(stack: _Stack):
    x, _ = _input(seed=3)
    body = json.dumps(
        {
            "inputs": [
                {
                    "name": "input_0",
                    "shape": [3, 16],
                    "datatype": "FP32",
                    "data": x.ravel().tolist(),
                }
            ]
        }
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{stack.http_port}/v2/models/mlp/infer",
        body,
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        reply = json.loads(response.read())
    out = np.array(reply["outputs"][0]["data"], np.float32).reshape(reply["outputs"][0]["shape"])
    np.testing.assert_allclose(out, _reference(stack, x), rtol=1e-5)


def test_rest_reads_http11_strictly_and_bounds_chunk_extensions(stack: _Stack):
    chunk_extensions_are_bounded(stack.http_port, [stack.workers[0].proc.pid])
    http11_rules_hold(stack.http_port)


def test_logs_are_json_lines_and_a_removed_switch_is_named(stack: _Stack):
    """Runs last: every line the servers logged through the tests above (expired deadlines,
    cancellations, a TLS gateway) is a JSON object, and the worker started with a removed
    switch said so by name."""
    for proc in (*stack.workers, stack.gateway):
        for line in proc.logs().splitlines():
            if line.strip():
                assert isinstance(json.loads(line), dict), line
    events = [json.loads(line) for line in stack.workers[0].logs().splitlines() if line.strip()]
    removed = [e for e in events if e.get("event") == "removed_switch_ignored"]
    assert [e["variable"] for e in removed] == ["KSERVE_TRIO_GRPC_FAST_UNARY"]

"""The gateway end to end: two CLI worker processes (127.0.0.1 and 127.0.0.2 on one port,
behind one name a hosts file resolves) and the gateway CLI process, driven by the stock
tritonclient and by our own client.

The workers start once for the module (the demo repository's mlp only); the gateways are cheap
(no jax) and each test that needs another configuration starts its own."""

from __future__ import annotations

import json
import queue
import threading
import time
import types

import anyio
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from kserve_trio.client import InferInput, KServeModel, RetryPolicy
from kserve_trio.client.h2_transport import H2Transport
from kserve_trio.client.transport import Endpoint, method_path
from kserve_trio.proto import inference as pb
from tests.e2e import reference as ref
from tests.gateway.procs import Gateway, Worker
from tests.ports import free_port
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
G = "KSERVE_TRIO_GATEWAY_"
INTERVAL = 1.0  # the test gateways' prober interval (HEALTH_INTERVAL_SECONDS)


@pytest.fixture(scope="module")
def e2e(demo_repo, tmp_path_factory):
    work = tmp_path_factory.mktemp("gateway_e2e")
    port = free_port("127.0.0.1", "127.0.0.2")
    mport = free_port("127.0.0.1", "127.0.0.2")
    a = Worker(demo_repo, "127.0.0.1", port, metrics_port=mport)
    b = Worker(demo_repo, "127.0.0.2", port, metrics_port=mport)
    hosts = work / "hosts"
    hosts.write_text("127.0.0.1 workers.test\n127.0.0.2 workers.test\n")
    gw = None
    try:
        a.wait_ready()
        b.wait_ready()
        env = {
            G + "WORKERS": f"workers.test:{port}",
            G + "WORKER_METRICS": f"workers.test:{mport}",
            G + "HOSTS_FILE": str(hosts),
        }
        gw = Gateway(work, env)
        gw.wait_ready()
        yield types.SimpleNamespace(
            a=a, b=b, gw=gw, work=work, port=port, hosts=hosts, repo=demo_repo
        )
    finally:
        if gw is not None:
            assert gw.stop() == 0, gw.logs()  # SIGTERM: drained, exit 0
        a.stop()
        b.stop()


def mlp_input(x: np.ndarray) -> grpcclient.InferInput:
    inp = grpcclient.InferInput("input_0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def successes(worker: Worker) -> int:
    """Requests the worker itself says it served (its own statistics)."""
    stats = worker.client().get_inference_statistics("mlp", as_json=True)["model_stats"][0]
    return int(stats["inference_stats"].get("success", {}).get("count", 0))


def test_tritonclient_sees_one_server_and_traffic_spreads_over_both_workers(e2e):
    c = e2e.gw.client()
    assert c.is_server_live() and c.is_server_ready()
    assert c.get_server_metadata(as_json=True)["name"] == "kserve_trio"
    assert c.is_model_ready("mlp") and not c.is_model_ready("cnn")
    assert c.is_model_ready("mlp", "1") and not c.is_model_ready("mlp", "7")
    assert [m["name"] for m in c.get_model_repository_index(as_json=True)["models"]] == ["mlp"]
    assert c.get_model_metadata("mlp", as_json=True)["inputs"][0]["shape"] == ["-1", "16"]
    assert c.get_model_config("mlp", as_json=True)["config"]["name"] == "mlp"
    before = (successes(e2e.a), successes(e2e.b))
    w = ref.weights(e2e.repo, "mlp")
    rng = np.random.default_rng(0)
    for i in range(20):
        x = rng.standard_normal((1 + i % 4, 16), dtype=np.float32)
        r = c.infer("mlp", [mlp_input(x)], request_id=f"u{i}")
        np.testing.assert_allclose(r.as_numpy("output"), ref.mlp(x, w), rtol=1e-5, atol=1e-5)
        assert r.get_response().id == f"u{i}"
    after = (successes(e2e.a), successes(e2e.b))
    assert (after[0] - before[0], after[1] - before[1]) == (10, 10)  # round robin
    total = c.get_inference_statistics("mlp", as_json=True)["model_stats"][0]
    assert int(total["inference_stats"]["success"]["count"]) == sum(after)  # summed
    _, routing = e2e.gw.admin("/routing")
    doc = json.loads(routing)
    labels = [f"127.0.0.1:{e2e.port}", f"127.0.0.2:{e2e.port}"]
    assert doc["models"] == {"mlp": labels}
    assert doc["workers"] == [{"worker": w, "ready": True} for w in labels]
    _, metrics = e2e.gw.admin("/metrics")
    for label in labels:  # each worker's own exposition merged in
        assert f'gateway_worker_metrics_up{{worker="{label}"}} 1.0' in metrics
    served = [ln for ln in metrics.splitlines() if ln.startswith("worker_requests_served_total")]
    assert len(served) >= 2  # one series per worker
    assert metrics.count("# TYPE worker_requests_served_total counter") == 1


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests_pass_through_to_the_workers(e2e, algorithm):
    """The gateway forwards a compressed request's bytes as they came (it only decompresses a
    copy to read the model name); the worker decompresses and answers compressed."""
    c = e2e.gw.client()
    w = ref.weights(e2e.repo, "mlp")
    x = np.random.default_rng(5).standard_normal((3, 16), dtype=np.float32)
    r = c.infer("mlp", [mlp_input(x)], compression_algorithm=algorithm)
    np.testing.assert_allclose(r.as_numpy("output"), ref.mlp(x, w), rtol=1e-5, atol=1e-5)


def test_streaming_inference_answers_each_request_with_its_id(e2e):
    c = e2e.gw.client()
    answers: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: answers.put((result, error)))
    w = ref.weights(e2e.repo, "mlp")
    xs = {f"s{i}": np.full((1, 16), i / 10, np.float32) for i in range(8)}
    try:
        for rid, x in xs.items():
            c.async_stream_infer("mlp", [mlp_input(x)], request_id=rid)
        c.async_stream_infer("nope", [mlp_input(xs["s0"])], request_id="bad")
        got = [answers.get(timeout=30) for _ in range(len(xs) + 1)]
        errors = [str(e) for r, e in got if e is not None]
        assert len(errors) == 1 and "model 'nope' not found on any worker" in errors[0]
        for r, e in got:
            if e is None:
                rid = r.get_response().id
                np.testing.assert_allclose(
                    r.as_numpy("output"), ref.mlp(xs[rid], w), rtol=1e-5, atol=1e-5
                )
        assert sorted(r.get_response().id for r, e in got if e is None) == sorted(xs)
        c.async_stream_infer("mlp", [mlp_input(xs["s1"])], request_id="again")  # still open
        r, e = answers.get(timeout=30)
        assert e is None and r.get_response().id == "again"
    finally:
        c.stop_stream()


def test_shared_memory_inference_through_the_gateway(e2e):
    c = e2e.gw.client()
    x = np.random.default_rng(3).standard_normal((2, 16), dtype=np.float32)
    w = ref.weights(e2e.repo, "mlp")
    out_bytes = 2 * 8 * 4
    h_in = shm.create_shared_memory_region("gw_e2e_in", "/gw_e2e_in", x.nbytes)
    h_out = shm.create_shared_memory_region("gw_e2e_out", "/gw_e2e_out", out_bytes)
    try:
        shm.set_shared_memory_region(h_in, [x])
        c.register_system_shared_memory("gw_e2e_in", "/gw_e2e_in", x.nbytes)
        c.register_system_shared_memory("gw_e2e_out", "/gw_e2e_out", out_bytes)
        for worker in (e2e.a, e2e.b):  # registered on every worker
            regions = (
                worker.client().get_system_shared_memory_status(as_json=True).get("regions", {})
            )
            assert {"gw_e2e_in", "gw_e2e_out"} <= set(regions)
        for _ in range(4):  # both workers serve some of them
            inp = grpcclient.InferInput("input_0", [2, 16], "FP32")
            inp.set_shared_memory("gw_e2e_in", x.nbytes)
            out = grpcclient.InferRequestedOutput("output")
            out.set_shared_memory("gw_e2e_out", out_bytes)
            c.infer("mlp", [inp], outputs=[out])
            y = shm.get_contents_as_numpy(h_out, np.float32, [2, 8])
            np.testing.assert_allclose(y, ref.mlp(x, w), rtol=1e-5, atol=1e-5)
        status = c.get_system_shared_memory_status(as_json=True).get("regions", {})
        assert {"gw_e2e_in", "gw_e2e_out"} <= set(status)
        c.unregister_system_shared_memory("gw_e2e_in")
        c.unregister_system_shared_memory("gw_e2e_out")
        regions = e2e.a.client().get_system_shared_memory_status(as_json=True).get("regions", {})
        assert "gw_e2e_in" not in regions
    finally:
        shm.destroy_shared_memory_region(h_in)
        shm.destroy_shared_memory_region(h_out)


def test_worker_statuses_reach_the_client_unchanged(e2e):
    c = e2e.gw.client()
    with pytest.raises(InferenceServerException) as info:
        c.infer("mlp", [mlp_input(np.ones((1, 15), np.float32))])  # wrong shape
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as info:
        c.infer("mlp", [mlp_input(np.ones((1, 16), np.float32))], timeout=1)  # 1 us budget
    assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    with pytest.raises(InferenceServerException) as info:
        c.infer("nope", [mlp_input(np.ones((1, 16), np.float32))])
    assert info.value.status() == "StatusCode.NOT_FOUND"
    assert "model 'nope' not found on any worker" in info.value.message()
    with pytest.raises(InferenceServerException) as info:  # static workers: their own answer
        c.load_model("mlp")
    assert info.value.status() == "StatusCode.FAILED_PRECONDITION"
    assert "requires model_control_mode 'explicit'" in info.value.message()


def test_is_same_ipc_namespace_asks_every_worker(e2e):
    host, port = e2e.gw.url.rsplit(":", 1)

    async def same(key: str) -> bool:
        async with H2Transport(Endpoint(host=host, port=int(port))) as t:
            reply = await t.unary(
                method_path("IsSameIPCNamespace"),
                pb.IsSameIpcNamespaceRequest(name=key),
                pb.IsSameIpcNamespaceResponse,
                timeout=10.0,
            )
        return reply.same

    handle = shm.create_shared_memory_region("gw_e2e_ipc", "/gw_e2e_ipc", 64)
    try:
        assert anyio.run(same, "/gw_e2e_ipc") is True  # both workers can open it
    finally:
        shm.destroy_shared_memory_region(handle)
    assert anyio.run(same, "/gw_e2e_ipc") is False  # gone: no worker can


def test_the_inbound_cap_without_a_queue_sheds_and_our_retry_policy_recovers(e2e):
    gw = Gateway(
        e2e.work,
        {
            G + "WORKERS": f"127.0.0.1:{e2e.port},127.0.0.2:{e2e.port}",
            G + "GRPC_MAX_CONCURRENT_REQUESTS_PER_WORKER": "1",  # cap 2
            G + "GRPC_MAX_QUEUED_REQUESTS_PER_WORKER": "0",  # no queue: shed at once
        },
    )
    try:
        gw.wait_ready()
        x = np.ones((1, 16), np.float32)

        async def burst(policy: RetryPolicy) -> list:
            model = KServeModel(gw.url, "mlp", retry=policy, deadline=30.0, shared_memory="off")
            out: list = []

            async def one() -> None:
                try:
                    out.append(await model.infer([InferInput("input_0", x)]))
                except Exception as exc:
                    out.append(exc)

            async with anyio.create_task_group() as tg:
                for _ in range(24):
                    tg.start_soon(one)
            await model.aclose()
            return out

        shed = anyio.run(burst, RetryPolicy(enabled=False))
        refused = [r for r in shed if isinstance(r, Exception)]
        assert refused and all("RESOURCE_EXHAUSTED" in str(r) for r in refused)
        recovered = anyio.run(burst, RetryPolicy(initial_backoff=0.02, max_backoff=0.2))
        assert not [r for r in recovered if isinstance(r, Exception)]
        _, metrics = gw.admin("/metrics")
        assert "gateway_max_concurrent_requests 2.0" in metrics
        line = next(ln for ln in metrics.splitlines() if ln.startswith("gateway_requests_shed"))
        assert float(line.split()[-1]) >= len(refused)
    finally:
        assert gw.stop() == 0


def test_one_name_behind_two_addresses_is_two_workers_and_dropping_one_drops_it(e2e):
    hosts = e2e.work / "hosts-discovery"
    hosts.write_text("127.0.0.1 fleet.test\n127.0.0.2 fleet.test\n")
    gw = Gateway(e2e.work, {G + "WORKERS": f"fleet.test:{e2e.port}", G + "HOSTS_FILE": str(hosts)})
    both = [f"127.0.0.1:{e2e.port}", f"127.0.0.2:{e2e.port}"]

    def workers() -> list[str]:
        return [w["worker"] for w in json.loads(gw.admin("/routing")[1])["workers"]]

    def wait(expected: list[str]) -> None:
        deadline = time.monotonic() + 10 * INTERVAL
        while workers() != expected:
            assert time.monotonic() < deadline, workers()
            time.sleep(0.1)

    try:
        gw.wait_ready()
        wait(both)
        hosts.write_text("127.0.0.1 fleet.test\n")
        wait(both[:1])
        c = gw.client()
        before = successes(e2e.b)
        for _ in range(4):
            c.infer("mlp", [mlp_input(np.ones((1, 16), np.float32))])
        assert successes(e2e.b) == before  # the dropped worker gets nothing
        hosts.write_text("127.0.0.2 fleet.test\n127.0.0.1 fleet.test\n")
        wait(both)
    finally:
        assert gw.stop() == 0


@pytest.fixture()
def tls_worker(demo_repo, pki, tmp_path):
    port = free_port()
    env = {
        "INFERENCE_SERVER_ENDPOINTS_TLS_CERT_FILE": str(pki / "server.pem"),
        "INFERENCE_SERVER_ENDPOINTS_TLS_KEY_FILE": str(pki / "server.key"),
    }
    worker = Worker(demo_repo, "127.0.0.1", port, env=env)
    try:
        worker.wait_ready(ssl=True, root_certificates=str(pki / "ca.pem"))
        yield worker
    finally:
        worker.stop()


def test_tls_public_port_mutual_tls_and_tls_to_the_workers(tls_worker, pki, tmp_path):
    gw = Gateway(
        tmp_path,
        {
            G + "WORKERS": f"localhost:{tls_worker.port}",  # the name its certificate carries
            G + "WORKER_CLIENT_TLS_CA_FILE": str(pki / "ca.pem"),
            G + "TLS_CERT_FILE": str(pki / "server.pem"),
            G + "TLS_KEY_FILE": str(pki / "server.key"),
            G + "TLS_CLIENT_CA_FILE": str(pki / "ca.pem"),
        },
    )
    try:
        gw.wait_ready()  # ready: it reached the TLS worker over TLS
        x = np.ones((1, 16), np.float32)
        good = gw.client(
            ssl=True,
            root_certificates=str(pki / "ca.pem"),
            private_key=str(pki / "client.key"),
            certificate_chain=str(pki / "client.pem"),
        )
        assert good.is_server_ready()
        assert good.infer("mlp", [mlp_input(x)]).as_numpy("output").shape == (1, 8)
        no_cert = gw.client(ssl=True, root_certificates=str(pki / "ca.pem"))
        with pytest.raises(InferenceServerException) as info:
            no_cert.is_server_ready(client_timeout=5)
        assert info.value.status() in ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")
        no_ca = gw.client(
            ssl=True,
            private_key=str(pki / "client.key"),
            certificate_chain=str(pki / "client.pem"),
        )
        with pytest.raises(InferenceServerException):
            no_ca.is_server_ready(client_timeout=5)  # the handshake fails: unknown CA
        plain = gw.client()
        with pytest.raises(InferenceServerException):
            plain.is_server_ready(client_timeout=5)
    finally:
        assert gw.stop() == 0


def test_a_worker_killed_under_load_fails_only_its_in_flight_requests_and_comes_back(e2e):
    a, b, gw = e2e.a, e2e.b, e2e.gw
    x = np.random.default_rng(5).standard_normal((1, 16), dtype=np.float32)
    expected = ref.mlp(x, ref.weights(e2e.repo, "mlp"))
    h_in = shm.create_shared_memory_region("gw_kill_in", "/gw_kill_in", x.nbytes)
    shm.set_shared_memory_region(h_in, [x])
    clients = 4
    results: list[tuple[float, str | None]] = []
    lock = threading.Lock()
    stop_load = threading.Event()
    try:
        gw.client().register_system_shared_memory("gw_kill_in", "/gw_kill_in", x.nbytes)

        def load() -> None:
            c = gw.client()
            while not stop_load.is_set():
                try:
                    c.infer("mlp", [mlp_input(x)])
                    outcome = None
                except InferenceServerException as exc:
                    outcome = exc.status()
                with lock:
                    results.append((time.monotonic(), outcome))

        threads = [threading.Thread(target=load) for _ in range(clients)]
        for t in threads:
            t.start()
        wait_until(lambda: successes(b) >= 20, 30, "worker b serving under the load")
        b.kill()
        killed = time.monotonic()
        b.restart()
        ready = b.wait_ready()
        back = None
        while back is None and time.monotonic() < ready + 30:
            if successes(b) > 0:  # the new process counts from zero
                back = time.monotonic()
            time.sleep(0.05)
        if back is not None:  # the load runs on until b has served some of it again
            again = successes(b) + 20
            wait_until(lambda: successes(b) >= again, 30, "worker b serving again")
        stop_load.set()
        for t in threads:
            t.join(30)
        failures = [status for _, status in results if status is not None]
        assert all(s == "StatusCode.UNAVAILABLE" for s in failures), failures
        assert len(failures) <= clients  # at most the requests in flight on b at the kill
        while_down = [t for t, s in results if s is None and killed < t < ready]
        assert len(while_down) > 20  # a kept serving
        assert back is not None and back - ready <= 2 * INTERVAL + 0.3
        regions = b.client().get_system_shared_memory_status(as_json=True).get("regions", {})
        assert "gw_kill_in" in regions  # replayed to the new process before it was routed to
        served = successes(b)
        c = gw.client()
        for _ in range(6):
            inp = grpcclient.InferInput("input_0", [1, 16], "FP32")
            inp.set_shared_memory("gw_kill_in", x.nbytes)
            r = c.infer("mlp", [inp])
            np.testing.assert_allclose(r.as_numpy("output"), expected, rtol=1e-5, atol=1e-5)
        assert successes(b) >= served + 2  # the shm region works on the restarted worker
        assert a.alive()
    finally:
        stop_load.set()
        shm.destroy_shared_memory_region(h_in)

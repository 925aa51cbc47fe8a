"""The gateway server in-process (``serve_gateway(blocking=False)``) in front of scripted fake
workers (real grpclib servers on 127.0.0.1/127.0.0.2), driven by the stock tritonclient: the
whole KServe surface, fan-outs with partial failures, streams, compression, admission, drain
and the admin endpoints. The same behaviour against real CLI workers is in
tests/gateway/test_e2e.py."""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
import urllib.error
import urllib.request

import anyio
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from kserve_trio.client.h2_transport import H2Transport
from kserve_trio.client.transport import Endpoint, method_path
from kserve_trio.gateway.config import (
    GatewayConfig,
    GatewayGrpcConfig,
    ListenConfig,
    ProberConfig,
)
from kserve_trio.gateway.server import serve_gateway, stop
from kserve_trio.proto import inference as pb
from kserve_trio.proto import reactant_control as rc
from tests.gateway.fake_worker import FakeWorker
from tests.gateway.test_prober import fleet
from tests.waiting import wait_until

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def gateway_config(workers, **kw) -> GatewayConfig:
    """A gateway in front of ``workers`` (each by its own address), rounds every 0.3 s, gRPC
    and metrics on ephemeral ports unless ``listen`` says otherwise."""
    kw.setdefault("listen", ListenConfig("127.0.0.1:0", "127.0.0.1:0"))
    kw.setdefault("prober", ProberConfig(health_interval_seconds=0.3))
    return GatewayConfig(endpoints=tuple(f"{w.host}:{w.port}" for w in workers), **kw)


@contextlib.contextmanager
def running(workers, **kw):
    """``gateway_config(workers, **kw)`` served in this process, stopped on exit."""
    gateway = serve_gateway(gateway_config(workers, **kw), blocking=False)
    assert gateway is not None
    try:
        yield gateway
    finally:
        stop(gateway)


def client(gateway) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(gateway.address)


def tensor(x: np.ndarray, name: str = "x") -> grpcclient.InferInput:
    inp = grpcclient.InferInput(name, list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def admin(gateway, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{gateway.metrics_port}{path}") as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def served_by(result) -> str:
    return result.get_response().parameters["worker"].string_param


def test_the_kserve_surface_through_the_gateway():
    with fleet(2) as (a, b):
        a.models, b.models = ["m"], ["m", "k"]
        a.stats, b.stats = {"m": 2}, {"m": 3, "k": 1}
        with running([a, b]) as gw:
            c = client(gw)
            assert c.is_server_live() and c.is_server_ready()
            meta = c.get_server_metadata(as_json=True)
            assert meta["name"] == "kserve_trio"
            assert meta["extensions"] == [  # what a worker lists: the gateway answers each
                "model_repository",
                "model_configuration",
                "system_shared_memory",
                "parameters",
                "statistics",
                "trace",
                "logging",
            ]
            assert c.is_model_ready("m") and c.is_model_ready("k")
            assert not c.is_model_ready("nope")
            assert c.get_model_metadata("k", as_json=True)["platform"] == b.name  # b only has k
            assert c.get_model_config("m", as_json=True)["config"]["max_batch_size"] == 8
            with pytest.raises(InferenceServerException) as info:
                c.get_model_metadata("nope")
            assert info.value.status() == "StatusCode.NOT_FOUND"
            assert "model 'nope' not found on any worker" in info.value.message()
            index = c.get_model_repository_index(as_json=True)["models"]
            assert [(m["name"], m["state"]) for m in index] == [("k", "READY"), ("m", "READY")]
            stats = c.get_inference_statistics("m", as_json=True)["model_stats"]
            assert [(s["name"], s["inference_count"]) for s in stats] == [("m", "5")]
            assert stats[0]["inference_stats"]["success"] == {"count": "5", "ns": "2000"}
            every = c.get_inference_statistics(as_json=True)["model_stats"]
            assert {s["name"]: s["inference_count"] for s in every} == {"m": "5", "k": "1"}
            with pytest.raises(InferenceServerException) as info:
                c.get_inference_statistics("nope")
            assert info.value.status() == "StatusCode.NOT_FOUND"
            status, body = admin(gw, "/routing")
            routing = json.loads(body)
            assert status == 200
            assert routing["models"] == {"k": [f"{b.host}:{b.port}"], "m": sorted(
                [f"{a.host}:{a.port}", f"{b.host}:{b.port}"])}  # fmt: skip
            assert [w["ready"] for w in routing["workers"]] == [True, True]
            assert admin(gw, "/healthz") == (200, "ok") and admin(gw, "/readyz") == (200, "ok")


def test_inference_spreads_over_the_replicas_and_returns_each_workers_answer():
    with fleet(2) as (a, b):
        a.echo = b.echo = True
        with running([a, b]) as gw:
            c = client(gw)
            x = np.arange(8, dtype=np.float32).reshape(2, 4)
            seen = []
            for i in range(10):
                r = c.infer("m", [tensor(x)], request_id=f"r{i}")
                np.testing.assert_array_equal(r.as_numpy("x"), x)
                assert r.get_response().id == f"r{i}"
                seen.append(served_by(r))
            assert seen.count(a.name) == seen.count(b.name) == 5
            status, text = admin(gw, "/metrics")
            assert status == 200
            assert 'gateway_requests_total{model="m",rpc="ModelInfer",status="OK"} 10.0' in text


def test_a_compressed_request_is_forwarded_compressed_and_answered():
    with fleet(1) as (a,):
        a.echo = True
        with running([a]) as gw:
            c = client(gw)
            x = np.ones((1, 64), np.float32)
            for algorithm in ("gzip", "deflate"):
                r = c.infer("m", [tensor(x)], compression_algorithm=algorithm)
                np.testing.assert_array_equal(r.as_numpy("x"), x)
            assert a.encodings == ["gzip", "deflate"]  # as the client sent them


def test_model_load_and_unload_go_to_the_workers_that_have_the_model():
    with fleet(2) as (a, b):
        a.unloaded = ["x"]  # an explicit-mode worker that has x, not loaded
        with running([a, b]) as gw:
            c = client(gw)
            assert not c.is_model_ready("x")
            c.load_model("x")
            assert a.loads == [("load", "x")] and b.loads == []
            assert c.is_model_ready("x")  # the table was rebuilt at once
            c.unload_model("x")
            assert a.loads[-1] == ("unload", "x") and not c.is_model_ready("x")
            with pytest.raises(InferenceServerException) as info:
                c.load_model("nope")
            assert info.value.status() == "StatusCode.NOT_FOUND"


def test_a_load_failing_on_one_worker_is_that_workers_error():
    with fleet(2) as (a, b):
        a.unloaded = b.unloaded = ["x"]
        b.load_fail_with = (9, "RepositoryModelLoad requires model_control_mode 'explicit'")
        with running([a, b]) as gw:
            with pytest.raises(InferenceServerException) as info:
                client(gw).load_model("x")
            assert info.value.status() == "StatusCode.FAILED_PRECONDITION"
            assert "requires model_control_mode 'explicit'" in info.value.message()
            assert a.loads == b.loads == [("load", "x")]  # both were asked


def call_gateway(gw, method: str, request, reply_type):
    """One call through our own h2 client (for RPCs tritonclient has no method for)."""

    async def go():
        host, port = gw.address.rsplit(":", 1)
        async with H2Transport(Endpoint(host=host, port=int(port))) as transport:
            return await transport.unary(method, request, reply_type, timeout=10.0)

    return anyio.run(go)


def test_is_same_ipc_namespace_is_an_and_over_the_workers_and_compaction_fans_out():
    with fleet(2) as (a, b):
        with running([a, b]) as gw:
            ask = pb.IsSameIpcNamespaceRequest(name="/gw_probe")
            same = method_path("IsSameIPCNamespace")
            b.same_ipc = False
            assert call_gateway(gw, same, ask, pb.IsSameIpcNamespaceResponse).same is False
            b.same_ipc = True
            assert call_gateway(gw, same, ask, pb.IsSameIpcNamespaceResponse).same is True
            totals = call_gateway(
                gw,
                "/reactant_control.ControlService/CompactMemory",
                rc.CompactMemoryRequest(),
                rc.CompactMemoryResponse,
            )
            assert (totals.reloaded_models, totals.resident_bytes_after) == (2, 200)
            assert a.compactions == b.compactions == 1


def test_shm_register_rolls_back_a_partial_failure_and_status_lists_the_gateways_regions():
    with fleet(2) as (a, b):
        with running([a, b]) as gw:
            c = client(gw)
            c.register_system_shared_memory("r1", "/r1", 64)
            assert a.regions == b.regions == {"r1": "/r1"}
            status = c.get_system_shared_memory_status(as_json=True)["regions"]
            assert status["r1"]["key"] == "/r1" and status["r1"]["byte_size"] == "64"
            b.register_fail_with = (3, "cannot map /r2")
            with pytest.raises(InferenceServerException) as info:
                c.register_system_shared_memory("r2", "/r2", 64)
            assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
            assert "cannot map /r2" in info.value.message()
            assert "r2" not in a.regions  # rolled back
            assert set(c.get_system_shared_memory_status(as_json=True)["regions"]) == {"r1"}
            c.unregister_system_shared_memory("r1")
            assert a.regions == b.regions == {}


def same_ipc(gw, key: str) -> bool:
    ask = pb.IsSameIpcNamespaceRequest(name=key)
    reply = call_gateway(gw, method_path("IsSameIPCNamespace"), ask, pb.IsSameIpcNamespaceResponse)
    return reply.same


def rest_register(gw, name: str, key: str) -> tuple[int, str]:
    """A REST registration through the gateway: its status and error message."""
    body = json.dumps({"key": key, "offset": 0, "byte_size": 64}).encode()
    url = f"http://127.0.0.1:{gw.http_port}/v2/systemsharedmemory/region/{name}/register"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body), timeout=10) as r:
            return r.status, ""
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["error"]


def test_the_gateways_client_shared_memory_switch_and_reserved_keys():
    """Off: the three shm RPCs are UNAVAILABLE (REST 503) naming the gateway's key, the probe
    says no although the worker would say yes, ServerMetadata drops the extension. On: a
    reserved key is refused (REST 400) and probed no without asking a worker."""
    listen = ListenConfig("127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0")
    with fleet(1) as (a,):
        with running([a], listen=listen, client_shared_memory=False) as gw:
            c = client(gw)
            off = "client shared memory is off on this server (client_shared_memory: false)"
            for call in (
                lambda: c.register_system_shared_memory("r", "/r", 64),
                lambda: c.unregister_system_shared_memory("r"),
                lambda: c.get_system_shared_memory_status(),
            ):
                with pytest.raises(InferenceServerException) as info:
                    call()
                assert info.value.status() == "StatusCode.UNAVAILABLE"
                assert off in info.value.message()
            code, message = rest_register(gw, "r", "/r")
            assert code == 503 and off in message
            assert same_ipc(gw, "/r") is False and a.same_ipc is True
            assert "system_shared_memory" not in c.get_server_metadata().extensions
            assert a.register_calls == []
        with running([a], listen=listen) as gw:
            c = client(gw)
            key = "/kst-w-mlp-00000000000000ab"
            with pytest.raises(InferenceServerException) as info:
                c.register_system_shared_memory("evil", key, 64)
            assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
            assert "is reserved: keys starting with 'kst-'" in info.value.message()
            code, message = rest_register(gw, "evil", key)
            assert code == 400 and "is reserved: keys starting with 'kst-'" in message
            assert same_ipc(gw, key) is False and same_ipc(gw, "/r") is True
            assert "system_shared_memory" in c.get_server_metadata().extensions
            assert a.register_calls == []


def test_a_worker_that_lost_its_regions_between_rounds_gets_them_replayed_on_demand():
    with fleet(1) as (a,):
        a.echo = True
        with running([a], prober=ProberConfig(health_interval_seconds=60.0)) as gw:
            c = client(gw)
            c.register_system_shared_memory("r", "/r", 16)
            a.regions.clear()  # restarted between two rounds: the prober saw nothing
            inp = grpcclient.InferInput("x", [4], "FP32")
            inp.set_shared_memory("r", 16)
            r = c.infer("m", [inp])
            assert r.get_response().model_name == "m"
            assert a.regions == {"r": "/r"} and a.register_calls == ["r", "r"]


def test_streaming_answers_every_request_with_its_id_and_errors_keep_the_stream_open():
    with fleet(2) as (a, b):
        a.echo = b.echo = True
        with running([a, b]) as gw:
            c = client(gw)
            answers: queue.Queue = queue.Queue()
            c.start_stream(callback=lambda result, error: answers.put((result, error)))
            x = np.arange(4, dtype=np.float32).reshape(1, 4)
            plan = ["m", "nope", "m", "m", "nope", "m"]
            for i, model in enumerate(plan):
                c.async_stream_infer(model, [tensor(x * i)], request_id=f"s{i}")
            got = [answers.get(timeout=10) for _ in plan]
            ok = {r.get_response().id: r for r, e in got if e is None}
            errors = [str(e) for r, e in got if e is not None]
            assert sorted(ok) == ["s0", "s2", "s3", "s5"]
            for rid, r in ok.items():
                np.testing.assert_array_equal(r.as_numpy("x"), x * int(rid[1:]))
            assert len(errors) == 2 and all("model 'nope' not found" in e for e in errors)
            c.async_stream_infer("m", [tensor(x)], request_id="after")  # still open
            r, e = answers.get(timeout=10)
            assert e is None and r.get_response().id == "after"
            assert {served_by(r) for r in ok.values()} == {a.name, b.name}
            c.stop_stream()


def test_a_client_leaving_a_stream_cancels_its_requests_on_the_workers():
    with fleet(1) as (a,):
        a.echo = True
        a.infer_delay = 30.0
        with running([a]) as gw:
            c = client(gw)
            c.start_stream(callback=lambda result, error: None)
            c.async_stream_infer("m", [tensor(np.ones((1, 4), np.float32))])
            wait_until(lambda: a.in_flight == 1)
            c.stop_stream(cancel_requests=True)
            wait_until(lambda: a.cancelled == 1 and a.in_flight == 0)
            wait_until(lambda: gw.gateway.admission.busy == 0)


def test_the_inbound_cap_without_a_queue_sheds_resource_exhausted():
    with fleet(1) as (a,):
        a.echo = True
        a.infer_gate = gate = threading.Event()  # the first call holds the one slot till set
        grpc = GatewayGrpcConfig(  # no queue: shed at once
            max_concurrent_requests_per_worker=1, max_queued_requests_per_worker=0
        )
        with running([a], grpc=grpc) as gw:
            results: queue.Queue = queue.Queue()
            x = np.ones((1, 4), np.float32)

            def call() -> None:
                try:
                    results.put(client(gw).infer("m", [tensor(x)]))
                except InferenceServerException as exc:
                    results.put(exc)

            first = threading.Thread(target=call)
            first.start()
            wait_until(lambda: a.in_flight == 1)
            with pytest.raises(InferenceServerException) as info:
                client(gw).infer("m", [tensor(x)])
            assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
            assert "admission cap (1 requests in flight" in info.value.message()
            gate.set()
            first.join()
            assert not isinstance(results.get(), Exception)
            _, text = admin(gw, "/metrics")
            assert "gateway_requests_shed_total 1.0" in text
            assert "gateway_max_concurrent_requests 1.0" in text


def test_readyz_waits_for_the_grpc_port_not_only_for_a_worker():
    """The admin port comes up before the gRPC port: /readyz must not say ready in between
    (a client that waited for it found the gRPC port still refusing, seen in a loaded run)."""
    with fleet(1) as (a,), running([a]) as gw:
        wait_until(lambda: admin(gw, "/readyz") == (200, "ok"))
        assert gw.gateway.listening
        gw.gateway.listening = False  # as between the two ports coming up
        try:
            assert admin(gw, "/readyz") == (503, "not ready")
        finally:
            gw.gateway.listening = True
        assert admin(gw, "/readyz") == (200, "ok")


def test_stop_drains_refuses_new_requests_and_lets_in_flight_ones_finish():
    with fleet(1) as (a,):
        a.echo = True
        a.infer_gate = gate = threading.Event()  # in flight until the drain has been seen
        cfg = GatewayConfig(
            listen=ListenConfig("127.0.0.1:0", "127.0.0.1:0"),
            endpoints=(f"{a.host}:{a.port}",),
            prober=ProberConfig(health_interval_seconds=0.3),
        )
        gw = serve_gateway(cfg, blocking=False)
        x = np.ones((1, 4), np.float32)
        results: queue.Queue = queue.Queue()
        flight = threading.Thread(target=lambda: results.put(client(gw).infer("m", [tensor(x)])))
        flight.start()
        wait_until(lambda: a.in_flight == 1)
        stopper = threading.Thread(target=stop, args=(gw,))
        stopper.start()
        wait_until(lambda: gw.gateway.admission.draining)
        assert admin(gw, "/readyz") == (503, "not ready")
        assert not client(gw).is_server_ready()
        with pytest.raises(InferenceServerException) as info:
            client(gw).infer("m", [tensor(x)])
        assert info.value.status() == "StatusCode.UNAVAILABLE"
        assert "gateway is shutting down" in info.value.message()
        gate.set()
        flight.join(10)
        stopper.join(10)
        assert results.get().get_response().model_name == "m"  # finished, not cut off
        assert len(a.requests) == 1


def test_one_name_behind_two_addresses_is_two_workers_and_an_address_dropped_is_dropped(
    tmp_path,
):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 workers.test\n127.0.0.2 workers.test\n")
    with fleet(2) as (a, _b):
        cfg = GatewayConfig(
            listen=ListenConfig("127.0.0.1:0", "127.0.0.1:0"),
            endpoints=(f"workers.test:{a.port}",),
            prober=ProberConfig(health_interval_seconds=0.2, hosts_file=str(hosts)),
        )
        gw = serve_gateway(cfg, blocking=False)
        try:
            labels = lambda: [w["worker"] for w in json.loads(admin(gw, "/routing")[1])["workers"]]  # noqa: E731
            assert labels() == [f"127.0.0.1:{a.port}", f"127.0.0.2:{a.port}"]
            hosts.write_text("127.0.0.1 workers.test\n")
            wait_until(lambda: labels() == [f"127.0.0.1:{a.port}"])
            # The routing table follows the worker set within a round (not atomically with it).
            routes = lambda: json.loads(admin(gw, "/routing")[1])["models"]  # noqa: E731
            wait_until(lambda: routes() == {"m": [f"127.0.0.1:{a.port}"]})
        finally:
            stop(gw)


def test_the_admin_metrics_merge_the_workers_expositions(tmp_path):
    exposition = (
        "# HELP worker_requests_total Requests\n# TYPE worker_requests_total counter\n"
        'worker_requests_total{model="m"} 7.0\n'
    )
    served = threading.Event()

    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = exposition.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            served.set()

        def log_message(self, *args):
            pass

    http_server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=http_server.serve_forever, daemon=True)
    thread.start()
    try:
        with FakeWorker() as a:
            metrics = (f"127.0.0.1:{http_server.server_address[1]}",)
            with running([a], worker_metrics=metrics) as gw:
                _, text = admin(gw, "/metrics")
                label = f"127.0.0.1:{a.port}"
                assert f'worker_requests_total{{model="m",worker="{label}"}} 7.0' in text
                assert f'gateway_worker_metrics_up{{worker="{label}"}} 1.0' in text
                assert text.count("# TYPE worker_requests_total counter") == 1
                http_server.shutdown()
                http_server.server_close()
                _, text = admin(gw, "/metrics")
                assert f'gateway_worker_metrics_up{{worker="{label}"}} 0.0' in text
                assert "worker_requests_total" not in text
    finally:
        http_server.server_close()


def test_a_stream_open_at_shutdown_gets_its_answers_then_ends_unavailable():
    with fleet(1) as (a,):
        a.echo = True
        a.infer_gate = gate = threading.Event()  # in flight until the drain has begun
        cfg = GatewayConfig(
            listen=ListenConfig("127.0.0.1:0", "127.0.0.1:0"),
            endpoints=(f"{a.host}:{a.port}",),
            prober=ProberConfig(health_interval_seconds=0.3),
        )
        gw = serve_gateway(cfg, blocking=False)
        answers: queue.Queue = queue.Queue()
        c = client(gw)
        c.start_stream(callback=lambda result, error: answers.put((result, error)))
        c.async_stream_infer("m", [tensor(np.ones((1, 4), np.float32))], request_id="in-flight")
        wait_until(lambda: a.in_flight == 1)
        stopper = threading.Thread(target=stop, args=(gw,))
        stopper.start()
        wait_until(lambda: gw.gateway.admission.draining)
        gate.set()
        result, error = answers.get(timeout=10)
        assert error is None and result.get_response().id == "in-flight"  # answered first
        result, error = answers.get(timeout=10)  # then the stream ends, UNAVAILABLE
        assert result is None and "gateway is shutting down" in str(error)
        stopper.join(10)
        assert not stopper.is_alive()
        c.stop_stream()


def test_startup_waits_for_a_ready_worker_within_the_bound():
    with FakeWorker() as a:
        a.ready = False

        def start(wait: float):
            cfg = GatewayConfig(
                listen=ListenConfig("127.0.0.1:0", "127.0.0.1:0"),
                endpoints=(f"{a.host}:{a.port}",),
                prober=ProberConfig(health_interval_seconds=30.0, startup_wait_seconds=wait),
            )
            t0 = time.monotonic()
            return serve_gateway(cfg, blocking=False), time.monotonic() - t0

        gw, took = start(0.6)  # nobody becomes ready: it serves anyway after the wait
        try:
            assert 0.5 <= took < 10.0
            assert not client(gw).is_server_ready()
            assert admin(gw, "/readyz") == (503, "not ready")
        finally:
            stop(gw)
        became_ready: list[float] = []
        probes = a.probes

        def ready_once_probed() -> None:  # the gateway is in its wait: it has asked already
            wait_until(lambda: a.probes > probes, what="the gateway probing the unready worker")
            became_ready.append(time.monotonic())
            a.ready = True

        readying = threading.Thread(target=ready_once_probed, daemon=True)
        readying.start()
        gw, took = start(30.0)  # ready during the wait: it opens its ports then, not at 30 s
        opened = time.monotonic()
        try:
            readying.join(30)
            assert became_ready and became_ready[0] <= opened and took < 20.0
            assert client(gw).is_server_ready()
        finally:
            stop(gw)


def test_compressed_stream_messages_are_forwarded_compressed():
    with fleet(1) as (a,):
        a.echo = True
        with running([a]) as gw:
            c = client(gw)
            answers: queue.Queue = queue.Queue()
            c.start_stream(
                callback=lambda result, error: answers.put((result, error)),
                compression_algorithm="gzip",
            )
            x = np.arange(32, dtype=np.float32).reshape(1, 32)
            c.async_stream_infer("m", [tensor(x)], request_id="z")
            result, error = answers.get(timeout=10)
            c.stop_stream()
            assert error is None and result.get_response().id == "z"
            np.testing.assert_array_equal(result.as_numpy("x"), x)
            assert a.encodings == ["gzip"]

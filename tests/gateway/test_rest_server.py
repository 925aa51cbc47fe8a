"""The gateway's REST endpoint in-process, in front of scripted fake workers, driven by the stock
``tritonclient.http``: inference spreads and returns each worker's answer, a worker's status
reaches the REST client mapped (with failover on UNAVAILABLE), the admission cap sheds 429, a
drain answers 503 while the request in flight finishes. The fakes speak gRPC only, so without
``worker_http_endpoints`` these requests take the translated path; with REST endpoints that are
down, the gateway answers 503 over REST and its gRPC side still serves. Real CLI workers behind
the gateway's REST port, forwarded to their own REST ports, are in
tests/gateway/test_rest_e2e.py."""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from kserve_trio.core.errors import StatusCode
from kserve_trio.gateway.config import (
    GatewayConfig,
    GatewayGrpcConfig,
    ListenConfig,
)
from kserve_trio.gateway.server import serve_gateway, stop
from tests.gateway.test_prober import fleet
from tests.gateway.test_server import gateway_config
from tests.gateway.test_server import running as grpc_gateway_running
from tests.waiting import wait_until

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


REST_LISTEN = ListenConfig("127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0")
"""gRPC, metrics and REST on ephemeral ports."""


def config(workers, **kw) -> GatewayConfig:
    return gateway_config(workers, listen=REST_LISTEN, **kw)


@contextlib.contextmanager
def running(workers, **kw):
    with grpc_gateway_running(workers, listen=REST_LISTEN, **kw) as gateway:
        assert gateway.http_port
        yield gateway


def client(gateway) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(f"127.0.0.1:{gateway.http_port}")


def tensor(x: np.ndarray) -> httpclient.InferInput:
    inp = httpclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)  # binary: the fakes echo raw contents
    return inp


def status_of(call) -> tuple[str | None, str]:
    with pytest.raises(InferenceServerException) as err:
        call()
    return err.value.status(), err.value.message()


def test_rest_inference_spreads_and_returns_each_workers_answer():
    with fleet(2) as (a, b), running([a, b]) as gw:
        a.echo = b.echo = True
        c = client(gw)
        assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("m")
        assert c.get_server_metadata()["name"] == "kserve_trio"
        assert c.get_model_metadata("m")["name"] == "m"
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        seen = set()
        for i in range(4):
            r = c.infer("m", [tensor(x)], request_id=f"r{i}")
            np.testing.assert_array_equal(r.as_numpy("x"), x)
            doc = r.get_response()
            assert doc["id"] == f"r{i}"
            seen.add(doc["parameters"]["worker"])  # the worker's response parameters pass
        assert seen == {a.name, b.name}
        assert len(a.requests) == len(b.requests) == 2
        assert c.get_model_repository_index() == [
            {"name": "m", "version": "1", "state": "READY", "reason": ""}
        ]


def test_worker_statuses_reach_the_rest_client_mapped_and_unavailable_fails_over():
    with fleet(2) as (a, b), running([a, b]) as gw:
        a.echo = b.echo = True
        c = client(gw)
        x = np.ones((1, 4), np.float32)
        a.fail_with = b.fail_with = (StatusCode.INVALID_ARGUMENT.value, "input 'x' is wrong")
        assert status_of(lambda: c.infer("m", [tensor(x)])) == ("400", "input 'x' is wrong")
        a.fail_with = b.fail_with = (StatusCode.RESOURCE_EXHAUSTED.value, "queue full")
        assert status_of(lambda: c.infer("m", [tensor(x)])) == ("429", "queue full")
        a.fail_with = (StatusCode.UNAVAILABLE.value, "going away")
        b.fail_with = None
        for _ in range(2):  # whichever worker comes first, b answers
            np.testing.assert_array_equal(c.infer("m", [tensor(x)]).as_numpy("x"), x)
        assert status_of(lambda: c.infer("nope", [tensor(x)])) == (
            "404",
            "model 'nope' not found on any worker",
        )


def test_the_inbound_cap_without_a_queue_sheds_429_over_rest():
    with fleet(1) as (a,):
        a.echo = True
        a.infer_gate = gate = threading.Event()  # the first call holds the one slot till set
        grpc = GatewayGrpcConfig(  # no queue: shed at once
            max_concurrent_requests_per_worker=1, max_queued_requests_per_worker=0
        )
        with running([a], grpc=grpc) as gw:
            results: queue.Queue = queue.Queue()
            x = np.ones((1, 4), np.float32)
            first = threading.Thread(target=lambda: results.put(client(gw).infer("m", [tensor(x)])))
            first.start()
            wait_until(lambda: a.in_flight == 1)
            status, message = status_of(lambda: client(gw).infer("m", [tensor(x)]))
            assert status == "429" and "admission cap (1 requests in flight" in message
            gate.set()
            first.join()
            np.testing.assert_array_equal(results.get().as_numpy("x"), x)


def test_a_drain_answers_503_and_the_request_in_flight_finishes():
    with fleet(1) as (a,):
        a.echo = True
        a.infer_gate = gate = threading.Event()  # in flight until the drain has been seen
        gw = serve_gateway(config([a]), blocking=False)
        x = np.ones((1, 4), np.float32)
        results: queue.Queue = queue.Queue()
        flight = threading.Thread(target=lambda: results.put(client(gw).infer("m", [tensor(x)])))
        flight.start()
        wait_until(lambda: a.in_flight == 1)
        stopper = threading.Thread(target=stop, args=(gw,))
        stopper.start()
        wait_until(lambda: gw.gateway.admission.draining)
        url = f"http://127.0.0.1:{gw.http_port}/v2/health/ready"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url, timeout=5)
        assert (err.value.code, json.loads(err.value.read())) == (503, {"ready": False})
        status, message = status_of(lambda: client(gw).infer("m", [tensor(x)]))
        assert status == "503" and "gateway is shutting down" in message
        gate.set()
        flight.join(10)
        stopper.join(10)
        np.testing.assert_array_equal(results.get().as_numpy("x"), x)  # finished, not cut off


def test_rest_ports_that_are_down_fail_over_then_answer_503_and_the_gateway_serves_on():
    import tritonclient.grpc as grpcclient

    from tests.ports import free_port

    with fleet(2) as (a, b):
        dead = (f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}")
        with running([a, b], worker_http_endpoints=dead) as gw:
            a.echo = b.echo = True
            c = client(gw)
            x = np.ones((1, 4), np.float32)
            status, message = status_of(lambda: c.infer("m", [tensor(x)]))
            assert status == "503" and "REST endpoint" in message and "failed" in message
            assert a.requests == b.requests == []  # nothing went over gRPC instead
            assert c.is_server_live()  # fleet requests do not use the REST ports
            g = grpcclient.InferenceServerClient(f"127.0.0.1:{gw.port}")
            inp = grpcclient.InferInput("x", [1, 4], "FP32")
            inp.set_data_from_numpy(x)
            np.testing.assert_array_equal(g.infer("m", [inp]).as_numpy("x"), x)

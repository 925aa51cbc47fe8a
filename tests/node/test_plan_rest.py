"""The node plan's REST wiring: with two or more workers each worker's REST port
(``http_base_port`` + index) reaches the embedded gateway as ``worker_http_endpoints``, so the
gateway forwards REST requests to the workers' own REST ports."""

from __future__ import annotations

from kserve_trio.node import GatewaySource, gateway_launch
from kserve_trio.node._plan import WorkerAddress
from tests.node.test_plan import PY, node_of, plan

G = "KSERVE_TRIO_GATEWAY_"


def test_two_workers_pass_their_rest_ports_to_the_gateway():
    env = {"KSERVE_TRIO_CPU_WORKERS": "2", G + "LISTEN_HTTP": "0.0.0.0:8000"}
    p = plan(node_of(http_base_port=9100), env)
    g = p.child("gateway")
    assert g.env[G + "WORKERS"] == "127.0.0.1:9000,127.0.0.1:9001"
    assert g.env[G + "WORKER_HTTP_ENDPOINTS"] == "127.0.0.1:9100,127.0.0.1:9101"
    assert [c.env.get("INFERENCE_SERVER_ENDPOINTS_HTTP_PORT") for c in p.workers] == [None, None]


def test_without_http_base_port_the_gateway_gets_no_rest_endpoints():
    env = {"KSERVE_TRIO_CPU_WORKERS": "2", G + "LISTEN_HTTP": "0.0.0.0:8000"}
    g = plan(node_of(), env).child("gateway")
    assert G + "WORKER_HTTP_ENDPOINTS" not in g.env  # REST is translated to gRPC then


def test_rest_endpoints_synthesis_respects_what_is_already_set():
    workers = [
        WorkerAddress("a", "0.0.0.0", 9000, None, 9100),
        WorkerAddress("b", "::", 9001, None, 9101),
    ]
    _, add = gateway_launch(GatewaySource(), workers, None, {}, PY)
    assert add[G + "WORKER_HTTP_ENDPOINTS"] == "127.0.0.1:9100,[::1]:9101"
    _, add = gateway_launch(
        GatewaySource(), workers, None, {G + "WORKER_HTTP_ENDPOINTS": "x:1"}, PY
    )
    assert G + "WORKER_HTTP_ENDPOINTS" not in add
    source = GatewaySource("file", "/g.yml", {"worker_http_endpoints": ["h:1", "h:2"]})
    _, add = gateway_launch(source, workers, None, {}, PY)
    assert G + "WORKER_HTTP_ENDPOINTS" not in add
    some = [workers[0], WorkerAddress("b", "::", 9001, None)]  # not every worker has one
    _, add = gateway_launch(GatewaySource(), some, None, {}, PY)
    assert G + "WORKER_HTTP_ENDPOINTS" not in add


def test_role_gateway_pairs_the_nodes_explicit_workers_rest_ports():
    node = {
        "model_repo": "/models",
        "http_base_port": 9100,
        "workers": [{"name": "w0", "port": 9000}, {"name": "w1", "port": 9001}],
    }
    g = plan(node, {}, role="gateway").child("gateway")
    assert g.env[G + "WORKER_HTTP_ENDPOINTS"] == "127.0.0.1:9100,127.0.0.1:9101"

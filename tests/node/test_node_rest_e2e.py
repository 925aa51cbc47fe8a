"""REST on real nodes: the public REST address (``KSERVE_TRIO_GATEWAY_LISTEN_HTTP``) is served
by a single worker itself, or by the embedded gateway in front of two workers, whose own REST
ports come from ``http_base_port``; ``tritonclient.http`` sees the same surface either way."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.e2e import reference as ref
from tests.node.conftest import wait_ready, write_node
from tests.ports import free_ports

pytestmark = pytest.mark.slow


def rest_infer(port: int, repo, rows: int = 2) -> None:
    x = np.random.default_rng(rows).standard_normal((rows, 16), dtype=np.float32)
    inp = httpclient.InferInput("input_0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    assert client.is_server_ready() and client.is_model_ready("mlp")
    result = client.infer("mlp", [inp])
    np.testing.assert_allclose(
        result.as_numpy("output"), ref.mlp(x, ref.weights(repo, "mlp")), rtol=1e-5, atol=1e-5
    )


def test_a_single_worker_serves_the_public_rest_port(demo_repo, tmp_path, start_node):
    base = free_ports(1)
    public = free_ports(3)
    node_file = write_node(tmp_path, demo_repo, base)
    env = {
        "KSERVE_TRIO_GATEWAY_LISTEN_GRPC": f"127.0.0.1:{public}",
        "KSERVE_TRIO_GATEWAY_LISTEN_METRICS": f"127.0.0.1:{public + 1}",
        "KSERVE_TRIO_GATEWAY_LISTEN_HTTP": f"127.0.0.1:{public + 2}",
    }
    node = start_node(["--node", str(node_file)], env)
    wait_ready(f"127.0.0.1:{public}", node=node)
    rest_infer(public + 2, demo_repo)
    assert (
        f"[supervisor] single worker: serving directly on 127.0.0.1:{public} (gRPC) / "
        f"127.0.0.1:{public + 1} (metrics) / 127.0.0.1:{public + 2} (REST); no gateway"
        in node.text()
    )
    assert "gateway" not in node.pids()
    assert node.stop() == 0


def test_two_workers_get_rest_ports_and_the_gateway_serves_the_public_one(
    demo_repo, tmp_path, start_node
):
    base = free_ports(7)  # worker gRPC x2, worker REST x2, public gRPC, metrics, REST
    public = base + 4
    node_file = write_node(tmp_path, demo_repo, base, f"http_base_port: {base + 2}\n")
    env = {
        "KSERVE_TRIO_CPU_WORKERS": "2",
        "KSERVE_TRIO_WORKER_THREADS": "1",
        "KSERVE_TRIO_GATEWAY_LISTEN_GRPC": f"127.0.0.1:{public}",
        "KSERVE_TRIO_GATEWAY_LISTEN_METRICS": f"127.0.0.1:{public + 1}",
        "KSERVE_TRIO_GATEWAY_LISTEN_HTTP": f"127.0.0.1:{public + 2}",
        "KSERVE_TRIO_GATEWAY_HEALTH_INTERVAL_SECONDS": "1",
    }
    node = start_node(["--node", str(node_file)], env)
    wait_ready(f"127.0.0.1:{public}", node=node)
    for name in ("worker0", "worker1"):
        node.wait_for(rf'^\[gateway\] \{{"worker": "{name}", .*"event": "worker_ready"')
    for _ in range(4):  # through the gateway's public REST port
        rest_infer(public + 2, demo_repo)
    for port in (base + 2, base + 3):  # each worker's own REST port
        rest_infer(port, demo_repo, rows=3)
    # the embedded gateway forwards to the workers' own REST ports
    rest_ports = f'"worker_http_endpoints": ["127.0.0.1:{base + 2}", "127.0.0.1:{base + 3}"]'
    assert rest_ports in node.text()
    assert sorted(node.pids()) == ["gateway", "worker0", "worker1"]
    assert node.stop() == 0

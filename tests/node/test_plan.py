"""The node plan: roles, workers and their environment, public ports, the gateway seam, warnings."""

from __future__ import annotations

from typing import Any

import pytest

from kserve_trio.core.errors import ConfigError
from kserve_trio.core.process.node import validate_node
from kserve_trio.node import GatewaySource, Machine, gateway_launch, plan_node
from kserve_trio.node._plan import WorkerAddress, parse_listen, public_listen, resolve_role

PY = "/usr/bin/python3"
NODE_FILE = "/run/kserve_trio/node.yaml"


def machine(cpus: int = 32, smi: str | None = None, quota: float | None = None) -> Machine:
    return Machine(lambda: smi, lambda: [], lambda: list(range(cpus)), lambda: quota)


def node_of(**extra: Any) -> dict[str, Any]:
    node: dict[str, Any] = {"model_repo": "/models", "base_port": 9000}
    node.update(extra)
    return node


def plan(node: dict[str, Any] | None, env: dict[str, str] | None = None, **kw: Any):
    kw.setdefault("machine", machine())
    return plan_node(node, env=env or {}, node_file=NODE_FILE, python=PY, **kw)


# --- roles ------------------------------------------------------------------------------------


def test_role_precedence_keyword_env_node_default():
    node = {"role": "workers"}
    assert resolve_role("GATEWAY", {"KSERVE_TRIO_ROLE": "all"}, node) == "gateway"
    assert resolve_role(None, {"KSERVE_TRIO_ROLE": "All"}, node) == "all"
    assert resolve_role(None, {}, node) == "workers"
    assert resolve_role(None, {"KSERVE_TRIO_ROLE": " "}, {}) == "all"
    assert resolve_role(None, {}, None) == "all"


def test_an_unknown_role_names_where_it_came_from():
    with pytest.raises(ConfigError, match="KSERVE_TRIO_ROLE must be one of all, workers, gateway"):
        resolve_role(None, {"KSERVE_TRIO_ROLE": "both"}, {})
    with pytest.raises(ConfigError, match="node config 'role'"):
        resolve_role(None, {}, {"role": 3})


# --- workers ----------------------------------------------------------------------------------


def test_cpu_node_synthesizes_cpu_workers_with_empty_cuda_visible_devices():
    env = {"KSERVE_TRIO_CPU_WORKERS": "2", "CUDA_VISIBLE_DEVICES": "0,1,2"}
    p = plan(node_of(), env, role="workers")
    assert [c.name for c in p.children] == ["worker0", "worker1"]
    assert [c.kind for c in p.children] == ["worker", "worker"]
    for i, c in enumerate(p.children):
        assert c.argv == (
            PY,
            "-m",
            "kserve_trio",
            "worker",
            "--node",
            NODE_FILE,
            "--worker",
            c.name,
        )
        assert c.env["KSERVE_TRIO_WORKER_NAME"] == c.name
        assert c.env["CUDA_VISIBLE_DEVICES"] == ""  # never the inherited "0,1,2"
        assert c.address == ("127.0.0.1", 9000 + i)
        assert c.grace == 15.0
        assert c.env["PYTHONUNBUFFERED"] == "1"
    assert p.node is not None and [w["name"] for w in p.node["workers"]] == ["worker0", "worker1"]
    validate_node(dict(p.node))
    assert "CPU node: 2 worker(s)" in p.notes


def test_the_plan_does_not_mutate_the_callers_node():
    node = node_of()
    plan(node, {"KSERVE_TRIO_CPU_WORKERS": "2"}, role="workers")
    assert "workers" not in node


def test_gpu_node_gets_one_worker_per_device_each_seeing_only_its_own():
    node = node_of(**{"global": {"runtime": {"backend": "cuda"}}})
    p = plan(node, {}, role="workers", machine=machine(smi="0\n1\n2\n"))
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in p.children] == ["0", "1", "2"]
    assert "devices: 0, 1, 2 (from nvidia-smi)" in p.notes


def test_explicit_workers_with_gpu_keys_get_those_devices():
    node = node_of(
        gpus=["GPU-a", "GPU-b", "GPU-c"],
        workers=[{"name": "big", "gpu": 2}, {"name": "small", "gpu": 0, "port": 9100}],
    )
    p = plan(node, {}, role="workers")
    assert [(c.name, c.env["CUDA_VISIBLE_DEVICES"], c.address[1]) for c in p.children] == [
        ("big", "GPU-c", 9000),
        ("small", "GPU-a", 9100),
    ]
    assert all("gpu" not in w for w in p.node["workers"])  # the child sees ordinal 0
    assert "1 visible device(s) left unused" in p.notes


def test_a_cuda_node_without_devices_fails_to_plan():
    node = node_of(**{"global": {"runtime": {"backend": "cuda"}}})
    with pytest.raises(ConfigError, match="no GPUs detected for a CUDA node"):
        plan(node, {"CUDA_VISIBLE_DEVICES": ""}, role="workers")


def test_invalid_nodes_fail_validation():
    with pytest.raises(ConfigError, match="model_repo"):
        plan({"base_port": 9000}, {}, role="workers")
    with pytest.raises(ConfigError, match="needs a node file"):
        plan(None, {}, role="workers")


def test_thread_budget_reaches_every_worker():
    p = plan(node_of(), {"KSERVE_TRIO_CPU_WORKERS": "2"}, role="workers", machine=machine(16))
    assert p.threads == 8
    for i, c in enumerate(p.children):
        assert c.env["PJRT_NPROC"] == "8"
        assert c.env["OMP_NUM_THREADS"] == "8"
        assert c.env["OPENBLAS_NUM_THREADS"] == "8"
        assert c.cpus == tuple(range(8 * i, 8 * i + 8))
    assert "worker0 on cpus 0-7, worker1 on cpus 8-15" in p.notes[-1]


def test_the_cgroup_quota_and_the_override_shape_the_budget():
    env = {"KSERVE_TRIO_CPU_WORKERS": "2"}
    assert plan(node_of(), env, role="workers", machine=machine(64, quota=8.0)).threads == 4
    env["KSERVE_TRIO_WORKER_THREADS"] = "3"
    p = plan(node_of(), env, role="workers", machine=machine(4))
    assert p.threads == 3
    assert [c.cpus for c in p.children] == [None, None]  # 2 x 3 > 4 CPUs: not pinned
    assert any("not pinned" in w for w in p.warnings)


def test_a_single_worker_is_not_pinned():
    p = plan(node_of(), {}, role="workers", machine=machine(8))
    assert p.children[0].cpus is None
    assert p.children[0].env["PJRT_NPROC"] == "8"


def test_node_assigned_worker_env_is_not_inherited():
    env = {"KSERVE_TRIO_CPU_WORKERS": "2", "INFERENCE_SERVER_ENDPOINTS_PORT": "7000"}
    p = plan(node_of(), env, role="workers")
    assert [c.address[1] for c in p.children] == [9000, 9001]
    assert all("INFERENCE_SERVER_ENDPOINTS_PORT" not in c.env for c in p.children)
    assert any(w.startswith("INFERENCE_SERVER_ENDPOINTS_PORT is set") for w in p.warnings)


def test_unknown_worker_env_fails_at_plan_time_like_the_worker_would():
    with pytest.raises(ConfigError, match="INFERENCE_SERVER_ENDPOINT_PORT"):
        plan(node_of(), {"INFERENCE_SERVER_ENDPOINT_PORT": "1"}, role="workers")


def test_restart_budget_comes_from_the_environment():
    env = {"KSERVE_TRIO_SUPERVISOR_MAX_RESTARTS": "4"}
    assert plan(node_of(), env, role="workers").max_restarts == 4
    assert plan(node_of(), {}, role="workers").max_restarts == 0


# --- single worker and public ports ------------------------------------------------------------


def test_single_worker_serves_the_public_ports_itself():
    p = plan(node_of(), {})
    assert p.role == "all"
    assert [c.kind for c in p.children] == ["worker"]
    w = p.children[0]
    assert w.env["INFERENCE_SERVER_ENDPOINTS_PORT"] == "8001"
    assert w.env["INFERENCE_SERVER_ENDPOINTS_METRICS_PORT"] == "8002"
    assert w.env["INFERENCE_SERVER_ENDPOINTS_HOST"] == "0.0.0.0"
    assert w.address == ("0.0.0.0", 8001)
    assert p.public_grpc == ("0.0.0.0", 8001)
    assert (
        "single worker: serving directly on 0.0.0.0:8001 (gRPC) / 0.0.0.0:8002 (metrics); "
        "no gateway" in p.notes
    )


def test_public_ports_come_from_the_gateway_listen_env():
    env = {
        "KSERVE_TRIO_GATEWAY_LISTEN_GRPC": "127.0.0.1:18001",
        "KSERVE_TRIO_GATEWAY_LISTEN_METRICS": "127.0.0.1:0",
    }
    w = plan(node_of(), env).children[0]
    assert w.env["INFERENCE_SERVER_ENDPOINTS_HOST"] == "127.0.0.1"
    assert w.env["INFERENCE_SERVER_ENDPOINTS_PORT"] == "18001"
    assert w.env["INFERENCE_SERVER_ENDPOINTS_METRICS_PORT"] == "0"  # metrics off


def test_public_listen_precedence_env_then_gateway_config_then_default():
    source = GatewaySource("node", "/x", {"listen": {"grpc": "10.0.0.1:7001"}})
    assert public_listen({}, source) == (("10.0.0.1", 7001), ("0.0.0.0", 8002))
    env = {"KSERVE_TRIO_GATEWAY_LISTEN_GRPC": "[::]:7002"}
    assert public_listen(env, source)[0] == ("::", 7002)
    assert public_listen({}, GatewaySource()) == (("0.0.0.0", 8001), ("0.0.0.0", 8002))
    assert parse_listen(":9", "x") == ("0.0.0.0", 9)
    with pytest.raises(ConfigError, match="KSERVE_TRIO_GATEWAY_LISTEN_GRPC must be 'host:port'"):
        public_listen({"KSERVE_TRIO_GATEWAY_LISTEN_GRPC": "8001"}, GatewaySource())


def test_role_workers_with_one_worker_keeps_its_own_port():
    p = plan(node_of(), {}, role="workers")
    assert p.children[0].address == ("127.0.0.1", 9000)
    assert "INFERENCE_SERVER_ENDPOINTS_PORT" not in p.children[0].env
    assert p.public_grpc is None


# --- the embedded gateway ----------------------------------------------------------------------


def test_two_workers_in_role_all_add_the_gateway_configured_from_the_environment():
    env = {"KSERVE_TRIO_CPU_WORKERS": "2", "CUDA_VISIBLE_DEVICES": "7"}
    p = plan(node_of(metrics_base_port=9500), env)
    assert [c.name for c in p.children] == ["worker0", "worker1", "gateway"]
    g = p.child("gateway")
    assert g.argv == (PY, "-m", "kserve_trio", "gateway")
    assert g.grace == 10.0
    assert g.env["KSERVE_TRIO_GATEWAY_WORKERS"] == "127.0.0.1:9000,127.0.0.1:9001"
    assert g.env["KSERVE_TRIO_GATEWAY_WORKER_NAMES"] == "worker0,worker1"
    assert g.env["KSERVE_TRIO_GATEWAY_WORKER_METRICS"] == "127.0.0.1:9500,127.0.0.1:9501"
    assert g.env["KSERVE_TRIO_GATEWAY_STARTUP_WAIT_SECONDS"] == "inf"
    assert g.env["CUDA_VISIBLE_DEVICES"] == ""
    assert g.env["PYTHONUNBUFFERED"] == "1"
    assert "KSERVE_TRIO_GATEWAY_FILE" not in g.env
    assert all("INFERENCE_SERVER_ENDPOINTS_PORT" not in c.env for c in p.workers)
    assert "embedded gateway on 0.0.0.0:8001 (configured from the environment)" in p.notes


def test_gateway_env_synthesis_respects_what_is_already_set():
    workers = [WorkerAddress("a", "0.0.0.0", 9000, None), WorkerAddress("b", "::", 9001, None)]
    _, add = gateway_launch(GatewaySource(), workers, None, {}, PY)
    assert add["KSERVE_TRIO_GATEWAY_WORKERS"] == "127.0.0.1:9000,[::1]:9001"
    assert "KSERVE_TRIO_GATEWAY_WORKER_METRICS" not in add  # no metrics ports
    env = {
        "KSERVE_TRIO_GATEWAY_WORKERS": "h:1",
        "KSERVE_TRIO_GATEWAY_STARTUP_WAIT_SECONDS": "5",
    }
    _, add = gateway_launch(GatewaySource(), workers, None, env, PY)
    assert "KSERVE_TRIO_GATEWAY_WORKERS" not in add
    assert "KSERVE_TRIO_GATEWAY_WORKER_NAMES" not in add
    assert "KSERVE_TRIO_GATEWAY_STARTUP_WAIT_SECONDS" not in add


def test_gateway_grpc_caps_mirror_the_workers_unless_configured():
    node = {"global": {"grpc": {"max_recv_msg_bytes": 1024, "max_send_msg_bytes": 2048}}}
    workers = [WorkerAddress("a", "127.0.0.1", 9000, None)]
    _, add = gateway_launch(GatewaySource(), workers, node, {}, PY)
    assert add["KSERVE_TRIO_GATEWAY_GRPC_MAX_RECV_MSG_BYTES"] == "1024"
    assert add["KSERVE_TRIO_GATEWAY_GRPC_MAX_SEND_MSG_BYTES"] == "2048"
    source = GatewaySource("file", "/g.yml", {"grpc": {"max_recv_msg_bytes": 5}})
    env = {"KSERVE_TRIO_GATEWAY_GRPC_MAX_SEND_MSG_BYTES": "7"}
    _, add = gateway_launch(source, workers, node, env, PY)
    assert "KSERVE_TRIO_GATEWAY_GRPC_MAX_RECV_MSG_BYTES" not in add
    assert "KSERVE_TRIO_GATEWAY_GRPC_MAX_SEND_MSG_BYTES" not in add


def test_a_gateway_file_is_passed_on_and_its_endpoints_win():
    workers = [WorkerAddress("a", "127.0.0.1", 9000, 9500)]
    source = GatewaySource("file", "/etc/g.yml", {"endpoints": ["10.0.0.9:1"]})
    argv, add = gateway_launch(source, workers, None, {}, PY)
    assert argv == (PY, "-m", "kserve_trio", "gateway")
    assert add["KSERVE_TRIO_GATEWAY_FILE"] == "/etc/g.yml"
    assert "KSERVE_TRIO_GATEWAY_WORKERS" not in add
    # a file without endpoints still gets the node's workers
    source = GatewaySource("file", "/etc/g.yml", {"scheduling": {"mode": "round_robin"}})
    _, add = gateway_launch(source, workers, None, {}, PY)
    assert add["KSERVE_TRIO_GATEWAY_WORKERS"] == "127.0.0.1:9000"
    assert add["KSERVE_TRIO_GATEWAY_WORKER_METRICS"] == "127.0.0.1:9500"


def test_the_nodes_gateway_block_is_written_for_the_gateway():
    block = {"scheduling": {"mode": "least_outstanding"}}
    source = GatewaySource("node", "/run/kserve_trio/gateway.yaml", block)
    p = plan(node_of(gateway=block), {"KSERVE_TRIO_CPU_WORKERS": "2"}, gateway=source)
    assert p.gateway_block == block
    assert p.gateway_file == "/run/kserve_trio/gateway.yaml"
    g = p.child("gateway")
    assert g.env["KSERVE_TRIO_GATEWAY_FILE"] == "/run/kserve_trio/gateway.yaml"
    assert g.env["KSERVE_TRIO_GATEWAY_WORKERS"] == "127.0.0.1:9000,127.0.0.1:9001"
    assert "configured from the node's gateway: block" in p.notes[-1]


def test_worker_ports_colliding_with_the_public_ports_are_warned_about():
    p = plan(node_of(base_port=8001), {"KSERVE_TRIO_CPU_WORKERS": "2"})
    assert "worker 'worker0' port 8001 collides with the gateway's public gRPC port" in p.warnings
    assert (
        "worker 'worker1' port 8002 collides with the gateway's public metrics port" in p.warnings
    )


def test_role_gateway_needs_no_node_file():
    env = {"KSERVE_TRIO_GATEWAY_WORKERS": "10.0.0.1:9000"}
    p = plan(None, env, role="gateway")
    assert [c.name for c in p.children] == ["gateway"]
    assert "KSERVE_TRIO_GATEWAY_WORKERS" in p.children[0].env
    assert p.children[0].env["KSERVE_TRIO_GATEWAY_WORKERS"] == "10.0.0.1:9000"
    assert p.node is None


def test_role_gateway_uses_an_explicit_workers_list_of_the_node():
    node = node_of(workers=[{"name": "a"}, {"name": "b", "host": "10.1.1.1"}])
    g = plan(node, {}, role="gateway").children[0]
    assert g.env["KSERVE_TRIO_GATEWAY_WORKERS"] == "127.0.0.1:9000,10.1.1.1:9001"
    assert g.env["KSERVE_TRIO_GATEWAY_WORKER_NAMES"] == "a,b"


# --- advisory warnings -------------------------------------------------------------------------


def test_gpu_workers_with_private_weight_caches_are_advised_to_share():
    node = node_of(**{"global": {"runtime": {"backend": "cuda"}}})
    p = plan(node, {"KSERVE_TRIO_GPUS": "2"}, role="workers")
    advice = [w for w in p.warnings if "shared_host_weights is off" in w]
    assert advice and advice[0].startswith("2 workers with the on-demand weight cache")
    node["shared_host_weights"] = True
    assert not any(
        "shared_host_weights" in w
        for w in plan(node, {"KSERVE_TRIO_GPUS": "2"}, role="workers").warnings
    )
    cpu = plan(node_of(), {"KSERVE_TRIO_CPU_WORKERS": "2"}, role="workers")
    assert not any("shared_host_weights" in w for w in cpu.warnings)


def test_an_operators_pythonunbuffered_is_kept():
    p = plan(node_of(), {"PYTHONUNBUFFERED": "0"}, role="workers")
    assert p.children[0].env["PYTHONUNBUFFERED"] == "0"


# --- REST ports -------------------------------------------------------------------------------


def test_a_single_worker_serves_the_public_rest_port_itself():
    env = {"KSERVE_TRIO_GATEWAY_LISTEN_HTTP": "0.0.0.0:8000"}
    p = plan(node_of(http_base_port=9100), env)
    w = p.children[0]
    assert w.env["INFERENCE_SERVER_ENDPOINTS_HTTP_PORT"] == "8000"  # over http_base_port's 9100
    assert p.public_http == ("0.0.0.0", 8000)
    assert (
        "single worker: serving directly on 0.0.0.0:8001 (gRPC) / 0.0.0.0:8002 (metrics) / "
        "0.0.0.0:8000 (REST); no gateway" in p.notes
    )
    off = plan(node_of(), {})  # no public REST address: REST stays off
    assert off.public_http is None
    assert "INFERENCE_SERVER_ENDPOINTS_HTTP_PORT" not in off.children[0].env


def test_the_gateway_configs_listen_http_is_the_public_rest_address_too():
    source = GatewaySource("node", "/x", {"listen": {"http": "127.0.0.1:7000"}})
    p = plan(node_of(), {}, gateway=source)
    assert p.public_http == ("127.0.0.1", 7000)
    assert p.children[0].env["INFERENCE_SERVER_ENDPOINTS_HTTP_PORT"] == "7000"


def test_two_workers_get_rest_ports_from_http_base_port_and_the_gateway_serves_the_public_one():
    env = {
        "KSERVE_TRIO_CPU_WORKERS": "2",
        "KSERVE_TRIO_GATEWAY_LISTEN_HTTP": "0.0.0.0:9101",
        "INFERENCE_SERVER_ENDPOINTS_HTTP_PORT": "7777",
    }
    p = plan(node_of(http_base_port=9100), env)
    assert [c.name for c in p.children] == ["worker0", "worker1", "gateway"]
    assert all("INFERENCE_SERVER_ENDPOINTS_HTTP_PORT" not in c.env for c in p.workers)
    assert (
        "INFERENCE_SERVER_ENDPOINTS_HTTP_PORT is set in the environment; the node assigns it "
        "per worker, so it is not passed to the workers" in p.warnings
    )
    assert p.child("gateway").env["KSERVE_TRIO_GATEWAY_LISTEN_HTTP"] == "0.0.0.0:9101"
    assert "worker 'worker1' port 9101 collides with the gateway's public REST port" in p.warnings


def test_node_http_ports_are_derived_and_checked():
    from kserve_trio.core.process.node import node_server_config

    node = node_of(
        http_base_port=9100, workers=[{"name": "a"}, {"name": "b"}], metrics_base_port=9200
    )
    validate_node(node)
    assert node_server_config(node, "b", env={})[0].endpoints.http_port == 9101
    with pytest.raises(ConfigError, match=r"worker 'b' port 9001 collides with 'a \(http\)'"):
        validate_node(node_of(http_base_port=9001, workers=[{"name": "a"}, {"name": "b"}]))
    collides = r"worker 'a' HTTP port 9200 collides with 'a \(metrics\)'"
    with pytest.raises(ConfigError, match=collides):
        validate_node(
            node_of(
                metrics_base_port=9200,
                http_base_port=9200,
                workers=[{"name": "a", "port": 1}, {"name": "b", "port": 2}],
            )
        )
    with pytest.raises(ConfigError, match="is derived by the node; set the node's http_base_port"):
        validate_node(node_of(workers=[{"name": "a", "endpoints": {"http_port": 5}}]))


def test_the_embedded_gateway_is_sized_from_the_cpus_unless_configured():
    env = {"KSERVE_TRIO_CPU_WORKERS": "2"}
    g = plan(node_of(), env).child("gateway")  # 32 CPUs, 2 workers: 2 processes
    assert g.env["KSERVE_TRIO_GATEWAY_PROCESSES"] == "2"
    small = plan(node_of(), env, machine=machine(cpus=4)).child("gateway")
    assert "KSERVE_TRIO_GATEWAY_PROCESSES" not in small.env  # one process: the default
    mine = plan(node_of(), {**env, "KSERVE_TRIO_GATEWAY_PROCESSES": "3"}).child("gateway")
    assert mine.env["KSERVE_TRIO_GATEWAY_PROCESSES"] == "3"  # the environment's own
    workers = [WorkerAddress("a", "127.0.0.1", 9000, None)]
    source = GatewaySource("node", "/run/g.yaml", {"processes": 1})
    _, add = gateway_launch(source, workers, None, {}, PY, processes=4)
    assert "KSERVE_TRIO_GATEWAY_PROCESSES" not in add  # the node file's gateway.processes wins


def test_each_worker_gets_front_ends_from_its_thread_budget():
    """``clamp(T - 1, 1, 8)`` front ends per worker; 1 (the worker serves its ports) is not
    passed; a worker that sets the key keeps it."""
    p = plan(node_of(), {"KSERVE_TRIO_CPU_WORKERS": "2"}, role="workers", machine=machine(16))
    assert [c.env["INFERENCE_SERVER_ENDPOINTS_FRONTEND_PROCESSES"] for c in p.children] == [
        "7",
        "7",
    ]
    small = plan(node_of(), {"KSERVE_TRIO_CPU_WORKERS": "2"}, role="workers", machine=machine(4))
    assert all("INFERENCE_SERVER_ENDPOINTS_FRONTEND_PROCESSES" not in c.env for c in small.children)
    big = plan(node_of(), {}, role="workers", machine=machine(64))
    assert big.children[0].env["INFERENCE_SERVER_ENDPOINTS_FRONTEND_PROCESSES"] == "8"
    own = {"INFERENCE_SERVER_ENDPOINTS_FRONTEND_PROCESSES": "3"}
    kept = plan(node_of(), own, role="workers", machine=machine(16))
    assert kept.children[0].env["INFERENCE_SERVER_ENDPOINTS_FRONTEND_PROCESSES"] == "3"

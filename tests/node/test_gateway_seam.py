"""The embedded gateway's launch, checked against the gateway's own configuration loader: the
environment and files the supervisor hands the gateway child configure it as intended."""

from __future__ import annotations

import math
from pathlib import Path

from kserve_trio.gateway.config import load_gateway_config
from kserve_trio.node import Machine
from kserve_trio.node._files import prepare_node

CPU = Machine(lambda: None, lambda: [], lambda: [0, 1], lambda: None)


def gateway_env(tmp_path: Path, node_text: str, env: dict[str, str], **kw) -> dict[str, str]:
    node = tmp_path / "node.yaml"
    node.write_text(node_text)
    plan, _ = prepare_node(
        node,
        role=None,
        gateway_path=kw.get("gateway_path"),
        env={"KSERVE_TRIO_CPU_WORKERS": "2", **env},
        runtime_dir=tmp_path / "run",
        machine=CPU,
    )
    gateway = plan.child("gateway")
    assert gateway.argv[1:] == ("-m", "kserve_trio", "gateway")
    return dict(gateway.env)


def test_environment_only_gateway_gets_the_nodes_workers(tmp_path):
    env = gateway_env(
        tmp_path,
        "model_repo: /m\nbase_port: 9100\nmetrics_base_port: 9200\n"
        "global:\n  grpc: {max_recv_msg_bytes: 1048576}\n",
        {"KSERVE_TRIO_GATEWAY_LISTEN_GRPC": "127.0.0.1:18001"},
    )
    cfg = load_gateway_config(env=env).config
    assert cfg.endpoints == ("127.0.0.1:9100", "127.0.0.1:9101")
    assert cfg.worker_names == ("worker0", "worker1")
    assert cfg.worker_metrics == ("127.0.0.1:9200", "127.0.0.1:9201")
    assert cfg.listen.grpc == "127.0.0.1:18001"
    assert cfg.grpc.max_recv_msg_bytes == 1048576
    assert cfg.prober.startup_wait_seconds == math.inf


def test_the_nodes_gateway_block_configures_the_gateway(tmp_path):
    env = gateway_env(
        tmp_path,
        "model_repo: /m\nbase_port: 9100\n"
        "gateway:\n  scheduling: {mode: least_outstanding}\n  listen: {grpc: '127.0.0.1:18005'}\n",
        {},
    )
    loaded = load_gateway_config(env=env)
    assert loaded.source == str(tmp_path / "run" / "gateway.yaml")
    assert loaded.config.scheduling.mode.value == "least_outstanding"
    assert loaded.config.listen.grpc == "127.0.0.1:18005"
    assert loaded.config.endpoints == ("127.0.0.1:9100", "127.0.0.1:9101")


def test_an_explicit_gateway_file_wins_over_the_block(tmp_path):
    mounted = tmp_path / "gateway.yml"
    mounted.write_text("endpoints: ['10.0.0.5:7000']\nworker_names: [remote]\n")
    env = gateway_env(
        tmp_path,
        "model_repo: /m\nbase_port: 9100\ngateway:\n  scheduling: {mode: least_outstanding}\n",
        {},
        gateway_path=mounted,
    )
    loaded = load_gateway_config(env=env)
    assert loaded.source == str(mounted)
    assert loaded.config.endpoints == ("10.0.0.5:7000",)
    assert loaded.config.scheduling.mode.value == "round_robin"
    assert not (tmp_path / "run" / "gateway.yaml").exists()

"""Upstream ``REACTANT_*`` environment names: read as their ``KSERVE_TRIO_*`` names by every
reader (worker and gateway configuration, node plan, client caps), one warning each naming the
new name, the new name winning when both are set."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from kserve_trio.client.endpoint import ENV_MAX_RECV, ENV_MAX_SEND, resolve_message_cap
from kserve_trio.core.errors import ConfigError
from kserve_trio.core.process import upstream_env
from kserve_trio.core.process.config import apply_env_overrides
from kserve_trio.core.process.node import choose_worker, load_server_config
from kserve_trio.core.process.upstream_env import (
    UpstreamUse,
    new_name,
    resolve_upstream_env,
    with_upstream_aliases,
)
from kserve_trio.gateway.config import load_gateway_config
from kserve_trio.node import Machine, plan_node
from kserve_trio.node._files import prepare_node

NODE = {"model_repo": "/models", "base_port": 9000}


@pytest.fixture(autouse=True)
def fresh_announcements(monkeypatch):
    """Each test sees the process's first use of every name (warnings are once per process)."""
    monkeypatch.setattr(upstream_env, "_announced", set())


def machine() -> Machine:
    return Machine(lambda: None, lambda: [], lambda: list(range(32)), lambda: None)


def plan(env: dict[str, str], **kw):
    return plan_node(
        kw.pop("node", dict(NODE)),
        env=env,
        machine=machine(),
        node_file="/tmp/n.yaml",
        python="py",
        **kw,
    )


# --- the rules --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("REACTANT_GATEWAY_WORKERS", "KSERVE_TRIO_GATEWAY_WORKERS"),
        ("REACTANT_GATEWAY_SCHEDULING_MODE", "KSERVE_TRIO_GATEWAY_SCHEDULING_MODE"),
        ("REACTANT_CLIENT_GRPC_MAX_SEND_MSG_BYTES", ENV_MAX_SEND),
        ("REACTANT_CLIENT_GRPC_MAX_RECV_MSG_BYTES", ENV_MAX_RECV),
        ("REACTANT_NODE_FILE", "KSERVE_TRIO_NODE_FILE"),
        ("REACTANT_ROLE", "KSERVE_TRIO_ROLE"),
        ("REACTANT_GPUS", "KSERVE_TRIO_GPUS"),
        ("REACTANT_CPU_WORKERS", "KSERVE_TRIO_CPU_WORKERS"),
        ("REACTANT_WORKER_NAME", "KSERVE_TRIO_WORKER_NAME"),
        ("REACTANT_WORKER_THREADS", "KSERVE_TRIO_WORKER_THREADS"),
        ("REACTANT_SUPERVISOR_MAX_RESTARTS", "KSERVE_TRIO_SUPERVISOR_MAX_RESTARTS"),
        ("REACTANT_FANOUT_BYTES", "KSERVE_TRIO_FANOUT_BYTES"),
        ("REACTANT_FANOUT_SLOTS", "KSERVE_TRIO_FANOUT_SLOTS"),
    ],
)
def test_each_upstream_name_is_read_as_its_new_name_and_dropped(old, new):
    assert new_name(old) == new
    out, uses = resolve_upstream_env({old: "v", "PATH": "/bin"})
    assert out == {new: "v", "PATH": "/bin"}
    assert uses == [UpstreamUse(old, new, "alias")]


def test_the_new_name_wins_when_both_are_set():
    env = {"REACTANT_GPUS": "4", "KSERVE_TRIO_GPUS": "0"}
    out, uses = resolve_upstream_env(env)
    assert out == {"KSERVE_TRIO_GPUS": "0"}
    assert uses == [UpstreamUse("REACTANT_GPUS", "KSERVE_TRIO_GPUS", "ignored")]


def test_a_name_without_counterpart_is_dropped_with_what_to_do_instead():
    out, uses = resolve_upstream_env({"REACTANT_GPU_RECLAIM_TIMEOUT_SECONDS": "30"})
    assert out == {}
    assert [(u.old, u.kind) for u in uses] == [
        ("REACTANT_GPU_RECLAIM_TIMEOUT_SECONDS", "unsupported")
    ]
    assert "KSERVE_TRIO_SUPERVISOR_MAX_RESTARTS" in uses[0].advice
    _, uses = resolve_upstream_env({"REACTANT_GPU_RECLAIM_MAX_USED_PERCENT": "15"})
    assert "INFERENCE_SERVER_RUNTIME_MEM_FRACTION" in uses[0].advice


def test_other_reactant_names_are_not_ours_and_pass_through():
    env = {"REACTANT_SOMETHING_ELSE": "1"}
    assert resolve_upstream_env(env) == (env, [])
    assert new_name("REACTANT_SOMETHING_ELSE") is None


def test_one_warning_per_name_per_process_naming_the_new_name():
    env = {"REACTANT_ROLE": "workers", "REACTANT_GPUS": "1", "KSERVE_TRIO_GPUS": "0"}
    with capture_logs() as logs:
        with_upstream_aliases(env)
        with_upstream_aliases(env)  # a second reader of the same environment: no repeat
    assert [(e["event"], e["variable"], e["use_instead"], e["log_level"]) for e in logs] == [
        ("upstream_env_ignored", "REACTANT_GPUS", "KSERVE_TRIO_GPUS", "warning"),
        ("upstream_env_alias", "REACTANT_ROLE", "KSERVE_TRIO_ROLE", "warning"),
    ]


# --- every reader honours them ------------------------------------------------------------------


def test_the_gateway_reads_reactant_gateway_variables_and_the_new_name_wins(tmp_path):
    env = {
        "REACTANT_GATEWAY_WORKERS": "10.0.0.1:9000, 10.0.0.2:9000",
        "REACTANT_GATEWAY_LISTEN_GRPC": "0.0.0.0:7001",
        "REACTANT_GATEWAY_GRPC_MAX_RECV_MSG_BYTES": "1000",
        "KSERVE_TRIO_GATEWAY_GRPC_MAX_RECV_MSG_BYTES": "2000",
    }
    with capture_logs() as logs:
        cfg = load_gateway_config(env=env).config
    assert cfg.endpoints == ("10.0.0.1:9000", "10.0.0.2:9000")
    assert cfg.listen.grpc == "0.0.0.0:7001"
    assert cfg.grpc.max_recv_msg_bytes == 2000
    assert {e["variable"]: e["use_instead"] for e in logs} == {
        "REACTANT_GATEWAY_WORKERS": "KSERVE_TRIO_GATEWAY_WORKERS",
        "REACTANT_GATEWAY_LISTEN_GRPC": "KSERVE_TRIO_GATEWAY_LISTEN_GRPC",
        "REACTANT_GATEWAY_GRPC_MAX_RECV_MSG_BYTES": "KSERVE_TRIO_GATEWAY_GRPC_MAX_RECV_MSG_BYTES",
    }
    gw = tmp_path / "gateway.yml"
    gw.write_text("endpoints: ['10.0.0.9:9000']\n")
    assert load_gateway_config(env={"REACTANT_GATEWAY_FILE": str(gw)}).source == str(gw)


def test_an_unknown_reactant_gateway_variable_fails_as_its_new_name_would():
    with pytest.raises(
        ConfigError, match="unknown environment override KSERVE_TRIO_GATEWAY_WORKRS"
    ):
        load_gateway_config(
            env={"REACTANT_GATEWAY_WORKRS": "a:1", "REACTANT_GATEWAY_WORKERS": "a:1"}
        )


def test_the_client_caps_read_the_upstream_names_and_the_new_name_wins():
    old_send = "REACTANT_CLIENT_GRPC_MAX_SEND_MSG_BYTES"
    old_recv = "REACTANT_CLIENT_GRPC_MAX_RECV_MSG_BYTES"
    assert resolve_message_cap(None, ENV_MAX_SEND, {old_send: "1234"}) == 1234
    assert resolve_message_cap(None, ENV_MAX_RECV, {old_recv: "4321"}) == 4321
    assert resolve_message_cap(None, ENV_MAX_SEND, {old_send: "1", ENV_MAX_SEND: "2"}) == 2
    assert resolve_message_cap(7, ENV_MAX_SEND, {old_send: "1"}) == 7  # the keyword still wins


def test_the_worker_configuration_reads_fanout_and_worker_name(tmp_path: Path):
    raw, applied = apply_env_overrides(
        {}, {"REACTANT_FANOUT_BYTES": "4096", "REACTANT_FANOUT_SLOTS": "3"}
    )
    assert raw["meta"] == {"fanout_bytes": 4096, "fanout_slots": 3}
    assert applied == [("KSERVE_TRIO_FANOUT_BYTES", "4096"), ("KSERVE_TRIO_FANOUT_SLOTS", "3")]
    both = {"REACTANT_FANOUT_SLOTS": "3", "KSERVE_TRIO_FANOUT_SLOTS": "5"}
    assert apply_env_overrides({}, both)[0]["meta"] == {"fanout_slots": 5}
    node = {**NODE, "workers": [{"name": "a"}, {"name": "b"}]}
    assert choose_worker(node, None, {"REACTANT_WORKER_NAME": "b"}) == ("b", True)
    repo = tmp_path / "models"
    repo.mkdir()
    cfg, _ = load_server_config(
        env={"REACTANT_WORKER_NAME": "w", "INFERENCE_SERVER_MODEL_DIRS": str(repo)}
    )
    assert cfg.worker_name == "w"


def test_meta_concurrency_reaches_the_refusal_under_its_new_name():
    with pytest.raises(ConfigError, match="KSERVE_TRIO_META_CONCURRENCY is not supported"):
        apply_env_overrides({}, {"REACTANT_META_CONCURRENCY": "4"})


def test_the_node_plan_reads_the_upstream_node_variables():
    env = {
        "REACTANT_ROLE": "workers",
        "REACTANT_GPUS": "0",
        "REACTANT_CPU_WORKERS": "3",
        "REACTANT_WORKER_THREADS": "2",
        "REACTANT_SUPERVISOR_MAX_RESTARTS": "4",
    }
    p = plan(env)
    assert p.role == "workers"
    assert [c.name for c in p.children] == ["worker0", "worker1", "worker2"]
    assert p.threads == 2 and p.max_restarts == 4
    for child in p.children:  # the children inherit the new names only
        assert not any(var.startswith("REACTANT_") for var in child.env)
        assert child.env["KSERVE_TRIO_CPU_WORKERS"] == "3"
    assert plan({"REACTANT_CPU_WORKERS": "3", "KSERVE_TRIO_CPU_WORKERS": "1"}).role == "all"
    assert len(plan({"REACTANT_CPU_WORKERS": "3", "KSERVE_TRIO_CPU_WORKERS": "1"}).children) == 1


def test_the_node_file_comes_from_reactant_node_file(tmp_path: Path):
    node_file = tmp_path / "node.yaml"
    node_file.write_text(f"model_repo: {tmp_path}\nbase_port: 9100\n")
    env = {"REACTANT_NODE_FILE": str(node_file), "REACTANT_ROLE": "workers"}
    p, _ = prepare_node(None, role=None, gateway_path=None, env=env, machine=machine(), write=False)
    assert p.role == "workers"
    assert [c.address for c in p.children] == [("127.0.0.1", 9100)]

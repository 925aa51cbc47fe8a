"""Where the node file comes from, where the materialized files go, which gateway config wins."""

from __future__ import annotations

from pathlib import Path

import pytest

from kserve_trio.core.errors import ConfigError
from kserve_trio.core.process.node import load_node, worker_raw_config
from kserve_trio.node import Machine
from kserve_trio.node._files import (
    choose_runtime_dir,
    default_node_file,
    prepare_node,
    read_gateway_source,
)

CPU = Machine(lambda: None, lambda: [], lambda: [0, 1], lambda: None)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_default_node_file():
    assert default_node_file({}) == "/etc/kserve_trio/node.yaml"
    assert default_node_file({"KSERVE_TRIO_NODE_FILE": "/x/n.yaml"}) == "/x/n.yaml"


def test_runtime_dir_keyword_then_env_then_default_then_temporary(tmp_path):
    kw = choose_runtime_dir(tmp_path / "kw", {"KSERVE_TRIO_RUNTIME_DIR": str(tmp_path / "env")})
    assert kw.path == tmp_path / "kw" and kw.path.is_dir() and not kw.temporary
    env = choose_runtime_dir(None, {"KSERVE_TRIO_RUNTIME_DIR": str(tmp_path / "env")})
    assert env.path == tmp_path / "env" and env.path.is_dir()
    default = choose_runtime_dir(None, {}, default=str(tmp_path / "run"))
    assert default.path == tmp_path / "run" and not default.temporary
    blocker = write(tmp_path / "file", "")  # a file where the default directory should be
    fallback = choose_runtime_dir(None, {}, default=str(blocker / "sub"))
    assert fallback.temporary and fallback.path.is_dir()
    fallback.cleanup()
    assert not fallback.path.exists()


def test_an_explicit_runtime_dir_that_cannot_be_created_is_an_error(tmp_path):
    blocker = write(tmp_path / "file", "")
    with pytest.raises(ConfigError, match="cannot create the node runtime directory"):
        choose_runtime_dir(blocker / "sub", {})


def test_gateway_source_precedence(tmp_path):
    arg = write(tmp_path / "arg.yml", "endpoints: ['h:1']\n")
    env_file = write(tmp_path / "env.yml", "scheduling: {mode: round_robin}\n")
    env = {"KSERVE_TRIO_GATEWAY_FILE": str(env_file)}
    node = {"gateway": {"listen": {"grpc": "0.0.0.0:1"}}}
    block = tmp_path / "rt" / "gateway.yaml"
    s = read_gateway_source(arg, env, node, block)
    assert (s.origin, s.path, dict(s.raw)) == ("file", str(arg), {"endpoints": ["h:1"]})
    s = read_gateway_source(None, env, node, block)
    assert (s.origin, s.path) == ("file", str(env_file))
    s = read_gateway_source(None, {}, node, block)
    assert (s.origin, s.path, dict(s.raw)) == ("node", str(block), node["gateway"])
    s = read_gateway_source(None, {}, {}, block)
    assert (s.origin, s.path, dict(s.raw)) == ("env", None, {})


def test_a_named_gateway_file_must_exist(tmp_path):
    with pytest.raises(ConfigError, match="gateway config file not found"):
        read_gateway_source(tmp_path / "nope.yml", {}, None, tmp_path / "g.yaml")
    env = {"KSERVE_TRIO_GATEWAY_FILE": str(tmp_path / "nope.yml")}
    with pytest.raises(ConfigError, match="gateway config file not found"):
        read_gateway_source(None, env, None, tmp_path / "g.yaml")


def test_prepare_writes_a_node_file_every_worker_resolves_from(tmp_path):
    node = write(tmp_path / "node.yaml", "model_repo: /models\nbase_port: 9100\n")
    env = {"KSERVE_TRIO_CPU_WORKERS": "2"}
    plan, rdir = prepare_node(
        node, role="workers", gateway_path=None, env=env, runtime_dir=tmp_path / "rt", machine=CPU
    )
    assert rdir is not None and rdir.path == tmp_path / "rt"
    assert plan.node_file == str(tmp_path / "rt" / "node.yaml")
    written = load_node(plan.node_file)
    assert [w["name"] for w in written["workers"]] == ["worker0", "worker1"]
    assert worker_raw_config(written, "worker1")["endpoints"]["port"] == 9101
    assert not (tmp_path / "rt" / "gateway.yaml").exists()


def test_prepare_writes_the_gateway_block_for_a_multi_worker_node(tmp_path):
    node = write(
        tmp_path / "node.yaml",
        "model_repo: /models\nbase_port: 9100\ngateway:\n  scheduling: {mode: least_outstanding}\n",
    )
    plan, _ = prepare_node(
        node,
        role=None,
        gateway_path=None,
        env={"KSERVE_TRIO_CPU_WORKERS": "2"},
        runtime_dir=tmp_path / "rt",
        machine=CPU,
    )
    gateway_file = tmp_path / "rt" / "gateway.yaml"
    assert plan.child("gateway").env["KSERVE_TRIO_GATEWAY_FILE"] == str(gateway_file)
    assert "least_outstanding" in gateway_file.read_text()


def test_prepare_without_writing_touches_nothing(tmp_path):
    node = write(tmp_path / "node.yaml", "model_repo: /models\nbase_port: 9100\n")
    env = {"KSERVE_TRIO_RUNTIME_DIR": str(tmp_path / "rt")}
    plan, rdir = prepare_node(node, role=None, gateway_path=None, env=env, machine=CPU, write=False)
    assert rdir is None
    assert not (tmp_path / "rt").exists()
    assert plan.public_grpc == ("0.0.0.0", 8001)


def test_a_missing_node_file_is_an_error_except_for_a_gateway_only_node(tmp_path):
    missing = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError, match="node config file not found"):
        prepare_node(missing, role=None, gateway_path=None, env={}, machine=CPU, write=False)
    plan, _ = prepare_node(
        missing,
        role=None,
        gateway_path=None,
        env={"KSERVE_TRIO_ROLE": "gateway"},
        machine=CPU,
        write=False,
    )
    assert [c.name for c in plan.children] == ["gateway"]

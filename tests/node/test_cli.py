"""``python -m kserve_trio node`` / ``probe`` from the command line, without workers."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.node.conftest import ROOT
from tests.ports import free_ports


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kserve_trio", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def test_node_help_names_its_flags():
    out = run_cli("node", "--help")
    assert out.returncode == 0
    for flag in ("--node", "--role", "--gateway"):
        assert flag in out.stdout


def test_a_missing_node_file_is_a_configuration_error_exit_2(tmp_path):
    missing = tmp_path / "absent.yaml"
    out = run_cli("node", "--node", str(missing))
    assert out.returncode == 2
    assert f"[supervisor] configuration error: node config file not found: {missing}" in out.stdout
    assert out.stdout.rstrip().endswith("[supervisor] node stopped (exit 2)")


def test_the_node_file_defaults_to_the_environment(tmp_path):
    missing = tmp_path / "from-env.yaml"
    out = run_cli("node", env={"KSERVE_TRIO_NODE_FILE": str(missing)})
    assert out.returncode == 2
    assert str(missing) in out.stdout


def test_a_cuda_node_without_gpus_exits_2_with_the_reason(tmp_path):
    node = tmp_path / "node.yaml"
    node.write_text(
        f"model_repo: {tmp_path}\nbase_port: 9000\nglobal:\n  runtime: {{backend: cuda}}\n"
    )
    out = run_cli("node", "--node", str(node), env={"CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 2
    assert "no GPUs detected for a CUDA node" in out.stdout


def test_probe_says_not_ready_when_nothing_listens(tmp_path):
    port = free_ports(1)
    node = tmp_path / "node.yaml"
    node.write_text(f"model_repo: {tmp_path}\nbase_port: {port}\n")
    env = {"KSERVE_TRIO_ROLE": "workers"}
    out = run_cli("probe", "--node", str(node), "--worker", "worker0", "--timeout", "2", env=env)
    assert out.returncode == 1
    assert out.stdout.strip() == f"not ready: 127.0.0.1:{port}"
    # role all: the single worker binds the public port, and that is what is probed
    public = free_ports(1)
    env = {"KSERVE_TRIO_GATEWAY_LISTEN_GRPC": f"0.0.0.0:{public}"}
    out = run_cli("probe", "--node", str(node), "--timeout", "2", env=env)
    assert out.returncode == 1
    assert out.stdout.strip() == f"not ready: 127.0.0.1:{public}"


def test_probe_of_an_unknown_worker_or_a_bad_node_exits_2(tmp_path):
    node = tmp_path / "node.yaml"
    node.write_text(f"model_repo: {tmp_path}\nbase_port: 9000\n")
    out = run_cli("probe", "--node", str(node), "--worker", "nope")
    assert out.returncode == 2
    assert "worker 'nope' not defined in node (have: worker0)" in out.stderr
    out = run_cli("probe", "--node", str(tmp_path / "absent.yaml"))
    assert out.returncode == 2
    assert "node config file not found" in out.stderr

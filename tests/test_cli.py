"""The top-level CLI lists every subcommand; unbuilt ones say which capability brings them."""

from __future__ import annotations

import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kserve_trio", *args], capture_output=True, text=True, timeout=120
    )


def test_help_lists_every_subcommand():
    out = run_cli("--help")
    assert out.returncode == 0
    for command in ("worker", "gateway", "node", "probe", "bundle", "bench"):
        assert command in out.stdout


def test_unbuilt_command_names_its_capability_and_fails():
    out = run_cli("gateway")
    assert out.returncode == 2
    assert "arrives with the Gateway capability" in out.stderr


def test_built_commands_are_not_placeholders():
    for command in ("node", "probe"):
        out = run_cli(command, "--help")
        assert out.returncode == 0
        assert "not built yet" not in out.stdout
        assert "--node" in out.stdout

"""The top-level CLI lists every subcommand; an unbuilt one would say which capability brings it."""

from __future__ import annotations

import os
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


def test_an_unbuilt_command_would_name_its_capability_and_fail(capsys):
    from kserve_trio.__main__ import _not_built

    assert _not_built("thing", "the Thing capability")(None) == 2
    assert (
        "'thing' is not built yet: it arrives with the Thing capability." in capsys.readouterr().err
    )


def test_the_gateway_command_is_built_and_refuses_a_config_without_workers():
    out = run_cli("gateway", "--help")
    assert out.returncode == 0
    assert "not built yet" not in out.stdout
    assert "--config" in out.stdout and "--log-level" in out.stdout
    env_free = subprocess.run(
        [sys.executable, "-m", "kserve_trio", "gateway"],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("KSERVE_TRIO_GATEWAY_")},
    )
    assert env_free.returncode == 2
    assert "gateway has no endpoints" in env_free.stderr


def test_built_commands_are_not_placeholders():
    for command in ("node", "probe"):
        out = run_cli(command, "--help")
        assert out.returncode == 0
        assert "not built yet" not in out.stdout
        assert "--node" in out.stdout


def test_the_worker_flags_of_client_shared_memory():
    import argparse

    import pytest

    from kserve_trio.core.errors import ConfigError
    from kserve_trio.core.process.config import build_config, validate_config
    from kserve_trio.worker.cli import configure_parser, overrides_from_args

    parser = argparse.ArgumentParser()
    configure_parser(parser)

    def endpoints(*argv: str):
        cfg = build_config(overrides_from_args(parser.parse_args(list(argv))))
        validate_config(cfg, check_dirs=False)
        return cfg.endpoints

    default = endpoints()
    assert default.client_shared_memory is True and default.client_shared_memory_prefixes == ()
    assert endpoints("--no-client-shared-memory").client_shared_memory is False
    assert endpoints("--client-shared-memory").client_shared_memory is True
    allowed = endpoints(
        "--client-shared-memory-prefix", "triton_", "--client-shared-memory-prefix", "/app-"
    )
    assert allowed.client_shared_memory_prefixes == ("triton_", "/app-")
    with pytest.raises(ConfigError, match="starts with 'kst-'"):
        endpoints("--client-shared-memory-prefix", "kst-w-")
    with pytest.raises(ConfigError, match=r"has no effect with endpoints\.client_shared_memory"):
        endpoints("--no-client-shared-memory", "--client-shared-memory-prefix", "a")


def test_a_command_imports_its_own_package_and_no_other_commands():
    """A front end or a gateway child is a ``python -m kserve_trio`` process of its own: it
    parses its command's options without importing the other commands' packages."""
    code = (
        "import sys\n"
        "from kserve_trio.__main__ import main\n"
        "try:\n"
        "    main(['frontend', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(sorted(m for m in ('kserve_trio.gateway', 'kserve_trio.worker', 'kserve_trio.node',"
        " 'kserve_trio.export', 'kserve_trio.bench', 'jax') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--channel-fd" in out.stdout  # the chosen command's full options
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_every_command_still_parses_as_the_first_word():
    from kserve_trio.__main__ import _command_named

    assert _command_named(["worker", "--port", "0"]) == "worker"
    assert _command_named(["--help"]) is None
    assert _command_named(["nonsense", "worker"]) is None
    out = run_cli("nonsense")
    assert out.returncode == 2 and "invalid choice" in out.stderr

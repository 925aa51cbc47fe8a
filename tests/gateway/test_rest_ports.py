"""The gateway with ``listen.http`` taken: the start fails naming ``listen.http`` and leaves no
port open. The CLI prints one line and exits 2 (no traceback); in process, ``serve_gateway``
raises the ``OSError`` and the gRPC port it was given is still free (REST binds first)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from kserve_trio.gateway.config import GatewayConfig, ListenConfig
from kserve_trio.gateway.server import serve_gateway
from tests.ports import free_port

G = "KSERVE_TRIO_GATEWAY_"


def test_the_cli_fails_in_one_line_when_listen_http_is_taken():
    grpc_port, metrics_port = free_port(), free_port()
    with socket.create_server(("127.0.0.1", 0)) as taken:
        http_port = taken.getsockname()[1]
        env = {
            **os.environ,
            G + "WORKERS": f"127.0.0.1:{free_port()}",
            G + "LISTEN_GRPC": f"127.0.0.1:{grpc_port}",
            G + "LISTEN_METRICS": f"127.0.0.1:{metrics_port}",
            G + "LISTEN_HTTP": f"127.0.0.1:{http_port}",
        }
        argv = [sys.executable, "-m", "kserve_trio", "gateway", "--log-format", "json"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: cannot serve: [Errno 98] listen.http 127.0.0.1:{http_port}: Address already in use"
    )
    assert "Traceback" not in out and '"gateway_up"' not in out
    with socket.create_server(("127.0.0.1", grpc_port)):
        pass


def test_in_process_the_start_raises_and_leaves_the_grpc_port_free():
    grpc_port = free_port()
    with socket.create_server(("127.0.0.1", 0)) as taken:
        http = f"127.0.0.1:{taken.getsockname()[1]}"
        config = GatewayConfig(
            listen=ListenConfig(f"127.0.0.1:{grpc_port}", "127.0.0.1:0", http),
            endpoints=(f"127.0.0.1:{free_port()}",),
        )
        with pytest.raises(OSError, match=f"listen.http {http}: Address already in use"):
            serve_gateway(config, blocking=False)
    with socket.create_server(("127.0.0.1", grpc_port)):  # nothing listens there
        pass

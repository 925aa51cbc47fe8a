"""``python -m kserve_trio worker --http-port P`` with P taken: the start fails with one line
naming the port and exit status 2, no traceback, and the gRPC port was never opened (the REST
listener binds first)."""

from __future__ import annotations

import socket
import subprocess
import sys

from tests.ports import free_port


def test_a_taken_rest_port_fails_the_start_in_one_line(tmp_path):
    repo = tmp_path / "models"
    repo.mkdir()
    grpc_port = free_port()
    with socket.create_server(("127.0.0.1", 0)) as taken:
        http_port = taken.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable, "-m", "kserve_trio", "worker", "--model-repo", str(repo),
                "--host", "127.0.0.1", "--port", str(grpc_port), "--metrics-port", "0",
                "--http-port", str(http_port), "--log-format", "json",
            ],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        f"error: cannot serve: [Errno 98] REST port 127.0.0.1:{http_port}: Address already in use"
    )
    assert "Traceback" not in out and '"server_up"' not in out
    with socket.create_server(("127.0.0.1", grpc_port)):  # gRPC never listened there
        pass

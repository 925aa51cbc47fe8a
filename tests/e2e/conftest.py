"""Fixtures for end-to-end tests: the demo repository, free ports, a worker subprocess."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tests.ports import free_port


class WorkerProcess:
    """A worker started from the CLI as a subprocess, stopped with SIGTERM."""

    def __init__(self, repo: pathlib.Path, *extra: str, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"127.0.0.1:{self.port}"
        self.log_path = repo.parent / f"worker-{self.port}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kserve_trio",
                "worker",
                "--model-repo",
                str(repo),
                "--port",
                str(self.port),
                "--model-control-mode",
                "static",
                "--log-format",
                "json",
                *extra,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    def wait_ready(self, timeout: float = 300.0) -> None:
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(self.url)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited early ({self.proc.returncode}):\n{self.logs()}")
            try:
                if client.is_server_ready():
                    return
            except Exception:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"worker not ready within {timeout}s:\n{self.logs()}")

    def logs(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def demo_worker(demo_repo):
    worker = WorkerProcess(demo_repo)
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.terminate()

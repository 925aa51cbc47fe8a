"""Real processes for the gateway's end-to-end tests: CLI workers bound to any loopback address
(127.0.0.1, 127.0.0.2, ... on one port: one name behind several addresses) and the gateway
CLI, each logging to a file next to the test's temporary directory."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import tritonclient.grpc as grpcclient

from tests.gate_model import Gate, add_gate_model
from tests.ports import free_port
from tests.sockets import tcp_sockets


class Proc:
    """A child process with its log file; ``stop`` sends SIGTERM and returns the exit code."""

    launcher: tuple[str, ...] = ()
    """A command the process's argv is run under (a subclass sets it, e.g. to lower limits)."""

    def __init__(self, argv: list[str], log: pathlib.Path, env: dict[str, str]) -> None:
        self.argv, self.log_path, self.env = argv, log, env
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(
            [*self.launcher, *argv], stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, **env},
        )  # fmt: skip

    def logs(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def events(self, name: str, since: int = 0) -> list[dict]:
        """The process's ``name`` log events (its lines are JSON: ``--log-format json``) past
        character ``since`` of its log."""
        out = []
        for line in self.logs()[since:].splitlines():
            if f'"{name}"' in line:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("event") == name:
                    out.append(event)
        return out

    def alive(self) -> bool:
        return self.proc.poll() is None

    def connections_to(self, port: int) -> set[int]:
        """The local ports of this process's open TCP sockets whose peer port is ``port``
        (its file descriptors matched with the kernel's socket table, ``/proc``)."""
        return {s.local_port for s in tcp_sockets(self.proc.pid) if s.peer_port == port}

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 20.0) -> int:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


class Worker(Proc):
    """``python -m kserve_trio worker`` on ``host:port`` (metrics on ``metrics_port``)."""

    def __init__(
        self,
        repo: pathlib.Path,
        host: str,
        port: int,
        *,
        metrics_port: int = 0,
        models: str = "mlp",
        env: dict[str, str] | None = None,
    ) -> None:
        self.host, self.port, self.metrics_port = host, port, metrics_port
        self.repo, self.models, self.extra_env = repo, models, env or {}
        self.url = f"{host}:{port}"
        super().__init__(self._argv(), repo.parent / f"worker-{host}-{port}.log", self._env())

    def _argv(self) -> list[str]:
        return [
            sys.executable, "-m", "kserve_trio", "worker", "--model-repo", str(self.repo),
            "--host", self.host, "--port", str(self.port), "--metrics-port",
            str(self.metrics_port), "--model-control-mode", "static", "--log-format", "json",
        ]  # fmt: skip

    def _env(self) -> dict[str, str]:
        return {"INFERENCE_SERVER_MODELS_INCLUDE": self.models, **self.extra_env}

    def restart(self) -> None:
        """A new process on the same address and port (the old one must be gone)."""
        self._log.close()
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [*self.launcher, *self._argv()], stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, **self._env()},
        )  # fmt: skip

    def client(self, **kw) -> grpcclient.InferenceServerClient:
        return grpcclient.InferenceServerClient(self.url, **kw)

    def wait_ready(self, timeout: float = 300.0, **client_kw) -> float:
        """Block until ServerReady; returns the monotonic time it was first seen ready."""
        c = self.client(**client_kw)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"worker exited ({self.proc.returncode}):\n{self.logs()}")
            try:
                if c.is_server_ready():
                    return time.monotonic()
            except Exception:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"worker {self.url} not ready within {timeout}s:\n{self.logs()}")


class Gateway(Proc):
    """``python -m kserve_trio gateway`` configured by ``KSERVE_TRIO_GATEWAY_*`` variables."""

    def __init__(self, workdir: pathlib.Path, env: dict[str, str], *args: str) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.url = f"127.0.0.1:{self.port}"
        g = "KSERVE_TRIO_GATEWAY_"
        full = {
            g + "LISTEN_GRPC": self.url,
            g + "LISTEN_METRICS": f"127.0.0.1:{self.metrics_port}",
            g + "HEALTH_INTERVAL_SECONDS": "1",
            g + "STARTUP_WAIT_SECONDS": "60",
            **env,
        }
        argv = [sys.executable, "-m", "kserve_trio", "gateway", "--log-format", "json", *args]
        super().__init__(argv, workdir / f"gateway-{self.port}.log", full)

    def admin(self, path: str) -> tuple[int, str]:
        try:
            url = f"http://127.0.0.1:{self.metrics_port}{path}"
            with urllib.request.urlopen(url, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"gateway exited ({self.proc.returncode}):\n{self.logs()}")
            try:
                if self.admin("/readyz")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"gateway not ready within {timeout}s:\n{self.logs()}")

    def client(self, **kw) -> grpcclient.InferenceServerClient:
        return grpcclient.InferenceServerClient(self.url, **kw)


def sleepy_repository(work: pathlib.Path) -> pathlib.Path:
    """A repository of the one ``sleepy`` model (it sleeps as long as its input says) under
    ``work``."""
    from tests.e2e.test_protocol_features_e2e import SLEEPY_MANIFEST, SLEEPY_MODEL_PY

    repo = work / "models"
    (repo / "sleepy").mkdir(parents=True)
    (repo / "sleepy" / "model.py").write_text(SLEEPY_MODEL_PY)
    (repo / "sleepy" / "manifest.yaml").write_text(SLEEPY_MANIFEST)
    return repo


def sleepy_worker(work: pathlib.Path) -> Worker:
    """A worker on ``sleepy_repository(work)``: the model a test holds a connection with."""
    return Worker(sleepy_repository(work), "127.0.0.1", free_port(), models="sleepy")


def gated_sleepy_worker(work: pathlib.Path) -> tuple[Worker, Gate]:
    """A worker on ``sleepy`` and the ``gate`` model, with the gate: the model a test holds the
    worker's device (and so a slot) with for as long as it needs, never for a guessed time."""
    repo = sleepy_repository(work)
    gate = add_gate_model(repo)
    return Worker(repo, "127.0.0.1", free_port(), models="sleepy:gate"), gate

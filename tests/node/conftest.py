"""Fixtures for the node tests: free ports, a node file on the demo repository, and the
supervisor (``python -m kserve_trio node``) as a subprocess whose output is a log file."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


def write_node(tmp_path: Path, repo: Path, base_port: int, extra: str = "") -> Path:
    """A node file serving the demo repository's ``mlp`` (one small model keeps start-up
    short); ``extra`` is appended YAML."""
    path = tmp_path / "node.yaml"
    path.write_text(
        textwrap.dedent(
            f"""\
            model_repo: {repo}
            base_port: {base_port}
            global:
              model_control_mode: static
              models_include: [mlp]
            """
        )
        + textwrap.dedent(extra)
    )
    return path


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def processes_with_env(marker: str) -> list[int]:
    """Live processes whose environment holds ``marker`` (every process of one node does)."""
    needle = marker.encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0") and alive(int(entry)):
            found.append(int(entry))
    return found


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out


class NodeProcess:
    """``python -m kserve_trio node`` with its output in a log file."""

    def __init__(self, tmp_path: Path, args: list[str], env: dict[str, str]) -> None:
        self.marker = f"KSERVE_TRIO_TEST_NODE={uuid.uuid4().hex}"
        key, _, value = self.marker.partition("=")
        self.log = tmp_path / "node.log"
        self._out = open(self.log, "wb")
        self.env = {
            **os.environ,
            "KSERVE_TRIO_RUNTIME_DIR": str(tmp_path / "run"),
            **env,
            key: value,
        }
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kserve_trio", "node", *args],
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=ROOT,
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 120.0, after: int = 0) -> re.Match:
        """The first match of ``pattern`` in the node's output from offset ``after``, once it
        is there; AssertionError with the output's tail past ``timeout`` or when the node
        exited without it."""
        regex = re.compile(pattern, re.M)

        def found() -> re.Match | None:
            exited = self.proc.poll() is not None  # before the read: its output is all there
            m = regex.search(self.text(), after)
            if m is None and exited:
                raise AssertionError(f"the node exited ({self.proc.returncode})")
            return m

        try:
            return wait_until(found, timeout, f"{pattern!r} in the node's output")
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n{self.text()[-6000:]}") from None

    def pids(self) -> dict[str, int]:
        """The latest pid the supervisor reported for each child."""
        out: dict[str, int] = {}
        for m in re.finditer(r"^\[supervisor\] started (\S+) \(pid (\d+)\)$", self.text(), re.M):
            out[m.group(1)] = int(m.group(2))
        return out

    def stop(self, timeout: float = 40.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def close(self) -> None:
        self.stop()
        for pid in processes_with_env(self.marker):  # never leave a stray worker behind
            os.kill(pid, signal.SIGKILL)
        self._out.close()


def wait_ready(url: str, timeout: float = 240.0, node: NodeProcess | None = None) -> None:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)

    def ready() -> bool:
        if node is not None and node.proc.poll() is not None:
            raise AssertionError(
                f"the node exited ({node.proc.returncode}):\n{node.text()[-6000:]}"
            )
        try:
            return client.is_server_ready()
        except Exception:  # not listening yet
            return False

    try:
        wait_until(ready, timeout, f"{url} ready")
    except AssertionError as exc:
        if node is None or "not within" not in str(exc):
            raise
        raise AssertionError(f"{exc}:\n{node.text()[-6000:]}") from None


@pytest.fixture
def start_node(tmp_path):
    nodes: list[NodeProcess] = []

    def start(args: list[str], env: dict[str, str]) -> NodeProcess:
        node = NodeProcess(tmp_path, args, env)
        nodes.append(node)
        return node

    yield start
    for node in nodes:
        node.close()

"""Fixtures for the deployment tests: the kustomizations rendered offline by ``kubectl
kustomize``, the schema/PromQL checker in ``.venv-deploy``, and one live node started the way
the container image starts it (shared by the tests that need a running server)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.manifests import DEPLOY, DOCKERFILES, ROOT, load_yaml_docs, parse_dockerfile
from tests.ports import free_port

DEPLOY_VENV_ENV = "KSERVE_TRIO_DEPLOY_VENV"
K8S_VERSION = "1.32.0"
"""The Kubernetes API version the built-in kinds are validated against (kubectl's here)."""
KUSTOMIZATIONS = {
    "base": DEPLOY / "k8s" / "base",
    "cpu": DEPLOY / "k8s" / "overlays" / "cpu",
    "monitoring": DEPLOY / "monitoring",
}


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        raise RuntimeError(
            "kubectl is not installed: the kustomizations are rendered with `kubectl kustomize` "
            "(the Debian image of this project ships it as the apt package kubectl)"
        )
    return path


def render(directory: Path) -> list[dict]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, f"kubectl kustomize {directory} failed:\n{out.stderr}"
    return load_yaml_docs(out.stdout)


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    """Every kustomization under deploy/, rendered offline."""
    return {name: render(path) for name, path in KUSTOMIZATIONS.items()}


def deploy_python() -> Path:
    venv = Path(os.environ.get(DEPLOY_VENV_ENV) or ROOT / ".venv-deploy")
    python = venv / "bin" / "python"
    if not python.exists():
        raise RuntimeError(
            f"no deployment-check environment at {venv}: run 'tools/dev.sh test' (it creates "
            f".venv-deploy with the kserve SDK, kubernetes-validate and promql-parser) or set "
            f"{DEPLOY_VENV_ENV}"
        )
    return python


def run_checker(objects: Sequence[Any] = (), promql: Sequence[str] = ()) -> dict:
    """tests/deploy/checker.py in .venv-deploy over ``objects`` and ``promql``."""
    request = {"objects": list(objects), "promql": list(promql), "k8s_version": K8S_VERSION}
    out = subprocess.run(
        [str(deploy_python()), str(Path(__file__).with_name("checker.py"))],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"checker failed:\n{out.stderr}"
    return json.loads(out.stdout)


@pytest.fixture(scope="session")
def checker() -> Callable[..., dict]:
    return run_checker


# ---------------------------------------------------------------------------------------------
# One live node, started as the CPU image starts it


@dataclass
class LiveNode:
    """The CPU image's entrypoint running on this machine: its gRPC and admin addresses, the
    environment it runs with (the image's ENV plus the test's overrides) and its log."""

    proc: subprocess.Popen
    grpc: str
    admin: str
    env: dict[str, str]
    log: Path
    healthcheck: list[str]

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://{self.admin}{path}", timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def run_healthcheck(self) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.healthcheck, env=self.env, capture_output=True, text=True, timeout=60
        )


def image_command(argv: Sequence[str]) -> list[str]:
    """An image argv with its interpreter (/app/.venv/bin/python) replaced by this one."""
    assert argv[0] == "/app/.venv/bin/python", argv
    return [sys.executable, *argv[1:]]


def run_image_process(
    what: str,
    make: Callable[[subprocess.Popen], LiveNode],
    argv: Sequence[str],
    env: dict[str, str],
    cwd: Path,
    *,
    ready: Callable[[LiveNode], bool],
    timeout: float,
) -> Iterator[LiveNode]:
    """Start ``argv`` logging to ``cwd/<what>.log``, yield its handle once ``ready`` holds, and
    at the end stop it with SIGTERM as a container runtime would: it must then exit 0."""
    with open(cwd / f"{what}.log", "wb") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    live = make(proc)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited early ({proc.returncode}):\n{live.logs()}")
            if ready(live):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not ready within {timeout:.0f} s:\n{live.logs()}")
            time.sleep(0.5)
        yield live
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, f"{what} exited {proc.returncode} after SIGTERM:\n{live.logs()}"


@pytest.fixture(scope="session")
def live_node(demo_repo, tmp_path_factory) -> Iterator[LiveNode]:
    """``ENTRYPOINT + CMD`` of cpu.Dockerfile with the image's ENV and node file, serving the
    demo repository's ``mlp`` with the weight cache on (a CPU device-memory figure), on free
    loopback ports. Stopped with SIGTERM at the end of the session; it must exit 0."""
    df = parse_dockerfile(DOCKERFILES["cpu"])
    image_env = df.env()
    tmp = tmp_path_factory.mktemp("live-node")
    grpc, admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    env = {
        **os.environ,
        **{k: v for k, v in image_env.items() if k not in ("PATH", "HOME")},
        # The image's paths, mapped onto this checkout and a scratch directory.
        "KSERVE_TRIO_NODE_FILE": str(ROOT / "deploy" / "container" / "node.yaml"),
        "KSERVE_TRIO_RUNTIME_DIR": str(tmp / "run"),
        "INFERENCE_SERVER_MODEL_DIRS": str(demo_repo),
        # One small model keeps start-up short; static: nothing to poll.
        "INFERENCE_SERVER_MODELS_INCLUDE": "mlp",
        "INFERENCE_SERVER_MODEL_CONTROL_MODE": "static",
        "INFERENCE_SERVER_RUNTIME_CPU_DEVICE_MEMORY_BYTES": str(256 << 20),
        "KSERVE_TRIO_GATEWAY_LISTEN_GRPC": grpc,
        "KSERVE_TRIO_GATEWAY_LISTEN_METRICS": admin,
        "KSERVE_TRIO_SUPERVISOR_MAX_RESTARTS": "1",
    }
    healthcheck = image_command(df.healthcheck_argv())
    yield from run_image_process(
        "node",
        lambda proc: LiveNode(proc, grpc, admin, env, tmp / "node.log", healthcheck),
        image_command(df.entry_argv()),
        env,
        tmp,
        ready=lambda node: node.run_healthcheck().returncode == 0,
        timeout=300,
    )


class LiveGateway(LiveNode):
    """The fleet's gateway (the gateway Deployment's container: the CPU image's entrypoint in
    role gateway with deploy/k8s/base/config/gateway.yaml) in front of the live node, the
    headless Service name resolving to it through a hosts file."""


def _fleet_gateway_env() -> dict[str, str]:
    from tests.deploy.manifests import container_env, find, load_yaml_file

    (deployment,) = find(
        load_yaml_file(DEPLOY / "k8s" / "base" / "gateway-deployment.yaml"), "Deployment"
    )
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container_env(container)


@pytest.fixture(scope="session")
def live_gateway(live_node, tmp_path_factory) -> Iterator[LiveGateway]:
    df = parse_dockerfile(DOCKERFILES["cpu"])
    tmp = tmp_path_factory.mktemp("live-gateway")
    hosts = tmp / "hosts"
    hosts.write_text("127.0.0.1 kserve-trio-workers\n")
    grpc, admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    fleet = _fleet_gateway_env()
    assert fleet["KSERVE_TRIO_GATEWAY_FILE"] == "/etc/kserve_trio/gateway/gateway.yaml"
    worker_port = live_node.grpc.rsplit(":", 1)[1]
    env = {
        **os.environ,
        **{k: v for k, v in df.env().items() if k not in ("PATH", "HOME")},
        **fleet,
        "KSERVE_TRIO_NODE_FILE": str(ROOT / "deploy" / "container" / "node.yaml"),
        "KSERVE_TRIO_GATEWAY_FILE": str(DEPLOY / "k8s" / "base" / "config" / "gateway.yaml"),
        "KSERVE_TRIO_RUNTIME_DIR": str(tmp / "run"),
        # The file's endpoint, the headless Service's name, on the live worker's port.
        "KSERVE_TRIO_GATEWAY_WORKERS": f"kserve-trio-workers:{worker_port}",
        "KSERVE_TRIO_GATEWAY_HOSTS_FILE": str(hosts),
        "KSERVE_TRIO_GATEWAY_HEALTH_INTERVAL_SECONDS": "1",
        "KSERVE_TRIO_GATEWAY_LISTEN_GRPC": grpc,
        "KSERVE_TRIO_GATEWAY_LISTEN_METRICS": admin,
        "KSERVE_TRIO_SUPERVISOR_MAX_RESTARTS": "1",
    }
    healthcheck = image_command(df.healthcheck_argv())
    yield from run_image_process(
        "gateway",
        lambda proc: LiveGateway(proc, grpc, admin, env, tmp / "gateway.log", healthcheck),
        image_command(df.entry_argv()),
        env,
        tmp,
        ready=lambda gw: gw.run_healthcheck().returncode == 0 and gw.get("/readyz")[0] == 200,
        timeout=120,
    )

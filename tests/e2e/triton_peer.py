"""A stock Triton server as a test peer: ``tritonserver`` from the ``nvidia-pytriton`` wheel.

``TritonPeer(workdir).start()`` serves ``tools/triton_peer/models`` (Python backend) on loopback
ports and returns once ``/v2/health/ready`` answers, or raises ``PeerStartError`` with the log
tail (bounded by ``timeout``, 60 s by default); ``stop()`` sends SIGTERM (SIGKILL after a grace
period), then unlinks any POSIX shared-memory object the Python backend left behind under its
unique prefix. How the binary is run here:

1. The server lives in its own virtual environment, ``.venv-triton`` (or
   ``KSERVE_TRIO_TRITON_VENV``), made by ``tools/dev.sh test``: its ``tritonclient`` pin must not
   reach ``.venv``.
2. The Python backend looks for ``triton_python_backend_stub`` in its own backend folder: the
   backend and the stub for this Python version are copied to ``workdir/backends/python``.
3. The stub embeds libpython and finds its prefix through ``python3`` on ``PATH``: the triton
   venv's ``bin`` goes first on ``PATH`` and the base interpreter's ``LIBDIR`` first on
   ``LD_LIBRARY_PATH`` (then the wheel's bundled libraries).
A peer that cannot start is an error, never a skip: the interoperability test must fail.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid

from tests.ports import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODELS = ROOT / "tools" / "triton_peer" / "models"
ENV_VENV = "KSERVE_TRIO_TRITON_VENV"
START_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0


class PeerStartError(RuntimeError):
    """The Triton peer could not be started (the message says why, with the log tail)."""


def triton_venv() -> pathlib.Path:
    """The virtual environment holding ``nvidia-pytriton`` (``PeerStartError`` if absent)."""
    venv = pathlib.Path(os.environ.get(ENV_VENV) or ROOT / ".venv-triton")
    if not (venv / "bin" / "python").exists():
        raise PeerStartError(
            f"no Triton virtual environment at {venv}: run 'tools/dev.sh test' (it creates "
            f".venv-triton with nvidia-pytriton==0.7.0) or set {ENV_VENV}"
        )
    return venv


def _site_packages(venv: pathlib.Path) -> pathlib.Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        raise PeerStartError(f"{venv} has no lib/python3*/site-packages")
    return found[0]


def _query(python: pathlib.Path, expr: str) -> str:
    return subprocess.run(
        [str(python), "-c", f"import sys, sysconfig; print({expr})"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()


class TritonPeer:
    """See the module docstring. ``grpc_address`` / ``http_url`` once started."""

    def __init__(self, workdir: pathlib.Path, models: pathlib.Path = MODELS) -> None:
        self.workdir = pathlib.Path(workdir)
        self.models = models
        self.shm_prefix = f"kt-peer-{uuid.uuid4().hex[:12]}-"
        self.grpc_port = self.http_port = self.metrics_port = 0
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / "tritonserver.log"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def _layout(self) -> tuple[list[str], dict[str, str]]:
        """The command line and environment (rules 1-3 of the module docstring)."""
        venv = triton_venv()
        site = _site_packages(venv)
        server = site / "pytriton" / "tritonserver"
        binary = server / "bin" / "tritonserver"
        python = venv / "bin" / "python"
        version = _query(python, "f'{sys.version_info[0]}.{sys.version_info[1]}'")
        stub = server / "python_backend_stubs" / version / "triton_python_backend_stub"
        for path in (binary, server / "backends" / "python", stub):
            if not path.exists():
                raise PeerStartError(f"the nvidia-pytriton wheel in {venv} lacks {path}")
        backend = self.workdir / "backends" / "python"
        backend.mkdir(parents=True, exist_ok=True)
        for item in (server / "backends" / "python").iterdir():
            if item.is_file():
                shutil.copy2(item, backend / item.name)
        shutil.copy2(stub, backend / stub.name)
        libdir = _query(python, "sysconfig.get_config_var('LIBDIR')")
        env = dict(os.environ)
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        libs = [libdir, str(site / "nvidia_pytriton.libs"), env.get("LD_LIBRARY_PATH", "")]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in libs if p)
        env.pop("PYTHONPATH", None)
        self.grpc_port, self.http_port, self.metrics_port = (free_port() for _ in range(3))
        cmd = [
            str(binary),
            f"--model-repository={self.models}",
            f"--backend-directory={self.workdir / 'backends'}",
            "--grpc-address=127.0.0.1",
            f"--grpc-port={self.grpc_port}",
            "--http-address=127.0.0.1",
            f"--http-port={self.http_port}",
            "--metrics-address=127.0.0.1",
            f"--metrics-port={self.metrics_port}",
            "--allow-gpu-metrics=false",
            "--model-control-mode=explicit",
            "--load-model=*",
            "--strict-readiness=true",
            "--exit-on-error=true",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            "--backend-config=python,shm-default-byte-size=16777216",
        ]
        return cmd, env

    def start(self, timeout: float = START_TIMEOUT) -> TritonPeer:
        """Start and wait for readiness (``PeerStartError`` with the log tail otherwise)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd, env = self._layout()
        log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir
            )
        except OSError as exc:
            raise PeerStartError(f"cannot run {cmd[0]}: {exc}") from None
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.stop()
                raise PeerStartError(
                    f"tritonserver exited with status {self.proc.returncode} before it was "
                    f"ready; log tail:\n{tail}"
                )
            if self.ready():
                return self
            time.sleep(0.2)
        tail = self.log_tail()
        self.stop()
        raise PeerStartError(f"tritonserver was not ready within {timeout:.0f}s; log tail:\n{tail}")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def shm_objects(self) -> list[str]:
        """POSIX shared-memory objects under this peer's Python-backend prefix."""
        try:
            return sorted(n for n in os.listdir("/dev/shm") if n.startswith(self.shm_prefix))
        except FileNotFoundError:
            return []

    def stop(self, timeout: float = STOP_TIMEOUT) -> list[str]:
        """SIGTERM (SIGKILL after ``timeout``), then unlink the backend's leftovers; returns
        the names that had to be unlinked (empty after a clean shutdown)."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        leftovers = self.shm_objects()
        for name in leftovers:
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except FileNotFoundError:
                pass
        return leftovers

    def __enter__(self) -> TritonPeer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:  # pragma: no cover - a manual convenience
    import tempfile

    with (
        tempfile.TemporaryDirectory(prefix="triton-peer-") as tmp,
        TritonPeer(pathlib.Path(tmp)) as peer,
    ):
        print(f"Triton peer: grpc {peer.grpc_address}, http {peer.http_url}", flush=True)
        try:
            while peer.proc is not None and peer.proc.poll() is None:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    sys.exit(0)


if __name__ == "__main__":  # pragma: no cover
    main()

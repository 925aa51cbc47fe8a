"""Which devices a node has, and how many CPU threads it may use: pure rules, injectable probes.

Detection precedence (the first source that answers wins; ``detect_devices``):

1. ``KSERVE_TRIO_GPUS``: a bare integer is a count (``0`` = a CPU node), anything else a comma
   list of ordinals or GPU UUIDs; an empty value is an error (unset it instead);
2. the node's ``gpus:`` key (a count or a list; ``auto``, the default, falls through);
3. ``CUDA_VISIBLE_DEVICES`` as the container runtime set it (comma list; empty = no GPUs);
4. ``nvidia-smi --query-gpu=index --format=csv,noheader``;
5. ``/dev/nvidiaN`` device nodes (plain numeric ones only, numerically sorted);
6. none.

Sources 3 to 6 are the machine's own devices. They are consulted only for a node whose backend
is not ``cpu``: a CPU node on a GPU host must not grow one worker per GPU, so its worker count
comes from ``KSERVE_TRIO_CPU_WORKERS`` (default 1) unless sources 1 or 2 name devices
explicitly.

The machine is reached only through ``Machine`` (``Machine.system()`` in production, plain
lambdas in tests), and each probe runs only when the precedence reaches it.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kserve_trio.core.errors import ConfigError
from kserve_trio.core.process import ENV_PREFIX, node_gpus

GPUS_ENV = "KSERVE_TRIO_GPUS"
CPU_WORKERS_ENV = "KSERVE_TRIO_CPU_WORKERS"
BACKEND_ENV = ENV_PREFIX + "RUNTIME_BACKEND"

NO_GPUS_MESSAGE = (
    "no GPUs detected for a CUDA node; run the container with --gpus all, set "
    "KSERVE_TRIO_GPUS, or set global.runtime.backend: cpu"
)

_DEV_RE = re.compile(r"^nvidia(\d+)$")


@dataclass(frozen=True)
class Machine:
    """The probes of the machine the node runs on.

    ``nvidia_smi()`` returns the tool's output, or ``None`` when it is absent or fails;
    ``dev_names()`` lists ``/dev``; ``allowed_cpus()`` is this process's CPU affinity;
    ``cpu_quota()`` is the cgroup CPU limit in CPUs (``None`` = unlimited).
    """

    nvidia_smi: Callable[[], str | None]
    dev_names: Callable[[], Sequence[str]]
    allowed_cpus: Callable[[], Sequence[int]]
    cpu_quota: Callable[[], float | None]

    @staticmethod
    def system() -> Machine:
        return Machine(_run_nvidia_smi, _list_dev, _affinity, _cgroup_cpu_quota)


def _run_nvidia_smi() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=15,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _list_dev() -> list[str]:
    try:
        return os.listdir("/dev")
    except OSError:
        return []


def _affinity() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def _cgroup_cpu_quota(path: str = "/sys/fs/cgroup/cpu.max") -> float | None:
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    return parse_cpu_max(text)


def parse_cpu_max(text: str) -> float | None:
    """A cgroup v2 ``cpu.max`` (``"max 100000"`` or ``"200000 100000"``) as CPUs, or ``None``."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def parse_gpus_env(text: str) -> list[str]:
    """``KSERVE_TRIO_GPUS``: ``"2"`` -> ``["0", "1"]``, ``"0"`` -> ``[]``, ``"1,GPU-ab"`` ->
    ``["1", "GPU-ab"]``; empty or blank entries are a ConfigError."""
    value = text.strip()
    if not value:
        raise ConfigError(
            f"{GPUS_ENV} is empty; set a device count, a comma list of devices, or unset it"
        )
    if value.isdigit():
        return [str(i) for i in range(int(value))]
    parts = [p.strip() for p in value.split(",")]
    if any(not p for p in parts):
        raise ConfigError(f"{GPUS_ENV}={text!r} has an empty entry")
    return parts


def parse_visible_devices(text: str) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` as CUDA reads it: entries in order up to the first invalid one
    (a negative ordinal such as ``-1`` hides every device); empty = no GPUs."""
    out: list[str] = []
    for part in text.split(","):
        p = part.strip()
        if not p or p.startswith("-"):
            break
        out.append(p)
    return out


def parse_nvidia_smi(output: str) -> list[str]:
    """The ordinals ``nvidia-smi --query-gpu=index --format=csv,noheader`` printed."""
    return [line.strip() for line in output.splitlines() if line.strip().isdigit()]


def devfs_devices(names: Iterable[str]) -> list[str]:
    """Ordinals of plain ``/dev/nvidiaN`` nodes (not nvidiactl, nvidia-uvm...), sorted as
    numbers."""
    found = sorted({int(m.group(1)) for n in names if (m := _DEV_RE.match(n))})
    return [str(i) for i in found]


@dataclass(frozen=True)
class Detected:
    """The node's devices and where they came from (for the supervisor's start-up note)."""

    devices: tuple[str, ...]
    source: str


def detect_devices(
    node: Mapping[str, Any], env: Mapping[str, str], machine: Machine, *, auto_detect: bool
) -> Detected:
    """The node's devices by the module's precedence; ``auto_detect=False`` (a CPU node) stops
    after the two explicit sources."""
    if GPUS_ENV in env:
        return Detected(tuple(parse_gpus_env(env[GPUS_ENV])), GPUS_ENV)
    gpus = node_gpus(node)
    if isinstance(gpus, int):
        return Detected(tuple(str(i) for i in range(gpus)), "node gpus")
    if isinstance(gpus, list):
        return Detected(tuple(gpus), "node gpus")
    if not auto_detect:
        return Detected((), "cpu backend")
    if "CUDA_VISIBLE_DEVICES" in env:
        return Detected(
            tuple(parse_visible_devices(env["CUDA_VISIBLE_DEVICES"])), "CUDA_VISIBLE_DEVICES"
        )
    smi = machine.nvidia_smi()
    if smi is not None:
        found = parse_nvidia_smi(smi)
        if found:
            return Detected(tuple(found), "nvidia-smi")
    found = devfs_devices(machine.dev_names())
    if found:
        return Detected(tuple(found), "/dev/nvidia*")
    return Detected((), "none")


def node_backend(node: Mapping[str, Any], env: Mapping[str, str]) -> str:
    """``cpu`` or ``cuda``: ``INFERENCE_SERVER_RUNTIME_BACKEND``, else the node's
    ``global.runtime.backend``, else ``cpu`` (``gpu`` means ``cuda``)."""
    value: Any = env.get(BACKEND_ENV)
    if value is None:
        glob = node.get("global") or {}
        runtime = glob.get("runtime") if isinstance(glob, Mapping) else None
        value = runtime.get("backend", "cpu") if isinstance(runtime, Mapping) else "cpu"
    token = str(value).strip().lower()
    return "cuda" if token in ("cuda", "gpu") else token


def check_devices(backend: str, devices: Sequence[str]) -> None:
    """A CUDA node needs at least one device."""
    if backend != "cpu" and not devices:
        raise ConfigError(NO_GPUS_MESSAGE)


def cpu_workers(env: Mapping[str, str]) -> int:
    """``KSERVE_TRIO_CPU_WORKERS`` (default 1): how many workers a node without devices runs."""
    text = env.get(CPU_WORKERS_ENV, "").strip()
    if not text:
        return 1
    try:
        n = int(text)
    except ValueError:
        raise ConfigError(f"{CPU_WORKERS_ENV}={text!r} must be an integer >= 1") from None
    if n < 1:
        raise ConfigError(f"{CPU_WORKERS_ENV}={text!r} must be an integer >= 1")
    return n


def cpu_threads(allowed: Sequence[int], quota: float | None) -> int:
    """The CPU threads this node may use: its affinity, capped by a cgroup quota (rounded up)."""
    n = len(allowed)
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)


__all__ = [
    "CPU_WORKERS_ENV",
    "GPUS_ENV",
    "NO_GPUS_MESSAGE",
    "Detected",
    "Machine",
    "check_devices",
    "cpu_threads",
    "cpu_workers",
    "detect_devices",
    "devfs_devices",
    "node_backend",
    "parse_cpu_max",
    "parse_gpus_env",
    "parse_nvidia_smi",
    "parse_visible_devices",
]

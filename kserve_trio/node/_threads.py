"""Each worker's CPU thread budget, and the environment and affinity that enforce it (pure).

A node's workers share the machine's CPUs. Each gets ``T = clamp(cpu_threads // n_workers, 1,
16)`` compute threads (``KSERVE_TRIO_WORKER_THREADS`` overrides it, at least 1) plus the one
interactive thread its event loop runs on. Past 16 threads a worker's XLA and BLAS pools gain
little and cost memory and wake-ups, so the budget stops there.

The budget reaches the libraries through what they read at start-up:

- ``PJRT_NPROC``: the size of the XLA CPU client's intra-op (Eigen) thread pool. jaxlib 0.10
  reads it in ``DefaultThreadPoolSize()``; without it the pool has one thread per CPU in the
  process's affinity (checked by counting the ``XLAEigen`` threads of a running process);
- ``XLA_FLAGS`` gains ``--xla_cpu_multi_thread_eigen=false`` when ``T == 1`` (no pool to hand
  work to), kept out when the inherited flags already name it;
- ``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS``: numpy's BLAS and any
  OpenMP runtime.

CPU affinity, where it helps: with two or more workers whose budgets fit the node's CPUs side
by side, worker ``i`` is pinned to its own slice ``allowed[i*T:(i+1)*T]``, so their thread pools
do not contend for the same cores or migrate between them. A single worker, or budgets that do
not fit (an override larger than the machine), are not pinned. ``KSERVE_TRIO_WORKER_AFFINITY=off``
turns pinning off.

The embedded gateway's processes (``processes`` of its configuration) are sized from the same
budget: ``gateway_processes(cpu_threads, n_workers) = clamp(min(n_workers, cpu_threads // 4),
1, 8)``. One gateway process per worker: a worker's event loop does about as much protocol
work per request (HTTP/2 framing, protobuf decode and encode) as the gateway does for it, so
with one gateway process per worker the gateway is not the narrower stage. At most one per
four CPUs, so the workers' compute threads keep most of the machine (the gateway's processes
are not in their budget), and at most 8. The node's ``gateway:`` block (``processes: N``) or
``KSERVE_TRIO_GATEWAY_PROCESSES`` overrides it.

Each worker's front-end processes (``endpoints.frontend_processes``) come from its own budget:
``frontend_processes(T) = clamp(T - 1, 1, 8)``, the last of its cores for the device process
(its event loop and the device thread). So a worker with 2 cores or fewer serves its ports
itself (one front end in another process costs the channel and buys no core), and at most 8,
as for the gateway. A worker whose configuration or environment sets the key keeps its value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kserve_trio.core.errors import ConfigError

WORKER_THREADS_ENV = "KSERVE_TRIO_WORKER_THREADS"
AFFINITY_ENV = "KSERVE_TRIO_WORKER_AFFINITY"
MAX_WORKER_THREADS = 16
MAX_GATEWAY_PROCESSES = 8
MAX_FRONTEND_PROCESSES = 8
CPUS_PER_GATEWAY_PROCESS = 4
SINGLE_THREAD_XLA_FLAG = "--xla_cpu_multi_thread_eigen=false"
THREAD_ENV_VARS = ("PJRT_NPROC", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def thread_budget(cpu_threads: int, n_workers: int) -> int:
    """``clamp(cpu_threads // n_workers, 1, 16)``."""
    if n_workers < 1:
        raise ValueError("n_workers must be >= 1")
    return max(1, min(MAX_WORKER_THREADS, cpu_threads // n_workers))


def gateway_processes(cpu_threads: int, n_workers: int) -> int:
    """``clamp(min(n_workers, cpu_threads // 4), 1, 8)``: the embedded gateway's processes."""
    by_cpus = cpu_threads // CPUS_PER_GATEWAY_PROCESS
    return max(1, min(MAX_GATEWAY_PROCESSES, n_workers, by_cpus))


def frontend_processes(threads: int) -> int:
    """``clamp(threads - 1, 1, 8)``: a worker's front ends from its thread budget."""
    return max(1, min(MAX_FRONTEND_PROCESSES, threads - 1))


def worker_threads(cpu_threads: int, n_workers: int, env: Mapping[str, str]) -> int:
    """The budget, or ``KSERVE_TRIO_WORKER_THREADS`` verbatim (at least 1) when set."""
    text = env.get(WORKER_THREADS_ENV, "").strip()
    if not text:
        return thread_budget(cpu_threads, n_workers)
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{WORKER_THREADS_ENV}={text!r} must be an integer") from None
    return max(1, value)


def thread_env(threads: int, inherited_xla_flags: str = "") -> dict[str, str]:
    """The variables that carry a budget of ``threads`` to XLA, OpenMP and BLAS."""
    out = {var: str(threads) for var in THREAD_ENV_VARS}
    flags = inherited_xla_flags.split()
    if threads == 1:
        name = SINGLE_THREAD_XLA_FLAG.split("=")[0]
        if not any(f.split("=")[0] == name for f in flags):
            flags.append(SINGLE_THREAD_XLA_FLAG)
    if flags:
        out["XLA_FLAGS"] = " ".join(flags)
    return out


def affinity_mode(env: Mapping[str, str]) -> str:
    """``auto`` (default) or ``off``."""
    text = env.get(AFFINITY_ENV, "auto").strip().lower() or "auto"
    if text in ("off", "0", "false", "no"):
        return "off"
    if text in ("auto", "on", "1", "true", "yes"):
        return "auto"
    raise ConfigError(f"{AFFINITY_ENV}={text!r} must be 'auto' or 'off'")


def cpu_slices(
    allowed: Sequence[int], n_workers: int, threads: int, mode: str = "auto"
) -> list[tuple[int, ...] | None]:
    """Worker ``i``'s CPUs, or ``None`` (not pinned): disjoint slices of ``allowed`` when there
    are two or more workers and ``n_workers * threads`` CPUs are available."""
    cpus = sorted(allowed)
    if mode == "off" or n_workers < 2 or n_workers * threads > len(cpus):
        return [None] * n_workers
    return [tuple(cpus[i * threads : (i + 1) * threads]) for i in range(n_workers)]


def format_cpus(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the ``Cpus_allowed_list`` notation)."""
    out: list[str] = []
    values = sorted(cpus)
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(out)


def parse_cpus(text: str) -> tuple[int, ...]:
    """The inverse of ``format_cpus``."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(out)


__all__ = [
    "AFFINITY_ENV",
    "MAX_GATEWAY_PROCESSES",
    "MAX_WORKER_THREADS",
    "SINGLE_THREAD_XLA_FLAG",
    "THREAD_ENV_VARS",
    "WORKER_THREADS_ENV",
    "affinity_mode",
    "cpu_slices",
    "format_cpus",
    "gateway_processes",
    "parse_cpus",
    "thread_budget",
    "thread_env",
    "worker_threads",
]

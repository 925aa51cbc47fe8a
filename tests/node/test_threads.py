"""The per-worker thread budget, its environment and the CPU slices."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kserve_trio.core.errors import ConfigError
from kserve_trio.node._threads import (
    affinity_mode,
    cpu_slices,
    format_cpus,
    parse_cpus,
    thread_budget,
    thread_env,
    worker_threads,
)


@pytest.mark.parametrize(
    ("cpu_threads", "n_workers", "expected"),
    [(32, 2, 16), (64, 2, 16), (16, 2, 8), (8, 1, 8), (100, 1, 16), (1, 4, 1)],
)
def test_budget_table(cpu_threads, n_workers, expected):
    assert thread_budget(cpu_threads, n_workers) == expected


def test_budget_rounds_down_and_never_reaches_zero():
    assert thread_budget(7, 2) == 3
    assert thread_budget(3, 8) == 1
    with pytest.raises(ValueError):
        thread_budget(8, 0)


def test_override_is_verbatim_with_a_floor_of_one():
    assert worker_threads(2, 2, {"KSERVE_TRIO_WORKER_THREADS": "24"}) == 24
    assert worker_threads(64, 2, {"KSERVE_TRIO_WORKER_THREADS": "0"}) == 1
    assert worker_threads(64, 2, {"KSERVE_TRIO_WORKER_THREADS": " "}) == 16
    assert worker_threads(64, 2, {}) == 16
    with pytest.raises(ConfigError, match="KSERVE_TRIO_WORKER_THREADS"):
        worker_threads(64, 2, {"KSERVE_TRIO_WORKER_THREADS": "many"})


def test_thread_env_sizes_xla_openmp_and_blas():
    env = thread_env(8)
    assert env == {
        "PJRT_NPROC": "8",
        "OMP_NUM_THREADS": "8",
        "OPENBLAS_NUM_THREADS": "8",
        "MKL_NUM_THREADS": "8",
    }


def test_one_thread_turns_off_eigen_multithreading_keeping_inherited_flags():
    env = thread_env(1, "--xla_dump_to=/tmp/x")
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_cpu_multi_thread_eigen=false"
    assert env["PJRT_NPROC"] == "1"
    # a flag the operator set is theirs
    env = thread_env(1, "--xla_cpu_multi_thread_eigen=true")
    assert env["XLA_FLAGS"] == "--xla_cpu_multi_thread_eigen=true"
    # inherited flags pass through unchanged at larger budgets
    assert thread_env(4, "--xla_dump_to=/tmp/x")["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"


def test_slices_are_disjoint_when_they_fit():
    assert cpu_slices([0, 1, 2, 3], 2, 2) == [(0, 1), (2, 3)]
    assert cpu_slices([5, 3, 4, 6], 2, 1) == [(3,), (4,)]
    assert cpu_slices([0, 1], 2, 1) == [(0,), (1,)]


def test_no_pinning_for_one_worker_an_oversized_budget_or_off():
    assert cpu_slices([0, 1, 2, 3], 1, 4) == [None]
    assert cpu_slices([0, 1], 2, 2) == [None, None]
    assert cpu_slices([0, 1, 2, 3], 2, 2, "off") == [None, None]


def test_affinity_mode_parsing():
    assert affinity_mode({}) == "auto"
    assert affinity_mode({"KSERVE_TRIO_WORKER_AFFINITY": "OFF"}) == "off"
    assert affinity_mode({"KSERVE_TRIO_WORKER_AFFINITY": "0"}) == "off"
    with pytest.raises(ConfigError, match="KSERVE_TRIO_WORKER_AFFINITY"):
        affinity_mode({"KSERVE_TRIO_WORKER_AFFINITY": "sometimes"})


def test_cpu_list_notation_round_trips():
    assert format_cpus([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert format_cpus([3]) == "3"
    assert parse_cpus("0-2,5,7-8") == (0, 1, 2, 5, 7, 8)
    assert parse_cpus(format_cpus(range(16, 32))) == tuple(range(16, 32))


_COUNT_EIGEN_THREADS = """
import os
import jax, jax.numpy as jnp
x = jnp.ones((64, 64)); (x @ x).block_until_ready()
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(names.count("tf_XLAEigen"))
"""


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 3])
def test_jaxlib_sizes_its_cpu_thread_pool_from_the_budget_env(threads):
    """The mechanism the budget relies on: jaxlib's CPU client reads PJRT_NPROC (here even
    above the CPUs this process may use)."""
    env = {**os.environ, **thread_env(threads), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", _COUNT_EIGEN_THREADS],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    assert int(out.stdout.strip().splitlines()[-1]) == threads


def test_the_embedded_gateway_gets_one_process_per_worker_at_most_one_per_4_cpus():
    from kserve_trio.node._threads import gateway_processes

    assert gateway_processes(2, 2) == 1  # a small machine: one process
    assert gateway_processes(16, 2) == 2  # one per worker
    assert gateway_processes(16, 8) == 4  # at most one per 4 CPUs
    assert gateway_processes(128, 16) == 8  # at most 8
    assert gateway_processes(64, 1) == 1

"""Test-suite wiring: the ``slow`` and ``gpu`` markers, and one compilation cache.

``pytest`` alone skips slow tests (fast local loop); ``pytest --run-slow`` (what CI runs through
``tools/dev.sh test``) runs everything. ``gpu`` tests are skipped when no CUDA device exists.

Every test has a time bound of its own (pytest-timeout, fixtures' set-up included), so one that
hangs fails naming itself instead of stalling the run: ``SLOW_TEST_SECONDS`` for a ``slow``
test, ``FAST_TEST_SECONDS`` for the rest, unless the test states its own
(``@pytest.mark.timeout(N)``). The bounds are several times the slowest test of each tier on the
2-core machine the suite is measured on (docs/benchmarks.md, "Test suite"); they catch hangs, they
measure nothing.

Every worker the suite starts (in process or as a CLI subprocess, which inherits the
environment) compiles the same demo bundles: JAX's persistent compilation cache, shared by the
whole suite in ``.cache/jax-tests`` (git-ignored), compiles each module once per machine instead
of once per worker. A test that configures its own ``cache_dir`` still gets its own (the
worker's setting replaces the environment's).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import structlog

_REPO = pathlib.Path(__file__).resolve().parent.parent
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_REPO / ".cache" / "jax-tests"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

# Tests capture info and debug events (structlog.testing.capture_logs keeps the configured
# level filter), so the suite logs every level; the library's own default is warnings only.
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(0))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="run slow tests too")


SLOW_TEST_SECONDS = 180
FAST_TEST_SECONDS = 60


def _has_gpu() -> bool:
    import shutil

    return shutil.which("nvidia-smi") is not None


LONGEST_FILES_FIRST = (
    "tests/e2e/test_frontend_processes.py",
    "tests/gateway/test_processes.py",
    "tests/edge/test_every_process_kind.py",
    "tests/node/test_node_e2e.py",
    "tests/gateway/test_frozen_fleet_e2e.py",
    "tests/export/test_torch_frontend.py",
    "tests/edge/test_memory_gateway.py",
    "tests/e2e/test_torch_export.py",
    "tests/e2e/test_tracing_e2e.py",
    "tests/gateway/test_tracing.py",
    "tests/edge/test_h2_server.py",
    "tests/client/test_worker_e2e.py",
    "tests/serving/grpc/conformance/test_conformance.py",
    "tests/edge/test_memory_connections.py",
    "tests/e2e/test_event_loops.py",
    "tests/worker/test_tracing.py",
    "tests/gateway/test_e2e.py",
    "tests/edge/test_memory_process.py",
    "tests/edge/test_connections_http.py",
    "tests/e2e/test_compression_e2e.py",
)
"""The suite's longest files, longest first, are handed out before all others. pytest-xdist's
``--dist loadfile --no-loadscope-reorder`` (``tools/dev.sh test``) gives each test process a
whole file at a time in collection order, so a long file collected late ran alone at the end
while the other processes had nothing left to do (without ``--no-loadscope-reorder`` xdist
hands out the files with the most tests first, whatever this order says). Measured with
``--durations=0`` on the quiet 2-core machine; a file missing here only costs the run some of
its overlap, never a result."""


def _longest_first(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES_FIRST)}

    def key(indexed: tuple[int, pytest.Item]) -> tuple[int, int]:
        index, item = indexed
        path = pathlib.Path(str(item.path)).resolve().relative_to(_REPO).as_posix()
        return (rank.get(path, len(rank)), index)

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _longest_first(items)
    run_slow = config.getoption("--run-slow")
    gpu = None
    for item in items:
        if item.get_closest_marker("timeout") is None:
            bound = SLOW_TEST_SECONDS if "slow" in item.keywords else FAST_TEST_SECONDS
            item.add_marker(pytest.mark.timeout(bound))
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow test: run with --run-slow"))
        if "gpu" in item.keywords:
            if gpu is None:
                gpu = _has_gpu()
            if not gpu:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)"))


@pytest.fixture(scope="session")
def demo_repo(tmp_path_factory) -> pathlib.Path:
    """The demo model repository written by ``python -m kserve_trio bundle demo``."""
    repo = tmp_path_factory.mktemp("demo") / "models"
    subprocess.run(
        [sys.executable, "-m", "kserve_trio", "bundle", "demo", str(repo)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return repo


@pytest.fixture(scope="session")
def demo_worker(demo_repo):
    """One in-process worker serving the demo repository (static mode, a free port), shared by
    the test modules that only send it requests: such a module must leave what it serves and
    how unchanged (no registrations kept, no settings changed). It saves each of them a worker
    start with its compilations."""
    from kserve_trio.worker.server import serve, stop

    running = serve(
        None,
        blocking=False,
        model_dirs=[str(demo_repo)],
        model_control_mode="static",
        endpoints={"port": 0},
    )
    yield running
    stop(running)


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """Tests run on asyncio unless their module parametrizes ``anyio_backend`` itself (the
    servers and the client run on trio too: tests/serving/grpc, tests/e2e/test_event_loops.py)."""
    return "asyncio"


@pytest.fixture(autouse=True, scope="module")
def _fresh_client_state_per_module():
    """The client's process-wide state (its ``kserve_init`` settings, pools, routes and loop
    thread) never crosses from one test module to the next, whatever order the modules run in:
    the suite's processes take test files in any order, and a module that leaves a small pool
    or a dead server's routes behind must not change what the next one measures.
    ``kserve_init()`` restores the default settings and shuts the state down."""
    from kserve_trio.client import kserve_init

    kserve_init()
    yield
    kserve_init()


@pytest.fixture(autouse=True)
def _restore_logging_configuration():
    """A test that reconfigures structlog (a CLI entry point, a log-settings test, a gateway's
    logging block) must not change what later tests capture: put the configuration back."""
    from kserve_trio.core import logging as klog

    saved = structlog.get_config()
    saved_state = dict(klog._state)
    yield
    structlog.configure(**saved)
    klog._state.clear()
    klog._state.update(saved_state)

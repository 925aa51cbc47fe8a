"""Real nodes: the supervisor running real workers on the demo repository, driven by
tritonclient. The two-worker node's tests run in order on one node: serving, its threads as
seen from outside, a worker killed and restarted, and finally SIGTERM stopping the tree."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.e2e import reference as ref
from tests.node.conftest import (
    ROOT,
    NodeProcess,
    alive,
    children_of,
    free_ports,
    processes_with_env,
    wait_ready,
    write_node,
)

pytestmark = pytest.mark.slow


def infer_mlp(url: str, repo: Path, rows: int = 3, seed: int = 0) -> None:
    """One mlp inference through tritonclient, checked against the numpy reference."""
    x = np.random.default_rng(seed).standard_normal((rows, 16), dtype=np.float32)
    inp = grpcclient.InferInput("input_0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = grpcclient.InferenceServerClient(url).infer("mlp", [inp])
    np.testing.assert_allclose(
        result.as_numpy("output"), ref.mlp(x, ref.weights(repo, "mlp")), rtol=1e-5, atol=1e-5
    )


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def cpus_allowed(pid: int) -> str:
    status = Path(f"/proc/{pid}/status").read_text()
    return re.search(r"^Cpus_allowed_list:\s*(\S+)$", status, re.M).group(1)


def thread_names(pid: int) -> list[str]:
    names = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:
            pass
    return names


# --- a CPU node with two workers (role workers) --------------------------------------------------


@pytest.fixture(scope="module")
def two_workers(demo_repo, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("node2")
    base = free_ports(2)
    node_file = write_node(tmp, demo_repo, base)
    env = {"KSERVE_TRIO_CPU_WORKERS": "2", "KSERVE_TRIO_WORKER_THREADS": "1"}
    node = NodeProcess(tmp, ["--node", str(node_file), "--role", "workers"], env)
    try:
        for port in (base, base + 1):
            wait_ready(f"127.0.0.1:{port}", node=node)
        yield node, base
    finally:
        node.close()


def test_both_cpu_workers_serve(two_workers, demo_repo):
    node, base = two_workers
    for i, port in enumerate((base, base + 1)):
        infer_mlp(f"127.0.0.1:{port}", demo_repo, rows=1 + i, seed=i)
    text = node.text()
    assert "[supervisor] role=workers children=worker0, worker1" in text
    assert "[supervisor] CPU node: 2 worker(s)" in text
    # worker lines are prefixed structlog JSON
    assert re.search(r'^\[worker1\] \{.*"event": "server_up"', text, re.M)


def test_each_worker_has_its_thread_budget_cpu_and_no_device(two_workers):
    node, _ = two_workers
    pids = node.pids()
    allowed = sorted(os.sched_getaffinity(0))
    assert len(allowed) >= 2, "the machine needs two CPUs for two pinned workers"
    for i, name in enumerate(("worker0", "worker1")):
        env = environ_of(pids[name])
        assert env["KSERVE_TRIO_WORKER_NAME"] == name
        assert env["CUDA_VISIBLE_DEVICES"] == ""
        for var in ("PJRT_NPROC", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            assert env[var] == "1"
        assert "--xla_cpu_multi_thread_eigen=false" in env["XLA_FLAGS"].split()
        assert cpus_allowed(pids[name]) == str(allowed[i])
        # XLA's CPU client sized its intra-op pool from the budget
        assert thread_names(pids[name]).count("tf_XLAEigen") == 1


def test_a_killed_worker_is_restarted_while_the_other_keeps_serving(two_workers, demo_repo):
    node, base = two_workers
    victim = node.pids()["worker0"]
    mark = len(node.text())
    results = {"ok": 0, "failed": []}
    stop = threading.Event()

    def closed_loop() -> None:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{base + 1}")
        x = np.ones((2, 16), dtype=np.float32)
        while not stop.is_set():
            inp = grpcclient.InferInput("input_0", [2, 16], "FP32")
            inp.set_data_from_numpy(x)
            try:
                client.infer("mlp", [inp])
                results["ok"] += 1
            except Exception as exc:
                results["failed"].append(repr(exc))

    loop = threading.Thread(target=closed_loop)
    loop.start()
    try:
        time.sleep(0.5)
        os.kill(victim, signal.SIGKILL)
        exited = node.wait_for(
            r"^\[supervisor\] worker0 exited \(code=none, signal=SIGKILL, uptime=", after=mark
        )
        node.wait_for(r"^\[supervisor\] restarting worker0 in 1s$", after=exited.end())
        restarted = node.wait_for(
            r"^\[supervisor\] started worker0 \(pid (\d+)\)$", after=exited.end()
        )
        assert int(restarted.group(1)) != victim
        assert not alive(victim)
        wait_ready(f"127.0.0.1:{base}", node=node)
    finally:
        stop.set()
        loop.join()
    assert results["failed"] == []
    assert results["ok"] > 10
    infer_mlp(f"127.0.0.1:{base}", demo_repo, rows=4, seed=7)


def test_sigterm_stops_the_whole_tree_within_the_graces(two_workers):
    node, _ = two_workers
    pids = node.pids()
    assert all(alive(p) for p in pids.values())
    assert sorted(children_of(node.proc.pid)) == sorted(pids.values())
    started = time.monotonic()
    node.proc.send_signal(signal.SIGTERM)
    assert node.proc.wait(timeout=30) == 0
    assert time.monotonic() - started < 15.0  # the workers' grace
    text = node.text()
    assert "[supervisor] received shutdown signal (SIGTERM)" in text
    assert "did not exit within" not in text  # workers stop on SIGTERM, no SIGKILL needed
    assert text.rstrip().endswith("[supervisor] node stopped (exit 0)")
    assert not any(alive(p) for p in pids.values())
    assert processes_with_env(node.marker) == []


# --- the crash-loop budget ------------------------------------------------------------------------


def test_a_worker_whose_port_is_taken_exhausts_the_budget_and_the_node_exits_1(
    demo_repo, tmp_path, start_node
):
    port = free_ports(1)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        node_file = write_node(tmp_path, demo_repo, port)
        env = {"KSERVE_TRIO_SUPERVISOR_MAX_RESTARTS": "1"}
        node = start_node(["--node", str(node_file), "--role", "workers"], env)
        assert node.proc.wait(timeout=240) == 1
    text = node.text()
    assert text.count("[supervisor] started worker0") == 2
    assert "[supervisor] restarting worker0 in 1s" in text
    assert "[supervisor] worker0 failed 2 consecutive times (max 1); shutting the node down" in text
    assert text.rstrip().endswith("[supervisor] node stopped (exit 1)")
    assert re.search(r"^\[worker0\] .*(address already in use|Errno 98)", text, re.M | re.I)


# --- a single-worker node (role all) -------------------------------------------------------------


def test_a_single_worker_serves_the_public_ports_itself_without_a_gateway(
    demo_repo, tmp_path, start_node
):
    base = free_ports(1)
    public = free_ports(2)
    node_file = write_node(tmp_path, demo_repo, base)
    env = {
        "KSERVE_TRIO_GATEWAY_LISTEN_GRPC": f"127.0.0.1:{public}",
        "KSERVE_TRIO_GATEWAY_LISTEN_METRICS": f"127.0.0.1:{public + 1}",
    }
    node = start_node(["--node", str(node_file)], env)
    wait_ready(f"127.0.0.1:{public}", node=node)
    infer_mlp(f"127.0.0.1:{public}", demo_repo, rows=5)
    with urllib.request.urlopen(f"http://127.0.0.1:{public + 1}/metrics", timeout=10) as r:
        assert r.status == 200
    text = node.text()
    assert "[supervisor] role=all children=worker0" in text
    assert (
        f"[supervisor] single worker: serving directly on 127.0.0.1:{public} (gRPC) / "
        f"127.0.0.1:{public + 1} (metrics); no gateway" in text
    )
    assert "gateway" not in node.pids()
    worker = node.pids()["worker0"]
    assert children_of(node.proc.pid) == [worker]
    cmdline = Path(f"/proc/{worker}/cmdline").read_bytes().split(b"\0")
    assert cmdline[1:4] == [b"-m", b"kserve_trio", b"worker"]
    with socket.socket() as s:  # the node's own base port stays unused
        s.bind(("127.0.0.1", base))

    probe = subprocess.run(
        [sys.executable, "-m", "kserve_trio", "probe", "--node", str(node_file)],
        capture_output=True,
        text=True,
        env=node.env,
        cwd=ROOT,
        timeout=60,
    )
    assert probe.returncode == 0, probe.stdout + probe.stderr
    assert probe.stdout.strip() == f"ready: 127.0.0.1:{public}"

    assert node.stop() == 0
    assert not alive(worker)
    assert processes_with_env(node.marker) == []

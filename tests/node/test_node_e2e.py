"""Real nodes: the supervisor running real workers on the demo repository, driven by
tritonclient. Each two-worker node's tests run in order on one node: serving, its threads as
seen from outside (role workers) or its public port and healthcheck (role all, through the
embedded gateway), a worker killed and restarted, and finally SIGTERM stopping the tree."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.e2e import reference as ref
from tests.node.conftest import (
    ROOT,
    NodeProcess,
    alive,
    children_of,
    processes_with_env,
    wait_ready,
    write_node,
)
from tests.ports import free_ports
from tests.waiting import wait_until

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
        wait_until(lambda: results["ok"] > 0, 30, "the load served")
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


# --- a CPU node with two workers behind the embedded gateway (role all) --------------------------


def worker_successes(port: int) -> int:
    """Requests the worker on ``port`` itself says it served (its own statistics)."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    stats = client.get_inference_statistics("mlp", as_json=True)["model_stats"][0]
    return int(stats["inference_stats"].get("success", {}).get("count", 0))


def worker_regions(port: int) -> set[str]:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    return set(client.get_system_shared_memory_status(as_json=True).get("regions", {}))


def run_probe(node: NodeProcess, node_file: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kserve_trio", "probe", "--node", str(node_file), *args],
        capture_output=True,
        text=True,
        env=node.env,
        cwd=ROOT,
        timeout=60,
    )


@pytest.fixture(scope="module")
def gateway_node(demo_repo, tmp_path_factory):
    """Role ``all`` (the default) with two CPU workers: the supervisor runs the workers and the
    embedded gateway, which alone listens on the public gRPC and metrics ports."""
    tmp = tmp_path_factory.mktemp("node_all")
    base = free_ports(6)  # workers, their metrics, the public gRPC and metrics ports
    public, public_metrics = base + 4, base + 5
    node_file = write_node(tmp, demo_repo, base, f"metrics_base_port: {base + 2}\n")
    env = {
        "KSERVE_TRIO_CPU_WORKERS": "2",
        "KSERVE_TRIO_WORKER_THREADS": "1",
        "KSERVE_TRIO_GATEWAY_LISTEN_GRPC": f"127.0.0.1:{public}",
        "KSERVE_TRIO_GATEWAY_LISTEN_METRICS": f"127.0.0.1:{public_metrics}",
        "KSERVE_TRIO_GATEWAY_HEALTH_INTERVAL_SECONDS": "1",
    }
    node = NodeProcess(tmp, ["--node", str(node_file)], env)
    try:
        wait_ready(f"127.0.0.1:{public}", node=node)
        for name in ("worker0", "worker1"):  # the gateway routes to both
            node.wait_for(rf'^\[gateway\] \{{"worker": "{name}", .*"event": "worker_ready"')
        yield types.SimpleNamespace(
            node=node,
            node_file=node_file,
            repo=demo_repo,
            public=public,
            public_metrics=public_metrics,
            workers=(base, base + 1),
        )
    finally:
        node.close()


def test_two_workers_serve_through_the_embedded_gateway_on_one_public_port(gateway_node):
    g = gateway_node
    url = f"127.0.0.1:{g.public}"
    before = [worker_successes(p) for p in g.workers]
    for i in range(8):
        infer_mlp(url, g.repo, rows=1 + i % 4, seed=i)
    after = [worker_successes(p) for p in g.workers]
    assert [a - b for a, b in zip(after, before, strict=True)] == [4, 4]  # round robin
    client = grpcclient.InferenceServerClient(url)
    assert client.get_server_metadata(as_json=True)["name"] == "kserve_trio"
    total = client.get_inference_statistics("mlp", as_json=True)["model_stats"][0]
    assert int(total["inference_stats"]["success"]["count"]) == sum(after)  # summed over both

    text = g.node.text()
    assert "[supervisor] role=all children=worker0, worker1, gateway" in text
    assert (
        f"[supervisor] embedded gateway on 127.0.0.1:{g.public} (configured from the environment)"
        in text
    )
    assert re.search(
        rf'^\[gateway\] \{{"address": "127.0.0.1:{g.public}", .*"gateway_up"', text, re.M
    )
    pids = g.node.pids()
    assert sorted(pids) == ["gateway", "worker0", "worker1"]
    assert sorted(children_of(g.node.proc.pid)) == sorted(pids.values())
    cmdline = Path(f"/proc/{pids['gateway']}/cmdline").read_bytes().split(b"\0")
    assert cmdline[1:4] == [b"-m", b"kserve_trio", b"gateway"]
    env = environ_of(pids["gateway"])
    assert env["KSERVE_TRIO_GATEWAY_WORKERS"] == ",".join(f"127.0.0.1:{p}" for p in g.workers)
    assert env["KSERVE_TRIO_GATEWAY_WORKER_NAMES"] == "worker0,worker1"
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    with urllib.request.urlopen(f"http://127.0.0.1:{g.public_metrics}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    for name in ("worker0", "worker1"):  # each worker's own exposition merged in
        assert f'gateway_worker_metrics_up{{worker="{name}"}} 1.0' in metrics


def test_shared_memory_registered_through_the_public_port_works_on_both_workers(gateway_node):
    g = gateway_node
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{g.public}")
    x = np.random.default_rng(3).standard_normal((2, 16), dtype=np.float32)
    expected = ref.mlp(x, ref.weights(g.repo, "mlp"))
    out_bytes = 2 * 8 * 4
    h_in = shm.create_shared_memory_region("node_all_in", "/node_all_in", x.nbytes)
    h_out = shm.create_shared_memory_region("node_all_out", "/node_all_out", out_bytes)
    try:
        shm.set_shared_memory_region(h_in, [x])
        client.register_system_shared_memory("node_all_in", "/node_all_in", x.nbytes)
        client.register_system_shared_memory("node_all_out", "/node_all_out", out_bytes)
        for port in g.workers:  # the gateway registered them on every worker
            assert {"node_all_in", "node_all_out"} <= worker_regions(port)
        before = [worker_successes(p) for p in g.workers]
        for _ in range(4):
            inp = grpcclient.InferInput("input_0", [2, 16], "FP32")
            inp.set_shared_memory("node_all_in", x.nbytes)
            out = grpcclient.InferRequestedOutput("output")
            out.set_shared_memory("node_all_out", out_bytes)
            client.infer("mlp", [inp], outputs=[out])
            y = shm.get_contents_as_numpy(h_out, np.float32, [2, 8])
            np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
        after = [worker_successes(p) for p in g.workers]
        assert [a - b for a, b in zip(after, before, strict=True)] == [2, 2]
        client.unregister_system_shared_memory("node_all_in")
        client.unregister_system_shared_memory("node_all_out")
        for port in g.workers:
            assert not {"node_all_in", "node_all_out"} & worker_regions(port)
    finally:
        shm.destroy_shared_memory_region(h_in)
        shm.destroy_shared_memory_region(h_out)


def test_probe_asks_the_embedded_gateway_on_the_public_port(gateway_node):
    g = gateway_node
    probe = run_probe(g.node, g.node_file)
    assert probe.returncode == 0, probe.stdout + probe.stderr
    assert probe.stdout.strip() == f"ready: 127.0.0.1:{g.public}"
    probe = run_probe(g.node, g.node_file, "--worker", "worker1")
    assert probe.returncode == 0, probe.stdout + probe.stderr
    assert probe.stdout.strip() == f"ready: 127.0.0.1:{g.workers[1]}"


def test_a_killed_worker_behind_the_gateway_restarts_and_its_shm_registrations_come_back(
    gateway_node,
):
    g = gateway_node
    node, url = g.node, f"127.0.0.1:{g.public}"
    x = np.random.default_rng(5).standard_normal((1, 16), dtype=np.float32)
    expected = ref.mlp(x, ref.weights(g.repo, "mlp"))
    h_in = shm.create_shared_memory_region("node_kill_in", "/node_kill_in", x.nbytes)
    shm.set_shared_memory_region(h_in, [x])
    pids = node.pids()
    victim = pids["worker0"]
    mark = len(node.text())
    results: list[tuple[float, str | None]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def closed_loop(use_shm: bool) -> None:
        client = grpcclient.InferenceServerClient(url)
        while not stop.is_set():
            inp = grpcclient.InferInput("input_0", [1, 16], "FP32")
            if use_shm:  # the region registered before the kill
                inp.set_shared_memory("node_kill_in", x.nbytes)
            else:
                inp.set_data_from_numpy(x)
            try:
                y = client.infer("mlp", [inp]).as_numpy("output")
                outcome = None if np.allclose(y, expected, rtol=1e-5, atol=1e-5) else "wrong"
            except InferenceServerException as exc:
                outcome = exc.status()
            with lock:
                results.append((time.monotonic(), outcome))

    loops = [threading.Thread(target=closed_loop, args=(i % 2 == 0,)) for i in range(4)]
    try:
        grpcclient.InferenceServerClient(url).register_system_shared_memory(
            "node_kill_in", "/node_kill_in", x.nbytes
        )
        for t in loops:
            t.start()
        wait_until(lambda: worker_successes(g.workers[0]) >= 20, 30, "worker0 serving the load")
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        exited = node.wait_for(
            r"^\[supervisor\] worker0 exited \(code=none, signal=SIGKILL, uptime=", after=mark
        )
        node.wait_for(r"^\[supervisor\] restarting worker0 in 1s$", after=exited.end())
        restarted = node.wait_for(
            r"^\[supervisor\] started worker0 \(pid (\d+)\)$", after=exited.end()
        )
        respawned = time.monotonic()
        assert int(restarted.group(1)) != victim
        assert not alive(victim)
        wait_ready(f"127.0.0.1:{g.workers[0]}", node=node)
        ready = time.monotonic()
        back = wait_until(  # the new process counts from zero
            lambda: worker_successes(g.workers[0]) > 0 and time.monotonic(),
            30,
            "the restarted worker0 served through the gateway",
        )
        # the load runs on until the new worker0 has served some of it
        again = worker_successes(g.workers[0]) + 20
        wait_until(lambda: worker_successes(g.workers[0]) >= again, 30, "worker0 back")
    finally:
        stop.set()
        for t in loops:
            t.join(30)
    try:
        failures = [s for _, s in results if s is not None]
        assert all(s == "StatusCode.UNAVAILABLE" for s in failures), failures
        assert len(failures) <= len(loops)  # at most the requests in flight on the killed worker
        while_down = [t for t, s in results if s is None and killed < t < ready]
        assert len(while_down) > 20  # worker1 kept serving through the public port
        print(
            f"\nrole all, kill -9 worker0: respawned after {respawned - killed:.1f}s, ready after "
            f"{ready - killed:.1f}s, routed after {back - killed:.1f}s; {len(results)} requests, "
            f"{len(while_down)} served while it was down, {len(failures)} UNAVAILABLE"
        )
        assert "node_kill_in" in worker_regions(g.workers[0])  # replayed by the gateway
        assert re.compile(
            r'^\[gateway\] \{"worker": "worker0", "region": "node_kill_in", '
            r'"event": "shm_(region_replayed|replayed_after_worker_lost_them)"',
            re.M,
        ).search(node.text(), mark)
        served = worker_successes(g.workers[0])
        client = grpcclient.InferenceServerClient(url)
        for _ in range(6):
            inp = grpcclient.InferInput("input_0", [1, 16], "FP32")
            inp.set_shared_memory("node_kill_in", x.nbytes)
            y = client.infer("mlp", [inp]).as_numpy("output")
            np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
        assert worker_successes(g.workers[0]) == served + 3  # half of them on the new worker0
        now = node.pids()
        assert now["worker1"] == pids["worker1"] and now["gateway"] == pids["gateway"]
        assert node.text().count("[supervisor] started gateway") == 1
    finally:
        try:
            grpcclient.InferenceServerClient(url).unregister_system_shared_memory("node_kill_in")
        finally:
            shm.destroy_shared_memory_region(h_in)


def test_sigterm_stops_the_workers_and_the_embedded_gateway(gateway_node):
    g = gateway_node
    node = g.node
    pids = node.pids()
    assert all(alive(p) for p in pids.values())
    assert sorted(children_of(node.proc.pid)) == sorted(pids.values())
    started = time.monotonic()
    node.proc.send_signal(signal.SIGTERM)
    assert node.proc.wait(timeout=30) == 0
    assert time.monotonic() - started < 15.0  # the workers' grace
    text = node.text()
    assert "did not exit within" not in text
    assert re.search(r"^\[supervisor\] gateway exited \(code=0, signal=none, ", text, re.M)
    assert text.rstrip().endswith("[supervisor] node stopped (exit 0)")
    assert not any(alive(p) for p in pids.values())
    assert processes_with_env(node.marker) == []
    probe = run_probe(node, g.node_file)
    assert probe.returncode == 1
    assert probe.stdout.strip() == f"not ready: 127.0.0.1:{g.public}"


# --- a worker with front-end processes under the node ------------------------------------------


def test_a_killed_device_process_is_restarted_with_its_front_ends_and_nothing_orphaned(
    demo_repo, tmp_path
):
    base = free_ports(1)
    node_file = write_node(tmp_path, demo_repo, base)
    env = {
        "KSERVE_TRIO_CPU_WORKERS": "1",
        "KSERVE_TRIO_WORKER_THREADS": "1",
        "INFERENCE_SERVER_ENDPOINTS_FRONTEND_PROCESSES": "2",
    }
    node = NodeProcess(tmp_path, ["--node", str(node_file), "--role", "workers"], env)
    try:
        url = f"127.0.0.1:{base}"
        wait_ready(url, node=node)
        infer_mlp(url, demo_repo)
        victim = node.pids()["worker0"]
        front_ends = children_of(victim)
        assert len(front_ends) == 2 and all(alive(p) for p in front_ends)
        mark = len(node.text())
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: not any(alive(p) for p in front_ends), 30, "the front ends exit with it")
        exited = node.wait_for(
            r"^\[supervisor\] worker0 exited \(code=none, signal=SIGKILL", after=mark
        )
        node.wait_for(r"^\[supervisor\] started worker0 \(pid (\d+)\)$", after=exited.end())
        wait_ready(url, node=node)
        infer_mlp(url, demo_repo, rows=2, seed=3)
        assert len(children_of(node.pids()["worker0"])) == 2
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(timeout=30) == 0
        assert processes_with_env(node.marker) == []
    finally:
        node.close()

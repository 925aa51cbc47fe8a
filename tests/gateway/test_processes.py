"""A gateway in two processes (``--processes 2``) end to end: real CLI workers, the gateway CLI
(a parent and its two children) and the stock tritonclient.

The tritonclient set of ``test_e2e`` and ``test_rest_e2e`` runs again here, its gateways
started with ``--processes 2`` (their ``Gateway`` is swapped for this module's), and then what
only several processes have: connections spread over both, one merged ``/metrics``, a process
killed under load, a process stopped (SIGSTOP) while the admin port answers without it until
its missed liveness probes get it replaced, shared memory registered through one process and
unregistered through the other, a SIGTERM that leaves nothing behind, and a SIGKILL whose runtime directory goes too."""

# ruff: noqa: F811  (the tests take the imported fixtures ``e2e`` and ``fleet`` by name)

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.e2e import reference as ref
from tests.gateway import test_e2e as grpc_e2e
from tests.gateway import test_rest_e2e as rest_e2e
from tests.gateway.procs import Gateway
from tests.gateway.test_e2e import (  # noqa: F401  (the fixture and the tests, run again here)
    e2e,
    test_compressed_requests_pass_through_to_the_workers,
    test_is_same_ipc_namespace_asks_every_worker,
    test_shared_memory_inference_through_the_gateway,
    test_streaming_inference_answers_each_request_with_its_id,
    test_tls_public_port_mutual_tls_and_tls_to_the_workers,
    test_worker_statuses_reach_the_client_unchanged,
    tls_worker,
)
from tests.gateway.test_rest_e2e import (  # noqa: F401
    fleet,
    test_explicit_load_and_unload_fan_out,
    test_one_server_over_rest_and_traffic_spreads_over_both_workers,
    test_shared_memory_through_the_gateway,
)
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
G = "KSERVE_TRIO_GATEWAY_"
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
"""A tritonclient channel with its own connection (gRPC shares one per target otherwise)."""


class TwoProcesses(Gateway):
    """The gateway CLI with ``--processes 2``; its log lines are JSON."""

    def __init__(self, workdir: pathlib.Path, env: dict[str, str], *args: str) -> None:
        super().__init__(workdir, env, "--processes", "2", *args)

    def children(self) -> dict[int, int]:
        """Each process's pid, as the parent last saw it come up."""
        return {e["gateway_process"]: e["pid"] for e in self.events("gateway_process_up")}

    def served(self) -> dict[str, float]:
        """ModelInfer requests each process answered (the merged /metrics)."""
        out: dict[str, float] = {}
        for line in self.admin("/metrics")[1].splitlines():
            if line.startswith("gateway_requests_total{") and 'rpc="ModelInfer"' in line:
                process = re.search(r'gateway_process="([^"]+)"', line)
                assert process is not None, line
                out[process.group(1)] = out.get(process.group(1), 0.0) + float(line.split()[-1])
        return out


@pytest.fixture(scope="module", autouse=True)
def _gateways_in_two_processes():
    """Every gateway this module's tests start (the imported ones too) runs two processes."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grpc_e2e, "Gateway", TwoProcesses)
        patch.setattr(rest_e2e, "Gateway", TwoProcesses)
        yield


def mlp_input(x: np.ndarray) -> grpcclient.InferInput:
    inp = grpcclient.InferInput("input_0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def client_per_process(gw: TwoProcesses) -> dict[str, grpcclient.InferenceServerClient]:
    """A client whose connection reached process "0" and one for "1" (the kernel picks the
    process of each new connection; a ModelInfer on it shows which)."""
    found: dict[str, grpcclient.InferenceServerClient] = {}
    x = np.ones((1, 16), np.float32)
    for _ in range(40):
        c = grpcclient.InferenceServerClient(gw.url, channel_args=OWN_CONNECTION)
        before = gw.served()
        c.infer("mlp", [mlp_input(x)])
        after = gw.served()
        (process,) = [p for p in after if after[p] != before.get(p, 0.0)]
        found.setdefault(process, c)
        if len(found) == 2:
            return found
    raise AssertionError(f"40 connections all reached process {sorted(found)}")


@pytest.mark.timeout(120)
def test_connections_spread_over_both_processes_and_admin_merges_them(e2e):
    gw = e2e.gw
    assert isinstance(gw, TwoProcesses)
    clients = client_per_process(gw)
    w = ref.weights(e2e.repo, "mlp")
    x = np.random.default_rng(1).standard_normal((2, 16), dtype=np.float32)
    for c in clients.values():
        np.testing.assert_allclose(
            c.infer("mlp", [mlp_input(x)]).as_numpy("output"), ref.mlp(x, w), rtol=1e-5, atol=1e-5
        )
    served = gw.served()
    assert set(served) == {"0", "1"} and min(served.values()) >= 2
    status, metrics = gw.admin("/metrics")
    assert status == 200
    assert 'gateway_processes{gateway_process="parent"} 2.0' in metrics
    for p in ("0", "1"):
        assert f'gateway_process_up{{gateway_process="{p}"}} 1.0' in metrics
        assert f'gateway_process_metrics_up{{gateway_process="{p}"}} 1.0' in metrics
        assert re.search(
            rf'gateway_worker_ready{{worker="[^"]+",gateway_process="{p}"}} 1.0', metrics
        )
    assert metrics.count("# TYPE gateway_requests_total counter") == 1  # one family, merged
    assert metrics.count("# TYPE worker_requests_served_total counter") == 1
    served_lines = [ln for ln in metrics.splitlines() if ln.startswith("worker_requests_served")]
    assert served_lines and all("gateway_process" not in ln for ln in served_lines)  # once each
    labels = [f"127.0.0.1:{e2e.port}", f"127.0.0.2:{e2e.port}"]
    doc = json.loads(gw.admin("/routing")[1])
    assert doc["models"] == {"mlp": labels}
    assert sorted(doc["processes"]) == ["0", "1"]
    assert all(d["models"] == {"mlp": labels} for d in doc["processes"].values())
    assert gw.admin("/readyz") == (200, "ok") and gw.admin("/healthz") == (200, "ok")
    stats = clients["0"].get_inference_statistics("mlp", as_json=True)["model_stats"][0]
    total = sum(grpc_e2e.successes(worker) for worker in (e2e.a, e2e.b))
    assert int(stats["inference_stats"]["success"]["count"]) == total  # either process sums


@pytest.mark.timeout(120)
def test_a_gateway_process_killed_under_load_fails_only_its_in_flight_requests(e2e):
    """SIGKILL process 1 under load from four connections: the requests in flight on its
    connections fail UNAVAILABLE (and, until their client reconnects, the calls its channel
    fails fast); process 0's connection is untouched; the process comes back.

    A unary request is in flight on the victim's connection at the kill only by chance (its
    client spends part of each loop between requests), so a stream opened on that connection
    and answered once before the kill is the call known to be in flight there."""
    gw = e2e.gw
    clients = client_per_process(gw)
    pids = gw.children()
    victim = "1"
    x = np.ones((1, 16), np.float32)
    results: list[tuple[float, float, str, str | None]] = []  # start, end, connection, outcome
    lock = threading.Lock()
    stop = threading.Event()

    def load(process: str, c: grpcclient.InferenceServerClient) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                c.infer("mlp", [mlp_input(x)])
                outcome = None
            except InferenceServerException as exc:
                outcome = exc.status()
            with lock:
                results.append((started, time.monotonic(), process, outcome))

    extra = [
        grpcclient.InferenceServerClient(gw.url, channel_args=OWN_CONNECTION) for _ in range(2)
    ]
    threads = [threading.Thread(target=load, args=(p, c)) for p, c in clients.items()]
    threads += [threading.Thread(target=load, args=("?", c)) for c in extra]
    stream_events: queue.Queue = queue.Queue()
    clients[victim].start_stream(callback=lambda result, error: stream_events.put(error))
    for t in threads:
        t.start()
    try:
        clients[victim].async_stream_infer("mlp", [mlp_input(x)])
        assert stream_events.get(timeout=30) is None  # the stream is open on the victim
        wait_until(lambda: len(results) > 40, 30, "no load")
        os.kill(pids[int(victim)], signal.SIGKILL)
        killed = time.monotonic()
        wait_until(
            lambda: gw.children().get(int(victim), pids[int(victim)]) != pids[int(victim)],
            30,
            "the killed process did not come back",
        )
        came_back = time.monotonic()
        settled = max(came_back, killed + 5.0)  # every client has reconnected by then
        wait_until(lambda: len([r for r in results if r[0] > settled]) > 20, 30, "no load after")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    stream_error = stream_events.get(timeout=30)
    clients[victim].stop_stream()
    assert isinstance(stream_error, InferenceServerException), stream_error
    assert stream_error.status() == "StatusCode.UNAVAILABLE", stream_error
    failures = [(start, end, p, s) for start, end, p, s in results if s is not None]
    assert all(s == "StatusCode.UNAVAILABLE" for *_, s in failures), failures
    assert not [p for *_, p, _ in failures if p == "0"]  # the other process's: untouched
    in_flight = [f for f in failures if f[0] < killed]
    assert len(in_flight) <= len(threads) - 1  # at most one per connection not on process 0
    assert all(killed - 0.5 < end < killed + 5.0 for _, end, _, _ in failures), (killed, failures)
    survivor = [t for t, _, p, s in results if p == "0" and s is None and killed < t < came_back]
    assert survivor  # served meanwhile
    after = [s for t, _, _, s in results if t > settled]
    assert after and all(s is None for s in after)
    metrics = gw.admin("/metrics")[1]
    assert f'gateway_process_restarts_total{{gateway_process="{victim}"}} 1.0' in metrics
    assert gw.alive() and os.path.exists(f"/proc/{gw.children()[0]}")


LIVENESS = {G + "PROCESS_LIVENESS_INTERVAL_SECONDS": "0.5", G + "PROCESS_LIVENESS_MISSES": "8"}
"""A stuck child is killed after 4 s (8 probes of 0.5 s): long beside the three admin requests
asked while it is stopped, each of which the client gives 2 s."""


def admin_within(gw: Gateway, path: str, timeout: float) -> tuple[int, str]:
    """``GET path`` on the parent's admin port, failing (a timeout) past ``timeout``."""
    try:
        url = f"http://127.0.0.1:{gw.metrics_port}{path}"
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _state(pid: int) -> str:
    """The process's state letter in ``/proc`` (``T``: stopped), or ``""`` when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return ""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("event_loop", ["uvloop", "trio"])
def test_a_stopped_process_is_left_out_of_the_admin_port_then_replaced(e2e, event_loop):
    """SIGSTOP child 1: while it is stopped the parent's /readyz, /routing and /metrics answer
    within the client's 2 s from child 0 alone (200, child 1 left out); its missed liveness
    probes get it killed and restarted, and new connections are served. On both event loops
    (the children answer the liveness probes on theirs)."""
    env = {G + "WORKERS": f"workers.test:{e2e.port}", G + "HOSTS_FILE": str(e2e.hosts), **LIVENESS}
    gw = TwoProcesses(e2e.work, env, "--event-loop", event_loop)
    try:
        gw.wait_ready()
        pids = wait_until(lambda: len(gw.children()) == 2 and gw.children(), 30, "both up")
        loops = [e["event_loop"] for e in gw.events("gateway_up") if "event_loop" in e]
        assert loops == [event_loop] * 2, loops  # each child's
        old = pids[1]
        os.kill(old, signal.SIGSTOP)
        try:
            status, _ = admin_within(gw, "/readyz", 2.0)
            assert status == 200
            status, body = admin_within(gw, "/routing", 2.0)
            assert status == 200 and set(json.loads(body)["processes"]) == {"0"}, body
            assert json.loads(body)["models"]["mlp"], body
            status, body = admin_within(gw, "/metrics", 2.0)
            assert status == 200
            assert 'gateway_process_metrics_up{gateway_process="1"} 0.0' in body
            assert 'gateway_process_metrics_up{gateway_process="0"} 1.0' in body
            assert _state(old) == "T"  # all three were answered while it was stopped
            wait_until(lambda: _exited(old), 30, "the stopped process killed")
        finally:
            if not _exited(old):
                os.kill(old, signal.SIGCONT)
        new = wait_until(lambda: gw.children().get(1, old) != old and gw.children()[1], 30)
        assert not _exited(new) and _state(new) != "T"
        (event,) = gw.events("gateway_process_unresponsive")
        assert event["pid"] == old and event["gateway_process"] == 1, event
        metrics = gw.admin("/metrics")[1]
        assert 'gateway_process_liveness_kills_total{gateway_process="1"} 1.0' in metrics
        assert 'gateway_process_liveness_kills_total{gateway_process="0"} 0.0' in metrics
        assert 'gateway_process_restarts_total{gateway_process="1"} 1.0' in metrics
        wait_until(lambda: admin_within(gw, "/readyz", 2.0)[0] == 200, 30, "ready again")
        for _ in range(10):
            c = grpcclient.InferenceServerClient(gw.url, channel_args=OWN_CONNECTION)
            assert c.is_server_live(client_timeout=10)
            c.close()
    finally:
        assert gw.stop() == 0, gw.logs()


@pytest.mark.timeout(180)
def test_shm_registered_through_one_process_and_unregistered_through_the_other(e2e):
    """After worker b restarts, exactly the live registrations are replayed to it, once."""
    gw, b = e2e.gw, e2e.b
    clients = client_per_process(gw)
    size = 64
    handles = [shm.create_shared_memory_region(f"gwp_{n}", f"/gwp_{n}", size) for n in "xy"]
    try:
        clients["0"].register_system_shared_memory("gwp_x", "/gwp_x", size)
        clients["0"].register_system_shared_memory("gwp_y", "/gwp_y", size)
        clients["1"].unregister_system_shared_memory("gwp_x")  # through the other process
        for worker in (e2e.a, b):
            regions = worker.client().get_system_shared_memory_status(as_json=True)
            assert set(regions.get("regions", {})) == {"gwp_y"}
        status = clients["1"].get_system_shared_memory_status(as_json=True).get("regions", {})
        assert set(status) == {"gwp_y"}
        replayed_before = len(gw.events("shm_region_replayed"))
        b.kill()
        b.restart()
        b.wait_ready()
        label = f"{b.host}:{b.port}"

        def routed_everywhere() -> bool:
            doc = json.loads(gw.admin("/routing")[1])
            return len(doc["processes"]) == 2 and label in doc["models"].get("mlp", [])

        wait_until(routed_everywhere, 30, "the restarted worker is not routed by both processes")
        regions = b.client().get_system_shared_memory_status(as_json=True).get("regions", {})
        assert set(regions) == {"gwp_y"}  # the live registration, not the unregistered one
        replays = gw.events("shm_region_replayed")[replayed_before:]
        assert [(e["worker"], e["region"]) for e in replays] == [(label, "gwp_y")]  # once
        clients["1"].unregister_system_shared_memory("gwp_y")
        assert b.client().get_system_shared_memory_status(as_json=True).get("regions", {}) == {}
    finally:
        for h in handles:
            shm.destroy_shared_memory_region(h)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return False
    return True


@pytest.mark.timeout(120)
def test_sigterm_drains_every_process_and_leaves_nothing_behind(e2e, tmp_path):
    """Port 0 works (the parent reserves one port for both); the children serve on trio; after
    SIGTERM no process, no listening socket and no runtime directory remain."""
    env = {G + "WORKERS": f"127.0.0.1:{e2e.port}", G + "LISTEN_GRPC": "127.0.0.1:0"}
    gw = TwoProcesses(tmp_path, env, "--event-loop", "trio")
    try:
        gw.wait_ready()
        parent_up = lambda: [e for e in gw.events("gateway_up") if "processes" in e]  # noqa: E731
        (up,) = wait_until(parent_up, 30, "the parent logged no gateway_up")
        port = int(up["address"].rsplit(":", 1)[1])
        (starting,) = gw.events("gateway_processes_starting")
        runtime_dir = pathlib.Path(starting["runtime_dir"])
        pids = list(gw.children().values())
        assert len(pids) == 2 and runtime_dir.is_dir()
        assert sorted(p.name for p in runtime_dir.glob("process-*.json")) == [
            "process-0.json",
            "process-1.json",
        ]
        gw.url = f"127.0.0.1:{port}"
        assert gw.client().is_server_ready()
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.proc.wait(30) == 0
        for pid in pids:
            assert not os.path.exists(f"/proc/{pid}"), pid  # reaped: gone
        assert not runtime_dir.exists()
        assert not _listening(port) and not _listening(gw.metrics_port)
        with socket.socket() as s:  # the port is free again, without SO_REUSEPORT
            s.bind(("127.0.0.1", port))
        drained = gw.events("gateway_down")
        assert len(drained) == 3  # each child, then the parent
    finally:
        gw.stop()


def _exited(pid: int) -> bool:
    """Gone, or a zombie nobody reaps (the orphan of a killed parent, where pid 1 does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _make_dir(path: pathlib.Path) -> pathlib.Path:
    path.mkdir()
    (path / "gateway.json").write_text("{}")
    return path


@pytest.mark.timeout(150)
def test_a_parent_killed_outright_leaves_no_runtime_directory_behind(e2e, tmp_path):
    """SIGKILL to the parent: its children exit and the last one removes the runtime
    directory. A gateway killed whole (nothing left to remove it) has its directory removed by
    the next parent that starts. Nothing else in the temporary directory is touched: another
    gateway's directory (live pid, or held by a process still draining), other names."""
    temp = tmp_path / "temp"
    temp.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    live = _make_dir(temp / f"kserve_trio-gateway-{os.getpid()}-live")
    draining = _make_dir(temp / f"kserve_trio-gateway-{dead.pid}-draining")
    others = [_make_dir(temp / "kserve_trio-gateway-oldname"), _make_dir(temp / "unrelated")]
    held = os.open(draining, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(held, fcntl.LOCK_SH)
    env = {G + "WORKERS": f"127.0.0.1:{e2e.port}", "TMPDIR": str(temp)}
    try:
        gw = TwoProcesses(tmp_path, env)
        try:
            gw.wait_ready()
            (starting,) = gw.events("gateway_processes_starting")
            runtime_dir = pathlib.Path(starting["runtime_dir"])
            assert runtime_dir.parent == temp and runtime_dir.is_dir()
            pids = wait_until(lambda: len(gw.children()) == 2 and gw.children(), 30, "children")
            gw.proc.send_signal(signal.SIGKILL)
            assert gw.proc.wait(10) == -signal.SIGKILL
            for pid in pids.values():
                wait_until(lambda p=pid: _exited(p), 30, f"gateway process {pid} exited")
            wait_until(lambda: not runtime_dir.exists(), 10, "the runtime directory removed")
        finally:
            gw.stop()
        stale = _make_dir(temp / f"kserve_trio-gateway-{dead.pid}-stale")  # killed whole
        gw = TwoProcesses(tmp_path, env)
        try:
            gw.wait_ready()
            assert not stale.exists()
            (starting,) = gw.events("gateway_processes_starting")
            runtime_dir = pathlib.Path(starting["runtime_dir"])
            assert runtime_dir.is_dir()
            assert gw.stop() == 0
            assert not runtime_dir.exists()
        finally:
            gw.stop()
    finally:
        os.close(held)
    assert sorted(p.name for p in temp.iterdir()) == sorted(
        p.name for p in (live, draining, *others)
    )
    for kept in (live, draining, *others):
        assert (kept / "gateway.json").read_text() == "{}", kept


@pytest.mark.timeout(90)
def test_a_child_that_cannot_start_fails_the_gateway_with_its_status(e2e, tmp_path):
    """A certificate that does not load fails each child at start-up (exit 2): the parent exits
    2 too, with no restart loop, and removes what it made."""
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    env = {
        G + "WORKERS": f"127.0.0.1:{e2e.port}",
        G + "TLS_CERT_FILE": str(bad),
        G + "TLS_KEY_FILE": str(bad),
    }
    gw = TwoProcesses(tmp_path, env)
    try:
        assert gw.proc.wait(60) == 2, gw.logs()
        (starting,) = gw.events("gateway_processes_starting")
        assert not pathlib.Path(starting["runtime_dir"]).exists()
        assert not gw.events("gateway_process_exited")  # failed at start: not restarted
        assert "exited with status 2 at start-up" in gw.logs()
    finally:
        gw.stop()

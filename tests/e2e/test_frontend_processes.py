"""A worker whose gRPC and REST ports are served by two front-end processes
(``--frontend-processes 2``), against stock tritonclient: every RPC answered, both front ends
serving (the per-front-end counters say which served a call), shared memory registered through
one front end and used through the other, batching across front ends, and the faults: a front
end SIGKILLed under load, one stopped (SIGSTOP) until its liveness pings kill it, the device
process SIGKILLed, and a SIGTERM that leaves nothing behind.

Which front end a connection lands on is the kernel's choice (SO_REUSEPORT hashes the
connection's addresses), so a test that needs a connection on each opens connections until the
counters show one on each (each new connection is a fresh draw: 64 draws all landing on one of
two front ends has odds of 2^-63).
"""

from __future__ import annotations

import json
import os
import pathlib
import queue
import signal
import socket
import threading
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from kserve_trio.export.demo import tokenize_sum_reference
from tests.client.test_tls import pki  # noqa: F401  (the session's throwaway PKI)
from tests.e2e import reference as ref
from tests.e2e.conftest import WorkerProcess
from tests.e2e.test_protocol_features_e2e import features_repository
from tests.edge.rest_peer import (
    a_100_kb_extension_is_refused,
    chunk_extensions_are_bounded,
    http11_rules_hold,
)
from tests.gate_model import Gate, add_gate_model
from tests.ports import free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

ARENA = 10_000_000
"""The device arena of the explicit-mode worker (the weight cache needs one on the CPU)."""


@pytest.fixture(scope="module")
def repo(demo_repo, tmp_path_factory):
    """The protocol-features repository and ``gate``."""
    root = features_repository(tmp_path_factory.mktemp("frontends") / "models", demo_repo)
    add_gate_model(root)
    return root


@pytest.fixture
def gate(repo):
    """The ``gate`` model's hold (``add_gate_model`` put it beside ``repo``), opened after the
    test whatever happened."""
    g = Gate(repo.parent / "gate")
    yield g
    g.open()


def start_worker(repo: pathlib.Path, *extra: str, env: dict | None = None) -> WorkerProcess:
    metrics_port, http_port = free_port(), free_port()
    w = WorkerProcess(
        repo,
        "--frontend-processes",
        "2",
        "--metrics-port",
        str(metrics_port),
        "--http-port",
        str(http_port),
        *extra,
        env=env,
    )
    w.metrics_port, w.http_port = metrics_port, http_port
    return w


@pytest.fixture(scope="module")
def worker(repo):
    w = start_worker(repo)
    try:
        w.wait_ready()
        yield w
    finally:
        w.terminate()


def metric(worker, name: str, **labels) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics") as r:
        text = r.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def served(worker) -> tuple[float, float]:
    return tuple(  # type: ignore[return-value]
        metric(worker, "worker_frontend_requests_total", frontend_process=str(i)) for i in (0, 1)
    )


def log_events(worker, event: str) -> list[dict]:
    out = []
    for line in worker.logs().splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            record = json.loads(line)
            if record.get("event") == event:
                out.append(record)
    return out


def mlp_input(x: np.ndarray) -> grpcclient.InferInput:
    inp = grpcclient.InferInput("input_0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def one_client_per_frontend(worker) -> dict[int, grpcclient.InferenceServerClient]:
    """A client (its own connection) on each front end, told apart by the counters."""
    found: dict[int, grpcclient.InferenceServerClient] = {}
    for _ in range(64):
        client = own_connection(worker.url)
        before = served(worker)
        assert client.is_server_live()
        after = served(worker)
        which = [i for i in (0, 1) if after[i] > before[i]]
        assert len(which) == 1, (before, after)
        if which[0] in found:
            client.close()
        else:
            found[which[0]] = client
        if len(found) == 2:
            return found
    raise AssertionError("64 connections all landed on one front end")


def own_connection(url: str, **kwargs) -> grpcclient.InferenceServerClient:
    """A client on a connection of its own: gRPC shares one connection between channels to
    the same address unless a channel keeps its own subchannel pool."""
    return grpcclient.InferenceServerClient(
        url, channel_args=[("grpc.use_local_subchannel_pool", 1)], **kwargs
    )


def sleepy_input(seconds: float) -> grpcclient.InferInput:
    inp = grpcclient.InferInput("seconds", [1, 1], "FP32")
    inp.set_data_from_numpy(np.array([[seconds]], np.float32))
    return inp


# --------------------------------------------------------------------------------------------


def test_every_rpc_through_both_front_ends(worker, repo):
    clients = one_client_per_frontend(worker)
    w = ref.weights(repo, "mlp")
    x = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    for c in clients.values():
        assert c.is_server_ready() and c.is_model_ready("mlp")
        assert c.get_server_metadata().name
        assert c.get_model_metadata("mlp").inputs[0].name == "input_0"
        assert c.get_model_config("mlp").config.name == "mlp"
        assert {m.name for m in c.get_model_repository_index().models} >= {"mlp", "sleepy"}
        out = c.infer("mlp", [mlp_input(x)]).as_numpy("output")
        np.testing.assert_allclose(out, ref.mlp(x, w), rtol=1e-5, atol=1e-5)
        with pytest.raises(InferenceServerException) as err:
            c.get_model_metadata("nope")
        assert "NOT_FOUND" in str(err.value.status()) and "nope" in err.value.message()
        with pytest.raises(InferenceServerException) as err:
            c.infer("mlp", [mlp_input(np.ones((1, 3), np.float32))])
        assert "INVALID_ARGUMENT" in str(err.value.status())
        with pytest.raises(InferenceServerException) as err:
            c.get_cuda_shared_memory_status()
        assert "UNIMPLEMENTED" in str(err.value.status())
        assert c.get_trace_settings(as_json=True)["settings"]["trace_mode"]["value"] == [
            "opentelemetry"
        ]
    stats = clients[0].get_inference_statistics("mlp").model_stats[0]
    assert stats.inference_stats.success.count >= 2, "requests of both front ends counted once"
    # BYTES through the hook bundle, on the device process
    texts = np.array([b"a b", b"hello world again"], dtype=np.object_)
    inp = grpcclient.InferInput("text", [len(texts)], "BYTES")
    inp.set_data_from_numpy(texts)
    want_counts, want_labels = tokenize_sum_reference(texts)
    for c in clients.values():
        result = c.infer("tokenize_sum", [inp])
        np.testing.assert_array_equal(result.as_numpy("tokens"), want_counts)
        assert list(result.as_numpy("label")) == list(want_labels)


def hold_device(worker, gate: Gate) -> threading.Thread:
    """A ``gate`` request on a connection of its own, once it holds the device thread (the
    test opens the gate, then joins the thread)."""
    holder = own_connection(worker.url)
    hold = threading.Thread(target=lambda: holder.infer("gate", [sleepy_input(0.0)]), daemon=True)
    hold.start()
    gate.wait_started()
    return hold


def test_streams_deadlines_and_cancellation_through_the_front_ends(worker, repo, gate):
    clients = one_client_per_frontend(worker)
    w = ref.weights(repo, "mlp")
    for c in clients.values():
        answers: list = []
        done = threading.Event()

        def callback(result, error, answers=answers, done=done):
            answers.append((result, error))
            if len(answers) == 4:
                done.set()

        c.start_stream(callback)
        xs = [np.full((1, 16), i, np.float32) for i in range(3)]
        for i, x in enumerate(xs):
            c.async_stream_infer("mlp", [mlp_input(x)], request_id=str(i))
        c.async_stream_infer("nope", [mlp_input(xs[0])], request_id="bad")
        assert done.wait(60)
        c.stop_stream()
        by_id = {}
        for result, error in answers:
            if error is not None:
                assert "nope" in str(error)
                by_id["bad"] = error
            else:
                by_id[result.get_response().id] = result
        assert set(by_id) == {"0", "1", "2", "bad"}
        for i, x in enumerate(xs):
            np.testing.assert_allclose(
                by_id[str(i)].as_numpy("output"), ref.mlp(x, w), rtol=1e-5, atol=1e-5
            )
        # a deadline that cannot be met: the device is held until the call has failed; the
        # request it queued leaves the device process's queue unrun, the gate still held
        served_before = metric(worker, "worker_requests_served_total", model="mlp")
        hold = hold_device(worker, gate)
        try:
            with pytest.raises(InferenceServerException) as err:
                c.infer("mlp", [mlp_input(xs[0])], client_timeout=1.0)
            assert "DEADLINE" in str(err.value.status()).upper()
            wait_until(
                lambda: metric(worker, "worker_queue_depth", model="mlp") == 0,
                timeout=30,
                what="the expired request off the device process's queue",
            )
            assert gate.holding()
        finally:
            gate.open()
            hold.join(60)
        assert metric(worker, "worker_requests_served_total", model="mlp") == served_before
    # cancellation: the client's RST reaches the device process, which drops the request (it
    # waits behind the gate from before the cancel until after it is recorded)
    c = clients[0]
    before = metric(worker, "worker_requests_total", model="mlp", status="CANCELLED")
    served_before = metric(worker, "worker_requests_served_total", model="mlp")
    hold = hold_device(worker, gate)
    try:
        answered: list = []
        future = c.async_infer(
            "mlp", [mlp_input(xs[0])], callback=lambda result, error: answered.append(error)
        )

        def queued() -> bool:
            assert not answered, answered  # nothing answers it before the cancel
            return metric(worker, "worker_queue_depth", model="mlp") == 1

        wait_until(queued, 30, "the request queued in the device process")
        future.cancel()
        wait_until(
            lambda: (
                metric(worker, "worker_requests_total", model="mlp", status="CANCELLED") > before
            ),
            timeout=30,
            what="the cancelled request is recorded CANCELLED",
        )
        assert metric(worker, "worker_queue_depth", model="mlp") == 0 and gate.holding()
    finally:
        gate.open()
        hold.join(60)
    assert metric(worker, "worker_requests_served_total", model="mlp") == served_before


def test_shared_memory_registered_through_one_front_end_used_through_the_other(worker, repo):
    clients = one_client_per_frontend(worker)
    a, b = clients[0], clients[1]
    x = np.random.default_rng(1).standard_normal((1, 16)).astype(np.float32)
    key = f"/kt_fe_{os.getpid()}"
    handle = shm.create_shared_memory_region("fe_in", key, x.nbytes)
    try:
        shm.set_shared_memory_region(handle, [x])
        a.register_system_shared_memory("fe_in", key, x.nbytes)
        assert "fe_in" in b.get_system_shared_memory_status(as_json=True).get("regions", {})
        inp = grpcclient.InferInput("input_0", [1, 16], "FP32")
        inp.set_shared_memory("fe_in", x.nbytes)
        out = b.infer("mlp", [inp]).as_numpy("output")
        np.testing.assert_allclose(out, ref.mlp(x, ref.weights(repo, "mlp")), rtol=1e-5)
        b.unregister_system_shared_memory("fe_in")
        assert "fe_in" not in a.get_system_shared_memory_status(as_json=True).get("regions", {})
    finally:
        shm.destroy_shared_memory_region(handle)


def test_rest_log_settings_and_metrics_through_the_front_ends(worker, repo):
    rest = httpclient.InferenceServerClient(f"127.0.0.1:{worker.http_port}")
    assert rest.is_server_ready()
    x = np.ones((1, 16), np.float32)
    inp = httpclient.InferInput("input_0", [1, 16], "FP32")
    inp.set_data_from_numpy(x)
    out = rest.infer("mlp", [inp]).as_numpy("output")
    np.testing.assert_allclose(out, ref.mlp(x, ref.weights(repo, "mlp")), rtol=1e-5, atol=1e-5)
    with pytest.raises(InferenceServerException) as err:
        rest.get_model_metadata("nope")
    assert "nope" in err.value.message()
    # a LogSettings change through gRPC reaches the device process and every front end
    c = grpcclient.InferenceServerClient(worker.url)
    c.update_log_settings({"log_verbose_level": 1})
    try:
        assert rest.get_log_settings()["log_verbose_level"] == 1
    finally:
        c.update_log_settings({"log_verbose_level": 0})
    # the front ends' edge counters reach /metrics, labelled
    wait_until(
        lambda: (
            metric(worker, "worker_edge_inflight_bytes", frontend_process="1") >= 0
            and 'frontend_process="1"' in _metrics_text(worker)
            and "worker_edge_refused_streams" in _metrics_text(worker)
        ),
        timeout=30,
        what="both front ends' edge counters in /metrics",
    )


def test_rest_reads_http11_strictly_and_bounds_chunk_extensions_in_each_front_end(worker):
    pids = [*frontend_pids(worker).values(), worker.proc.pid]
    assert len(pids) == 3
    chunk_extensions_are_bounded(worker.http_port, pids)  # CPU counted over all three
    http11_rules_hold(worker.http_port)

    def refused(frontend: str) -> float:
        return metric(
            worker,
            "worker_edge_refused_requests_total",
            reason="chunk_extensions",
            frontend_process=frontend,
        )

    def both_counted() -> bool:
        """Each connection lands on either front end, and a front end pushes its counters to
        the device process once a second: send another until both have counted one."""
        if refused("0") and refused("1"):
            return True
        a_100_kb_extension_is_refused(worker.http_port)
        return False

    wait_until(both_counted, 60, "a chunk-extension refusal counted by each front end")


def _metrics_text(worker) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics") as r:
        return r.read().decode()


def test_requests_of_both_front_ends_coalesce_into_one_batch(worker, gate):
    clients = one_client_per_frontend(worker)
    before = metric(worker, "worker_dispatch_total", model="mlp")
    hold = hold_device(worker, gate)
    results: list = []
    x = np.ones((1, 16), np.float32)
    threads = [  # 4 through each front end: 8 rows, mlp's compiled batch of 8
        threading.Thread(target=lambda c=c: results.append(c.infer("mlp", [mlp_input(x)])))
        for c in clients.values()
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    wait_until(
        lambda: metric(worker, "worker_queue_depth", model="mlp") == 8,
        timeout=30,
        what="four requests of each front end queued behind the gate",
    )
    gate.open()
    for t in threads:
        t.join(60)
    hold.join(60)
    assert len(results) == 8
    dispatched = metric(worker, "worker_dispatch_total", model="mlp") - before
    assert dispatched == 1, f"the two front ends' requests ran in {dispatched} executions"


# --------------------------------------------------------------------------------------------
# faults


def frontend_pids(worker) -> dict[int, int]:
    pids = {}
    for record in log_events(worker, "frontend_started"):
        pids[int(record["frontend_process"])] = int(record["pid"])
    return pids


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_killed_front_end_fails_its_calls_unavailable_and_comes_back(repo, gate):
    w = start_worker(repo)
    try:
        w.wait_ready()
        clients = one_client_per_frontend(w)
        pid = frontend_pids(w)[0]
        errors: list = []
        waiting = threading.Thread(target=lambda: _expect_error(clients[0], errors), daemon=True)
        waiting.start()
        gate.wait_started()
        # the other front end goes on serving while this one is killed
        stop = threading.Event()
        served_other: list = []

        def load():
            while not stop.is_set():
                served_other.append(clients[1].is_model_ready("mlp"))

        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        os.kill(pid, signal.SIGKILL)
        waiting.join(30)
        assert errors and "UNAVAILABLE" in str(errors[0].status()), errors
        gate.open()
        wait_until(
            lambda: len(log_events(w, "frontend_ready")) >= 3,
            timeout=60,
            what="front end 0 restarted",
        )
        stop.set()
        loader.join(30)
        assert served_other and all(served_other)
        assert metric(w, "worker_frontend_restarts_total", frontend_process="0") == 1
        # after the restart both front ends serve again
        again = one_client_per_frontend(w)
        assert all(c.is_server_ready() for c in again.values())
    finally:
        w.terminate()


LIVENESS_ENV = {
    "INFERENCE_SERVER_ENDPOINTS_FRONTEND_LIVENESS_INTERVAL_SECONDS": "0.5",
    "INFERENCE_SERVER_ENDPOINTS_FRONTEND_LIVENESS_MISSES": "4",
}
"""A stuck front end is killed after 2 s (4 pings of 0.5 s), well past any pause a loaded
machine gives a live one."""


def state(pid: int) -> str:
    """The process's state letter in ``/proc`` (``T``: stopped), or ``""`` when it is gone."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


@pytest.mark.parametrize("event_loop", ["uvloop", "trio"])
def test_a_stopped_front_end_is_killed_and_replaced_then_every_new_connection_is_served(
    repo, event_loop
):
    """SIGSTOP front end 0: its listening socket keeps taking connections until its missed
    liveness pings get it killed (SIGKILL) and restarted; then every new connection, gRPC and
    REST, is served. On both event loops (a front end answers the pings on the worker's)."""
    w = start_worker(repo, "--event-loop", event_loop, env=LIVENESS_ENV)
    try:
        w.wait_ready()
        up = wait_until(lambda: log_events(w, "server_up"), 60, "server_up in the log")
        assert up[0]["event_loop"] == event_loop
        old = frontend_pids(w)[0]
        os.kill(old, signal.SIGSTOP)
        try:
            wait_until(lambda: not alive(old), timeout=60, what="the stopped front end killed")
        finally:
            if alive(old):
                os.kill(old, signal.SIGCONT)
        wait_until(
            lambda: len(log_events(w, "frontend_ready")) >= 3,
            timeout=60,
            what="front end 0 restarted",
        )
        new = frontend_pids(w)[0]
        assert new != old and alive(new) and state(new) != "T"
        (event,) = log_events(w, "frontend_unresponsive")
        assert event["pid"] == old and event["frontend_process"] == 0, event
        assert metric(w, "worker_frontend_liveness_kills_total", frontend_process="0") == 1
        assert metric(w, "worker_frontend_liveness_kills_total", frontend_process="1") == 0
        assert metric(w, "worker_frontend_restarts_total", frontend_process="0") == 1
        for _ in range(10):
            c = own_connection(w.url)
            assert c.is_server_ready(client_timeout=10)
            c.close()
            r = httpclient.InferenceServerClient(
                f"127.0.0.1:{w.http_port}", connection_timeout=10, network_timeout=10
            )
            assert r.is_server_ready()
            r.close()
    finally:
        w.terminate()


def _expect_error(client, errors: list) -> None:
    try:
        client.infer("gate", [sleepy_input(0.0)])
    except InferenceServerException as exc:
        errors.append(exc)


def test_a_killed_device_process_takes_its_front_ends_with_it(repo):
    w = start_worker(repo)
    try:
        w.wait_ready()
        pids = frontend_pids(w)
        assert len(pids) == 2 and all(alive(p) for p in pids.values())
        w.proc.send_signal(signal.SIGKILL)
        w.proc.wait(30)
        wait_until(
            lambda: not any(alive(p) for p in pids.values()),
            timeout=30,
            what="both front ends exit once the device process is gone",
        )
    finally:
        w.terminate()


@pytest.mark.parametrize("event_loop", ["uvloop", "trio"])
def test_sigterm_leaves_no_process_shared_memory_or_socket_behind(repo, event_loop):
    """On both event loops (the device process and the front ends run the worker's)."""
    shm_before = set(os.listdir("/dev/shm"))
    w = start_worker(repo, "--event-loop", event_loop)
    try:
        w.wait_ready()
        c = grpcclient.InferenceServerClient(w.url)
        assert (
            c.infer("mlp", [mlp_input(np.ones((1, 16), np.float32))]).as_numpy("output") is not None
        )
        answers: queue.Queue = queue.Queue()
        c.start_stream(lambda result, error: answers.put((result, error)))
        c.async_stream_infer("mlp", [mlp_input(np.ones((2, 16), np.float32))], request_id="s")
        result, error = answers.get(timeout=60)
        c.stop_stream()
        assert error is None and result.as_numpy("output").shape[0] == 2
        # A front end answers as soon as it is up, maybe before its sibling is: the device
        # process says server_up once both are.
        up = wait_until(lambda: log_events(w, "server_up"), 60, "server_up in the log")
        assert up[0]["event_loop"] == event_loop
        pids = frontend_pids(w)
    finally:
        assert w.terminate() == 0
    assert not any(alive(p) for p in pids.values())
    ours = {str(w.proc.pid), *map(str, pids.values())}
    # the worker's own names only (tests run beside it): its buffer pools, named by pid. It
    # keeps its weights private (runtime.shared_host_weights off), so a kst-w- region that
    # appears meanwhile is another worker's (a node test's, under xdist or beside the suite)
    left = {
        name
        for name in set(os.listdir("/dev/shm")) - shm_before
        if any(f"-{pid}-" in name for pid in ours)
    }
    assert left == set()
    for port in (w.port, w.http_port):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still accepts"


def test_tls_through_the_front_ends(repo, pki):  # noqa: F811
    w = start_worker(
        repo,
        env={
            "INFERENCE_SERVER_ENDPOINTS_TLS_CERT_FILE": str(pki / "server.pem"),
            "INFERENCE_SERVER_ENDPOINTS_TLS_KEY_FILE": str(pki / "server.key"),
        },
    )
    try:
        ca = str(pki / "ca.pem")

        def ready_client() -> grpcclient.InferenceServerClient | None:
            assert w.proc.poll() is None, w.logs()
            c = grpcclient.InferenceServerClient(w.url, ssl=True, root_certificates=ca)
            try:
                return c if c.is_server_ready() else None
            except InferenceServerException:
                return None

        c = wait_until(ready_client, 300, "the worker ready over TLS")
        out = c.infer("mlp", [mlp_input(np.ones((1, 16), np.float32))]).as_numpy("output")
        assert out.shape == (1, 8)
    finally:
        w.terminate()


def test_repository_load_unload_and_the_control_service_through_the_front_ends(repo):
    w = start_worker(
        repo,
        "--model-control-mode",
        "explicit",
        env={"INFERENCE_SERVER_RUNTIME_CPU_DEVICE_MEMORY_BYTES": str(ARENA)},
    )
    try:
        w.wait_ready()
        clients = one_client_per_frontend(w)
        a, b = clients[0], clients[1]
        assert not b.is_model_ready("mlp")
        a.load_model("mlp")
        assert b.is_model_ready("mlp"), "loaded through one front end, ready through the other"
        x = np.ones((1, 16), np.float32)
        np.testing.assert_allclose(
            b.infer("mlp", [mlp_input(x)]).as_numpy("output"),
            ref.mlp(x, ref.weights(repo, "mlp")),
            rtol=1e-5,
            atol=1e-5,
        )
        status = control_status(w.url)
        assert {m.name: m.device_resident for m in status.models}["mlp"] is True
        b.unload_model("mlp")
        assert not a.is_model_ready("mlp")
        with pytest.raises(InferenceServerException) as err:
            a.infer("mlp", [mlp_input(x)])
        assert "FAILED_PRECONDITION" in str(err.value.status())
    finally:
        w.terminate()


def control_status(url: str):
    """ModelControlStatus over a plain gRPC channel (the control service is ours)."""
    import grpc

    from kserve_trio.proto import reactant_control as rc

    with grpc.insecure_channel(url) as channel:
        call = channel.unary_unary(
            "/reactant_control.ControlService/ModelControlStatus",
            request_serializer=bytes,
            response_deserializer=rc.ModelControlStatusResponse.parse,
        )
        return call(rc.ModelControlStatusRequest(), timeout=30)

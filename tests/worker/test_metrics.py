"""Worker metrics and health endpoints: pure pieces, then the live HTTP endpoint."""

from __future__ import annotations

import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from kserve_trio.serving.admin_http import route
from kserve_trio.worker.metrics import LATENCY_BUCKETS, gpu_label, inject_labels
from kserve_trio.worker.observer import UNKNOWN_MODEL
from tests.ports import free_port
from tests.waiting import wait_until


def test_inject_labels_adds_constant_labels_to_samples_only():
    text = '# HELP x doc\n# TYPE x counter\nx_total 3.0\ny{model="m"} 1.0\nz{worker="keep"} 2.0\n'
    out = inject_labels(text, {"worker": "w0", "gpu": "1"})
    lines = out.splitlines()
    assert lines[0] == "# HELP x doc" and lines[1] == "# TYPE x counter"
    assert lines[2] == 'x_total{worker="w0",gpu="1"} 3.0'
    assert lines[3] == 'y{model="m",worker="w0",gpu="1"} 1.0'
    assert lines[4] == 'z{worker="keep",gpu="1"} 2.0'
    assert inject_labels(text, {}) == text


def test_gpu_label_rules():
    assert gpu_label("cpu", 0, {"CUDA_VISIBLE_DEVICES": "3"}) == ""
    assert gpu_label("cuda", 0, {"CUDA_VISIBLE_DEVICES": "3"}) == "3"
    assert gpu_label("cuda", 1, {"CUDA_VISIBLE_DEVICES": "3,5"}) == "5"
    assert gpu_label("cuda", 2, {}) == "2"


def test_latency_buckets_double_from_one_millisecond():
    assert LATENCY_BUCKETS[0] == pytest.approx(0.001)
    assert LATENCY_BUCKETS[-1] == pytest.approx(0.001 * 2**13)
    assert len(LATENCY_BUCKETS) == 14


def test_http_routes():
    ready = {"v": False}
    kw = {"exposition": lambda: b"m 1\n", "ready": lambda: ready["v"]}
    assert route("/metrics", **kw)[0:3:2] == (200, b"m 1\n")
    assert route("/metrics?x=1", **kw)[0] == 200
    assert route("/healthz", **kw) == (200, "text/plain; charset=utf-8", b"ok")
    assert route("/readyz", **kw)[0::2] == (503, b"not ready")
    ready["v"] = True
    assert route("/readyz", **kw)[0::2] == (200, b"ok")
    assert route("/nope", **kw)[0::2] == (404, b"not found")


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _samples(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_endpoint_counts_requests_and_reports_readiness(demo_repo):
    from kserve_trio.worker.server import serve, stop

    running = serve(
        None,
        blocking=False,
        model_dirs=[str(demo_repo)],
        model_control_mode="static",
        endpoints={"port": 0, "metrics_port": free_port()},
    )
    try:
        port = running.metrics_port
        assert port == running.config.endpoints.metrics_port
        assert _get(port, "/healthz") == (200, "ok")
        assert _get(port, "/readyz") == (200, "ok")
        assert _get(port, "/other")[0] == 404
        before = _samples(_get(port, "/metrics")[1])
        c = grpcclient.InferenceServerClient(running.address)
        for _ in range(7):
            inp = grpcclient.InferInput("input_0", [2, 16], "FP32")
            inp.set_data_from_numpy(np.ones((2, 16), np.float32))
            c.infer("mlp", [inp])
        made_up = [f"nope-{i}" for i in range(5)]
        for name in made_up:
            with pytest.raises(InferenceServerException):
                c.infer(name, [inp])
        status, text = _get(port, "/metrics")
        assert status == 200
        after = _samples(text)
        key = ("worker_requests_total", (("model", "mlp"), ("status", "OK")))
        assert after[key] - before.get(key, 0.0) == 7
        # Models the worker does not have share one fixed label value: made-up names add no
        # label sets (the label cardinality a client can cause is bounded).
        unknown = ("worker_requests_total", (("model", UNKNOWN_MODEL), ("status", "NOT_FOUND")))
        assert after[unknown] - before.get(unknown, 0.0) == 5
        assert not any(name in text for name in made_up)
        models = {
            dict(labels)["model"] for name, labels in after if name == "worker_requests_total"
        }
        assert models == {"mlp", UNKNOWN_MODEL}
        unknown_latency = ("worker_request_latency_seconds_count", (("model", UNKNOWN_MODEL),))
        assert after[unknown_latency] - before.get(unknown_latency, 0.0) == 5
        served = ("worker_requests_served_total", (("model", "mlp"),))
        assert after[served] - before.get(served, 0.0) == 7
        rows = ("worker_rows_served_total", (("model", "mlp"),))
        assert after[rows] - before.get(rows, 0.0) == 14
        assert after[("worker_request_latency_seconds_count", (("model", "mlp"),))] >= 7
        assert after[("worker_models_loaded", ())] == 5
        assert ("worker_model_compilations_total", (("model", "cnn"),)) in after
        assert any(name.startswith("process_") for name, _ in after)
        assert any(name == "worker_info" for name, _ in after)
    finally:
        stop(running)


def test_readyz_turns_ready_only_after_every_model_compiled(demo_repo, tmp_path):
    import shutil
    import threading
    import time

    from kserve_trio.worker.server import serve, stop

    repo = tmp_path / "models"
    repo.mkdir()
    shutil.copytree(demo_repo / "mlp", repo / "mlp")
    shutil.copytree(demo_repo / "mlp_softmax", repo / "slow")
    go = tmp_path / "go"  # "slow" loads once the probe has seen the worker up and not ready
    code = (repo / "slow" / "model.py").read_text()
    hold = (
        "import pathlib, time\n"
        "_give_up = time.monotonic() + 60\n"
        f"while not pathlib.Path({str(go)!r}).exists() and time.monotonic() < _give_up:\n"
        "    time.sleep(0.01)\n"
    )
    (repo / "slow" / "model.py").write_text(hold + code)
    port = free_port()
    seen: list[tuple[int, int]] = []
    done = threading.Event()

    def probe():
        while not done.is_set():
            try:
                seen.append((_get(port, "/healthz")[0], _get(port, "/readyz")[0]))
            except OSError:
                pass
            if (200, 503) in seen:
                go.touch()
            time.sleep(0.05)  # the poll's period

    t = threading.Thread(target=probe)
    t.start()
    running = serve(
        None,
        blocking=False,
        model_dirs=[str(repo)],
        model_control_mode="static",
        endpoints={"port": 0, "metrics_port": port},
    )
    try:
        wait_until(lambda: (200, 200) in seen, 30, "/readyz ready")
    finally:
        done.set()
        t.join()
        stop(running)
    assert (200, 503) in seen, seen[:5]  # up but not ready while "slow" loads
    first_ready = seen.index((200, 200))
    assert all(r == 503 for _, r in seen[:first_ready])

"""Protocol features stock clients use, against the CLI worker with stock tritonclient:
ModelStreamInfer (mixed sizes, interleaved failures, a client that disconnects mid-stream),
Triton's log settings (a round trip that changes what the worker writes to its log), and BYTES
tensors through a bundle whose hooks turn text into tensors and back.

And our client's ``compression`` option against the same worker.

The repository holds the demo ``mlp``, the demo ``tokenize_sum`` (BYTES in, BYTES out) and
``sleepy``, a meta model whose ``run`` holds the device thread for the seconds it is given, so
that requests queue behind it deterministically.
"""

from __future__ import annotations

import json
import pathlib
import queue
import shutil
import threading
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from kserve_trio.client import InferInput, InferOutput, KServeModel, infer_sync, kserve_shutdown
from kserve_trio.export.demo import tokenize_sum_reference, write_demo_repository
from tests.e2e import reference as ref
from tests.e2e.conftest import WorkerProcess
from tests.gate_model import Gate, add_gate_model
from tests.ports import free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

SLEEPY_MANIFEST = """\
format_version: "2.0"
kind: meta
meta:
  calls: []
client_inputs:
  - {name: seconds, dtype: f32, shape: cn, dims: {c: 1}}
client_outputs:
  - {name: slept, dtype: f32, shape: cn, dims: {c: 1}}
"""

SLEEPY_MODEL_PY = """\
import time

from kserve_trio.core.tensors.tensor import NamedTensor


def run(inputs, call):
    (seconds,) = inputs
    time.sleep(float(seconds.data.reshape(-1)[0]))
    return [NamedTensor.from_array("slept", seconds.data.copy())]


register_meta_model("sleepy", run=run)
"""


def features_repository(root: pathlib.Path, demo_repo: pathlib.Path) -> pathlib.Path:
    """``root`` made a repository of the demo ``mlp``, ``tokenize_sum`` and ``sleepy``."""
    root.mkdir()
    shutil.copytree(demo_repo / "mlp", root / "mlp")
    write_demo_repository(root, only=["tokenize_sum"])
    (root / "sleepy").mkdir()
    (root / "sleepy" / "model.py").write_text(SLEEPY_MODEL_PY)
    (root / "sleepy" / "manifest.yaml").write_text(SLEEPY_MANIFEST)
    return root


@pytest.fixture(scope="module")
def repo(demo_repo, tmp_path_factory):
    return features_repository(tmp_path_factory.mktemp("features") / "models", demo_repo)


@pytest.fixture(scope="module")
def gate(repo) -> Gate:
    """The ``gate`` model in ``repo``: a request that holds the device until the test opens it."""
    return add_gate_model(repo)


@pytest.fixture(autouse=True)
def fresh_client():
    kserve_shutdown()
    yield
    kserve_shutdown()


@pytest.fixture(scope="module")
def worker(repo, gate):
    metrics_port = free_port()
    w = WorkerProcess(repo, "--metrics-port", str(metrics_port))
    w.metrics_port = metrics_port
    try:
        w.wait_ready()
        yield w
    finally:
        w.terminate()


def mlp_input(x: np.ndarray, datatype: str = "FP32") -> grpcclient.InferInput:
    inp = grpcclient.InferInput("input_0", list(x.shape), datatype)
    inp.set_data_from_numpy(x)
    return inp


def sample(worker, name: str, model: str | None = None, **labels) -> float:
    """The sum of a metric's samples with these labels (``model`` None: any model)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics") as r:
        text = r.read().decode()
    if model is not None:
        labels["model"] = model
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


# --------------------------------------------------------------------------------------------
# ModelStreamInfer


def test_twenty_streamed_requests_with_interleaved_failures(worker, repo):
    w = ref.weights(repo, "mlp")
    rng = np.random.default_rng(1)
    c = grpcclient.InferenceServerClient(worker.url)
    got: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: got.put((result, error)))
    good: dict[str, np.ndarray] = {}
    bad: list[str] = []
    try:
        for i in range(20):
            rid = f"m{i}"
            if i % 4 == 1:
                c.async_stream_infer("no_such_model", [mlp_input(np.ones((1, 16), np.float32))])
                bad.append("unknown model: no_such_model")
            elif i % 4 == 3:
                x64 = np.ones((2, 16), np.float64)
                c.async_stream_infer("mlp", [mlp_input(x64, "FP64")], request_id=rid)
                bad.append("input 'input_0' of model 'mlp' has datatype FP64, expected FP32")
            else:
                x = rng.standard_normal((1 + (i * 7) % 40, 16), dtype=np.float32)
                c.async_stream_infer("mlp", [mlp_input(x)], request_id=rid)
                good[rid] = x
        answers = [got.get(timeout=60) for _ in range(20)]
        errors = sorted(str(e.message()) for r, e in answers if e is not None)
        assert errors == sorted(bad)
        results = {r.get_response().id: r for r, e in answers if e is None}
        assert sorted(results) == sorted(good)
        for rid, x in good.items():
            np.testing.assert_allclose(
                results[rid].as_numpy("output"), ref.mlp(x, w), rtol=1e-5, atol=1e-5
            )
        x = np.full((3, 16), 0.5, np.float32)
        c.async_stream_infer("mlp", [mlp_input(x)], request_id="still-open")
        result, error = got.get(timeout=30)
        assert error is None and result.get_response().id == "still-open"
        np.testing.assert_allclose(result.as_numpy("output"), ref.mlp(x, w), rtol=1e-5, atol=1e-5)
    finally:
        c.stop_stream()


def test_a_client_that_disconnects_mid_stream_leaves_nothing_queued(worker, gate):
    served_before = sample(worker, "worker_requests_served_total", "mlp")
    cancelled_before = sample(worker, "worker_requests_total", "mlp", status="CANCELLED")
    holder = grpcclient.InferenceServerClient(worker.url)
    seconds = grpcclient.InferInput("seconds", [1, 1], "FP32")
    seconds.set_data_from_numpy(np.zeros((1, 1), np.float32))
    hold = threading.Thread(target=holder.infer, args=("gate", [seconds]), daemon=True)
    hold.start()  # the device thread runs it until the gate opens: mlp requests queue behind it
    try:
        gate.wait_started()
        c = grpcclient.InferenceServerClient(worker.url)
        c.start_stream(callback=lambda result, error: None)
        for i in range(10):
            c.async_stream_infer("mlp", [mlp_input(np.full((1, 16), i, np.float32))])
        wait_until(lambda: sample(worker, "worker_queue_depth", "mlp") == 10, what="10 queued")
        c.stop_stream(cancel_requests=True)  # the client goes away with ten requests queued
        wait_until(lambda: sample(worker, "worker_queue_depth", "mlp") == 0, what="queue emptied")
        assert gate.holding()  # emptied while the device was still busy
        assert sample(worker, "worker_requests_total", "mlp", status="CANCELLED") == (
            cancelled_before + 10
        )
    finally:
        gate.open()
    hold.join(30)
    assert not hold.is_alive()
    out = grpcclient.InferenceServerClient(worker.url).infer(
        "mlp", [mlp_input(np.ones((1, 16), np.float32))]
    )
    # a request still queued would have run before this one or in its batch: none did
    assert sample(worker, "worker_requests_served_total", "mlp") == served_before + 1
    assert out.as_numpy("output").shape == (1, 8)  # and the worker serves on


# --------------------------------------------------------------------------------------------
# our client's compression


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_our_clients_compression_against_the_cli_worker(worker, repo, algorithm):
    x = np.random.default_rng(9).standard_normal((12, 16), dtype=np.float32)
    with KServeModel(worker.url, "mlp", compression=algorithm, shared_memory="off") as m:
        response = infer_sync(m, [InferInput("input_0", x)])
    np.testing.assert_allclose(
        InferOutput("output", response), ref.mlp(x, ref.weights(repo, "mlp")), rtol=1e-5, atol=1e-5
    )


# --------------------------------------------------------------------------------------------
# log settings


def settings_of(reply: dict) -> dict:
    plain = {}
    for key, value in reply["settings"].items():
        ((_, v),) = value.items()
        plain[key] = v
    return plain


def log_lines_after(worker, mark: int) -> list[str]:
    return worker.logs()[mark:].splitlines()


def wait_for_log_line(worker, mark: int, needle: str, timeout: float = 10.0) -> list[str]:
    """The worker's log lines after ``mark`` once one of them holds ``needle`` (the worker logs
    a request after answering it, so the line may trail the reply)."""

    def lines_once_there() -> list[str] | None:
        lines = log_lines_after(worker, mark)
        return lines if any(needle in line for line in lines) else None

    return wait_until(lines_once_there, timeout, f"a log line with {needle!r} after the mark")


def test_log_settings_round_trip_and_change_what_the_worker_logs(worker):
    c = grpcclient.InferenceServerClient(worker.url)
    start = settings_of(c.get_log_settings(as_json=True))
    assert start == {
        "log_file": "",
        "log_info": True,
        "log_warning": True,
        "log_error": True,
        "log_verbose_level": 0,
        "log_format": "json",
    }
    x = np.ones((1, 16), np.float32)
    mark = len(worker.logs())
    c.infer("mlp", [mlp_input(x)], request_id="quiet-1")

    updated = settings_of(c.update_log_settings({"log_verbose_level": 1}, as_json=True))
    assert updated == {**start, "log_verbose_level": 1}
    assert settings_of(c.get_log_settings(as_json=True)) == updated
    c.infer("mlp", [mlp_input(x)], request_id="verbose-1")
    # One thread logs both requests in turn: once verbose-1's line is there, a line for
    # quiet-1 would be too, had it been logged.
    lines = wait_for_log_line(worker, mark, "verbose-1")
    assert not any("quiet-1" in line for line in lines)  # debug was off
    events = [json.loads(ln) for ln in lines if "verbose-1" in ln]
    assert [(e["event"], e["request_id"], e["status"]) for e in events] == [
        ("request_done", "verbose-1", "OK")
    ]

    updated = settings_of(c.update_log_settings({"log_format": "ISO8601"}, as_json=True))
    assert updated["log_format"] == "ISO8601"
    mark = len(worker.logs())
    c.infer("mlp", [mlp_input(x)], request_id="console-1")
    lines = wait_for_log_line(worker, mark, "console-1")
    (line,) = [ln for ln in lines if "console-1" in ln]
    assert not line.startswith("{") and "request_done" in line  # console lines now

    with pytest.raises(InferenceServerException) as info:
        c.update_log_settings({"log_file": "/tmp/worker.log", "log_info": False})
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "log_file" in info.value.message()
    assert settings_of(c.get_log_settings(as_json=True))["log_info"] is True  # all or nothing

    back = settings_of(
        c.update_log_settings({"log_verbose_level": 0, "log_format": "default"}, as_json=True)
    )
    assert back == start
    mark = len(worker.logs())
    c.infer("mlp", [mlp_input(x)], request_id="quiet-2")
    c.update_log_settings({"log_verbose_level": 1})
    c.infer("mlp", [mlp_input(x)], request_id="verbose-2")
    lines = wait_for_log_line(worker, mark, "verbose-2")
    assert not any("quiet-2" in line for line in lines)  # quiet again before verbose-2
    assert settings_of(c.update_log_settings({"log_verbose_level": 0}, as_json=True)) == start


def test_cuda_shared_memory_stays_unimplemented_by_name_and_trace_settings_read_off(worker):
    c = grpcclient.InferenceServerClient(worker.url)
    with pytest.raises(InferenceServerException) as info:
        c.get_cuda_shared_memory_status()
    assert info.value.status() == "StatusCode.UNIMPLEMENTED"
    assert info.value.message().startswith("CudaSharedMemoryStatus is not implemented")
    level = c.get_trace_settings(as_json=True)["settings"]["trace_level"]["value"]
    assert level == ["OFF"]  # this worker's configuration does not enable tracing


# --------------------------------------------------------------------------------------------
# BYTES tensors


def test_bytes_round_trip_through_a_hook_bundle(worker):
    c = grpcclient.InferenceServerClient(worker.url)
    meta = c.get_model_metadata("tokenize_sum", as_json=True)
    assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": ["-1"]}]
    texts = np.array(
        [b"hello world", b"", "na\u00efve caf\u00e9".encode(), b"\x00\xff a b"], object
    )
    inp = grpcclient.InferInput("text", [len(texts)], "BYTES")
    inp.set_data_from_numpy(texts)
    result = c.infer("tokenize_sum", [inp])
    want_counts, want_labels = tokenize_sum_reference(texts)
    np.testing.assert_array_equal(result.as_numpy("tokens"), want_counts)
    labels = result.as_numpy("label")
    assert labels.dtype == np.object_ and list(labels) == list(want_labels)

"""Structured logs: one debug event per request carrying its id; lifecycle events at info."""

from __future__ import annotations

import numpy as np
import pytest
import structlog
import tritonclient.grpc as grpcclient
from structlog.testing import capture_logs
from tritonclient.utils import InferenceServerException

from kserve_trio.worker.server import serve, stop


@pytest.fixture
def debug_logging():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(10))
    yield
    structlog.reset_defaults()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(0))


def test_request_logs_carry_model_id_batch_timings_and_status(demo_repo, debug_logging):
    with capture_logs() as logs:
        running = serve(
            None,
            blocking=False,
            model_dirs=[str(demo_repo)],
            model_control_mode="static",
            endpoints={"port": 0},
        )
        try:
            c = grpcclient.InferenceServerClient(running.address)
            inp = grpcclient.InferInput("input_0", [3, 16], "FP32")
            inp.set_data_from_numpy(np.ones((3, 16), np.float32))
            c.infer("mlp", [inp], request_id="req-abc")
            with pytest.raises(InferenceServerException):
                c.infer("nope", [inp], request_id="req-bad")
        finally:
            stop(running)
    done = {e["request_id"]: e for e in logs if e["event"] == "request_done"}
    ok = done["req-abc"]
    assert ok["model"] == "mlp" and ok["status"] == "OK" and ok["log_level"] == "debug"
    assert ok["batch_size"] == 8  # 3 rows padded to the compiled size 8
    assert ok["queue_ms"] >= 0 and ok["compute_ms"] > 0 and ok["duration_ms"] >= ok["compute_ms"]
    assert done["req-bad"]["status"] == "NOT_FOUND"
    events = [e["event"] for e in logs if e["log_level"] == "info"]
    assert "model_loaded" in events and "server_up" in events and "server_down" in events
    assert events.index("server_up") < events.index("server_down")

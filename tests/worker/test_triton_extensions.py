"""Triton's ModelConfig / ModelStatistics RPCs, heartbeat events and serve guards."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from kserve_trio.worker import heartbeat
from kserve_trio.worker.server import serve, stop
from tests.ports import free_port


def start(repo, **overrides):
    overrides.setdefault("endpoints", {"port": 0})
    return serve(
        None, blocking=False, model_dirs=[str(repo)], model_control_mode="static", **overrides
    )


def mlp_input(rows=1):
    inp = grpcclient.InferInput("input_0", [rows, 16], "FP32")
    inp.set_data_from_numpy(np.ones((rows, 16), np.float32))
    return inp


@pytest.fixture(scope="module")
def server(demo_repo):
    running = start(demo_repo)
    yield running
    stop(running)


def test_model_config_matches_the_manifest(server):
    c = grpcclient.InferenceServerClient(server.address)
    cfg = c.get_model_config("mlp", as_json=True)["config"]
    assert cfg["name"] == "mlp"
    assert cfg["platform"] == "jax"
    assert cfg["max_batch_size"] == 64
    assert cfg["input"] == [{"name": "input_0", "data_type": "TYPE_FP32", "dims": ["16"]}]
    assert cfg["output"] == [{"name": "output", "data_type": "TYPE_FP32", "dims": ["8"]}]
    assert cfg["dynamic_batching"]["preferred_batch_size"] == [1, 8, 32, 64]
    cfg = c.get_model_config("cnn", as_json=True)["config"]
    assert cfg["input"][0]["dims"] == ["3", "32", "32"]
    cfg = c.get_model_config("scale4", as_json=True)["config"]
    assert "max_batch_size" not in cfg  # 0: an unbatched model (proto3 omits the default)
    assert cfg["input"][0]["dims"] == ["4"]
    assert "dynamic_batching" not in cfg
    cfg = c.get_model_config("mlp_softmax", as_json=True)["config"]
    assert cfg["output"] == [{"name": "probs", "data_type": "TYPE_FP32", "dims": ["8"]}]
    with pytest.raises(InferenceServerException) as err:
        c.get_model_config("nope")
    assert err.value.status() == "StatusCode.NOT_FOUND"


def test_inference_statistics_count_the_requests_sent(demo_repo):
    running = start(demo_repo)
    try:
        c = grpcclient.InferenceServerClient(running.address)
        for rows in (1, 2, 3):
            c.infer("mlp", [mlp_input(rows)])
        with pytest.raises(InferenceServerException):
            c.infer(
                "mlp",
                [
                    grpcclient.InferInput("input_0", [1, 15], "FP32").set_data_from_numpy(
                        np.ones((1, 15), np.float32)
                    )
                ],
            )
        stats = c.get_inference_statistics("mlp", as_json=True)["model_stats"]
        assert len(stats) == 1
        s = stats[0]
        assert s["name"] == "mlp"
        assert int(s["inference_count"]) == 6  # rows
        assert int(s["execution_count"]) == 3
        inf = s["inference_stats"]
        assert int(inf["success"]["count"]) == 3
        assert int(inf["fail"]["count"]) == 1
        assert int(inf["success"]["ns"]) > 0
        assert int(inf["compute_infer"]["count"]) == 3
        assert int(inf["queue"]["count"]) == 3
        sizes = {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in s["batch_stats"]}
        assert sum(sizes.values()) == 3 and set(sizes) <= {1, 8}
        everything = c.get_inference_statistics(as_json=True)["model_stats"]
        assert {m["name"] for m in everything} == {
            "cnn",
            "mlp",
            "mlp_bf16",
            "mlp_softmax",
            "scale4",
        }
    finally:
        stop(running)


def test_heartbeat_events_arrive_in_order(demo_repo):
    events: list[tuple[str, object]] = []

    def beat(event, detail):
        events.append((event, detail if isinstance(detail, str) else type(detail).__name__))

    def broken(event, detail):
        raise RuntimeError("a heartbeat that fails must not break serving")

    heartbeat.register_heartbeat(beat)
    heartbeat.register_heartbeat(broken)
    try:
        running = start(demo_repo)
        c = grpcclient.InferenceServerClient(running.address)
        c.infer("mlp", [mlp_input()])
        with pytest.raises(InferenceServerException):
            c.infer("nope", [mlp_input()])
        stop(running)
    finally:
        heartbeat.unregister_heartbeat(beat)
        heartbeat.unregister_heartbeat(broken)
    assert events == [
        ("up", "ServerConfig"),
        ("request", "mlp"),
        ("request", "nope"),
        ("down", "ServerConfig"),
    ]


def test_a_raising_guard_stops_serve_before_any_port_is_bound(demo_repo):
    port = free_port()
    calls: list[int] = []

    def first(cfg):
        calls.append(1)

    def refuse(cfg):
        calls.append(2)
        raise PermissionError(f"refusing to serve on {cfg.endpoints.port}")

    heartbeat.register_serve_guard(first)
    heartbeat.register_serve_guard(refuse)
    try:
        with pytest.raises(PermissionError, match=f"refusing to serve on {port}"):
            serve(None, blocking=False, model_dirs=[str(demo_repo)], endpoints={"port": port})
    finally:
        heartbeat.unregister_serve_guard(first)
        heartbeat.unregister_serve_guard(refuse)
    assert calls == [1, 2]
    import socket

    with socket.socket() as s:  # the port was never bound
        s.bind(("127.0.0.1", port))

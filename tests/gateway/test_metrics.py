"""The gateway's metric families: names, labels, per-instance registries, scrape-time series."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kserve_trio.core.errors import StatusCode
from kserve_trio.gateway.config import WorkBasis
from kserve_trio.gateway.fleet.routing import LeastOutstanding, RoundRobin, build_routing_table
from kserve_trio.gateway.metrics import LATENCY_BUCKETS, GatewayMetrics, status_label


def parsed(metrics: GatewayMetrics) -> dict:
    text = metrics.exposition().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(fams: dict, family: str, sample: str | None = None) -> list:
    return [s for s in fams[family].samples if sample is None or s.name == sample]


def test_status_labels_are_camel_case():
    assert status_label(StatusCode.OK) == "OK"
    assert status_label(StatusCode.NOT_FOUND) == "NotFound"
    assert status_label(StatusCode.DEADLINE_EXCEEDED) == "DeadlineExceeded"
    assert status_label(StatusCode.RESOURCE_EXHAUSTED) == "ResourceExhausted"
    assert status_label(3) == "InvalidArgument"


def test_request_and_worker_series_carry_their_labels():
    m = GatewayMetrics()
    m.observe_request("ModelInfer", "mlp", StatusCode.OK, 0.002)
    m.observe_request("ModelInfer", "mlp", StatusCode.OK, 0.004)
    m.observe_request("ModelInfer", "mlp", StatusCode.INVALID_ARGUMENT, 0.001)
    m.observe_request("SystemSharedMemoryRegister", "region0", StatusCode.OK, 0.001)
    m.observe_worker_call("ModelInfer", "gpu0", 0.0015)
    fams = parsed(m)
    counts = {
        (s.labels["rpc"], s.labels["model"], s.labels["status"]): s.value
        for s in samples(fams, "gateway_requests", "gateway_requests_total")
    }
    assert counts == {
        ("ModelInfer", "mlp", "OK"): 2.0,
        ("ModelInfer", "mlp", "InvalidArgument"): 1.0,
        ("SystemSharedMemoryRegister", "region0", "OK"): 1.0,
    }
    (count,) = [
        s
        for s in samples(
            fams, "gateway_request_latency_seconds", "gateway_request_latency_seconds_count"
        )
        if s.labels["model"] == "mlp"
    ]
    assert count.value == 3.0
    (worker,) = samples(
        fams, "gateway_worker_latency_seconds", "gateway_worker_latency_seconds_count"
    )
    assert worker.labels == {"rpc": "ModelInfer", "worker": "gpu0"} and worker.value == 1.0
    buckets = samples(
        fams, "gateway_worker_latency_seconds", "gateway_worker_latency_seconds_bucket"
    )
    assert len(buckets) == len(LATENCY_BUCKETS) + 1  # + the +Inf bucket


def test_prober_series_and_forgetting_a_worker():
    m = GatewayMetrics()
    m.routing_table_size.set(3)
    m.set_worker_ready("gpu0", True)
    m.set_worker_ready("gpu1", False)
    m.set_worker_metrics_up("gpu0", False)
    m.observe_worker_call("ModelInfer", "gpu1", 0.1)
    fams = parsed(m)
    assert samples(fams, "gateway_routing_table_size")[0].value == 3.0
    ready = {s.labels["worker"]: s.value for s in samples(fams, "gateway_worker_ready")}
    assert ready == {"gpu0": 1.0, "gpu1": 0.0}
    assert samples(fams, "gateway_worker_metrics_up")[0].value == 0.0
    m.forget_worker("gpu1")
    m.forget_worker("never-seen")
    fams = parsed(m)
    assert [s.labels["worker"] for s in samples(fams, "gateway_worker_ready")] == ["gpu0"]
    assert samples(fams, "gateway_worker_latency_seconds") == []


def test_admission_series_are_read_at_scrape_time():
    state = {"inflight": 2}
    m = GatewayMetrics(inflight=lambda: state["inflight"], max_concurrent=lambda: 128)
    m.shed.inc()
    fams = parsed(m)
    assert samples(fams, "gateway_inflight_requests")[0].value == 2.0
    assert samples(fams, "gateway_max_concurrent_requests")[0].value == 128.0
    assert samples(fams, "gateway_requests_shed", "gateway_requests_shed_total")[0].value == 1.0
    state["inflight"] = 5
    assert samples(parsed(m), "gateway_inflight_requests")[0].value == 5.0


def test_inflight_work_per_worker_only_for_a_policy_with_load_counters():
    lo = LeastOutstanding(WorkBasis.ITEMS)
    table = build_routing_table({"w1": ["m"]})
    sel = lo.select("m", 8, table)
    m = GatewayMetrics(policy=lo, workers=lambda: ["w2", "w0", "w1"])
    work = [
        (s.labels["worker"], s.labels["basis"], s.value)
        for s in samples(parsed(m), "gateway_worker_inflight_work")
    ]
    assert work == [("w0", "items", 0.0), ("w1", "items", 8.0), ("w2", "items", 0.0)]
    sel.reservation.release()
    after = [s.value for s in samples(parsed(m), "gateway_worker_inflight_work")]
    assert after == [0.0, 0.0, 0.0]
    rr = GatewayMetrics(policy=RoundRobin(), workers=lambda: ["w0"])
    assert "gateway_worker_inflight_work" not in parsed(rr)


def test_each_gateway_has_its_own_registry():
    a, b = GatewayMetrics(), GatewayMetrics()
    a.observe_request("ModelInfer", "m", StatusCode.OK, 0.01)
    assert samples(parsed(b), "gateway_requests", "gateway_requests_total") == []
    assert len(samples(parsed(a), "gateway_requests", "gateway_requests_total")) == 1
    assert "process_cpu_seconds" in parsed(a)


def test_client_chosen_model_names_cannot_grow_the_series_without_bound():
    from kserve_trio.gateway import metrics as gm

    m = GatewayMetrics()
    for i in range(50):
        m.observe_request("ModelInfer", f"made-up-{i}", StatusCode.NOT_FOUND, 0.001)
    text = generate_latest(m.registry).decode()
    assert 'model="<unknown>"' in text
    assert "made-up-" not in text
    for i in range(gm.MAX_MODEL_LABELS + 10):
        m.observe_request("ModelInfer", f"m{i}", StatusCode.OK, 0.001)
    text = generate_latest(m.registry).decode()
    assert 'model="<other>"' in text
    assert f'model="m{gm.MAX_MODEL_LABELS + 5}"' not in text
    assert 'model="m0"' in text

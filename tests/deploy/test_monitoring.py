"""The monitoring assets (deploy/monitoring/): the dashboards are what their builder writes,
every query parses as PromQL and names a metric that a live worker or a live gateway really
exposes (GPU-only device-memory series aside, in a list checked against the worker's own
code; the gateway's also against its metric registry, without starting anything; lpt_packing's
placement series against a live gateway running in that mode, in front of a fifo worker), and
the scrape configuration keeps exactly the admin ports."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kserve_trio.core.errors import StatusCode
from kserve_trio.gateway.config import SchedulingConfig, SchedulingMode, load_gateway_config
from kserve_trio.gateway.fleet.routing import build_routing_table, make_policy
from kserve_trio.gateway.metrics import GatewayMetrics
from kserve_trio.gateway.placement.metrics import LptCollector
from kserve_trio.gateway.placement.policy import LptPacking
from kserve_trio.gateway.placement.scheduler import LptScheduler
from kserve_trio.proto import reactant_control as rc
from kserve_trio.worker import metrics as worker_metrics
from tests.deploy.manifests import DEPLOY, find, load_yaml_file, pod_spec, port_numbers
from tests.gateway.procs import Gateway, Worker
from tests.ports import free_port

GRAFANA = DEPLOY / "monitoring" / "grafana"
PROMETHEUS = DEPLOY / "monitoring" / "prometheus"

GPU_ONLY_METRICS = frozenset(
    {"worker_device_memory_peak_in_use_bytes", "worker_device_memory_pool_bytes"}
)
"""Device-memory series only a GPU allocator reports (a CPU worker reports in-use and limit)."""

LPT_METRICS = frozenset(
    {
        "gateway_placement_weight",
        "gateway_model_utilization",
        "gateway_model_replicas",
        "gateway_replica_outstanding",
        "gateway_model_fill_quantum",
        "gateway_repacks_total",
        "gateway_replica_routed_total",
    }
)
"""The series only a gateway in lpt_packing exposes (its scheduler's), checked against the
collector's own output below."""

SCRAPE_LABELS = frozenset({"namespace", "pod", "component", "inferenceservice"})
"""Labels the scrape configuration adds to every target (the dashboards filter on them)."""


def load_builder():
    path = GRAFANA / "dashboards.py"
    spec = importlib.util.spec_from_file_location("kserve_trio_grafana_dashboards", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted((GRAFANA / "dashboards").glob("*"))}


def queries() -> list[str]:
    """Every PromQL expression of every dashboard: panel targets, and the series each
    ``label_values(SERIES, label)`` variable reads."""
    out = []
    for board in dashboards().values():
        for panel in board["panels"]:
            out += [t["expr"] for t in panel.get("targets", [])]
        for var in board["templating"]["list"]:
            if var["type"] == "query":
                m = re.fullmatch(r"label_values\((.+), *(\w+)\)", var["query"]["query"])
                assert m, var["query"]
                out.append(m.group(1))
    return [q.replace("$__rate_interval", "5m") for q in out]


@pytest.fixture(scope="module")
def parsed(checker) -> list[dict]:
    result = checker(promql=queries())["promql"]
    return result


def test_the_dashboards_are_what_the_builder_writes():
    builder = load_builder()
    files = {f"{d.uid}.json": builder.render(d) for d in builder.DASHBOARDS}
    assert {p.name: p.read_text() for p in (GRAFANA / "dashboards").glob("*")} == files
    assert len(files) == 3


def test_every_query_parses_and_names_its_metric(parsed):
    assert len(parsed) >= 50
    for query, result in zip(queries(), parsed, strict=True):
        assert result["error"] is None, (query, result["error"])
        assert result["names"], query
        assert None not in result["names"], f"selector without a metric name: {query}"


def test_the_promql_check_catches_a_broken_query(checker):
    bad = checker(promql=["sum(rate(worker_requests_total[5m])", '{__name__="x"}'])["promql"]
    assert bad[0]["error"]
    assert bad[1]["names"] == [None]


def dashboard_metrics(parsed) -> set[str]:
    return {n for r in parsed for n in r["names"]}


def test_the_dashboards_cover_every_area(parsed):
    names = dashboard_metrics(parsed)
    for metric in (
        "worker_requests_total",  # requests per model
        "worker_request_latency_seconds_bucket",  # latency per model
        "worker_queue_depth",  # queue depth
        "worker_queue_wait_seconds",  # queue wait
        "worker_rows_served_total",  # batch sizes
        "worker_model_max_batch_size",
        "worker_model_resident",  # residency
        "worker_weight_loads_total",  # weight-cache activity
        "worker_weight_evicts_total",
        "worker_device_memory_in_use_bytes",  # device memory
        "gateway_worker_latency_seconds_count",  # gateway routing
        "gateway_worker_inflight_work",  # replica load
        "gateway_worker_ready",
        *LPT_METRICS,  # lpt_packing placement
    ):
        assert metric in names, metric


def sample_names(exposition: str) -> dict[str, set[str]]:
    """Sample name -> the label names it is exposed with."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(exposition):
        for s in family.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def gateway_exposition() -> dict[str, set[str]]:
    """The gateway's registry, configured as the fleet's gateway is, after one of everything it
    records (a request, a worker call, a shed, a prober round)."""
    cfg_path = DEPLOY / "k8s" / "base" / "config" / "gateway.yaml"
    cfg = load_gateway_config(cfg_path, env={}, check_files=False).config
    policy = make_policy(cfg.scheduling)
    sel = policy.select("mlp", 4, build_routing_table({"gpu0/10.0.0.1:9000": ["mlp"]}))
    m = GatewayMetrics(
        inflight=lambda: 1, max_concurrent=lambda: 64, policy=policy, workers=lambda: ["w"]
    )
    m.observe_request("ModelInfer", "mlp", StatusCode.OK, 0.002)
    m.observe_request("SystemSharedMemoryRegister", "region", StatusCode.NOT_FOUND, 0.001)
    m.observe_worker_call("ModelInfer", "gpu0/10.0.0.1:9000", 0.0015)
    m.set_worker_ready("gpu0/10.0.0.1:9000", True)
    m.set_worker_metrics_up("gpu0/10.0.0.1:9000", False)
    m.routing_table_size.set(1)
    m.shed.inc()
    try:
        return sample_names(m.exposition().decode())
    finally:
        sel.reservation.release()


def lpt_exposition() -> dict[str, set[str]]:
    """A gateway registry with lpt_packing's collector, after a start-up repack over two
    workers and one routed request (no I/O: the scheduler's rules are plain code)."""
    replies = {
        w: rc.ModelControlStatusResponse(
            discipline="fifo", models=[rc.ModelStatus(name="mlp", weight_nbytes=10)]
        )
        for w in ("gpu0", "gpu1")
    }
    cfg = SchedulingConfig(mode=SchedulingMode.LPT_PACKING)
    policy = LptPacking(cfg.basis)
    scheduler = LptScheduler(cfg, policy, clients=dict)
    scheduler.begin(replies)
    sel = policy.select("mlp", 4, build_routing_table({"gpu0": ["mlp"], "gpu1": ["mlp"]}))
    m = GatewayMetrics(policy=policy, workers=lambda: ["gpu0", "gpu1"])
    m.add_collector(LptCollector(scheduler))
    try:
        return sample_names(m.exposition().decode())
    finally:
        sel.reservation.release()


def test_the_lpt_metric_list_is_what_the_lpt_collector_exposes():
    lpt = lpt_exposition()
    plain = gateway_exposition()
    assert set(lpt) - set(plain) - {"gateway_worker_inflight_work"} == LPT_METRICS


def check_selectors(
    parsed, exposed: dict[str, set[str]], prefix: str, skip: frozenset[str] = frozenset()
) -> None:
    for query, result in zip(queries(), parsed, strict=True):
        for name, labels in result["selectors"]:
            if not name.startswith(prefix) and not (
                prefix == "worker_" and name.startswith("process_")
            ):
                continue
            if name in GPU_ONLY_METRICS or name in skip:
                continue
            assert name in exposed, f"{name} is not exposed ({query})"
            missing = set(labels) - exposed[name] - SCRAPE_LABELS
            assert not missing, f"{name} has no label {missing} ({query})"


def test_every_gateway_metric_is_in_the_gateways_registry(parsed):
    exposed = {**gateway_exposition(), **lpt_exposition()}
    check_selectors(parsed, exposed, "gateway_")
    used = {n for n in dashboard_metrics(parsed) if n.startswith("gateway_")}
    assert len(used) >= 8


class _Backend:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def device_series_names(stats) -> set[str]:
    return {f.name for f in worker_metrics._device_series(_Backend(stats))}


def test_the_gpu_only_metrics_are_the_ones_only_a_gpu_allocator_yields():
    """A CPU backend reports bytes_in_use and bytes_limit (docs/residency.md); the GPU
    allocator adds its peak and pool figures, and those are exactly the GPU-only series."""
    cpu = device_series_names({"bytes_in_use": 10, "bytes_limit": 100})
    gpu = device_series_names(
        {
            "bytes_in_use": 10,
            "bytes_limit": 100,
            "peak_bytes_in_use": 50,
            "pool_bytes": 90,
            "num_allocs": 3,
            "largest_alloc_size": 8,
        }
    )
    assert cpu == {
        "worker_device_memory_in_use_bytes",
        "worker_device_memory_limit_bytes",
        "worker_device_memory_free_bytes",
    }
    assert gpu - cpu == GPU_ONLY_METRICS


@pytest.fixture(scope="module")
def live_lpt_gateway(demo_repo, tmp_path_factory):
    """The gateway CLI in lpt_packing in front of one fifo CLI worker serving mlp (the fleet's
    node runs the fair discipline, which lpt_packing refuses), after a few requests and an
    operator repack, so every placement series has samples."""
    work = tmp_path_factory.mktemp("lpt-monitoring")
    worker = Worker(
        demo_repo,
        "127.0.0.1",
        free_port(),
        env={
            "INFERENCE_SERVER_SCHEDULER_DISCIPLINE": "fifo",
            "INFERENCE_SERVER_RUNTIME_CPU_DEVICE_MEMORY_BYTES": str(64 << 20),
        },
    )
    gateway = None
    try:
        worker.wait_ready()
        g = "KSERVE_TRIO_GATEWAY_"
        gateway = Gateway(work, {g + "WORKERS": worker.url, g + "SCHEDULING_MODE": "lpt_packing"})
        gateway.wait_ready()
        yield gateway
    finally:
        if gateway is not None:
            assert gateway.stop() == 0, gateway.logs()
        worker.stop()


def exercise(url: str) -> None:
    """A few good requests and one the worker refuses, through the gateway at ``url``."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url)
    for rows in (1, 3, 5):
        x = np.ones((rows, 16), np.float32)
        inp = grpcclient.InferInput("input_0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        client.infer("mlp", [inp])
    bad = grpcclient.InferInput("input_0", [1, 15], "FP32")
    bad.set_data_from_numpy(np.ones((1, 15), np.float32))
    with pytest.raises(InferenceServerException):
        client.infer("mlp", [bad])


@pytest.mark.slow
def test_the_placement_metrics_are_exposed_by_a_live_lpt_gateway(live_lpt_gateway, parsed):
    """Every gateway series the dashboards query, lpt_packing's placement ones included, with
    the labels they filter on, on the /metrics of a live gateway in lpt_packing."""
    exercise(live_lpt_gateway.url)
    status, text = live_lpt_gateway.admin("/metrics")
    assert status == 200
    exposed = sample_names(text)
    check_selectors(parsed, exposed, "gateway_")
    assert LPT_METRICS <= exposed.keys()
    used = {n for n in dashboard_metrics(parsed) if n.startswith("gateway_")}
    assert LPT_METRICS <= used and used <= exposed.keys()
    assert 'gateway_repacks_total{trigger="startup"} 1.0' in text


@pytest.mark.slow
def test_every_metric_is_exposed_by_the_live_worker_and_gateway(
    live_node, live_gateway, live_lpt_gateway, parsed
):
    """After a few requests through the fleet's gateway to the live worker (one of them
    failing), the worker's /metrics has every worker series the dashboards query and the
    gateway's /metrics every gateway series but lpt_packing's (the fleet's gateway runs
    least_outstanding; the live lpt_packing gateway has those), with the labels they filter
    on; the GPU-only ones are absent on this CPU worker and nothing else is left unaccounted
    for."""
    exercise(live_gateway.grpc)
    status, text = live_node.get("/metrics")
    assert status == 200
    worker = sample_names(text)
    check_selectors(parsed, worker, "worker_")
    assert not GPU_ONLY_METRICS & worker.keys()
    status, gateway_text = live_gateway.get("/metrics")
    assert status == 200
    gateway = sample_names(gateway_text)
    check_selectors(parsed, gateway, "gateway_", skip=LPT_METRICS)
    assert not LPT_METRICS & gateway.keys()
    _, lpt_text = live_lpt_gateway.admin("/metrics")
    lpt = sample_names(lpt_text)
    for name in dashboard_metrics(parsed):
        assert name in worker or name in gateway or name in lpt or name in GPU_ONLY_METRICS, name
    for exposition, family in (
        (text, "worker_requests_total"),
        (gateway_text, "gateway_requests_total"),
    ):
        statuses = {
            s.labels["status"]
            for f in text_string_to_metric_families(exposition)
            for s in f.samples
            if s.name == family
        }
        assert "OK" in statuses and len(statuses) == 2, statuses  # the error-ratio panels


# ---------------------------------------------------------------------------------------------
# Prometheus


def scrape_jobs(name: str) -> dict[str, dict]:
    (config,) = load_yaml_file(PROMETHEUS / name)
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert len(jobs) == len(config["scrape_configs"])
    return jobs


def keep_rule(job: dict, label: str) -> re.Pattern[str]:
    (rule,) = [
        r
        for r in job["relabel_configs"]
        if r.get("action") == "keep" and r["source_labels"] == [label]
    ]
    return re.compile(rule["regex"])


def test_the_fleet_scrape_job_keeps_exactly_the_admin_ports(rendered):
    job = scrape_jobs("prometheus.yml")["kserve-trio"]
    ports = keep_rule(job, "__meta_kubernetes_pod_container_port_name")
    for overlay in ("base", "cpu"):
        for kind, admin, other in (
            ("StatefulSet", "metrics", "grpc"),
            ("Deployment", "admin", "grpc"),
        ):
            (workload,) = find(rendered[overlay], kind)
            (c,) = pod_spec(workload)["containers"]
            names = port_numbers(c)
            assert ports.fullmatch(admin) and admin in names
            assert not ports.fullmatch(other) and other in names
            labels = workload["spec"]["template"]["metadata"]["labels"]
            name = keep_rule(job, "__meta_kubernetes_pod_label_app_kubernetes_io_name")
            assert name.fullmatch(labels["app.kubernetes.io/name"])
    assert ports.fullmatch("metrics-3")
    targets = {r.get("target_label") for r in job["relabel_configs"]}
    assert {"namespace", "pod", "__metrics_path__"} <= targets


def test_the_kserve_scrape_job_finds_the_runtimes_admin_port():
    job = scrape_jobs("prometheus.yml")["kserve-trio-kserve"]
    (rt,) = load_yaml_file(DEPLOY / "kserve" / "clusterservingruntime.yaml")
    (c,) = rt["spec"]["containers"]
    (rule,) = [
        r
        for r in job["relabel_configs"]
        if len(r["source_labels"]) == 2 and r.get("action") == "keep"
    ]
    assert re.fullmatch(rule["regex"], f"{c['name']};{c['ports'][0]['name']}")
    (address,) = [r for r in job["relabel_configs"] if r.get("target_label") == "__address__"]
    port = rt["spec"]["annotations"]["prometheus.kserve.io/port"]
    m = re.fullmatch(address["regex"], f"10.1.2.3;{port}")
    assert m and m.expand(address["replacement"].replace("$", "\\")) == "10.1.2.3:8002"
    targets = {r.get("target_label") for r in job["relabel_configs"]}
    assert {"namespace", "pod"} <= targets


def test_the_docker_scrape_config_targets_the_admin_port():
    (job,) = scrape_jobs("prometheus-docker.yml").values()
    (static,) = job["static_configs"]
    assert [t.rsplit(":", 1)[1] for t in static["targets"]] == ["8002"]
    assert {"namespace", "pod"} <= set(static["labels"])


def test_the_monitoring_kustomization_ships_every_dashboard(rendered):
    (cm,) = find(rendered["monitoring"], "ConfigMap", "kserve-trio-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert set(cm["data"]) == set(dashboards())
    (prom,) = find(rendered["monitoring"], "ConfigMap", "kserve-trio-prometheus")
    assert prom["data"]["prometheus.yml"] == (PROMETHEUS / "prometheus.yml").read_text()


def test_grafana_provisioning_points_at_the_dashboards():
    (provider,) = load_yaml_file(GRAFANA / "provisioning" / "dashboards" / "kserve-trio.yaml")
    path = Path(provider["providers"][0]["options"]["path"])
    assert path.is_absolute()
    (ds,) = load_yaml_file(GRAFANA / "provisioning" / "datasources" / "prometheus.yaml")
    assert ds["datasources"][0]["type"] == "prometheus"
    for board in dashboards().values():
        assert board["templating"]["list"][0]["query"] == "prometheus"

"""The Grafana dashboards over the metrics kserve_trio exports, as compact panel lists.

``python deploy/monitoring/grafana/dashboards.py`` writes ``dashboards/*.json`` next to this
file; tests/deploy/test_monitoring.py checks the committed JSON is what this builds and that
every query names a metric a live worker or the gateway exposes. Every query filters on the
dashboard variables (namespace, pod, model) so one Prometheus can hold several fleets.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or loaded by path
from grafana_model import Dashboard, Panel, rate, render, sel

HERE = Path(__file__).resolve().parent
OUT = HERE / "dashboards"

W = 'namespace=~"$namespace", pod=~"$pod"'
"""Label filter of every worker series (namespace and pod are added by the scrape config)."""
WM = W + ', model=~"$model"'
G = 'namespace=~"$namespace"'


WORKER_VARS = (
    ("namespace", "label_values(worker_info, namespace)"),
    ("pod", 'label_values(worker_info{namespace=~"$namespace"}, pod)'),
    ("model", 'label_values(worker_model_max_batch_size{namespace=~"$namespace"}, model)'),
)

MODELS = Dashboard(
    uid="kserve-trio-models",
    title="kserve_trio / models: requests, latency, queues, batching",
    description="Per-model traffic on the workers: requests and latency, queue depth and "
    "wait, how requests coalesce into batches, device compute.",
    variables=WORKER_VARS,
    rows=(
        (
            "Requests and latency",
            (
                Panel(
                    "Requests by model and status",
                    "reqps",
                    (
                        (
                            f"sum by (model, status) ({rate(f'worker_requests_total{{{WM}}}')})",
                            "{{model}} {{status}}",
                        ),
                    ),
                    "ModelInfer calls finished per second, by gRPC status.",
                ),
                Panel(
                    "Error ratio by model",
                    "percentunit",
                    (
                        (
                            "sum by (model) ("
                            + rate(f'worker_requests_total{{{WM}, status!="OK"}}')
                            + ") / sum by (model) ("
                            + rate(f"worker_requests_total{{{WM}}}")
                            + ")",
                            "{{model}}",
                        ),
                    ),
                    "Share of calls that did not end OK.",
                ),
                Panel(
                    "Latency p50 / p99 by model",
                    "s",
                    tuple(
                        (
                            f"histogram_quantile({q}, sum by (le, model) ("
                            + rate(f"worker_request_latency_seconds_bucket{{{WM}}}")
                            + "))",
                            f"{{{{model}}}} p{label}",
                        )
                        for q, label in (("0.5", "50"), ("0.99", "99"))
                    ),
                    "Receive to reply, at the worker.",
                ),
                Panel(
                    "Mean latency by model",
                    "s",
                    (
                        (
                            "sum by (model) ("
                            + rate(f"worker_request_latency_seconds_sum{{{WM}}}")
                            + ") / sum by (model) ("
                            + rate(f"worker_request_latency_seconds_count{{{WM}}}")
                            + ")",
                            "{{model}}",
                        ),
                    ),
                ),
            ),
        ),
        (
            "Queues",
            (
                Panel(
                    "Queue depth by model",
                    "short",
                    ((f"sum by (model) (worker_queue_depth{{{WM}}})", "{{model}}"),),
                    "Requests waiting in the scheduler's per-model queues.",
                ),
                Panel(
                    "Queue wait p50 / p99 by model",
                    "s",
                    tuple(
                        (
                            f'max by (model) (worker_queue_wait_seconds{{{WM}, quantile="{q}"}})',
                            f"{{{{model}}}} p{label}",
                        )
                        for q, label in (("0.5", "50"), ("0.99", "99"))
                    ),
                    "Percentiles of recent requests' queue wait, worst worker.",
                ),
                Panel(
                    "In-flight requests and cap by worker",
                    "short",
                    (
                        (
                            f"sum by (pod, worker) (worker_inflight_requests{{{W}}})",
                            "{{pod}}/{{worker}}",
                        ),
                        (
                            f"max by (pod, worker) (worker_max_concurrent_requests{{{W}}})",
                            "cap {{pod}}/{{worker}}",
                        ),
                    ),
                    "Calls in flight against the concurrency cap (0 = uncapped).",
                ),
                Panel(
                    "Requests shed at the cap",
                    "reqps",
                    (
                        (
                            f"sum by (pod, worker) ({rate(f'worker_requests_shed_total{{{W}}}')})",
                            "{{pod}}/{{worker}}",
                        ),
                    ),
                    "Calls refused RESOURCE_EXHAUSTED because the worker was at its cap.",
                ),
            ),
        ),
        (
            "Batching and compute",
            (
                Panel(
                    "Dispatches by model",
                    "ops",
                    ((f"sum by (model) ({rate(f'worker_dispatch_total{{{WM}}}')})", "{{model}}"),),
                    "Device executions per second.",
                ),
                Panel(
                    "Mean batch size (rows per dispatch) by model",
                    "short",
                    (
                        (
                            f"sum by (model) ({rate(f'worker_rows_served_total{{{WM}}}')})"
                            f" / sum by (model) ({rate(f'worker_dispatch_total{{{WM}}}')})",
                            "{{model}} rows",
                        ),
                        (
                            f"sum by (model) ({rate(f'worker_requests_served_total{{{WM}}}')})"
                            f" / sum by (model) ({rate(f'worker_dispatch_total{{{WM}}}')})",
                            "{{model}} requests",
                        ),
                        (f"max by (model) (worker_model_max_batch_size{{{WM}}})", "{{model}} max"),
                    ),
                    "Rows and requests coalesced into one execution, against the effective "
                    "max batch size.",
                ),
                Panel(
                    "Device compute by model",
                    "percentunit",
                    (
                        (
                            f"sum by (model) ({rate(f'worker_compute_seconds_total{{{WM}}}')})",
                            "{{model}}",
                        ),
                    ),
                    "Seconds of device compute per second (1 = one device busy).",
                ),
                Panel(
                    "Compilations by model",
                    "short",
                    ((f"sum by (model) (worker_model_compilations_total{{{WM}}})", "{{model}}"),),
                    "Bundle compilations since the worker started.",
                ),
            ),
        ),
    ),
)

MEMORY = Dashboard(
    uid="kserve-trio-memory",
    title="kserve_trio / memory: residency, weight cache, device memory",
    description="Which models' weights are on the device, the on-demand weight cache's "
    "budget and traffic, and the device memory pool.",
    variables=WORKER_VARS,
    rows=(
        (
            "Residency",
            (
                Panel(
                    "Models loaded and resident by worker",
                    "short",
                    (
                        (
                            f"sum by (pod, worker) (worker_models_loaded{{{W}}})",
                            "loaded {{pod}}/{{worker}}",
                        ),
                        (
                            f"sum by (pod, worker) (worker_models_resident{{{W}}})",
                            "resident {{pod}}/{{worker}}",
                        ),
                    ),
                ),
                Panel(
                    "Device-resident weight bytes by worker",
                    "bytes",
                    (
                        (
                            f"sum by (pod, worker) (worker_resident_weight_bytes{{{W}}})",
                            "{{pod}}/{{worker}}",
                        ),
                    ),
                ),
                Panel(
                    "Model resident (1) / pinned to the device (1)",
                    "short",
                    (
                        (f"max by (model) (worker_model_resident{{{WM}}})", "resident {{model}}"),
                        (f"max by (model) (worker_model_pinned{{{WM}}})", "pinned {{model}}"),
                    ),
                    "Per model, on any worker.",
                ),
                Panel(
                    "Weight footprint by model",
                    "bytes",
                    ((f"max by (model) (worker_model_weight_bytes{{{WM}}})", "{{model}}"),),
                ),
            ),
        ),
        (
            "Weight cache (on-demand residency)",
            (
                Panel(
                    "Weight cache budget by worker",
                    "bytes",
                    (
                        (
                            f"sum by (pod, worker) (worker_weight_cache_resident_bytes{{{W}}})",
                            "on-demand resident {{pod}}/{{worker}}",
                        ),
                        (
                            f"sum by (pod, worker) (worker_weight_cache_max_bytes{{{W}}})",
                            "on-demand budget {{pod}}/{{worker}}",
                        ),
                        (
                            f"sum by (pod, worker) (worker_weight_cache_pinned_bytes{{{W}}})",
                            "pinned {{pod}}/{{worker}}",
                        ),
                        (
                            f"sum by (pod, worker) (worker_weight_pool_bytes{{{W}}})",
                            "pool {{pod}}/{{worker}}",
                        ),
                        (
                            f"sum by (pod, worker) (worker_weight_cache_max_scratch_bytes{{{W}}})",
                            "max scratch {{pod}}/{{worker}}",
                        ),
                    ),
                    "On-demand bytes on the device against their budget, pinned bytes, the "
                    "whole weight pool and the largest measured execution scratch.",
                ),
                Panel(
                    "Weight loads and evictions",
                    "ops",
                    (
                        (
                            f"sum by (pod, worker) ({rate(f'worker_weight_loads_total{{{W}}}')})",
                            "loads {{pod}}/{{worker}}",
                        ),
                        (
                            f"sum by (pod, worker) ({rate(f'worker_weight_evicts_total{{{W}}}')})",
                            "evictions {{pod}}/{{worker}}",
                        ),
                    ),
                    "Sustained loads with evictions mean the models in use do not fit the budget.",
                ),
                Panel(
                    "Time spent loading weights",
                    "percentunit",
                    (
                        (
                            f"sum by (pod, worker) ({rate(f'worker_weight_load_seconds_total{{{W}}}')})",
                            "{{pod}}/{{worker}}",
                        ),
                    ),
                    "Seconds per second spent moving on-demand weights to the device.",
                ),
            ),
        ),
        (
            "Device and host memory",
            (
                Panel(
                    "Device memory pool by worker",
                    "bytes",
                    (
                        (
                            f"sum by (pod, worker, gpu) (worker_device_memory_in_use_bytes{{{W}}})",
                            "in use {{pod}}/{{worker}} {{gpu}}",
                        ),
                        (
                            f"sum by (pod, worker, gpu) (worker_device_memory_limit_bytes{{{W}}})",
                            "limit {{pod}}/{{worker}} {{gpu}}",
                        ),
                        (
                            f"sum by (pod, worker, gpu) (worker_device_memory_free_bytes{{{W}}})",
                            "free {{pod}}/{{worker}} {{gpu}}",
                        ),
                    ),
                ),
                Panel(
                    "Device memory peak and allocator pool (GPU)",
                    "bytes",
                    (
                        (
                            f"sum by (pod, worker, gpu) (worker_device_memory_peak_in_use_bytes{{{W}}})",
                            "peak {{pod}}/{{worker}} {{gpu}}",
                        ),
                        (
                            f"sum by (pod, worker, gpu) (worker_device_memory_pool_bytes{{{W}}})",
                            "pool {{pod}}/{{worker}} {{gpu}}",
                        ),
                    ),
                    "Reported by the GPU allocator only; empty on CPU workers.",
                ),
                Panel(
                    "Worker resident memory (host)",
                    "bytes",
                    (
                        (
                            f'sum by (pod, worker) (process_resident_memory_bytes{{{W}, worker!=""}})',
                            "{{pod}}/{{worker}}",
                        ),
                    ),
                ),
            ),
        ),
    ),
)


def by(labels: str, metric: str, fn: str = "max") -> str:
    """``fn by (labels) (metric{namespace})``: one gateway series, aggregated over pods."""
    return f"{fn} by ({labels}) ({metric}{{{G}}})"


LPT_PANELS = (
    Panel(
        "Placement weight per model and worker",
        "percentunit",
        ((by("model, worker", "gateway_placement_weight"), "{{model}} on {{worker}}"),),
        "Each replica's share of its model's traffic; 0 once a repack moved the model away.",
    ),
    Panel(
        "Model utilization and replicas",
        "short",
        (
            (by("model", "gateway_model_utilization"), "{{model}} device-s/s"),
            (by("model", "gateway_model_replicas"), "{{model}} replicas"),
            (by("model", "gateway_model_fill_quantum"), "{{model}} fill quantum"),
        ),
        "What the last repack measured and placed: utilization, workers, items per fill run.",
    ),
    Panel(
        "Requests and items in flight per replica",
        "short",
        (
            (
                "sum by (model, worker) (" + rate(sel("gateway_replica_routed_total", G)) + ")",
                "{{model}} on {{worker}} req/s",
            ),
            (by("model, worker", "gateway_replica_outstanding", "sum"), "{{model}} on {{worker}}"),
        ),
    ),
    Panel(
        "Repacks and compactions",
        "short",
        (
            ("sum by (trigger) (" + rate(sel("gateway_repacks_total", G)) + ")", "{{trigger}}"),
            (
                "sum by (worker) ("
                + rate(sel("gateway_worker_latency_seconds_count", G, 'rpc="CompactMemory"'))
                + ")",
                "compact {{worker}}",
            ),
        ),
        "Repacks by trigger, and the CompactMemory calls they sent to the changed workers.",
    ),
)


GATEWAY = Dashboard(
    uid="kserve-trio-gateway",
    title="kserve_trio / gateway: routing and replica load",
    description="The gateway's traffic, its calls to each worker, which workers are ready "
    "and routable, the outstanding work on each replica, and lpt_packing's placement.",
    variables=(("namespace", "label_values(gateway_routing_table_size, namespace)"),),
    rows=(
        (
            "Traffic",
            (
                Panel(
                    "Requests by model and status",
                    "reqps",
                    (
                        (
                            "sum by (model, status) ("
                            + rate(sel("gateway_requests_total", G, 'rpc="ModelInfer"'))
                            + ")",
                            "{{model}} {{status}}",
                        ),
                    ),
                ),
                Panel(
                    "Latency p99 by model (at the gateway)",
                    "s",
                    (
                        (
                            "histogram_quantile(0.99, sum by (le, model) ("
                            + rate(
                                f'gateway_request_latency_seconds_bucket{{{G}, rpc="ModelInfer"}}'
                            )
                            + "))",
                            "{{model}}",
                        ),
                    ),
                ),
                Panel(
                    "Admission: in flight, cap, shed",
                    "short",
                    (
                        (f"sum(gateway_inflight_requests{{{G}}})", "in flight"),
                        (f"sum(gateway_max_concurrent_requests{{{G}}})", "cap"),
                        (f"sum({rate(f'gateway_requests_shed_total{{{G}}}')})", "shed / s"),
                    ),
                ),
                Panel(
                    "Other RPCs (shared memory, compaction)",
                    "reqps",
                    (
                        (
                            "sum by (rpc, status) ("
                            + rate(sel("gateway_requests_total", G, 'rpc!="ModelInfer"'))
                            + ")",
                            "{{rpc}} {{status}}",
                        ),
                    ),
                ),
            ),
        ),
        (
            "Routing and replica load",
            (
                Panel(
                    "Requests routed to each worker",
                    "reqps",
                    (
                        (
                            "sum by (worker) ("
                            + rate(
                                sel("gateway_worker_latency_seconds_count", G, 'rpc="ModelInfer"')
                            )
                            + ")",
                            "{{worker}}",
                        ),
                    ),
                    "How the gateway spreads ModelInfer calls over the workers.",
                ),
                Panel(
                    "Worker call latency p99",
                    "s",
                    (
                        (
                            "histogram_quantile(0.99, sum by (le, worker) ("
                            + rate(
                                f'gateway_worker_latency_seconds_bucket{{{G}, rpc="ModelInfer"}}'
                            )
                            + "))",
                            "{{worker}}",
                        ),
                    ),
                ),
                Panel(
                    "Outstanding work per worker",
                    "short",
                    (
                        (
                            f"max by (worker, basis) (gateway_worker_inflight_work{{{G}}})",
                            "{{worker}} ({{basis}})",
                        ),
                    ),
                    "The load counters of least_outstanding and lpt_packing, on their work basis.",
                ),
                Panel(
                    "Workers ready and routable models",
                    "short",
                    (
                        (f"min by (worker) (gateway_worker_ready{{{G}}})", "ready {{worker}}"),
                        (f"max(gateway_routing_table_size{{{G}}})", "routable models"),
                    ),
                ),
            ),
        ),
        ("Placement (lpt_packing)", LPT_PANELS),
    ),
)

DASHBOARDS = (MODELS, MEMORY, GATEWAY)


def main(argv: list[str]) -> int:
    OUT.mkdir(exist_ok=True)
    for d in DASHBOARDS:
        (OUT / f"{d.uid}.json").write_text(render(d))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

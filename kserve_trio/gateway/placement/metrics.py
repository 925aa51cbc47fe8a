"""lpt_packing's series on the gateway's registry, read from the scheduler at scrape time.

``gateway_placement_weight{model,worker}`` (each replica's share of its model's traffic; 0 for a
pair a repack dropped, so a graph shows the move), ``gateway_model_utilization{model}``
(device-seconds per second the last repack placed), ``gateway_model_replicas{model}``,
``gateway_replica_outstanding{model,worker}`` (items in flight),
``gateway_model_fill_quantum{model}``, ``gateway_repacks_total{trigger}`` (``startup``,
``compute``, ``operator``) and ``gateway_replica_routed_total{model,worker}`` (requests routed).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kserve_trio.gateway.placement.scheduler import LptScheduler

TRIGGERS = ("startup", "compute", "operator")


class LptCollector:
    """A ``prometheus_client`` collector over one ``LptScheduler``."""

    def __init__(self, scheduler: LptScheduler) -> None:
        self._s = scheduler

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self._s
        policy = s.policy
        placements = policy.assignment.placements
        pairs = sorted(s.pairs)
        models = sorted(set(placements) | set(s.util) | {m for m, _ in pairs})
        weight = GaugeMetricFamily(
            "gateway_placement_weight",
            "Share of the model's traffic placed on the worker (0 once dropped)",
            labels=["model", "worker"],
        )
        outstanding = GaugeMetricFamily(
            "gateway_replica_outstanding",
            "Items of the model in flight on the worker",
            labels=["model", "worker"],
        )
        routed = CounterMetricFamily(
            "gateway_replica_routed",
            "Requests of the model routed to the worker",
            labels=["model", "worker"],
        )
        for model, worker in pairs:
            p = placements.get(model)
            weight.add_metric([model, worker], p.weight(worker) if p is not None else 0.0)
            outstanding.add_metric([model, worker], policy.outstanding(model, worker))
            routed.add_metric([model, worker], policy.routed(model, worker))
        util = GaugeMetricFamily(
            "gateway_model_utilization",
            "Utilization (device-seconds per second) the last repack placed",
            labels=["model"],
        )
        replicas = GaugeMetricFamily(
            "gateway_model_replicas", "Workers the model is placed on", labels=["model"]
        )
        quantum = GaugeMetricFamily(
            "gateway_model_fill_quantum", "Items per fill run of the model", labels=["model"]
        )
        for model in models:
            util.add_metric([model], s.util.get(model, 0.0))
            p = placements.get(model)
            replicas.add_metric([model], len(p.workers) if p is not None else 0)
            quantum.add_metric([model], policy.quantum(model))
        repacks = CounterMetricFamily(
            "gateway_repacks", "lpt_packing repacks by trigger", labels=["trigger"]
        )
        for trigger in TRIGGERS:
            repacks.add_metric([trigger], s.book.by_trigger.get(trigger, 0))
        yield from (weight, util, replicas, outstanding, quantum, repacks, routed)


__all__ = ["TRIGGERS", "LptCollector"]

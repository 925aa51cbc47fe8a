"""Routing metadata: what the work-based routing modes know about each model, from the workers'
``ModelControlStatus`` replies, polled every prober round.

Pure functions over frozen snapshots, in two steps:

- ``aggregate_poll`` sums one round's replies per model (compute seconds, requests and batch
  rows served, the largest weight footprint and batch size, the batch input) and keeps each
  (worker, model)'s cumulative counters.
- ``fold_poll`` turns the counters' growth since the previous round into per-model costs
  (seconds per request, seconds per batch item), smoothed by an exponential moving average whose
  clock is fleet compute time rather than wall time, so a quiet fleet does not forget its costs.

A model's batch axis is the 1-based index into the request's wire (row-major) shape of the input
named by ``batch_input_name``, exactly as the workers' control service reports it;
``request_items`` reads that extent from a peeked shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kserve_trio.proto import reactant_control as rc

COST_HALFLIFE_COMPUTE_SECONDS = 30.0
"""The cost averages' half-life, in seconds of fleet compute consumed."""


def ewma(old: float, sample: float, dt: float, halflife: float) -> float:
    """``(1 - a) * old + a * sample`` with ``a = 1 - 2 ** (-dt / halflife)``: after ``halflife``
    of elapsed ``dt`` the sample has half the weight. ``dt <= 0`` keeps ``old``;
    ``halflife <= 0`` adopts the sample."""
    if not dt > 0:
        return old
    if not halflife > 0:
        return sample
    a = 1.0 - 2.0 ** (-dt / halflife)
    return (1.0 - a) * old + a * sample


@dataclass(frozen=True)
class Counters:
    """One (worker, model)'s cumulative counters as its last reply stated them."""

    compute_seconds: float = 0.0
    requests: int = 0
    rows: int = 0

    def went_back_from(self, prev: Counters) -> bool:
        """Whether any counter is below ``prev``'s: the worker restarted (or reloaded the
        model) and counts from zero again."""
        return (
            self.compute_seconds < prev.compute_seconds
            or self.requests < prev.requests
            or self.rows < prev.rows
        )


@dataclass(frozen=True)
class ModelReport:
    """One model over one round's replies: counters summed over the workers reporting it, the
    largest weight footprint and batch size, the first batch input declared (workers in label
    order), and who reported it."""

    name: str
    total_compute_seconds: float
    requests_served: int
    rows_served: int
    weight_nbytes: int
    max_batch_size: int
    batch_input_name: str
    batch_axis: int
    workers: tuple[str, ...]


@dataclass(frozen=True)
class FleetPoll:
    """One round's replies, aggregated (``aggregate_poll``)."""

    models: Mapping[str, ModelReport]
    counters: Mapping[tuple[str, str], Counters]
    weight_cache_max_bytes: Mapping[str, int]
    polled: tuple[str, ...]
    fleet_compute_seconds: float


def aggregate_poll(replies: Mapping[str, rc.ModelControlStatusResponse]) -> FleetPoll:
    """Aggregate the replies of one round, keyed by worker label (see ``FleetPoll``).

    Rules:
    1. Workers are visited in label order; a worker listing a model twice counts it once
       (the first entry).
    2. Per model: compute seconds, requests and rows are summed; ``weight_nbytes`` and
       ``max_batch_size`` are the maximum; the batch input is the first non-empty
       ``(batch_input_name, batch_axis > 0)`` pair.
    3. Fleet compute is the sum of every reported model's compute seconds.
    """
    totals: dict[str, dict] = {}
    counters: dict[tuple[str, str], Counters] = {}
    for worker in sorted(replies):
        for status in replies[worker].models:
            key = (worker, status.name)
            if key in counters:
                continue
            counters[key] = Counters(
                float(status.total_compute_seconds),
                int(status.requests_served),
                int(status.rows_served),
            )
            t = totals.setdefault(
                status.name,
                {"c": 0.0, "q": 0, "r": 0, "w": 0, "b": 0, "input": ("", 0), "workers": []},
            )
            t["c"] += float(status.total_compute_seconds)
            t["q"] += int(status.requests_served)
            t["r"] += int(status.rows_served)
            t["w"] = max(t["w"], int(status.weight_nbytes))
            t["b"] = max(t["b"], int(status.max_batch_size))
            if not t["input"][0] and status.batch_input_name and status.batch_axis > 0:
                t["input"] = (status.batch_input_name, int(status.batch_axis))
            t["workers"].append(worker)
    models = {
        name: ModelReport(
            name,
            t["c"],
            t["q"],
            t["r"],
            t["w"],
            t["b"],
            batch_input_name=t["input"][0],
            batch_axis=t["input"][1],
            workers=tuple(t["workers"]),
        )
        for name, t in sorted(totals.items())
    }
    return FleetPoll(
        models=models,
        counters=counters,
        weight_cache_max_bytes={w: int(replies[w].weight_cache_max_bytes) for w in sorted(replies)},
        polled=tuple(sorted(replies)),
        fleet_compute_seconds=sum(t.total_compute_seconds for t in models.values()),
    )


@dataclass(frozen=True)
class ModelCost:
    """What routing knows about one model: measured costs (0 = not measured yet), its batch
    input (``batch_axis`` 1-based into the wire shape, 0 = none), footprint and batch size."""

    cost_per_request: float = 0.0
    cost_per_item: float = 0.0
    batch_input_name: str = ""
    batch_axis: int = 0
    max_batch_size: int = 0
    weight_nbytes: int = 0


@dataclass(frozen=True)
class RoutingMetadata:
    """The routing metadata snapshot (``fold_poll`` makes the next one; ``EMPTY_METADATA`` is
    the start). ``baseline`` holds each (worker, model)'s counters at its last poll."""

    models: Mapping[str, ModelCost] = field(default_factory=dict)
    mean_cost_per_item: float = 0.0
    baseline: Mapping[tuple[str, str], Counters] = field(default_factory=dict)
    last_poll: FleetPoll | None = None

    def item_cost(self, model: str) -> float:
        """Seconds per batch item: the model's own measured cost, else the fleet's mean item
        cost, else 1.0 (never 0, so every item weighs something)."""
        cost = self.models.get(model)
        if cost is not None and cost.cost_per_item > 0:
            return cost.cost_per_item
        return self.mean_cost_per_item if self.mean_cost_per_item > 0 else 1.0

    def batch_input(self, model: str) -> tuple[str, int] | None:
        """``(input name, 1-based wire axis)`` to count a request's items by, or ``None``."""
        cost = self.models.get(model)
        if cost is None or not cost.batch_input_name or cost.batch_axis <= 0:
            return None
        return cost.batch_input_name, cost.batch_axis

    def request_items(self, model: str, shape: Sequence[int] | None) -> int:
        """How many batch items a request carries: the extent of its batch input's shape at
        the model's batch axis (1-based, wire order). 1 when the model is unknown or has no
        batch axis, the input is missing (``shape`` ``None``), the axis is beyond the shape,
        or the extent is below 1 (every request weighs at least one item)."""
        spec = self.batch_input(model)
        if spec is None or shape is None or spec[1] > len(shape):
            return 1
        return max(int(shape[spec[1] - 1]), 1)


EMPTY_METADATA = RoutingMetadata()


def fold_poll(
    meta: RoutingMetadata, poll: FleetPoll, halflife: float = COST_HALFLIFE_COMPUTE_SECONDS
) -> RoutingMetadata:
    """The next snapshot after ``poll``.

    Rules:
    1. Each (worker, model)'s delta is its counters minus its baseline (zero for a pair seen
       for the first time). Counters that went backwards mean the worker restarted (or reloaded
       the model) and counts from zero: the delta is the counters themselves.
    2. A model's deltas are summed over its workers; ``dt`` is the fleet's summed compute delta
       (compute consumed since the previous poll).
    3. ``cost_per_request`` samples ``d_compute / d_requests`` when requests grew, and
       ``cost_per_item`` samples ``d_compute / d_rows`` when rows grew; a model's first sample
       is adopted as is, later ones folded with ``ewma(old, sample, dt, halflife)``; without
       growth the cost is kept.
    4. The batch input follows the latest report that declares one; a model whose report
       lacks it this round keeps the previous one. Footprint and batch size follow the latest
       report. Models absent from the poll keep their metadata; baselines of absent pairs too
       (a worker that misses a round resumes from where it was).
    5. ``mean_cost_per_item`` is the mean over models of the measured (> 0) item costs.
    """
    deltas: dict[str, list[float]] = {}
    baseline = dict(meta.baseline)
    dt = 0.0
    for (worker, model), now in poll.counters.items():
        prev = baseline.get((worker, model), Counters())
        if now.went_back_from(prev):
            prev = Counters()
        d = deltas.setdefault(model, [0.0, 0, 0])
        d[0] += now.compute_seconds - prev.compute_seconds
        d[1] += now.requests - prev.requests
        d[2] += now.rows - prev.rows
        dt += now.compute_seconds - prev.compute_seconds
        baseline[(worker, model)] = now
    models = dict(meta.models)
    for name, report in poll.models.items():
        old = models.get(name, ModelCost())
        d_compute, d_requests, d_rows = deltas.get(name, (0.0, 0, 0))
        per_request, per_item = old.cost_per_request, old.cost_per_item
        if d_requests > 0:
            sample = d_compute / d_requests
            per_request = sample if per_request <= 0 else ewma(per_request, sample, dt, halflife)
        if d_rows > 0:
            sample = d_compute / d_rows
            per_item = sample if per_item <= 0 else ewma(per_item, sample, dt, halflife)
        declared = bool(report.batch_input_name) and report.batch_axis > 0
        models[name] = ModelCost(
            cost_per_request=per_request,
            cost_per_item=per_item,
            batch_input_name=report.batch_input_name if declared else old.batch_input_name,
            batch_axis=report.batch_axis if declared else old.batch_axis,
            max_batch_size=report.max_batch_size,
            weight_nbytes=report.weight_nbytes,
        )
    measured = [c.cost_per_item for c in models.values() if c.cost_per_item > 0]
    return RoutingMetadata(
        models=models,
        mean_cost_per_item=sum(measured) / len(measured) if measured else 0.0,
        baseline=baseline,
        last_poll=poll,
    )


__all__ = [
    "COST_HALFLIFE_COMPUTE_SECONDS",
    "EMPTY_METADATA",
    "Counters",
    "FleetPoll",
    "ModelCost",
    "ModelReport",
    "RoutingMetadata",
    "aggregate_poll",
    "ewma",
    "fold_poll",
]

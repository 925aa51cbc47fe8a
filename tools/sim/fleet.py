"""Fleet simulator: the gateway's real routing policies over a synthetic multi-model trace.

It drives the gateway's own ``RoundRobin``, ``LeastOutstanding`` and ``LptPacking`` policies
(``kserve_trio.gateway``) and lpt_packing's ``compute_assignment`` (not copies) with a
discrete-event model of a fleet:

- N workers, each a FIFO single server with a device-memory budget and an LRU weight cache;
  a request for a model whose weights are not resident first loads them (evicting the least
  recently used models until they fit), which costs ``LOAD_FIXED_S + bytes / LOAD_BYTES_PER_S``
  (fitted to the measured on-demand load figures in docs/benchmarks.md, "Memory");
- M models with log-uniform weight sizes, a compute cost per request that grows with the size,
  and Zipf popularity; Poisson arrivals sized to a target fleet utilization;
- every worker can serve every model (round_robin and least_outstanding see all of them);
  lpt_packing repacks from the utilizations measured over the previous window, with each hot
  model's replica count set to cover its load (the operator's ``models.<m>.replicas``).

Reported per policy: weight loads per 1000 requests, the share of requests served without a
load, the busiest worker's utilization, and queueing delay (mean, p99). Usage:

    python tools/sim/fleet.py [--sizes 8x100,64x1000] [--requests N] [--json out.json]
        [--plot docs/sim_fleet.png] [--seed 0]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from collections import OrderedDict
from dataclasses import dataclass, field

from kserve_trio.gateway.config import WorkBasis
from kserve_trio.gateway.fleet import (
    LeastOutstanding,
    ModelCost,
    RoundRobin,
    RoutingMetadata,
    RoutingTable,
)
from kserve_trio.gateway.placement import LptPacking, compute_assignment

LOAD_FIXED_S = 0.0005
LOAD_BYTES_PER_S = 0.5e9  # 128 MB in 256 ms, the measured host-to-device load on this box
MB = 1 << 20


@dataclass
class Model:
    name: str
    nbytes: int
    cost_s: float
    popularity: float


@dataclass
class Worker:
    name: str
    budget: int
    resident: OrderedDict = field(default_factory=OrderedDict)  # model -> bytes, LRU order
    free_at: float = 0.0
    busy_s: float = 0.0
    loads: int = 0

    def ensure(self, model: Model) -> float:
        """Make ``model`` resident; returns the load time it cost (0 when it was resident)."""
        if model.name in self.resident:
            self.resident.move_to_end(model.name)
            return 0.0
        while self.resident and sum(self.resident.values()) + model.nbytes > self.budget:
            self.resident.popitem(last=False)
        self.resident[model.name] = model.nbytes
        self.loads += 1
        return LOAD_FIXED_S + model.nbytes / LOAD_BYTES_PER_S


def make_models(n: int, rng: random.Random, zipf_s: float = 1.1) -> list[Model]:
    weights = [1.0 / (i + 1) ** zipf_s for i in range(n)]
    total = sum(weights)
    models = []
    for i in range(n):
        nbytes = int(math.exp(rng.uniform(math.log(5 * MB), math.log(500 * MB))))
        cost = 0.010 * math.sqrt(nbytes / (64 * MB))
        models.append(Model(f"m{i:04d}", nbytes, cost, weights[i] / total))
    return models


def make_trace(models: list[Model], n_workers: int, requests: int, utilization: float, rng):
    """(arrival time, model) pairs: Poisson arrivals at ``utilization`` of the fleet's compute."""
    mean_cost = sum(m.cost_s * m.popularity for m in models)
    rate = utilization * n_workers / mean_cost
    names = [m.name for m in models]
    pops = [m.popularity for m in models]
    t = 0.0
    trace = []
    for name in rng.choices(names, weights=pops, k=requests):
        t += rng.expovariate(rate)
        trace.append((t, name))
    return trace


def make_policy(kind: str, models: dict[str, Model]):
    if kind == "round_robin":
        return RoundRobin()
    if kind == "least_outstanding":
        return LeastOutstanding(WorkBasis.REQUESTS)
    meta = RoutingMetadata(
        models={
            m.name: ModelCost(cost_per_request=m.cost_s, cost_per_item=m.cost_s)
            for m in models.values()
        }
    )
    return LptPacking(WorkBasis.COMPUTE, metadata=meta)


def repack(policy: LptPacking, models, workers, rates: dict[str, float]):
    """One lpt_packing repack from the models' arrival rates (requests/s, smoothed)."""
    u = {m: r * models[m].cost_s for m, r in rates.items()}
    replicas = {m: max(1, math.ceil(v / 0.7)) for m, v in u.items() if v > 0.7}
    prev = {m: p.workers for m, p in policy.assignment.placements.items()}
    assignment = compute_assignment(
        u,
        [w.name for w in workers],
        prev,
        mem={m: models[m].nbytes for m in u},
        mem_cap={w.name: w.budget for w in workers},
        replicas=replicas,
        hysteresis=0.1,
    )
    policy.repack(assignment)


def simulate(kind: str, n_workers: int, n_models: int, requests: int, seed: int) -> dict:
    rng = random.Random(seed)
    model_list = make_models(n_models, rng)
    models = {m.name: m for m in model_list}
    total_bytes = sum(m.nbytes for m in model_list)
    # The fleet holds the catalogue twice over (each worker 2/N of it, at least the largest
    # model): enough to place every model once with room to spare, never every model everywhere.
    budget = max(int(total_bytes / n_workers * 2.0), max(m.nbytes for m in model_list))
    workers = [Worker(f"w{i:03d}", budget) for i in range(n_workers)]
    by_name = {w.name: w for w in workers}
    table = RoutingTable({m: tuple(by_name) for m in models}, tuple(by_name))
    trace = make_trace(model_list, n_workers, requests, 0.5, random.Random(seed + 1))
    policy = make_policy(kind, models)
    window = trace[-1][0] / 20
    next_repack = window
    counts: dict[str, int] = dict.fromkeys(models, 0)
    rates: dict[str, float] = {}
    completions: list[tuple[float, int, object]] = []
    waits: list[float] = []
    served_without_load = 0
    loads_before = 0
    for seq, (t, name) in enumerate(trace):
        while completions and completions[0][0] <= t:
            _, _, reservation = heapq.heappop(completions)
            reservation.release()
        if kind == "lpt_packing" and t >= next_repack:
            # arrival rates folded like the gateway's EWMAs (half-life: one window)
            for m, n in counts.items():
                sample = n / window
                rates[m] = sample if m not in rates else 0.5 * rates[m] + 0.5 * sample
            repack(policy, models, workers, {m: r for m, r in rates.items() if r > 0})
            counts = dict.fromkeys(models, 0)
            next_repack = t + window
        counts[name] += 1
        selection = policy.select(name, 1, table)
        w = by_name[selection.order[0]]
        start = max(t, w.free_at)
        load_s = w.ensure(models[name])
        service = load_s + models[name].cost_s
        w.free_at = start + service
        w.busy_s += service
        waits.append(start - t)
        served_without_load += load_s == 0.0
        heapq.heappush(completions, (w.free_at, seq, selection.reservation))
        if seq == requests // 10:  # the first tenth warms the caches and the placement
            loads_before = sum(x.loads for x in workers)
            waits.clear()
            served_without_load = 0
            for x in workers:
                x.busy_s = 0.0
            t_measure = t
    measured = requests - requests // 10 - 1
    span = trace[-1][0] - t_measure
    loads = sum(x.loads for x in workers) - loads_before
    waits.sort()
    return {
        "policy": kind,
        "workers": n_workers,
        "models": n_models,
        "requests": measured,
        "loads_per_1000": round(1000 * loads / measured, 2),
        "served_without_load": round(served_without_load / measured, 4),
        "max_worker_utilization": round(max(x.busy_s for x in workers) / span, 3),
        "mean_queue_ms": round(1e3 * sum(waits) / len(waits), 2),
        "p99_queue_ms": round(1e3 * waits[int(0.99 * (len(waits) - 1))], 2),
    }


POLICIES = ("round_robin", "least_outstanding", "lpt_packing")


def table_text(rows: list[dict]) -> str:
    head = (
        "| fleet | policy | loads / 1000 req | served without a load | busiest worker util "
        "| mean queue (ms) | p99 queue (ms) |\n|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['workers']} x {r['models']} | {r['policy']} | {r['loads_per_1000']} | "
            f"{100 * r['served_without_load']:.1f}% | {r['max_worker_utilization']} | "
            f"{r['mean_queue_ms']} | {r['p99_queue_ms']} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    from matplotlib.figure import Figure

    fleets = sorted({(r["workers"], r["models"]) for r in rows})
    fig = Figure(figsize=(10, 4), dpi=100)
    metrics = [
        ("loads_per_1000", "weight loads / 1000 requests"),
        ("max_worker_utilization", "busiest worker utilization"),
        ("p99_queue_ms", "p99 queueing delay (ms)"),
    ]
    for k, (key, title) in enumerate(metrics):
        ax = fig.add_subplot(1, len(metrics), k + 1)
        width = 0.8 / len(POLICIES)
        for j, policy in enumerate(POLICIES):
            values = [
                next(
                    r[key]
                    for r in rows
                    if r["policy"] == policy and (r["workers"], r["models"]) == f
                )
                for f in fleets
            ]
            xs = [i + j * width for i in range(len(fleets))]
            ax.bar(xs, values, width, label=policy)
        ax.set_xticks([i + width for i in range(len(fleets))])
        ax.set_xticklabels([f"{w}x{m}" for w, m in fleets])
        ax.set_title(title, fontsize=9)
        if key == "p99_queue_ms":
            ax.set_yscale("symlog")
    fig.axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="8x100,64x1000")
    p.add_argument(
        "--requests",
        type=int,
        default=0,
        help="requests per fleet (default: 400 per model, at least 40000)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    rows = []
    for size in args.sizes.split(","):
        n_workers, n_models = (int(v) for v in size.split("x"))
        requests = args.requests or max(40000, 200 * n_models)
        for kind in POLICIES:
            row = simulate(kind, n_workers, n_models, requests, args.seed)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    print(table_text(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

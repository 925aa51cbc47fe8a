"""lpt_packing's placement: which workers hold which models (pure).

``compute_assignment`` is longest-processing-time-first packing over the workers' compute and
device memory: the most utilized models are placed first, each on the worker(s) whose load
after taking it is smallest, with device memory as a second dimension of load. It knows
nothing about clocks, RPCs or metrics; the lpt_packing scheduler feeds it measured
utilizations and applies its answer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kserve_trio.gateway.config import ALL_REPLICAS


@dataclass(frozen=True)
class Placement:
    """Where one model lives: its workers (sorted) and each one's share of its traffic."""

    workers: tuple[str, ...]
    weights: tuple[float, ...]

    def weight(self, worker: str) -> float:
        return self.weights[self.workers.index(worker)] if worker in self.workers else 0.0


@dataclass(frozen=True)
class Assignment:
    """The result of a packing: each placed model's ``Placement``, each worker's compute
    (``load``, in utilization units) and device memory (``memory``, bytes) after packing, and
    the warnings the packing raised (sorted)."""

    placements: Mapping[str, Placement] = field(default_factory=dict)
    load: Mapping[str, float] = field(default_factory=dict)
    memory: Mapping[str, int] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    def workers_of(self, model: str) -> tuple[str, ...]:
        placement = self.placements.get(model)
        return placement.workers if placement is not None else ()

    def models_on(self, worker: str) -> list[str]:
        return sorted(m for m, p in self.placements.items() if worker in p.workers)


def replica_count(model: str, replicas: Mapping[str, int], default_replicas: int, n: int) -> int:
    """``k``: the model's replica count clamped to ``[1, n]`` (``ALL_REPLICAS`` = every
    worker); a model without its own count inherits ``default_replicas``."""
    k = replicas.get(model, default_replicas)
    if k == ALL_REPLICAS or k < 0:
        return n
    return max(1, min(int(k), n))


def compute_assignment(
    u: Mapping[str, float],
    workers: Sequence[str],
    prev: Mapping[str, Sequence[str]] | None = None,
    *,
    mem: Mapping[str, int] | None = None,
    mem_cap: Mapping[str, int] | None = None,
    replicas: Mapping[str, int] | None = None,
    default_replicas: int = 1,
    hysteresis: float = 0.0,
    forbid_memory_oversubscription: bool = True,
    max_worker_share: float = 1.0,
) -> Assignment:
    """Pack the models of ``u`` (model -> utilization, device-seconds per second) onto
    ``workers``.

    Rules:
    1. ``cap(w)`` is ``mem_cap[w]`` when positive, else unbounded. A worker's score after
       taking compute ``c`` and memory ``m`` is ``max(load + c, (memory + m) / cap)`` (the
       memory term is 0 when unbounded); it *fits* ``m`` when unbounded or ``memory + m <=
       cap``.
    2. Models are placed in the order (-u, -memory, name); models absent from ``u`` are not
       placed (the scheduler routes them round robin).
    3. ``k`` = ``replica_count`` (1..number of workers).
    4. k == 1: the candidates are every worker, or only the fitting ones when
       ``forbid_memory_oversubscription`` and at least one fits. The best is the candidate
       with the smallest score (the first in sorted order on ties). Hysteresis: when the
       model's previous single worker still exists, is a candidate and its score is at most
       ``best * (1 + hysteresis)``, the model stays there. The worker is charged ``u`` and the
       model's memory.
    5. k > 1: workers are ranked by (forbidden-and-does-not-fit, score after taking ``u / k``
       and the whole memory, not previously a member, name); the first ``k`` each get weight
       ``1/k``, compute ``u/k`` and the model's full memory.
    6. Share cap (``max_worker_share`` < 1): a worker whose share of the fleet's utilization
       (``sum(u)``) would pass the cap after taking its part is skipped in favour of the next
       best one that stays under it. When no worker stays under, the uncapped choice stands
       and the packing warns.
    7. A worker whose assigned memory exceeds its cap is reported in a warning.
    """
    workers = sorted(workers)
    n = len(workers)
    prev = prev or {}
    mem = mem or {}
    mem_cap = mem_cap or {}
    replicas = replicas or {}
    load = dict.fromkeys(workers, 0.0)
    memory = dict.fromkeys(workers, 0)
    placements: dict[str, Placement] = {}
    warnings: set[str] = set()
    if n == 0:
        return Assignment({}, {}, {}, ())
    fleet_u = sum(max(0.0, v) for v in u.values())

    def cap(w: str) -> float:
        c = mem_cap.get(w, 0)
        return float(c) if c > 0 else math.inf

    def score(w: str, c: float, m: int) -> float:
        memory_term = 0.0 if math.isinf(cap(w)) else (memory[w] + m) / cap(w)
        return max(load[w] + c, memory_term)

    def fits(w: str, m: int) -> bool:
        return math.isinf(cap(w)) or memory[w] + m <= cap(w)

    def under_share(w: str, c: float) -> bool:
        if max_worker_share >= 1.0 or fleet_u <= 0.0:
            return True
        return (load[w] + c) / fleet_u <= max_worker_share + 1e-12

    order = sorted(u, key=lambda m: (-u[m], -mem.get(m, 0), m))
    for model in order:
        um = max(0.0, float(u[model]))
        mm = int(mem.get(model, 0))
        k = replica_count(model, replicas, default_replicas, n)
        if k == 1:
            candidates = list(workers)
            if forbid_memory_oversubscription:
                fitting = [w for w in workers if fits(w, mm)]
                if fitting:
                    candidates = fitting
            ranked = sorted(candidates, key=lambda w: (score(w, um, mm), w))
            capped = [w for w in ranked if under_share(w, um)]
            if not capped:
                warnings.add(
                    f"every worker would exceed max_worker_share {max_worker_share:g}; "
                    f"model '{model}' placed without the share cap"
                )
                capped = ranked
            best = capped[0]
            before = tuple(prev.get(model, ()))
            if len(before) == 1 and before[0] in capped:
                home = before[0]
                if score(home, um, mm) <= score(best, um, mm) * (1.0 + hysteresis):
                    best = home
            chosen = (best,)
            share = um
        else:
            share = um / k
            members = set(prev.get(model, ()))

            def rank(w: str, share: float = share, mm: int = mm, members=members):
                forbidden = forbid_memory_oversubscription and not fits(w, mm)
                return (1 if forbidden else 0, score(w, share, mm), 0 if w in members else 1, w)

            ranked = sorted(workers, key=rank)
            capped = [w for w in ranked if under_share(w, share)]
            if len(capped) < k:
                if max_worker_share < 1.0:
                    warnings.add(
                        f"fewer than {k} workers stay under max_worker_share "
                        f"{max_worker_share:g}; model '{model}' placed without the share cap"
                    )
                capped = ranked
            chosen = tuple(sorted(capped[:k]))
        for w in chosen:
            load[w] += share
            memory[w] += mm
        placements[model] = Placement(chosen, tuple(1.0 / len(chosen) for _ in chosen))
    for w in workers:
        if memory[w] > cap(w):
            warnings.add(
                f"worker {w}: assigned weights need {memory[w]} bytes, over its device "
                f"budget of {int(cap(w))} bytes"
            )
    return Assignment(placements, load, memory, tuple(sorted(warnings)))


def moved_models(old: Assignment, new: Assignment) -> list[str]:
    """Models whose worker set changed (models new in ``new`` do not count)."""
    return sorted(
        m
        for m, p in new.placements.items()
        if m in old.placements and set(old.placements[m].workers) != set(p.workers)
    )


def changed_workers(old: Assignment, new: Assignment) -> list[str]:
    """Workers whose set of assigned models changed, including the old workers of models that
    were dropped (the workers compaction is sent to)."""
    changed: set[str] = set()
    for model in set(old.placements) | set(new.placements):
        before = set(old.workers_of(model))
        after = set(new.workers_of(model))
        changed |= before ^ after
    return sorted(changed)


__all__ = [
    "Assignment",
    "Placement",
    "changed_workers",
    "compute_assignment",
    "moved_models",
    "replica_count",
]

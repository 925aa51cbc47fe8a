"""The scheduling disciplines (fair, fifo, edf): which model's batch runs next, and what a
batch must leave of its requests' deadlines to be admitted.

The rules are plain functions of plain values (no clocks, no locks, no I/O), so each is pinned
by a plain test: the fair priority with its EMAs and cost estimates, the choice of the next
model under each discipline, the deadline checks. Each discipline is also an object
(``Fair``, ``Fifo``, ``Edf``), chosen once from the configuration (``discipline_for``), through
which the dispatch loop (``worker/dispatch.py``) applies those rules to its queued models: the
loop never asks which discipline runs.

Conventions: times are seconds (float) for compute costs and EMAs, nanoseconds (int) for
enqueue stamps and deadlines; a deadline of 0 means none. Shapes and batch axes are row-major.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from kserve_trio.core.process import SchedulingDiscipline

if TYPE_CHECKING:
    from kserve_trio.core.process import SchedulerConfig
    from kserve_trio.worker.model_state import ModelState
    from kserve_trio.worker.model_table import ModelTable
    from kserve_trio.worker.planner import BatchPlan

DEFAULT_COST_SECONDS = 0.01
"""Cost assumed for a (variant, batch size) that has never been measured."""

MIN_COST_SECONDS = 1e-9
"""Floor for a measured cost, so a priority never divides by zero."""


# --------------------------------------------------------------------------------------------
# Fair discipline arithmetic


def decay_ema(ema: float, dt_seconds: float, halflife_seconds: float) -> float:
    """Decay a recent-compute EMA by ``dt_seconds``: it halves every ``halflife_seconds``.

    A negative ``dt`` (clock skew between stamps) decays nothing rather than growing the EMA.
    """
    if dt_seconds <= 0.0 or ema == 0.0:
        return ema
    return ema * math.exp(-dt_seconds * math.log(2.0) / halflife_seconds)


def decay(state: ModelState, now_ns: int, halflife_seconds: float) -> None:
    """Bring a model's recent-compute EMA forward to ``now_ns`` (``decay_ema`` on its state)."""
    state.ema = decay_ema(state.ema, (now_ns - state.ema_ns) / 1e9, halflife_seconds)
    state.ema_ns = now_ns


def fair_priority(share: float, nema: float, cap: float, eff_cost: float) -> float:
    """Priority of a model under the fair discipline; the highest wins.

    ``share`` is the model's weight over the total weight, ``nema`` its recent compute over the
    total recent compute, ``cap`` the recency penalty cap and ``eff_cost`` the (discounted)
    estimated seconds of the dispatch it would make. A model that used less than its share
    gets a positive priority, and a cheap dispatch ranks above an expensive one with the same
    deficit: ``clamp(share - nema, -cap, +cap) / eff_cost``.
    """
    deficit = min(max(share - nema, -cap), cap)
    return deficit / max(eff_cost, MIN_COST_SECONDS)


def effective_cost(
    estimate: float | None, *, coalescing_discount: float, coalesced_requests: int
) -> float:
    """Estimated cost of a dispatch as the fair discipline weighs it.

    ``estimate`` is the learned cost of the plan's (variant, batch size), ``None`` when never
    measured (then 0.01 s). The coalescing discount rewards only a plan that
    actually coalesces more than one request (upstream discounted every candidate, which changes
    nothing in the ranking).
    """
    cost = DEFAULT_COST_SECONDS if estimate is None else estimate
    if coalesced_requests > 1:
        cost *= 1.0 - coalescing_discount
    return cost


def update_cost(old: float | None, measured: float, alpha: float) -> float:
    """Fold one measured execution time into a learned cost: ``alpha*t + (1-alpha)*old``.

    The first measurement (``old is None``) seeds the estimate exactly.
    """
    measured = max(measured, MIN_COST_SECONDS)
    if old is None:
        return measured
    return alpha * measured + (1.0 - alpha) * old


# --------------------------------------------------------------------------------------------
# Discipline selection


@dataclass(frozen=True, slots=True)
class Candidate:
    """One schedulable model as the disciplines see it at one decision.

    ``front_enqueued_ns`` stamps the oldest queued request; ``earliest_deadline_ns`` is the
    smallest non-zero deadline among all its queued requests (0 = none queued has one);
    ``ema`` is the recent compute already decayed to now; ``cost`` the effective cost of the
    dispatch its plan would make.
    """

    name: str
    front_enqueued_ns: int
    weight: float = 1.0
    ema: float = 0.0
    cost: float = DEFAULT_COST_SECONDS
    earliest_deadline_ns: int = 0


def select_fair(
    candidates: Sequence[Candidate], *, total_weight: float, total_ema: float, cap: float
) -> Candidate:
    """Pick the next model under the fair discipline.

    Rules:
    1. ``share = weight / total_weight`` (0 when the total is 0) and ``nema = ema / total_ema``
       (0 when the total is 0); the totals cover every registered model, queued or not.
    2. ``priority = fair_priority(share, nema, cap, cost)``; the highest priority wins.
    3. Ties go to the older front request, then to the lexicographically smaller name.
    """

    def key(c: Candidate) -> tuple[float, int, str]:
        share = c.weight / total_weight if total_weight > 0 else 0.0
        nema = c.ema / total_ema if total_ema > 0 else 0.0
        return (-fair_priority(share, nema, cap, c.cost), c.front_enqueued_ns, c.name)

    return min(candidates, key=key)


def select_fifo(candidates: Sequence[Candidate]) -> Candidate:
    """Pick the model whose front request is the oldest; ties go to the smaller name."""
    return min(candidates, key=lambda c: (c.front_enqueued_ns, c.name))


def select_edf(candidates: Sequence[Candidate]) -> Candidate:
    """Pick the model holding the most urgent deadline (earliest-deadline-first).

    Rules:
    1. A model's urgency is the smallest non-zero deadline among all its queued requests; a model
       with no deadline queued is least urgent (+inf).
    2. Ties (equal deadlines, or none) fall back to fifo: older front request, then smaller name.
       So uniform deadlines make edf exactly fifo.
    """

    def key(c: Candidate) -> tuple[float, int, str]:
        urgency = c.earliest_deadline_ns if c.earliest_deadline_ns > 0 else math.inf
        return (urgency, c.front_enqueued_ns, c.name)

    return min(candidates, key=key)


def deadline_expired(deadline_ns: int, now_ns: int, margin_ns: int = 0) -> bool:
    """Whether a request must be refused at dispatch admission.

    A request with a deadline (non-zero) is refused when ``now + margin >= deadline``: under edf
    the margin is the plan's learned cost (laxity shedding: work that cannot finish in time is
    not started), otherwise 0.
    """
    return deadline_ns != 0 and now_ns + margin_ns >= deadline_ns


def laxity_margin_ns(cost_estimate: float | None) -> int:
    """The edf admission margin for a plan: its learned cost (0.01 s if unmeasured) in ns."""
    cost = DEFAULT_COST_SECONDS if cost_estimate is None else cost_estimate
    return int(cost * 1e9)


# --------------------------------------------------------------------------------------------
# The disciplines as the dispatch loop holds them

Planner = Callable[["ModelState"], "BatchPlan | None"]
"""The loop's planner: a model's next batch plan, or None when planning failed (the loop has
then answered the front request)."""

Pick = tuple["ModelState", "BatchPlan"]
"""A discipline's choice: the model whose batch runs next and its plan."""


class Discipline(abc.ABC):
    """One discipline as the dispatch loop applies it. The loop asks ``select`` only when two
    or more models have queued requests (with one, every discipline picks it), and asks
    ``admission_margin_ns`` of every batch it admits."""

    name: ClassVar[str]
    warms_models: ClassVar[bool] = False
    """Whether a model is warmed when it is added: the discipline ranks by learned costs from
    the first decision, so they are seeded before any request runs."""

    @abc.abstractmethod
    def select(self, ready: list[ModelState], models: ModelTable, plan: Planner) -> Pick | None:
        """The next (model, plan) among ``ready`` (the models with queued requests, in load
        order; ``models`` is every loaded model); None when no plan could be made."""

    def admission_margin_ns(self, state: ModelState, plan: BatchPlan) -> int:
        """What a request's deadline must leave beyond now for the batch to be admitted
        (``deadline_expired``); 0: only a passed deadline refuses it."""
        return 0


class Fifo(Discipline):
    """The model whose front request is the oldest goes first (``select_fifo``)."""

    name = "fifo"

    def select(self, ready: list[ModelState], models: ModelTable, plan: Planner) -> Pick | None:
        chosen = select_fifo([Candidate(s.name, s.queue[0].enqueued_ns) for s in ready])
        return _planned(models[chosen.name], plan)


class Edf(Discipline):
    """The model holding the most urgent deadline goes first (``select_edf``), and a batch is
    admitted only when each request's deadline leaves room for its learned cost (laxity
    shedding: work that cannot finish in time is not started)."""

    name = "edf"

    def select(self, ready: list[ModelState], models: ModelTable, plan: Planner) -> Pick | None:
        candidates = [
            Candidate(
                s.name,
                s.queue[0].enqueued_ns,
                earliest_deadline_ns=min(
                    (r.deadline_ns for r in s.queue if r.deadline_ns), default=0
                ),
            )
            for s in ready
        ]
        return _planned(models[select_edf(candidates).name], plan)

    def admission_margin_ns(self, state: ModelState, plan: BatchPlan) -> int:
        return laxity_margin_ns(state.cost.get((plan.variant, plan.batch_key)))


class Fair(Discipline):
    """Each model gets compute in proportion to its weight (``select_fair``): every ready
    model's batch is planned and priced, the EMAs of all loaded models are decayed to now."""

    name = "fair"
    warms_models = True

    def __init__(self, config: SchedulerConfig, clock: Callable[[], int]) -> None:
        self.config = config
        self.clock = clock

    def select(self, ready: list[ModelState], models: ModelTable, plan: Planner) -> Pick | None:
        now = self.clock()
        cfg = self.config
        for s in models.states():
            decay(s, now, cfg.ema_halflife_seconds)
        total_ema = sum(s.ema for s in models.states())
        total_weight = sum(s.weight for s in models.states())
        plans: dict[str, BatchPlan] = {}
        candidates: list[Candidate] = []
        for s in ready:
            planned = plan(s)
            if planned is None:
                continue
            plans[s.name] = planned
            cost = effective_cost(
                s.cost.get((planned.variant, planned.batch_key)),
                coalescing_discount=cfg.coalescing_discount,
                coalesced_requests=planned.take,
            )
            candidates.append(Candidate(s.name, s.queue[0].enqueued_ns, s.weight, s.ema, cost))
        if not candidates:
            return None
        chosen = select_fair(
            candidates,
            total_weight=total_weight,
            total_ema=total_ema,
            cap=cfg.recency_penalty_cap,
        )
        return models[chosen.name], plans[chosen.name]


def _planned(chosen: ModelState, plan: Planner) -> Pick | None:
    planned = plan(chosen)
    return None if planned is None else (chosen, planned)


def discipline_for(config: SchedulerConfig, clock: Callable[[], int]) -> Discipline:
    """The configured discipline (``scheduler.discipline``), built once per scheduler."""
    if config.discipline is SchedulingDiscipline.FAIR:
        return Fair(config, clock)
    if config.discipline is SchedulingDiscipline.EDF:
        return Edf()
    return Fifo()


__all__ = [
    "DEFAULT_COST_SECONDS",
    "MIN_COST_SECONDS",
    "Candidate",
    "Discipline",
    "Edf",
    "Fair",
    "Fifo",
    "Pick",
    "Planner",
    "deadline_expired",
    "decay",
    "decay_ema",
    "discipline_for",
    "effective_cost",
    "fair_priority",
    "laxity_margin_ns",
    "select_edf",
    "select_fair",
    "select_fifo",
    "update_cost",
]

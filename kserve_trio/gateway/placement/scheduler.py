"""lpt_packing's scheduler: when to repack, with what utilizations, and what follows a repack.

``LptScheduler`` owns the runtime knobs (one immutable ``SchedulingConfig`` snapshot, swapped
whole by the control RPCs, with a ``generation`` counter), the per-model rate and cost averages,
the compute accumulator that decides when to repack, and the repack bookkeeping that
GetSchedulingStatus reports. It places through ``placement.compute_assignment`` and routes
through ``policy.LptPacking``; compaction after a repack is ``compaction.Compactor``.

Start-up (``start``, before the gateway serves):
1. *Every worker answers*: every worker must answer ModelControlStatus (each call bounded by the
   watchdog; a timed-out call resets that worker's connection). With a start-up wait, unanswered
   workers are polled again every ``STARTUP_POLL_SECONDS`` until the wait ends; without one the
   first failure is fatal (``LptStartupError`` naming the workers). Calls that time out are failures
   like any other: a frozen fleet is not a wedged gateway (``watchdog``).
2. *One discipline, one model set*: every worker must run the fifo or edf discipline (under
   lpt_packing the gateway is the fairness authority; a fair worker would fight its placement) and
   report the same model names.
3. *Placed by memory*: a repack with trigger ``startup`` places every model by memory alone (no load
   measured yet).

Tick (each prober round whose ModelControlStatus poll got an answer; ``tick``):
1. *Fill plans*: fill plans are re-resolved (batch sizes may have changed).
2. *Fleet compute*: the first observation is the baseline; afterwards growth is added to the
   accumulator, and a fall (a worker restarted) re-baselines without adding.
3. *Threshold*: the threshold is ``first_rebalance_compute_seconds`` until the first
   compute-triggered repack (when > 0), then ``rebalance_compute_seconds``.
4. *Trigger*: a pending operator request (``requested > completed``) repacks with trigger
   ``operator`` (the first budget is not consumed); else an accumulator at or over the threshold
   repacks with trigger ``compute``. The operator completion counter is stored last, after
   compaction is scheduled, so a waiting Repack sees the whole repack done.

Repack (``_repack``):
1. *Rates and costs*: ``wall`` = seconds since the previous repack (0 on the first); the model's
   arrival rate samples ``arrivals / wall`` and its per-request cost samples
   ``d_compute / d_requests`` since the previous repack. A model's first sample is adopted as is, later ones are
   folded with ``ewma(old, sample, compute_elapsed, halflife)``: the average forgets by fleet
   compute consumed, not by wall time, so an idle fleet keeps its picture.
2. *Utilizations*: ``u[m] = rate * cost`` (0 unless both are measured), for the models every polled
   worker reports. A model only some workers report is *drifted*: placed evenly over those workers,
   with a warning.
3. *Assignment*: ``compute_assignment`` over the polled workers with the previous placement, the
   models' weight footprints, the workers' on-demand budgets, the replica overrides and the knobs.
4. *Adoption*: the routing policy adopts it (in-flight counts carried over), the accumulator
   restarts, and moved models (worker set changed) and changed workers
   (``placement.changed_workers``) are counted and logged; the compaction cadence decides whether to
   compact the changed workers.

Several gateway processes (``multiprocess``): one process's scheduler places; it counts the
others' arrivals too (``extra_arrivals``, added to its own in *rates and costs*) and hands each
repack's result to ``on_repack``, which the other processes follow.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import anyio

from kserve_trio.client.errors import RpcError
from kserve_trio.core.errors import ConfigError
from kserve_trio.core.logging import get_logger
from kserve_trio.gateway.config import (
    ALL_REPLICAS,
    INFLIGHT_WARNING,
    CompactionMode,
    FillMode,
    ModelPlacementConfig,
    SchedulingConfig,
)
from kserve_trio.gateway.fleet import (
    MODEL_CONTROL_STATUS,
    PROBE_TIMEOUT_SECONDS,
    WATCHDOG_SECONDS,
    FleetPoll,
    RoutingMetadata,
    WorkerClient,
    aggregate_poll,
    ewma,
)
from kserve_trio.gateway.placement.assignment import (
    Assignment,
    Placement,
    changed_workers,
    compute_assignment,
    moved_models,
)
from kserve_trio.gateway.placement.compaction import Compactor, compaction_jobs
from kserve_trio.gateway.placement.policy import FillSettings, LptPacking
from kserve_trio.proto import reactant_control as rc

STARTUP_POLL_SECONDS = 10.0
"""How often start-up polls the workers that have not answered yet (with a start-up wait)."""
DISCIPLINES = ("fifo", "edf")
NO_REPACK_YET = "no repack has run yet: placement starts at the first prober round"

_log = get_logger(__name__)


class LptStartupError(ConfigError):
    """A start-up precondition of lpt_packing failed (the gateway does not serve)."""


@dataclass(frozen=True)
class RepackReport:
    """What one repack did."""

    trigger: str
    placed: int
    moved: tuple[str, ...]
    changed_workers: tuple[str, ...]
    drifted: tuple[str, ...]
    warnings: tuple[str, ...]
    compacted: tuple[str, ...] = ()


@dataclass
class RepackBook:
    """The repack bookkeeping GetSchedulingStatus reports (``RepackStatus``)."""

    count: int = 0
    by_trigger: dict[str, int] = field(default_factory=dict)
    last_unix: float = 0.0
    last_wall_elapsed: float = 0.0
    last_compute: float = 0.0
    last_trigger: str = ""
    last_placed: int = 0
    last_moved: int = 0
    last_tick_unix: float = 0.0
    since_compaction: int = 0
    requested: int = 0
    completed: int = 0
    first_compute_done: bool = False


def resolve_fill(
    knobs: SchedulingConfig, override: ModelPlacementConfig | None = None
) -> FillSettings:
    """A model's fill settings: its override's mode and factor where set, else the knobs'."""
    mode = knobs.routing_fill_mode
    factor = knobs.routing_fill_factor
    if override is not None:
        mode = override.fill_mode or mode
        factor = override.fill_factor if override.fill_factor > 0 else factor
    return FillSettings(mode, knobs.routing_policy, factor)


class LptScheduler:
    """lpt_packing's scheduler (see the module docstring)."""

    def __init__(
        self,
        knobs: SchedulingConfig,
        policy: LptPacking,
        *,
        clients: Callable[[], Mapping[str, WorkerClient]],
        startup_wait: float = 0.0,
        wake: Callable[[], None] = lambda: None,
        compactor: Compactor | None = None,
        watchdog: float = WATCHDOG_SECONDS,
    ) -> None:
        self.knobs = knobs
        self.generation = 0
        self.policy = policy
        self.overrides: dict[str, ModelPlacementConfig] = {
            name: m for name, m in knobs.models.items() if not m.empty
        }
        self._clients = clients
        self._startup_wait = startup_wait
        self.wake = wake
        self.compactor = compactor or Compactor(clients)
        self._watchdog = watchdog
        self.book = RepackBook()
        self.started = False
        self.rate: dict[str, float] = {}
        self.cost: dict[str, float] = {}
        self.util: dict[str, float] = {}
        self._cost_base: dict[str, tuple[float, int]] = {}
        self._fleet_base: float | None = None
        self.accum = 0.0
        self._last_repack: float | None = None
        self.ready: tuple[str, ...] = ()
        self.drifted: tuple[str, ...] = ()
        self.poll: FleetPoll | None = None
        self.last_report: RepackReport | None = None
        self.pairs: set[tuple[str, str]] = set()
        """Every (model, worker) ever placed: a dropped pair is exported as weight 0."""
        self.extra_arrivals: Callable[[], Mapping[str, int]] = dict
        """Arrivals counted elsewhere since the last call (the gateway's other processes)."""
        self.on_repack: Callable[[RepackReport], None] = lambda report: None
        """Called after each repack (the gateway's other processes follow the placement)."""
        policy.on_metadata = self._on_metadata
        self._publish_plans()

    # ---- knobs ------------------------------------------------------------------------------

    def set_knobs(self, knobs: SchedulingConfig) -> None:
        """Adopt a validated knob snapshot (one swap) and bump the generation."""
        self.knobs = knobs
        self.generation += 1
        self._publish_plans()

    def set_override(self, model: str, override: ModelPlacementConfig) -> None:
        """Set (or, all fields inheriting, remove) a model's override; fill plans re-publish
        now, its replica count applies at the next repack."""
        if override.empty:
            self.overrides.pop(model, None)
        else:
            self.overrides[model] = override
        self._publish_plans()

    def fill_for(self, model: str) -> FillSettings:
        return resolve_fill(self.knobs, self.overrides.get(model))

    def configured_replicas(self, model: str) -> int:
        override = self.overrides.get(model)
        if override is not None and override.replicas is not None:
            return override.replicas
        return self.knobs.default_replicas

    def effective_replicas(self, model: str) -> int:
        n = len(self.ready)
        k = self.configured_replicas(model)
        return n if k == ALL_REPLICAS else max(1, min(k, n)) if n else 0

    @property
    def threshold(self) -> float:
        """*Threshold* (tick)."""
        first = self.knobs.first_rebalance_compute_seconds
        if first > 0 and not self.book.first_compute_done:
            return first
        return self.knobs.rebalance_compute_seconds

    def fill_modes(self) -> list[FillMode]:
        return [self.knobs.routing_fill_mode, *(self.fill_for(m).mode for m in self.overrides)]

    def warnings(self) -> list[str]:
        """The standing warnings (sorted): inflight parking, no repack yet, the last repack's."""
        out = set(self.last_report.warnings if self.last_report else ())
        if FillMode.INFLIGHT in self.fill_modes():
            out.add(INFLIGHT_WARNING)
        if self.book.count == 0:
            out.add(NO_REPACK_YET)
        return sorted(out)

    def _publish_plans(self) -> None:
        policy = self.policy
        policy.basis = self.knobs.basis
        policy.fill = resolve_fill(self.knobs)
        policy.overrides = {m: self.fill_for(m) for m in self.overrides}
        policy.refresh_plans()

    # ---- start-up ---------------------------------------------------------------------------

    async def _poll(self, clients: Sequence[WorkerClient]) -> dict[str, object]:
        """ModelControlStatus on ``clients``: label -> reply, or the failure's text."""
        out: dict[str, object] = {}

        async def one(client: WorkerClient) -> None:
            with anyio.move_on_after(self._watchdog):
                try:
                    out[client.label] = await client.call(
                        MODEL_CONTROL_STATUS,
                        rc.ModelControlStatusRequest(),
                        rc.ModelControlStatusResponse,
                        timeout=PROBE_TIMEOUT_SECONDS,
                    )
                except RpcError as exc:
                    out[client.label] = f"{exc.status.name}: {exc.message}"
                return
            out[client.label] = "timed out"
            await client.reset()

        async with anyio.create_task_group() as tg:
            for client in clients:
                tg.start_soon(one, client)
        return out

    async def start(self) -> RepackReport:
        """Start-up (*every worker answers*, *one discipline, one model set*, *placed by memory*);
        raises ``LptStartupError``."""
        deadline = anyio.current_time() + self._startup_wait
        replies: dict[str, rc.ModelControlStatusResponse] = {}
        while True:
            clients = self._clients()
            pending = [c for label, c in sorted(clients.items()) if label not in replies]
            results = await self._poll(pending)
            failed = {}
            for label, r in results.items():
                if isinstance(r, rc.ModelControlStatusResponse):
                    replies[label] = r
                else:
                    failed[label] = r
            if not failed:
                break
            left = deadline - anyio.current_time()
            if not left > 0:
                raise LptStartupError(
                    f"lpt_packing scheduling: worker(s) {sorted(failed)} unreachable over the "
                    f"control plane ({'; '.join(f'{k}: {v}' for k, v in sorted(failed.items()))}); "
                    "lpt_packing needs every worker's ModelControlStatus (set "
                    "KSERVE_TRIO_GATEWAY_STARTUP_WAIT_SECONDS to wait for them)"
                )
            _log.info("lpt_waiting_for_workers", ready=sorted(replies), pending=sorted(failed))
            await anyio.sleep(min(STARTUP_POLL_SECONDS, left))
        return self.begin(replies)

    def begin(self, replies: Mapping[str, rc.ModelControlStatusResponse]) -> RepackReport:
        """Start-up's *one discipline, one model set* and *placed by memory* over every worker's
        reply (pure: ``start`` calls it once every worker has answered); raises
        ``LptStartupError``."""
        check_preconditions(replies)
        poll = aggregate_poll(replies)
        self.ready = poll.polled
        self.poll = poll
        self.started = True
        if FillMode.INFLIGHT in self.fill_modes():
            _log.warning("lpt_fill_mode_inflight", message=INFLIGHT_WARNING)
        return self._repack("startup", poll)

    # ---- ticks ------------------------------------------------------------------------------

    def _on_metadata(self, metadata: RoutingMetadata) -> None:
        if not self.started or metadata.last_poll is None:
            return
        try:
            self.tick(metadata.last_poll)
        except Exception as exc:  # a bug in one tick keeps the previous placement
            _log.exception("lpt_tick_failed", error=str(exc))

    def tick(self, poll: FleetPoll) -> RepackReport | None:
        """A tick (*fill plans*, *fleet compute*, *threshold*, *trigger*); returns the repack's
        report when one ran."""
        self.book.last_tick_unix = time.time()
        self.ready = poll.polled
        self.poll = poll
        self.policy.refresh_plans()
        fleet = poll.fleet_compute_seconds
        if self._fleet_base is not None and fleet >= self._fleet_base:
            self.accum += fleet - self._fleet_base
        self._fleet_base = fleet
        requested = self.book.requested
        if requested > self.book.completed:
            report = self._repack("operator", poll)
            self.book.completed = requested  # stored last: a waiting Repack sees it all
            return report
        if self.accum >= self.threshold:
            report = self._repack("compute", poll)
            self.book.first_compute_done = True
            return report
        return None

    # ---- repack -----------------------------------------------------------------------------

    def _measure(self, poll: FleetPoll, compute_elapsed: float, wall: float) -> None:
        """*Rates and costs* (repack)."""
        h = self.knobs.halflife
        arrivals = self.policy.take_arrivals()
        for model, n in self.extra_arrivals().items():
            arrivals[model] = arrivals.get(model, 0) + n
        for model, n in arrivals.items():
            if model not in poll.models:
                continue
            sample = n / wall if wall > 0 else 0.0
            old = self.rate.get(model)
            self.rate[model] = sample if not old else ewma(old, sample, compute_elapsed, h)
        for model in poll.models:
            if model not in self.rate:
                self.rate[model] = 0.0
        for model, report in poll.models.items():
            now = (report.total_compute_seconds, report.requests_served)
            base = self._cost_base.get(model, (0.0, 0))
            self._cost_base[model] = now
            d_compute, d_requests = now[0] - base[0], now[1] - base[1]
            if d_compute < 0 or d_requests < 0 or d_requests == 0:
                continue  # a restart re-baselines; no requests: nothing measured
            sample = d_compute / d_requests
            old = self.cost.get(model)
            self.cost[model] = sample if not old else ewma(old, sample, compute_elapsed, h)

    def _repack(self, trigger: str, poll: FleetPoll) -> RepackReport:
        now = time.monotonic()  # a pure tick needs no event loop (tests, the simulator)
        wall = 0.0 if self._last_repack is None else now - self._last_repack
        compute_elapsed = self.accum
        self._measure(poll, compute_elapsed, wall)
        workers = poll.polled
        everywhere = {m for m, r in poll.models.items() if set(r.workers) == set(workers)}
        u = {}
        for m in sorted(everywhere):
            rate, cost = self.rate.get(m, 0.0), self.cost.get(m, 0.0)
            u[m] = rate * cost if rate > 0 and cost > 0 else 0.0
        old = self.policy.assignment
        knobs = self.knobs
        assignment = compute_assignment(
            u,
            workers,
            {m: p.workers for m, p in old.placements.items()},
            mem={m: r.weight_nbytes for m, r in poll.models.items()},
            mem_cap=dict(poll.weight_cache_max_bytes),
            replicas={m: o.replicas for m, o in self.overrides.items() if o.replicas is not None},
            default_replicas=knobs.default_replicas,
            hysteresis=knobs.hysteresis,
            forbid_memory_oversubscription=knobs.forbid_memory_oversubscription,
            max_worker_share=knobs.max_worker_share,
        )
        drifted = sorted(set(poll.models) - everywhere)
        warnings = list(assignment.warnings)
        if drifted:
            placements = dict(assignment.placements)
            for m in drifted:
                reporting = tuple(sorted(poll.models[m].workers))
                placements[m] = Placement(reporting, tuple(1.0 / len(reporting) for _ in reporting))
                warnings.append(
                    f"model '{m}' is reported by {list(reporting)} only, not by every worker: "
                    "placed evenly over those (the workers' model sets drifted)"
                )
            assignment = dataclasses.replace(assignment, placements=placements)
        self.policy.repack(assignment)
        self.util = u
        self.drifted = tuple(drifted)
        self.accum = 0.0
        self._last_repack = now
        moved = moved_models(old, assignment)
        changed = changed_workers(old, assignment)
        for m, p in assignment.placements.items():
            self.pairs.update((m, w) for w in p.workers)
        book = self.book
        book.count += 1
        book.by_trigger[trigger] = book.by_trigger.get(trigger, 0) + 1
        book.last_unix = time.time()
        book.last_wall_elapsed = wall
        book.last_compute = compute_elapsed
        book.last_trigger = trigger
        book.last_placed = len(assignment.placements)
        book.last_moved = len(moved)
        compacted = self._compaction_cadence(old, assignment, changed)
        report = RepackReport(
            trigger,
            len(assignment.placements),
            tuple(moved),
            tuple(changed),
            tuple(drifted),
            tuple(sorted(warnings)),
            compacted,
        )
        self.last_report = report
        _log.info(
            "lpt_repacked",
            trigger=trigger,
            placements={m: list(p.workers) for m, p in sorted(assignment.placements.items())},
            utilization={m: round(v, 6) for m, v in u.items()},
            moved=list(moved),
            changed_workers=list(changed),
            compacting=list(compacted),
        )
        for warning in report.warnings:
            _log.warning("lpt_repack_warning", message=warning)
        self.on_repack(report)
        return report

    def _compaction_cadence(
        self, old: Assignment, new: Assignment, changed: Sequence[str]
    ) -> tuple[str, ...]:
        """After a repack: with compaction on, count the repack; once ``compaction_interval``
        repacks have run and some worker's assignment changed, compact the changed workers
        (``eager``: free on-demand weights; ``scheduled``: and load the newly assigned ones)
        and start counting again."""
        knobs = self.knobs
        if knobs.compaction_mode is CompactionMode.OFF or knobs.compaction_interval <= 0:
            return ()
        self.book.since_compaction += 1
        if self.book.since_compaction < knobs.compaction_interval or not changed:
            return ()
        self.book.since_compaction = 0
        jobs = compaction_jobs(old, new, changed, knobs.compaction_mode)
        self.compactor.submit(jobs)
        return tuple(sorted(jobs))

    # ---- operator repacks -------------------------------------------------------------------

    def request_repack(self) -> int:
        """Ask for an operator repack at the next tick; returns its sequence number (requests
        before that tick share it: they coalesce into one repack)."""
        self.book.requested += 1
        self.wake()
        return self.book.requested

    def weight_budget(self, worker: str) -> int:
        poll = self.poll
        return int(poll.weight_cache_max_bytes.get(worker, 0)) if poll is not None else 0

    def assigned_bytes(self, worker: str) -> int:
        poll = self.poll
        sizes = {m: r.weight_nbytes for m, r in poll.models.items()} if poll else {}
        meta = self.policy.metadata.models
        return sum(
            sizes.get(m, meta[m].weight_nbytes if m in meta else 0)
            for m in self.policy.assignment.models_on(worker)
        )


def check_preconditions(replies: Mapping[str, rc.ModelControlStatusResponse]) -> None:
    """*One discipline, one model set* (start-up, pure): every worker runs fifo or edf, and all
    report one model set."""
    for label, reply in sorted(replies.items()):
        if reply.discipline.lower() not in DISCIPLINES:
            raise LptStartupError(
                f"lpt_packing scheduling: worker {label} runs the '{reply.discipline}' "
                "discipline; under lpt_packing the gateway decides fairness, so set "
                "scheduler.discipline: fifo or edf on every worker"
            )
    sets = {label: sorted({m.name for m in r.models}) for label, r in sorted(replies.items())}
    distinct = {tuple(v) for v in sets.values()}
    if len(distinct) > 1:
        detail = "; ".join(f"{label}: {names}" for label, names in sets.items())
        raise LptStartupError(
            "lpt_packing scheduling: the workers report different model sets; every worker "
            f"must serve the same models ({detail})"
        )


__all__ = [
    "DISCIPLINES",
    "NO_REPACK_YET",
    "STARTUP_POLL_SECONDS",
    "LptScheduler",
    "LptStartupError",
    "RepackBook",
    "RepackReport",
    "check_preconditions",
    "resolve_fill",
]

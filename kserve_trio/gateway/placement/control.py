"""``reactant_control.GatewayControlService`` on the gateway's gRPC port: the operator's view
and levers of lpt_packing (GetSchedulingStatus, SetSchedulingPolicy, SetModelPlacement, Repack).

Nothing is persisted: a change lives until the gateway restarts (``gateway.yml`` is the
start-up state, generation 0). The mutators need lpt_packing (FAILED_PRECONDITION otherwise);
a value the configuration rules refuse is INVALID_ARGUMENT with the rule; anything unexpected
is INTERNAL. The pure parts (applying an update mask, building the status) are functions of
their inputs; ``GatewayControl`` is the thin gRPC shell.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import anyio

from kserve_trio.core.errors import (
    ConfigError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from kserve_trio.core.logging import get_logger
from kserve_trio.gateway.config import (
    ALL_REPLICAS,
    INFLIGHT_WARNING,
    CompactionMode,
    FillMode,
    FillPolicy,
    ModelPlacementConfig,
    SchedulingConfig,
    SchedulingMode,
    WorkBasis,
    validate_scheduling,
)
from kserve_trio.gateway.placement.scheduler import LptScheduler
from kserve_trio.proto import reactant_control as rc
from kserve_trio.serving.grpc import Call, Limits, Method, RawMessage, raw_unary

SERVICE = "/reactant_control.GatewayControlService/"
MAX_WAIT_SECONDS = 120.0
REPACK_POLL_SECONDS = 0.05
MUTABLE = (
    "rebalance_compute_seconds",
    "first_rebalance_compute_seconds",
    "hysteresis",
    "ema_halflife_compute_seconds",
    "default_replicas",
    "routing_policy",
    "work_basis",
    "routing_fill_factor",
    "routing_fill_mode",
    "compaction_mode",
    "compaction_interval",
    "forbid_memory_oversubscription",
)
"""The update-mask names SetSchedulingPolicy accepts (``SchedulingPolicy``'s field names)."""
FIXED = {
    "mode": "the scheduling mode is fixed at start-up (gateway.yml)",
    "scheduling_mode": "the scheduling mode is fixed at start-up (gateway.yml)",
    "max_worker_share": "the share cap is fixed at start-up (gateway.yml)",
    "endpoints": "the worker list is the gateway's configuration (gateway.yml or discovery)",
    "listen": "the listen addresses are bound at start-up",
}
TAKES_EFFECT = "takes effect at the next repack; call Repack to apply it now"

_log = get_logger(__name__)


def needs_lpt(mode: SchedulingMode) -> FailedPrecondition:
    return FailedPrecondition(
        f"gateway scheduling mode is '{mode.value}'; the scheduler control RPCs require lpt_packing"
    )


def policy_message(knobs: SchedulingConfig, generation: int) -> rc.SchedulingPolicy:
    """The knobs as the proto reports them (``default_replicas`` -1 = all; the half-life
    resolved)."""
    return rc.SchedulingPolicy(
        rebalance_compute_seconds=knobs.rebalance_compute_seconds,
        first_rebalance_compute_seconds=knobs.first_rebalance_compute_seconds,
        hysteresis=knobs.hysteresis,
        ema_halflife_compute_seconds=knobs.halflife,
        default_replicas=knobs.default_replicas,
        routing_policy=knobs.routing_policy.value,
        routing_fill_factor=knobs.routing_fill_factor,
        routing_fill_mode=knobs.routing_fill_mode.value,
        compaction_mode=knobs.compaction_mode.value,
        compaction_interval=knobs.compaction_interval,
        forbid_memory_oversubscription=knobs.forbid_memory_oversubscription,
        generation=generation,
        work_basis=knobs.basis.value,
        max_worker_share=knobs.max_worker_share,
    )


E = TypeVar("E", bound=enum.Enum)


def _enum(cls: type[E], text: str, name: str) -> E:
    """The member of the string enum ``cls`` whose value ``text`` names (case-insensitive)."""
    for member in cls:
        if member.value == text.strip().lower():
            return member
    choices = ", ".join(m.value for m in cls)
    raise ConfigError(f"must be one of {choices} (got {text!r})", f"scheduling.{name}")


def apply_policy_update(
    knobs: SchedulingConfig, mask: Sequence[str], policy: rc.SchedulingPolicy | None
) -> SchedulingConfig:
    """The knobs after SetSchedulingPolicy (pure; all or nothing).

    Rules:
    1. An empty mask or no policy is INVALID_ARGUMENT; a name of ``FIXED`` is
       INVALID_ARGUMENT "cannot be changed at runtime: <reason>"; an unknown name lists the
       accepted ones.
    2. Every masked field is taken from ``policy`` (``default_replicas`` -1 = all; enum names
       any case; ``ema_halflife_compute_seconds`` 0 = track the rebalance budget), then the
       whole result is checked with gateway.yml's rules: the first violation refuses the whole
       update (ConfigError -> INVALID_ARGUMENT) and nothing changes.
    """
    names = [n.strip() for n in mask if n.strip()]
    if not names or policy is None:
        raise InvalidArgument("SetSchedulingPolicy needs a non-empty update_mask and a policy")
    for name in names:
        if name in FIXED:
            raise InvalidArgument(f"'{name}' cannot be changed at runtime: {FIXED[name]}")
        if name not in MUTABLE:
            raise InvalidArgument(
                f"unknown update_mask name '{name}'; accepted: {', '.join(MUTABLE)}"
            )
    changes: dict[str, object] = {}
    for name in names:
        value = getattr(policy, name)
        if name == "routing_policy":
            if value.strip().lower() == "least_outstanding":
                raise ConfigError(
                    "'least_outstanding' is a scheduling mode, not an lpt_packing routing "
                    "policy; use fill_least or fill_rr",
                    "scheduling.routing_policy",
                )
            value = _enum(FillPolicy, value, name)
        elif name == "routing_fill_mode":
            value = _enum(FillMode, value, name)
        elif name == "compaction_mode":
            value = _enum(CompactionMode, value, name)
        elif name == "work_basis":
            value = _enum(WorkBasis, value, name)
        elif name == "default_replicas" and value < ALL_REPLICAS:
            raise ConfigError(
                f"must be a positive integer or -1 (every worker) (got {value})",
                "scheduling.default_replicas",
            )
        changes[name] = value
    updated = dataclasses.replace(knobs, **changes)
    validate_scheduling(updated)
    return updated


def policy_warnings(
    old: SchedulingConfig, new: SchedulingConfig, scheduler: LptScheduler
) -> list[str]:
    """What an accepted SetSchedulingPolicy should tell the operator."""
    out = []
    if scheduler.accum >= scheduler.threshold:
        out.append(
            f"the compute accumulated since the last repack ({scheduler.accum:g} s) already "
            "reaches the rebalance budget: a repack runs at the next tick"
        )
    if new.halflife != old.halflife:
        out.append(
            "the rate and cost averages keep their history; only new samples use the new half-life"
        )
    if (
        new.first_rebalance_compute_seconds != old.first_rebalance_compute_seconds
        and scheduler.book.first_compute_done
    ):
        out.append(
            "the first rebalance budget no longer applies: the first compute-triggered repack "
            "has already run"
        )
    if FillMode.INFLIGHT in (new.routing_fill_mode,):
        out.append(INFLIGHT_WARNING)
    return sorted(out)


def repack_status(s: LptScheduler) -> rc.RepackStatus:
    b = s.book
    return rc.RepackStatus(
        last_repack_unix_seconds=b.last_unix,
        last_repack_wall_elapsed_seconds=b.last_wall_elapsed,
        last_repack_compute_seconds=b.last_compute,
        last_trigger=b.last_trigger,
        last_models_placed=b.last_placed,
        last_models_moved=b.last_moved,
        repack_count=b.count,
        compute_accumulated_seconds=s.accum,
        active_threshold_seconds=s.threshold,
        first_tick_repack_done=b.first_compute_done,
        last_tick_unix_seconds=b.last_tick_unix,
        repacks_since_compaction=b.since_compaction,
        operator_repacks_requested=b.requested,
        operator_repacks_completed=b.completed,
    )


def scheduling_status(s: LptScheduler) -> rc.GetSchedulingStatusResponse:
    """GetSchedulingStatus under lpt_packing: the knobs, the repack book, one entry per model
    (placed, overridden or reported; sorted) and per worker (sorted), and the warnings."""
    policy = s.policy
    assignment = policy.assignment
    reported = set(policy.metadata.models)
    if s.poll is not None:
        reported |= set(s.poll.models)
    models = []
    for name in sorted(set(assignment.placements) | set(s.overrides) | reported):
        placement = assignment.placements.get(name)
        replicas = []
        if placement is not None:
            for worker, weight in zip(placement.workers, placement.weights, strict=True):
                replicas.append(
                    rc.ReplicaPlacement(
                        worker=worker,
                        weight=weight,
                        outstanding=policy.outstanding(name, worker),
                        routed_total=policy.routed(name, worker),
                    )
                )
        meta = policy.metadata.models.get(name)
        models.append(
            rc.ModelSchedulingStatus(
                name=name,
                configured_replicas=s.configured_replicas(name),
                effective_replicas=s.effective_replicas(name),
                replicas=replicas,
                utilization=s.util.get(name, 0.0),
                arrival_rate=s.rate.get(name, 0.0),
                cost_seconds=s.cost.get(name, 0.0),
                max_batch=meta.max_batch_size if meta else 0,
                fill_mode=s.fill_for(name).mode.value,
                fill_quantum=policy.quantum(name),
                weight_nbytes=meta.weight_nbytes if meta else 0,
                placed=placement is not None,
                drifted=name in s.drifted,
            )
        )
    inflight = policy.inflight_work()
    known = set(s.ready) | {w for p in assignment.placements.values() for w in p.workers}
    workers = []
    for worker in sorted(known):
        assigned, budget = s.assigned_bytes(worker), s.weight_budget(worker)
        workers.append(
            rc.WorkerSchedulingStatus(
                worker=worker,
                ready=worker in s.ready,
                models_placed=len(assignment.models_on(worker)),
                inflight_compute=inflight.get(worker, 0.0),
                assigned_weight_bytes=assigned,
                weight_budget_bytes=budget,
                oversubscribed=budget > 0 and assigned > budget,
            )
        )
    return rc.GetSchedulingStatusResponse(
        mode=SchedulingMode.LPT_PACKING.value,
        policy=policy_message(s.knobs, s.generation),
        repack=repack_status(s),
        models=models,
        workers=workers,
        warnings=s.warnings(),
    )


def placement_override(
    current: ModelPlacementConfig | None, request: rc.SetModelPlacementRequest
) -> ModelPlacementConfig:
    """The override after SetModelPlacement (pure). ``replicas``: 0 clears, -1 all, > 0 a
    count, < -1 refused; ``fill_mode``: "" unchanged, ``inherit`` clears, else a fill mode;
    ``fill_factor``: < 0 unchanged, 0 clears, > 0 sets."""
    base = current or ModelPlacementConfig()
    replicas = base.replicas
    if request.replicas < ALL_REPLICAS:
        raise InvalidArgument(
            f"replicas must be > 0, -1 (every worker) or 0 (clear) (got {request.replicas})"
        )
    if request.replicas != 0:
        replicas = request.replicas
    else:
        replicas = None
    fill_mode = base.fill_mode
    text = request.fill_mode.strip().lower()
    if text == "inherit":
        fill_mode = None
    elif text:
        try:
            fill_mode = _enum(FillMode, text, "fill_mode")
        except ConfigError:
            raise InvalidArgument(
                f"fill_mode must be run, spread, inflight, inherit or empty (got "
                f"{request.fill_mode!r})"
            ) from None
    factor = base.fill_factor
    if math.isnan(request.fill_factor) or math.isinf(request.fill_factor):
        raise InvalidArgument(f"fill_factor must be finite (got {request.fill_factor})")
    if request.fill_factor >= 0:
        factor = request.fill_factor
    return ModelPlacementConfig(replicas, fill_mode, factor)


class GatewayControl:
    """The gRPC methods of GatewayControlService (see the module docstring)."""

    def __init__(
        self,
        mode: SchedulingMode,
        scheduler: LptScheduler | None,
        *,
        routable_models: Callable[[], set[str]],
        limits: Limits,
    ) -> None:
        self.mode = mode
        self.scheduler = scheduler
        self._models = routable_models
        self.limits = limits
        self.settled: Callable[[], Awaitable[None]] | None = None
        """Awaited after a change (SetSchedulingPolicy, SetModelPlacement, Repack) and before
        its reply: a gateway's other processes have adopted it (``multiprocess``)."""

    def methods(self) -> dict[str, Method]:
        rpcs = {
            "GetSchedulingStatus": (self.get_status, rc.GetSchedulingStatusRequest),
            "SetSchedulingPolicy": (self.set_policy, rc.SetSchedulingPolicyRequest),
            "SetModelPlacement": (self.set_placement, rc.SetModelPlacementRequest),
            "Repack": (self.repack, rc.RepackRequest),
        }
        return {
            SERVICE + rpc: raw_unary(self._handler(fn, cls, rpc), self.limits, rpc)
            for rpc, (fn, cls) in rpcs.items()
        }

    def _handler(self, fn, cls, rpc: str):
        async def run(call: Call, message: RawMessage) -> bytes:
            data = call.plain(message)
            try:
                request = cls.parse(bytes(data))
            except Exception as exc:
                raise InvalidArgument(f"malformed {rpc} request: {exc}") from None
            try:
                reply = bytes(await fn(request))
            except ConfigError as exc:
                raise InvalidArgument(str(exc)) from None
            if self.settled is not None and rpc != "GetSchedulingStatus":
                await self.settled()
            return reply

        return run

    def _lpt(self) -> LptScheduler:
        if self.scheduler is None:
            raise needs_lpt(self.mode)
        return self.scheduler

    async def get_status(self, request: rc.GetSchedulingStatusRequest):
        if self.scheduler is None:
            return rc.GetSchedulingStatusResponse(mode=self.mode.value)
        return scheduling_status(self.scheduler)

    async def set_policy(self, request: rc.SetSchedulingPolicyRequest):
        s = self._lpt()
        old = s.knobs
        new = apply_policy_update(old, request.update_mask, request.policy)
        warnings = policy_warnings(old, new, s)
        s.set_knobs(new)
        _log.info(
            "lpt_policy_changed",
            fields=sorted(set(request.update_mask)),
            before=policy_message(old, s.generation - 1).to_dict(),
            after=policy_message(new, s.generation).to_dict(),
        )
        return rc.SetSchedulingPolicyResponse(
            applied=policy_message(new, s.generation), warnings=warnings, persisted=False
        )

    async def set_placement(self, request: rc.SetModelPlacementRequest):
        s = self._lpt()
        name = request.name.strip()
        if not name:
            raise InvalidArgument("SetModelPlacement needs a model name")
        known = self._models() | set(s.policy.metadata.models)
        warnings = []
        if name not in known:
            if not request.allow_unknown_model:
                raise NotFound(
                    f"model '{name}' is not in the routing table (set allow_unknown_model to "
                    "store an override for a model not served yet)"
                )
            warnings.append(f"model '{name}' is not served yet: the override is stored for it")
        override = placement_override(s.overrides.get(name), request)
        s.set_override(name, override)
        configured = s.configured_replicas(name)
        effective = s.effective_replicas(name)
        if configured != ALL_REPLICAS and configured > effective:
            warnings.append(
                f"replicas {configured} clamped to {effective}: the ready workers at the last tick"
            )
        fill = s.fill_for(name)
        if fill.mode is FillMode.INFLIGHT:
            warnings.append(INFLIGHT_WARNING)
        meta = s.policy.metadata.models.get(name)
        if meta is not None and effective > 1:
            over = [
                w
                for w in s.ready
                if 0 < s.weight_budget(w) < s.assigned_bytes(w) + meta.weight_nbytes
                and w not in s.policy.assignment.workers_of(name)
            ]
            if over:
                warnings.append(
                    f"estimated device memory oversubscription on {over}: their assigned "
                    f"weights plus '{name}' ({meta.weight_nbytes} bytes) exceed their budget"
                )
        warnings.append(TAKES_EFFECT)
        _log.info("lpt_placement_override", model=name, override=dataclasses.asdict(override))
        return rc.SetModelPlacementResponse(
            name=name,
            configured_replicas=configured,
            effective_replicas=effective,
            fill_mode=fill.mode.value,
            fill_quantum=s.policy.quantum(name),
            warnings=sorted(warnings),
            persisted=False,
        )

    async def repack(self, request: rc.RepackRequest):
        s = self._lpt()
        wait = request.wait_seconds
        warnings = []
        if math.isnan(wait) or wait < 0:
            raise InvalidArgument(f"wait_seconds must be >= 0 (got {wait})")
        if wait > MAX_WAIT_SECONDS:
            warnings.append(f"wait_seconds {wait:g} clamped to {MAX_WAIT_SECONDS:g}")
            wait = MAX_WAIT_SECONDS
        if wait > 0 and not s.ready:
            raise Unavailable("no worker was ready at the last tick: a repack cannot run now")
        sequence = s.request_repack()
        started = anyio.current_time()
        with anyio.move_on_after(wait):
            while s.book.completed < sequence:
                await anyio.sleep(REPACK_POLL_SECONDS)
        done = s.book.completed >= sequence
        if wait > 0 and not done:
            warnings.append(f"the repack did not complete within {wait:g} s; it runs at a tick")
        return rc.RepackResponse(
            sequence=sequence,
            completed_sequence=s.book.completed,
            completed=done,
            waited_seconds=anyio.current_time() - started,
            repack=repack_status(s),
            warnings=sorted(warnings),
        )


__all__ = [
    "FIXED",
    "MUTABLE",
    "SERVICE",
    "GatewayControl",
    "apply_policy_update",
    "placement_override",
    "policy_message",
    "scheduling_status",
]

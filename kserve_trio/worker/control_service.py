"""The worker's ``reactant_control.ControlService``: residency, live policy and compaction.

``ModelControlStatus`` reports the residency mode, the
discipline, the on-demand budget and one row per *routable* model (a meta is one row folded
from its sub-models, which are not listed); ``SetModelResidency`` moves a model's floor in
explicit mode (a meta applies it to its declared sub-models); ``SetModelPolicy`` changes the
live fair weight (a non-positive weight is INVALID_ARGUMENT); ``CompactMemory``
frees the on-demand device weights and reloads the listed models.

Statuses: a bad target or weight INVALID_ARGUMENT; an unknown model NOT_FOUND ``unknown model:
m``; no weight cache, a self-managed worker or a missing sub-model FAILED_PRECONDITION.
``control_status`` and ``set_model_residency`` are shared with the Triton repository RPCs
(``RepositoryModelLoad``/``Unload`` in explicit mode, ``worker/service.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kserve_trio.core.bundles import wire_batch_spec
from kserve_trio.core.errors import FailedPrecondition
from kserve_trio.core.process import ResidencyMode, ResidencyState
from kserve_trio.proto import reactant_control as pb
from kserve_trio.runtime.weight_cache import (
    NEEDS_CACHE,
    SELF_MANAGED,
    least_resident,
    residency_target,
)
from kserve_trio.serving.grpc import Method, unary
from kserve_trio.serving.rpc_codec import TypedRpc
from kserve_trio.worker.registry import unknown_model

if TYPE_CHECKING:
    from kserve_trio.runtime.model import CompiledModel
    from kserve_trio.worker.state import WorkerState

PREFIX = "/reactant_control.ControlService/"
"""The path prefix of the control service's RPCs."""


@dataclass(frozen=True, slots=True)
class ModelControlRow:
    """One routable model as the control plane sees it (``batch_axis`` 1-based, wire order)."""

    name: str
    residency: ResidencyState
    device_resident: bool
    host_resident: bool
    weight_nbytes: int
    weight: float
    queue_depth: int
    total_compute_seconds: float
    requests_served: int
    dispatch_count: int
    max_batch_size: int
    batch_input_name: str
    batch_axis: int
    rows_served: int


@dataclass(frozen=True, slots=True)
class ControlStatus:
    """``control_status``: the worker's residency mode, discipline, budget and models."""

    residency_mode: str
    discipline: str
    weight_cache_max_bytes: int
    models: tuple[ModelControlRow, ...]


def _mode(state: WorkerState) -> ResidencyMode:
    return state.config.residency_mode


def _discipline(state: WorkerState) -> str:
    discipline = state.config.scheduler.discipline
    return str(getattr(discipline, "value", discipline)).lower()


def _residency(
    state: WorkerState, name: str, model: CompiledModel | None
) -> tuple[ResidencyState, bool, bool, int]:
    cache = state.cache
    if cache.has(name):
        r = cache.residency(name)
        return r.floor, r.device_resident, r.host_resident, r.weight_nbytes
    resident = bool(model is not None and model.weights_resident())
    nbytes = int(getattr(model, "weight_nbytes", 0) or 0)
    return ResidencyState.UNPINNED, resident, False, nbytes


def control_status(state: WorkerState) -> ControlStatus:
    """Assemble the control-plane snapshot from the scheduler, the cache and the bundles.

    Rules for a meta's row: residency = the least-resident floor of its declared sub-models
    (UNPINNED with none, or for one that is not loaded); ``weight_nbytes`` the sum of theirs;
    ``device_resident``/``host_resident`` the AND over them (False with none); its own counters
    (one dispatch per request, ``rows_served == requests_served``); no batch axis and
    ``max_batch_size`` 0.
    """
    metrics = state.scheduler.scheduler_metrics()
    repository = state.repository
    rows: list[ModelControlRow] = []
    for name in repository.routable_names():
        bundle = repository.bundles[name]
        if bundle.is_meta:
            subs = []
            for callee in bundle.manifest.meta_calls:
                sub = repository.get(callee)
                if sub is None or sub.model is None:
                    subs.append((ResidencyState.UNPINNED, False, False, 0))
                else:
                    subs.append(_residency(state, callee, sub.model))
            stats = state.observer.stats.get(name)
            served = stats.success.count if stats is not None else 0
            compute = stats.compute_infer.ns / 1e9 if stats is not None else 0.0
            rows.append(
                ModelControlRow(
                    name=name,
                    residency=least_resident(s[0] for s in subs),
                    device_resident=bool(subs) and all(s[1] for s in subs),
                    host_resident=bool(subs) and all(s[2] for s in subs),
                    weight_nbytes=sum(s[3] for s in subs),
                    weight=1.0,
                    queue_depth=0,
                    total_compute_seconds=compute,
                    requests_served=served,
                    dispatch_count=served,
                    max_batch_size=0,
                    batch_input_name="",
                    batch_axis=0,
                    rows_served=served,
                )
            )
            continue
        m = metrics.get(name)
        if m is None:  # compiled but not admitted yet (a reload in flight)
            continue
        floor, device, host, nbytes = _residency(state, name, bundle.model)
        spec = wire_batch_spec(bundle.manifest)
        rows.append(
            ModelControlRow(
                name=name,
                residency=floor,
                device_resident=device,
                host_resident=host,
                weight_nbytes=nbytes,
                weight=m.weight,
                queue_depth=m.queue_depth,
                total_compute_seconds=m.total_compute,
                requests_served=m.requests_served,
                dispatch_count=m.dispatch_count,
                max_batch_size=m.max_batch_size,
                batch_input_name=spec[0] if spec else "",
                batch_axis=spec[1] + 1 if spec else 0,
                rows_served=m.rows_served,
            )
        )
    cache = state.cache
    return ControlStatus(
        residency_mode=_mode(state).value,
        discipline=_discipline(state),
        weight_cache_max_bytes=cache.max_bytes,
        models=tuple(rows),
    )


async def set_model_residency(
    state: WorkerState, name: str, target: ResidencyState | int
) -> ResidencyState:
    """Move ``name`` (a regular model, or each declared sub-model of a meta) to ``target``.

    Rules: the target must be UNPINNED/PINNED_SYSTEM/PINNED_DEVICE (INVALID_ARGUMENT); the model
    must exist (NOT_FOUND); the worker must have the weight cache and be externally managed
    (FAILED_PRECONDITION). For a meta, every declared sub-model must be loaded; when the target
    is below PINNED_DEVICE, a sub-model also declared by another meta is left alone (that meta
    still needs it). Returns the resulting floor (a meta's: the least resident of its subs).
    Each move runs on the device thread.
    """
    target = residency_target(target)
    bundle = state.repository.get(name)
    if bundle is None:
        raise unknown_model(name)
    cache = state.cache
    if not cache.enabled:
        raise FailedPrecondition(NEEDS_CACHE)
    if not cache.externally_managed:
        raise FailedPrecondition(SELF_MANAGED)
    if not bundle.is_meta:
        return await state.scheduler.set_residency(name, target)
    subs = list(dict.fromkeys(bundle.manifest.meta_calls))
    for sub in subs:
        if not state.scheduler.has_model(sub):
            raise FailedPrecondition(f"meta model '{name}' calls '{sub}', which is not loaded")
    shared = {
        c
        for other, b in state.repository.bundles.items()
        if b.is_meta and other != name
        for c in b.manifest.meta_calls
    }
    for sub in subs:
        if target is not ResidencyState.PINNED_DEVICE and sub in shared:
            continue
        await state.scheduler.set_residency(sub, target)
    return least_resident(cache.residency(s).floor for s in subs)


def _status_message(row: ModelControlRow) -> pb.ModelStatus:
    return pb.ModelStatus(
        name=row.name,
        residency=pb.Residency(int(row.residency)),
        device_resident=row.device_resident,
        host_resident=row.host_resident,
        weight_nbytes=row.weight_nbytes,
        weight=row.weight,
        queue_depth=row.queue_depth,
        total_compute_seconds=row.total_compute_seconds,
        requests_served=row.requests_served,
        dispatch_count=row.dispatch_count,
        max_batch_size=row.max_batch_size,
        batch_input_name=row.batch_input_name,
        batch_axis=row.batch_axis,
        rows_served=row.rows_served,
    )


class ControlService:
    """``reactant_control.ControlService`` over a ``WorkerState`` (``methods`` maps its paths)."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state

    def typed_rpcs(self) -> dict[str, TypedRpc]:
        """The RPCs by name, each with its parse and encode."""
        return {
            "ModelControlStatus": TypedRpc(self.model_control_status, pb.ModelControlStatusRequest),
            "SetModelResidency": TypedRpc(self.set_model_residency, pb.SetModelResidencyRequest),
            "SetModelPolicy": TypedRpc(self.set_model_policy, pb.SetModelPolicyRequest),
            "CompactMemory": TypedRpc(self.compact_memory, pb.CompactMemoryRequest),
        }

    def methods(self) -> dict[str, Method]:
        lim = self.state.limits
        return {
            PREFIX + rpc: unary(m.handler, m.request_type, lim, rpc)
            for rpc, m in self.typed_rpcs().items()
        }

    async def model_control_status(self, request):
        status = control_status(self.state)
        return pb.ModelControlStatusResponse(
            residency_mode=status.residency_mode,
            discipline=status.discipline,
            models=[_status_message(r) for r in status.models],
            weight_cache_max_bytes=status.weight_cache_max_bytes,
        )

    async def set_model_residency(self, request):
        result = await set_model_residency(self.state, request.name, request.target)
        return pb.SetModelResidencyResponse(residency=pb.Residency(int(result)))

    async def set_model_policy(self, request):
        scheduler = self.state.scheduler
        if not scheduler.has_model(request.name):
            raise unknown_model(request.name)
        if request.has_weight:
            scheduler.set_policy(request.name, weight=request.weight)
        return pb.SetModelPolicyResponse()

    async def compact_memory(self, request):
        reloaded = await self.state.scheduler.compact(list(request.reload_models))
        cache = self.state.cache
        after = cache.stats().resident_bytes
        return pb.CompactMemoryResponse(reloaded_models=reloaded, resident_bytes_after=after)


__all__ = [
    "PREFIX",
    "ControlService",
    "ControlStatus",
    "ModelControlRow",
    "control_status",
    "set_model_residency",
]

"""What the gateway answers from its workers' answers: the pure merges behind its fan-out RPCs.

Each function takes the replies of the workers that answered (in worker label order) and
returns the gateway's reply; none does I/O. A worker that failed or did not answer is simply
absent from the input (the caller decides what a failure means for the RPC as a whole).

- ``union_repository_index``: every model any worker lists, once.
- ``sum_model_statistics``: one entry per model with every counter and duration summed.
- ``same_ipc_namespace``: true only if every worker shares the client's IPC namespace.
- ``sum_compact_memory``: the totals of a fleet-wide compaction.
- ``shm_status``: the regions the gateway registered, from its own record.
- ``first_failure``: the outcome of a fan-out that must succeed everywhere (model load/unload).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

from kserve_trio.client.errors import RpcError
from kserve_trio.proto import inference as pb
from kserve_trio.proto import reactant_control as rc

READY = "READY"
M = TypeVar("M")


def union_repository_index(
    replies: Sequence[pb.RepositoryIndexResponse],
) -> pb.RepositoryIndexResponse:
    """The models of every reply, one entry per (name, version), sorted.

    Rules:
    1. A model listed READY by any worker is READY (with an empty reason): a client asking
       "can I use it?" through the gateway gets yes when some replica serves it.
    2. Otherwise the first worker's entry (label order) is kept as it stands, state and reason.
    """
    merged: dict[tuple[str, str], pb.RepositoryIndexResponseModelIndex] = {}
    for reply in replies:
        for entry in reply.models:
            key = (entry.name, entry.version)
            kept = merged.get(key)
            if kept is None or (entry.state == READY and kept.state != READY):
                merged[key] = pb.RepositoryIndexResponseModelIndex(
                    name=entry.name, version=entry.version, state=entry.state, reason=entry.reason
                )
    return pb.RepositoryIndexResponse(models=[merged[k] for k in sorted(merged)])


def _sum_messages(cls: type[M], items: Iterable[M | None]) -> M | None:
    """Field-by-field sum of messages whose fields are all ``StatisticDuration``s (or, for a
    ``StatisticDuration`` itself, counts and nanoseconds); ``None`` when no item is set."""
    present = [item for item in items if item is not None]
    if not present:
        return None
    if cls is pb.StatisticDuration:
        return pb.StatisticDuration(  # type: ignore[return-value]
            count=sum(d.count for d in present),  # type: ignore[attr-defined]
            ns=sum(d.ns for d in present),  # type: ignore[attr-defined]
        )
    values = {
        f.name: _sum_messages(pb.StatisticDuration, (getattr(m, f.name) for m in present))
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
    }
    return cls(**{k: v for k, v in values.items() if v is not None})


def _merge_model(entries: Sequence[pb.ModelStatistics]) -> pb.ModelStatistics:
    batches: dict[int, list[pb.InferBatchStatistics]] = {}
    memory: dict[tuple[str, int], int] = {}
    responses: dict[str, list[pb.InferResponseStatistics]] = {}
    for e in entries:
        for b in e.batch_stats:
            batches.setdefault(b.batch_size, []).append(b)
        for u in e.memory_usage:
            memory[(u.type, u.id)] = memory.get((u.type, u.id), 0) + u.byte_size
        for key, r in e.response_stats.items():
            responses.setdefault(key, []).append(r)
    first = entries[0]
    return pb.ModelStatistics(
        name=first.name,
        version=first.version,
        last_inference=max(e.last_inference for e in entries),
        inference_count=sum(e.inference_count for e in entries),
        execution_count=sum(e.execution_count for e in entries),
        inference_stats=_sum_messages(pb.InferStatistics, (e.inference_stats for e in entries)),
        batch_stats=[
            pb.InferBatchStatistics(
                batch_size=size,
                compute_input=_sum_messages(pb.StatisticDuration, (b.compute_input for b in bs)),
                compute_infer=_sum_messages(pb.StatisticDuration, (b.compute_infer for b in bs)),
                compute_output=_sum_messages(pb.StatisticDuration, (b.compute_output for b in bs)),
            )
            for size, bs in sorted(batches.items())
        ],
        memory_usage=[
            pb.MemoryUsage(type=t, id=i, byte_size=n) for (t, i), n in sorted(memory.items())
        ],
        response_stats={
            key: _sum_messages(pb.InferResponseStatistics, rs)  # type: ignore[misc]
            for key, rs in sorted(responses.items())
        },
    )


def sum_model_statistics(
    replies: Sequence[pb.ModelStatisticsResponse],
) -> pb.ModelStatisticsResponse:
    """One entry per (name, version), in the order first seen, with counts, durations, batch
    statistics (by batch size), memory usage (by type and id) and response statistics (by
    key) summed over the workers and ``last_inference`` the latest."""
    grouped: dict[tuple[str, str], list[pb.ModelStatistics]] = {}
    for reply in replies:
        for entry in reply.model_stats:
            grouped.setdefault((entry.name, entry.version), []).append(entry)
    return pb.ModelStatisticsResponse(model_stats=[_merge_model(g) for g in grouped.values()])


def same_ipc_namespace(answers: Sequence[bool | None]) -> bool:
    """True iff there is at least one worker and every one answered true (``None``: it failed
    or does not know the RPC, which counts as false: a region it cannot map breaks every
    request routed to it)."""
    return bool(answers) and all(a is True for a in answers)


def sum_compact_memory(replies: Sequence[rc.CompactMemoryResponse]) -> rc.CompactMemoryResponse:
    """Models reloaded and device bytes resident afterwards, summed over the fleet."""
    return rc.CompactMemoryResponse(
        reloaded_models=sum(r.reloaded_models for r in replies),
        resident_bytes_after=sum(r.resident_bytes_after for r in replies),
    )


def shm_status(registered: Iterable[bytes], name: str = "") -> pb.SystemSharedMemoryStatusResponse:
    """The regions of the remembered Register requests (``name``: that one only; an unknown
    name gives no region, as a worker answers)."""
    regions: dict[str, pb.SystemSharedMemoryStatusResponseRegionStatus] = {}
    for data in registered:
        r = pb.SystemSharedMemoryRegisterRequest.parse(data)
        if name and r.name != name:
            continue
        regions[r.name] = pb.SystemSharedMemoryStatusResponseRegionStatus(
            name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size
        )
    return pb.SystemSharedMemoryStatusResponse(regions=dict(sorted(regions.items())))


def first_failure(results: Mapping[str, object]) -> tuple[str, RpcError] | None:
    """The first (label order) worker whose result is an ``RpcError``, or ``None`` when every
    worker succeeded."""
    for label in sorted(results):
        outcome = results[label]
        if isinstance(outcome, RpcError):
            return label, outcome
    return None


__all__ = [
    "READY",
    "first_failure",
    "same_ipc_namespace",
    "shm_status",
    "sum_compact_memory",
    "sum_model_statistics",
    "union_repository_index",
]

"""Triton's views of a model: ``ModelConfig`` from the manifest and ``ModelStatistics`` from the
scheduler's counters, so ``tritonclient.get_model_config`` /
``get_inference_statistics`` and Triton's tools work against a worker unchanged.

Pure functions over plain values; the service layer supplies the counters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kserve_trio.core.bundles import Manifest, TensorSpec
from kserve_trio.core.protocol import BUNDLE_VERSION
from kserve_trio.proto import inference as pb

PLATFORM = "jax"
"""The platform every bundle reports, in ``ModelConfig`` (as ``platform`` and ``backend``) and
in ``ModelMetadata`` alike: the framework that runs it, whatever the device."""


def _data_type(spec: TensorSpec) -> pb.DataType:
    # Triton's configuration calls the BYTES wire type TYPE_STRING
    return pb.DataType["TYPE_STRING" if spec.dtype.is_bytes else f"TYPE_{spec.dtype.wire}"]


def _batch_leading(specs: Sequence[TensorSpec]) -> bool:
    return all(s.batch_axis == 0 for s in specs)


def model_config(
    name: str, manifest: Manifest, compiled_sizes: Sequence[int], *, coalesces: bool
) -> pb.ModelConfig:
    """Triton ``ModelConfig`` for a bundle.

    Triton puts the batch dimension first and leaves it out of ``dims`` when
    ``max_batch_size > 0``. That holds when every client-facing tensor's batch axis is the
    leading one and a batched module exists: then ``max_batch_size`` is the largest compiled
    size and ``dims`` drop the batch axis. Otherwise ``max_batch_size`` is 0 and ``dims`` are the
    full wire shapes (-1 for batch and variable axes). ``dynamic_batching {}`` is present when
    the scheduler coalesces requests of this model.
    """
    sizes = [s for s in compiled_sizes if s > 0]
    inputs, outputs = manifest.wire_inputs, manifest.wire_outputs
    batched = bool(sizes) and _batch_leading(inputs) and _batch_leading(outputs) and bool(inputs)
    max_batch = max(sizes) if batched else 0

    def dims(spec: TensorSpec) -> list[int]:
        shape = spec.wire_shape()
        return shape[1:] if batched else shape

    cfg = pb.ModelConfig(
        name=name,
        platform=PLATFORM,
        backend=PLATFORM,
        max_batch_size=max_batch,
        input=[pb.ModelInput(name=s.name, data_type=_data_type(s), dims=dims(s)) for s in inputs],
        output=[
            pb.ModelOutput(name=s.name, data_type=_data_type(s), dims=dims(s)) for s in outputs
        ],
    )
    if coalesces and batched:
        cfg.dynamic_batching = pb.ModelDynamicBatching(preferred_batch_size=sorted(sizes))
    return cfg


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        self.count += 1
        self.ns += int(ns)


@dataclass
class RequestStats:
    """Per-model request outcomes measured by the service (Triton's success/fail/queue)."""

    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    last_inference_ms: int = 0


def _dur(d: Duration) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=d.count, ns=d.ns)


def model_statistics(
    name: str,
    stats: RequestStats,
    *,
    inference_count: int,
    execution_count: int,
    batch_compute: Mapping[int, tuple[int, int]],
) -> pb.ModelStatistics:
    """Triton ``ModelStatistics`` for one model.

    ``inference_count`` counts rows (Triton counts every batch element), ``execution_count``
    device executions; ``batch_compute`` maps batch size -> (executions, compute ns).
    """
    return pb.ModelStatistics(
        name=name,
        version=BUNDLE_VERSION,
        last_inference=stats.last_inference_ms,
        inference_count=inference_count,
        execution_count=execution_count,
        inference_stats=pb.InferStatistics(
            success=_dur(stats.success),
            fail=_dur(stats.fail),
            queue=_dur(stats.queue),
            compute_input=_dur(stats.compute_input),
            compute_infer=_dur(stats.compute_infer),
            compute_output=_dur(stats.compute_output),
            cache_hit=pb.StatisticDuration(),
            cache_miss=pb.StatisticDuration(),
        ),
        batch_stats=[
            pb.InferBatchStatistics(
                batch_size=size,
                compute_input=pb.StatisticDuration(),
                compute_infer=pb.StatisticDuration(count=count, ns=ns),
                compute_output=pb.StatisticDuration(),
            )
            for size, (count, ns) in sorted(batch_compute.items())
        ],
    )


__all__ = ["PLATFORM", "Duration", "RequestStats", "model_config", "model_statistics"]

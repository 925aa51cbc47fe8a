"""The weight cache's startup isolation probe: how much scratch memory one execution needs.

The on-demand budget (``_budget.weight_budget``) leaves room for one execution's scratch on top
of the weights, and only a measurement says how large that is. ``measure_scratch`` runs every
compiled program of every on-demand model once, alone on the device with its own weights, and
reports the largest scratch it saw, the largest weights it loaded and each program's time (the
scheduler's first cost estimates). The driver (``WeightCache.probe``) frees the device around it
and solves the budget from the result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kserve_trio.runtime._budget import Program
from kserve_trio.runtime._tiers import Record, Tiers

MIN_COST_SECONDS = 1e-6
"""The floor of a measured program time (a zero would read as "free" to the scheduler)."""


@dataclass
class Measurement:
    """What ``measure_scratch`` saw; ``failures`` maps a model to its failed steps."""

    max_scratch: int = 0
    max_weight: int = 0
    costs: dict[str, dict[Any, float]] = field(default_factory=dict)
    failures: dict[str, list[str]] = field(default_factory=dict)


def measure_scratch(
    records: Iterable[Record],
    programs: Callable[[str], Sequence[Program]],
    tiers: Tiers,
    *,
    pinned_bytes: int,
    free_on_demand: Callable[[], None],
    clock: Callable[[], float],
) -> Measurement:
    """Measure the scratch of every program of ``records`` (on-demand models, in the order to
    probe them: ascending weight size).

    Rules:
    1. for each model with programs: ``free_on_demand()``, load its weights (a failed load is
       recorded and the model skipped), ``max_weight = max(max_weight, nbytes)``;
    2. run each program once on its zero inputs, timed (at least ``MIN_COST_SECONDS``);
    3. scratch: with an allocator peak (GPU), ``peak_in_use - (pinned_bytes + max_weight)``;
       without one (CPU), the live bytes while the inputs and outputs exist minus those before
       the inputs were transferred; ``max_scratch`` is the largest, at least 0.
    A failing program is recorded and the next one runs. The last model's weights stay loaded.
    """
    out = Measurement()
    use_peak = "peak_bytes_in_use" in tiers.memory_stats()
    for rec in records:
        progs = list(programs(rec.name))
        if not progs:
            continue
        free_on_demand()
        try:
            tiers.load(rec)
        except Exception as exc:
            out.failures.setdefault(rec.name, []).append(f"load: {exc!r}")
            continue
        out.max_weight = max(out.max_weight, rec.nbytes)
        for label, inputs, run in progs:
            try:
                base = tiers.in_use()
                dev_inputs = tiers.backend.transfer_to_device(list(inputs))
                t0 = clock()
                outs = run(dev_inputs)
                dt = clock() - t0
                if use_peak:
                    peak = int(tiers.memory_stats().get("peak_bytes_in_use", 0))
                    scratch = peak - (pinned_bytes + out.max_weight)
                else:
                    scratch = tiers.in_use() - base
                del outs, dev_inputs
            except Exception as exc:
                out.failures.setdefault(rec.name, []).append(f"{label}: {exc!r}")
                continue
            out.max_scratch = max(out.max_scratch, scratch)
            out.costs.setdefault(rec.name, {})[label] = max(dt, MIN_COST_SECONDS)
    out.max_scratch = max(out.max_scratch, 0)
    return out


__all__ = ["MIN_COST_SECONDS", "Measurement", "measure_scratch"]

"""lpt_packing's fill plans: which replica of a multi-replica model takes the next request.

A placed model with several replicas is filled so that each worker's batches fill up: requests
go to one replica until it has a quantum ``Q`` of items in flight (its compiled batch size times
the fill factor), then the next replica opens a run. This keeps coalescing intact on every
replica instead of spreading a trickle of requests so thin that no replica ever batches.

``FillState`` is the per-model state machine (pure: no clocks, no locks; the gateway calls it
on its event loop). Three modes:

- ``run`` (default): runs of ``Q`` items, balanced so no replica falls a whole quantum behind;
- ``spread``: the replica with the fewest items in flight (plain least-outstanding);
- ``inflight``: fill the replica closest to completing a quantum (parks a closed loop of fewer
  than ``Q`` clients on one replica; kept for comparison).

and two tie-breaking policies: ``fill_least`` prefers the replica whose worker has the least
load, ``fill_rr`` ignores load and rotates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kserve_trio.gateway.config import FillMode, FillPolicy


def fill_quantum(max_batch: int, factor: float) -> int:
    """``Q``: ``max(1, round(factor * max_batch))`` items, or 1 when the batch size is unknown."""
    if max_batch <= 0:
        return 1
    return max(1, round(factor * max_batch))


def _quantize(load: float) -> int:
    return round(load * 1e9)


@dataclass
class FillState:
    """The fill state of one multi-replica model: items in flight per replica, the rotation
    cursor and the open run. ``replicas`` are worker labels, sorted."""

    replicas: tuple[str, ...]
    quantum: int = 1
    mode: FillMode = FillMode.RUN
    policy: FillPolicy = FillPolicy.FILL_LEAST
    outs: list[int] = field(default_factory=list)
    cursor: int = -1
    run_target: int | None = None
    run_units: int = 0

    def __post_init__(self) -> None:
        if not self.outs:
            self.outs = [0] * len(self.replicas)

    def _rot(self, i: int) -> int:
        """Rotation distance: 0 for the replica after the cursor, then onwards."""
        return (i - 1 - self.cursor) % len(self.replicas)

    def choose(self, units: int, loads: Sequence[float] | None = None) -> int:
        """Reserve ``units`` items on the next replica and return its index.

        ``loads`` are the replicas' worker loads (compared quantized); ``fill_rr`` ignores
        them. Rules per mode:

        1. ``spread``: argmin (items in flight, load, rotation); the cursor moves to it.
        2. ``run``: with ``floor = min_i floor(outs_i / Q)``, a replica is *ahead* when its own
           ``floor(outs_i / Q)`` is greater. A new run opens when there is none, the run holds
           ``Q`` items or more, its replica is ahead, or nothing is in flight: argmin (ahead,
           load, rotation), the cursor moves to it and the run starts with ``units``. Otherwise
           the request joins the open run.
        3. ``inflight``: progress is ``(floor(outs_i / Q), -outs_i)``; argmin (progress, load,
           rotation); the cursor moves only when several replicas tie on the best progress.
        """
        n = len(self.replicas)
        q = max(1, self.quantum)
        quant = [_quantize(x) for x in loads] if loads is not None else [0] * n
        use_load = self.policy is FillPolicy.FILL_LEAST

        def load(i: int) -> int:
            return quant[i] if use_load else 0

        if self.mode is FillMode.SPREAD:
            chosen = min(range(n), key=lambda i: (self.outs[i], load(i), self._rot(i)))
            self.cursor = chosen
            self.run_target, self.run_units = chosen, units
        elif self.mode is FillMode.RUN:
            floor = min(o // q for o in self.outs)

            def ahead(i: int) -> bool:
                return self.outs[i] // q > floor

            target = self.run_target
            if (
                target is None
                or target >= n
                or self.run_units >= q
                or ahead(target)
                or sum(self.outs) == 0
            ):
                chosen = min(range(n), key=lambda i: (ahead(i), load(i), self._rot(i)))
                self.cursor = chosen
                self.run_target, self.run_units = chosen, units
            else:
                chosen = target
                self.run_units += units
        else:

            def progress(i: int) -> tuple[int, int]:
                return (self.outs[i] // q, -self.outs[i])

            best = min(progress(i) for i in range(n))
            tied = [i for i in range(n) if progress(i) == best]
            chosen = min(tied, key=lambda i: (load(i), self._rot(i)))
            if len(tied) > 1:
                self.cursor = chosen
        self.outs[chosen] += units
        return chosen

    def release(self, index: int, units: int) -> None:
        """A request reserved on replica ``index`` finished: its items leave the count."""
        if 0 <= index < len(self.outs):
            self.outs[index] = max(0, self.outs[index] - units)

    def order(self, chosen: int) -> list[str]:
        """Failover order: the chosen replica, then the others by (quanta in flight, items in
        flight, label)."""
        q = max(1, self.quantum)
        rest = sorted(
            (i for i in range(len(self.replicas)) if i != chosen),
            key=lambda i: (self.outs[i] // q, self.outs[i], self.replicas[i]),
        )
        return [self.replicas[chosen], *(self.replicas[i] for i in rest)]

    def carried(self, replicas: tuple[str, ...], quantum: int) -> FillState:
        """This state after a repack to ``replicas``: in-flight counts carried over for the
        replicas that persist, the cursor kept, the open run ended."""
        outs = [self.outs[self.replicas.index(r)] if r in self.replicas else 0 for r in replicas]
        return FillState(
            replicas,
            quantum,
            self.mode,
            self.policy,
            outs,
            cursor=min(self.cursor, len(replicas) - 1),
        )


__all__ = ["FillMode", "FillPolicy", "FillState", "fill_quantum"]

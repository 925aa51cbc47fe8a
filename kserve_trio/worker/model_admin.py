"""Model admin on the dispatch loop: add, replace (reload), remove (unload), rename, probe.

These are the only changes to the loop's model table. Each keeps the table consistent with the
weight cache (every residency change runs on the device thread, through ``cache_op``) and with
the requests in flight: a running execution finishes on the version it started on, queued
requests move to a replacement or are answered. ``Scheduler`` (``worker/scheduler.py``) is their
public face.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Sequence

import numpy as np

from kserve_trio.core.errors import FailedPrecondition, NotFound, Unavailable
from kserve_trio.core.logging import get_logger
from kserve_trio.runtime.weight_cache import ProbeResult, Program
from kserve_trio.worker.dispatch import DispatchLoop, Phase
from kserve_trio.worker.hooks import Hook
from kserve_trio.worker.model_state import ModelEntry, ModelState, finish, same_io
from kserve_trio.worker.planner import ModelLayout

log = get_logger("kserve_trio.worker.scheduler")


async def add_model(
    loop: DispatchLoop,
    entry: ModelEntry,
    *,
    preprocess: Hook | None,
    postprocess: Hook | None,
    warm: bool,
) -> None:
    """Admit ``entry`` (see ``Scheduler.add_model``)."""
    loop.refuse_if_stopping()
    name = entry.name
    if name in loop.models:
        raise FailedPrecondition(f"model '{name}' is already loaded")
    overrides = loop.config.models.get(name)
    state = ModelState.build(
        entry,
        weight=overrides.weight if overrides is not None else 1.0,
        max_batch_size=overrides.max_batch_size if overrides is not None else None,
        preprocess=preprocess,
        postprocess=postprocess,
        now_ns=loop.clock(),
        cached=loop.cache is not None,
    )
    loop.models[name] = state
    if loop.cache is not None:
        floor = overrides.residency if overrides is not None else None
        try:
            await loop.cache_op(loop.cache.admit, state.managed_entry, floor)
        except BaseException:
            if loop.models.get(name) is state:
                del loop.models[name]
            raise
    if not loop.warmup or not warm:
        return
    if loop.phase is Phase.NEW:
        loop.pending_warmups.append(state)
    else:
        await loop.warm(state)


async def remove_model(loop: DispatchLoop, name: str) -> None:
    """Unload ``name`` (see ``Scheduler.remove_model``)."""
    state = loop.models.pop(name, None)
    if state is None:
        raise NotFound(f"unknown model: {name}")
    state.removed = True
    while state.queue:
        finish(state.queue.popleft(), error=NotFound(f"model '{name}' was unloaded"))
    if state in loop.pending_warmups:
        loop.pending_warmups.remove(state)
    await loop.wait_idle(state)
    if loop.cache is not None:  # device buffers freed, host copy released
        await loop.cache_op(loop.cache.release, name, state.managed_entry)


async def replace_model(
    loop: DispatchLoop, entry: ModelEntry, *, preprocess: Hook | None, postprocess: Hook | None
) -> None:
    """Swap in a new version of a loaded model, or add it (see ``Scheduler.replace_model``)."""
    name = entry.name
    old = loop.models.get(name)
    if old is None:
        await add_model(loop, entry, preprocess=preprocess, postprocess=postprocess, warm=True)
        return
    loop.refuse_if_stopping()
    overrides = loop.config.models.get(name)
    new = ModelState.build(
        entry,
        weight=old.weight,
        max_batch_size=overrides.max_batch_size if overrides is not None else None,
        preprocess=preprocess,
        postprocess=postprocess,
        now_ns=loop.clock(),
        cached=loop.cache is not None,
    )
    if loop.warmup and loop.phase is Phase.RUNNING and loop.cache is None:
        await loop.warm(new)
    await loop.wait_idle(old)
    old.removed = True
    old.replaced_by = new
    if same_io(old, new):
        new.queue, old.queue = old.queue, collections.deque()
    else:
        while old.queue:
            finish(old.queue.popleft(), error=Unavailable(f"model '{name}' was reloaded; retry"))
    loop.models[name] = new
    loop.wake()
    if loop.cache is not None:
        # Queued before any batch of the new version can run (units go first): the old
        # version's tiers are released and the new one admitted at the old floor.
        await loop.cache_op(loop.cache.replace, new.managed_entry)
        if loop.warmup and loop.phase is Phase.RUNNING:
            await loop.warm(new)


def rename_model(loop: DispatchLoop, old: str, new: str) -> None:
    """Rekey a loaded model (see ``Scheduler.rename_model``)."""
    if new in loop.models:
        raise FailedPrecondition(f"cannot rename '{old}' to '{new}': '{new}' is loaded")
    state = loop.models.pop(old, None)
    if state is None:
        raise NotFound(f"unknown model: {old}")
    if loop.cache is not None:
        try:
            loop.cache.rename(old, new)
        except BaseException:
            loop.models[old] = state
            raise
    state.name = new
    with contextlib.suppress(AttributeError):
        state.entry.name = new
    state.layout = ModelLayout.build(new, state.entry.manifest, state.layout.keys)
    overrides = loop.config.models.get(new)
    if overrides is not None:
        state.weight = overrides.weight
        state.max_batch_size = overrides.max_batch_size
    loop.models[new] = state


def _programs(states: dict[str, ModelState]) -> Callable[[str], Sequence[Program]]:
    """The probe's view of the models: every compiled (variant, key) with zero inputs."""

    def programs(name: str) -> list[Program]:
        state = states.get(name)
        if state is None:
            return []
        entry = state.entry

        def run(
            variant: int | None, key: int
        ) -> Callable[[Sequence[np.ndarray]], list[np.ndarray]]:
            return lambda inputs: entry.execute(variant, key, inputs)

        return [
            ((variant, key), state.layout.zero_inputs(variant, key), run(variant, key))
            for variant, keys in state.layout.keys.items()
            for key in keys
        ]

    return programs


async def probe_weights(loop: DispatchLoop) -> ProbeResult | None:
    """The cache's startup probe (see ``Scheduler.probe_weights``)."""
    if loop.cache is None or not loop.cache.enabled:
        return None
    result: ProbeResult = await loop.cache_op(loop.cache.probe, _programs(dict(loop.models)))
    for name, costs in result.costs.items():
        state = loop.models.get(name)
        if state is not None:
            for key, cost in costs.items():
                state.cost.setdefault(key, cost)
    for name, failures in result.failures.items():
        for failure in failures:
            log.warning("probe_failed", model=name, detail=failure)
    return result


__all__ = ["add_model", "probe_weights", "remove_model", "rename_model", "replace_model"]

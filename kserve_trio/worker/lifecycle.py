"""Model lifecycle in a running worker: applying the watcher's changes (dynamic mode).

Compilation runs in a worker thread, off the dispatch loop; only the swap touches the scheduler
(``replace_model`` / ``remove_model`` / ``rename_model``), so every other model keeps serving
while a bundle compiles. Each applied change fires the matching heartbeat event and log line.
"""

from __future__ import annotations

import contextlib

import anyio

from kserve_trio.core.logging import get_logger
from kserve_trio.worker import heartbeat
from kserve_trio.worker.registry import ModelBundle, load_bundle
from kserve_trio.worker.watcher import Change

log = get_logger("kserve_trio.worker.lifecycle")


class Lifecycle:
    """Applies load / reload / unload / rename changes to a worker's state."""

    def __init__(self, state, backend) -> None:
        self.state = state
        self.backend = backend

    async def apply(self, change: Change) -> None:
        """The watcher's ``apply`` callback; raises on failure so the change is retried."""
        if change.action in ("load", "reload"):
            await self.load(change.name, change.dir)
        elif change.action == "unload":
            await self.unload(change.name)
        elif change.action == "rename":
            self.rename(change.old, change.name)
        else:  # pragma: no cover - the detector emits only the four actions
            raise ValueError(f"unknown change action {change.action!r}")

    async def load(self, name: str, bundle_dir) -> ModelBundle:
        """Compile ``bundle_dir`` (in a thread) and swap it in under ``name``."""
        bundle = await anyio.to_thread.run_sync(
            lambda: load_bundle(bundle_dir, self.backend, name=name)
        )
        state = self.state
        old = state.bundles.get(name)
        if bundle.model is not None:
            if state.metrics is not None:
                state.metrics.compilations.labels(model=name).inc()
            await state.scheduler.replace_model(
                bundle.model, preprocess=bundle.preprocess, postprocess=bundle.postprocess
            )
        elif old is not None and old.model is not None:
            await state.scheduler.remove_model(name)  # a regular model became a meta
        state.bundles[name] = bundle
        if old is not None and old.model is not None:
            with contextlib.suppress(Exception):
                old.model.close()
        log.info(
            "model_loaded" if old is None else "model_reloaded", model=name, path=str(bundle_dir)
        )
        heartbeat.fire("load", name)
        return bundle

    async def unload(self, name: str) -> None:
        state = self.state
        bundle = state.bundles.pop(name, None)
        if bundle is None:
            return
        if bundle.model is not None:
            with contextlib.suppress(Exception):
                await state.scheduler.remove_model(name)
            with contextlib.suppress(Exception):
                bundle.model.close()
        log.info("model_unloaded", model=name)
        heartbeat.fire("unload", name)

    def rename(self, old: str, new: str) -> None:
        """Rekey without recompiling or moving any memory."""
        state = self.state
        bundle = state.bundles.pop(old)
        if bundle.model is not None:
            state.scheduler.rename_model(old, new)
        bundle.name = new
        state.bundles[new] = bundle
        still_called = sorted(
            b.name for b in state.bundles.values() if b.is_meta and old in b.manifest.meta_calls
        )
        log.info("model_renamed", old=old, model=new)
        if still_called:
            log.warning("meta_calls_renamed_model", model=old, renamed_to=new, metas=still_called)


__all__ = ["Lifecycle"]

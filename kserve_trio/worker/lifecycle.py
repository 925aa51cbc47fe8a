"""Model lifecycle in a running worker: applying the watcher's changes (dynamic mode).

Compilation runs in a worker thread, off the dispatch loop (``registry.load_bundle``, the same
loader start-up uses); the swap goes through the ``ModelRepository`` (``install`` / ``remove`` /
``rename``), the one owner of the bundles and of the scheduler's membership, so every other
model keeps serving while a bundle compiles. Each applied change fires the matching heartbeat
event; the repository logs it.
"""

from __future__ import annotations

import os
import pathlib

import anyio

from kserve_trio.runtime.backend import Backend
from kserve_trio.worker import heartbeat
from kserve_trio.worker.registry import LoadFailure, ModelBundle, load_bundle
from kserve_trio.worker.repository import ModelRepository
from kserve_trio.worker.watcher import Change


class Lifecycle:
    """Applies load / reload / unload / rename changes to a worker's model repository."""

    def __init__(
        self, repository: ModelRepository, backend: Backend, *, serve_without_hooks: bool = False
    ) -> None:
        self.repository = repository
        self.backend = backend
        self.serve_without_hooks = serve_without_hooks

    async def apply(self, change: Change) -> None:
        """The watcher's ``apply`` callback; raises on failure so the change is retried."""
        if change.action in ("load", "reload"):
            assert change.dir is not None  # the detector always names the directory to load
            await self.load(change.name, change.dir)
        elif change.action == "unload":
            await self.unload(change.name)
        elif change.action == "rename":
            assert change.old is not None  # a rename always names the old model
            self.rename(change.old, change.name)
        else:  # pragma: no cover - the detector emits only the four actions
            raise ValueError(f"unknown change action {change.action!r}")

    async def load(self, name: str, bundle_dir: str | os.PathLike[str]) -> ModelBundle:
        """Compile ``bundle_dir`` (in a thread) and install it under ``name``.

        A bundle that fails to compile or install is recorded in the repository with its
        directory and the error (RepositoryIndex shows why it is not served; a later successful
        load, or deleting the directory, clears it), and the error propagates so the watcher
        retries the change."""
        try:
            bundle = await anyio.to_thread.run_sync(
                lambda: load_bundle(
                    bundle_dir,
                    self.backend,
                    name=name,
                    serve_without_hooks=self.serve_without_hooks,
                )
            )
            await self.repository.install(bundle)
        except Exception as exc:
            self.repository.record_failure(name, LoadFailure(pathlib.Path(bundle_dir), str(exc)))
            raise
        heartbeat.fire("load", name)
        return bundle

    async def unload(self, name: str) -> None:
        if await self.repository.remove(name) is not None:
            heartbeat.fire("unload", name)

    def rename(self, old: str, new: str) -> None:
        """Rekey without recompiling or moving any memory."""
        self.repository.rename(old, new)


__all__ = ["Lifecycle"]

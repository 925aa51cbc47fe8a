"""The worker's model repository: the loaded bundles and the scheduler's membership, in one place.

``ModelRepository`` is the only owner of "which models does this worker serve". Every change of
membership goes through it, so the bundles it holds and the models the scheduler runs cannot
drift apart:

- start-up admission and the watcher's (re)loads both end in ``install``, which admits a compiled
  bundle to the scheduler (or swaps it in for the running version), records the bundle and
  closes the version it replaced;
- ``remove`` and ``rename`` change the scheduler and the bundles together;
- requests find their model with ``lookup`` (one dict lookup and the version rule), and the
  readiness RPCs ask ``model_ready`` / ``model_compiled`` / ``ready``;
- a bundle that failed to load is remembered with its directory and reason (``record_failure``)
  until a later load under its name succeeds or its directory is deleted, so ``index``
  (RepositoryIndex) can say why it is not served instead of leaving the reason in the log alone.

Compilation itself (``registry.load_bundle``) happens before any of this, off the event loop;
this class only runs on the event loop thread, so it needs no lock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from kserve_trio.core.logging import get_logger
from kserve_trio.core.protocol import BUNDLE_VERSION, require_model_name
from kserve_trio.worker.registry import (
    LoadFailure,
    ModelBundle,
    check_version,
    hidden_submodels,
    is_bundle_dir,
    unknown_model,
)

if TYPE_CHECKING:
    from prometheus_client import Counter

    from kserve_trio.runtime.weight_cache import WeightCache
    from kserve_trio.worker.scheduler import Scheduler

log = get_logger("kserve_trio.worker.repository")


class ModelRepository:
    """The bundles a worker serves and their membership in the scheduler.

    ``externally_managed`` (explicit mode) makes readiness depend on residency: a regular model
    is ready only while the weight cache can serve it. ``compilations`` is the
    ``worker_model_compilations`` counter, incremented once per compiled bundle installed.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        cache: WeightCache | None = None,
        externally_managed: bool = False,
        compilations: Counter | None = None,
    ) -> None:
        self.scheduler = scheduler
        self._cache = cache
        self._externally_managed = externally_managed
        self._compilations = compilations
        self._bundles: dict[str, ModelBundle] = {}
        self.bundles: Mapping[str, ModelBundle] = MappingProxyType(self._bundles)
        """A read-only live view of the loaded bundles by serving name."""
        self._failures: dict[str, LoadFailure] = {}
        self.failures: Mapping[str, LoadFailure] = MappingProxyType(self._failures)
        """A read-only live view of the bundles whose last load failed, by name."""

    # ---------------------------------------------------------------- queries

    def __contains__(self, name: object) -> bool:
        return name in self._bundles

    def __len__(self) -> int:
        return len(self._bundles)

    def get(self, name: str) -> ModelBundle | None:
        """The bundle loaded under ``name``, or None."""
        return self._bundles.get(name)

    def lookup(self, name: str, version: str = "") -> ModelBundle:
        """The bundle a request names.

        Rules: an empty name is ``InvalidArgument("model_name is empty")``; an unknown name is
        ``NotFound("unknown model: m")``; a version other than the one a bundle is served as is
        ``NotFound`` (``check_version``). One message per fault, whichever RPC asks.
        """
        require_model_name(name)
        bundle = self._bundles.get(name)
        if bundle is None:
            raise unknown_model(name)
        if version:
            check_version(name, version)
        return bundle

    def names(self) -> list[str]:
        """Every loaded model, sorted (hidden sub-models included)."""
        return sorted(self._bundles)

    def hidden(self) -> set[str]:
        """Models declared in some meta's ``calls``: internal, not routable."""
        return hidden_submodels(self._bundles)

    def routable_names(self) -> list[str]:
        """The models a client or gateway may address directly, sorted."""
        hidden = self.hidden()
        return sorted(n for n in self._bundles if n not in hidden)

    def index(self, *, ready_only: bool = False) -> list[tuple[str, bool, str]]:
        """RepositoryIndex's entries, sorted by name: ``(name, ready, reason)``.

        1. Every routable model that is ready (reason ``""``), wherever its directory: it
           serves (dynamic mode unloads it once its directory is gone; explicit mode serves it
           until it is unloaded).
        2. Unless ``ready_only``, while its bundle directory is still a bundle: every routable
           model that is not ready (explicit mode: not resident), and every bundle whose load
           failed and that serves no version (the load error as reason: Triton lists a model it
           could not load as UNAVAILABLE with the reason, and a user moving a bundle over
           learns there why it is refused). A failed reload of a served model lists the served
           version (still ready).
        3. A deleted bundle directory leaves the index: a failure whose directory is gone is
           forgotten, so nothing piles up for bundles that no longer exist.
        """
        entries = []
        for name in self.routable_names():
            ready = self.model_ready(name)
            if ready or (not ready_only and is_bundle_dir(self._bundles[name].bundle_dir)):
                entries.append((name, ready, ""))
        for name, failure in list(self._failures.items()):
            if not is_bundle_dir(failure.bundle_dir):
                del self._failures[name]
            elif not ready_only and name not in self._bundles:
                entries.append((name, False, failure.reason))
        return sorted(entries)

    def metas_calling(self, name: str) -> list[str]:
        """The loaded meta models that declare ``name`` among their calls, sorted."""
        return sorted(
            b.name for b in self._bundles.values() if b.is_meta and name in b.manifest.meta_calls
        )

    # ---------------------------------------------------------------- readiness

    def model_ready(self, name: str, version: str = "") -> bool:
        """Compiled and admitted; in explicit mode also servable from the device (a meta: all
        its declared sub-models so).

        A version other than the one a bundle is served as is not ready, as an unknown model
        is not: a readiness poll answers yes or no (Triton's way), it never fails, while the
        RPCs that read a model (``lookup``) answer NOT_FOUND for it."""
        bundle = self._bundles.get(name)
        if bundle is None or version not in ("", BUNDLE_VERSION):
            return False
        if bundle.is_meta:
            if not self._externally_managed:
                return True
            return all(self._regular_ready(c) for c in bundle.manifest.meta_calls)
        return self._regular_ready(name)

    def _regular_ready(self, name: str) -> bool:
        bundle = self._bundles.get(name)
        if bundle is None or bundle.model is None or not self.scheduler.has_model(name):
            return False
        if self._externally_managed and self._cache is not None:
            return self._cache.is_servable(name)
        return True

    def model_compiled(self, name: str) -> bool:
        """A meta once loaded; a regular model once the scheduler has admitted it."""
        bundle = self._bundles.get(name)
        if bundle is None:
            return False
        return bundle.is_meta or self.scheduler.has_model(name)

    def ready(self) -> bool:
        """At least one model, and every regular model compiled (residency does not count)."""
        return bool(self._bundles) and all(self.model_compiled(n) for n in self._bundles)

    # ---------------------------------------------------------------- membership

    def record_failure(self, name: str, failure: LoadFailure) -> None:
        """Remember that the bundle under ``name`` failed to load, where it is and why (shown
        by ``index`` until ``install`` or ``remove`` of that name, or until its directory is
        deleted)."""
        self._failures[name] = failure

    async def install(self, bundle: ModelBundle, *, warm: bool = True) -> ModelBundle | None:
        """Serve ``bundle`` under its name: the one path start-up loading and reloads share.

        Rules:
        1. A compiled bundle is admitted to the scheduler (``add_model``, warmed unless
           ``warm=False``) or, when a version is running, swapped in for it
           (``replace_model``: queued requests move over when the I/O is unchanged).
        2. A meta replacing a regular model removes that model from the scheduler.
        3. Only then is the bundle recorded, so a failed admission changes nothing.
        4. The replaced version's compiled model is closed (its device and host weights
           released); a failure to close is not the new version's failure.

        Returns the bundle it replaced, or None.
        """
        name = bundle.name
        old = self._bundles.get(name)
        if bundle.model is not None:
            if self._compilations is not None:
                self._compilations.labels(model=name).inc()
            if self.scheduler.has_model(name):
                await self.scheduler.replace_model(
                    bundle.model, preprocess=bundle.preprocess, postprocess=bundle.postprocess
                )
            else:
                await self.scheduler.add_model(
                    bundle.model,
                    preprocess=bundle.preprocess,
                    postprocess=bundle.postprocess,
                    warm=warm,
                )
        elif self.scheduler.has_model(name):
            await self.scheduler.remove_model(name)
        self._bundles[name] = bundle
        self._failures.pop(name, None)
        if old is not None and old.model is not None and old.model is not bundle.model:
            with contextlib.suppress(Exception):
                old.model.close()
        log.info(
            "model_loaded" if old is None else "model_reloaded",
            model=name,
            path=str(bundle.bundle_dir),
        )
        return old

    async def remove(self, name: str) -> ModelBundle | None:
        """Stop serving ``name``: queued requests answer NOT_FOUND, its weights are released.
        Returns the removed bundle, or None when nothing was loaded under that name."""
        self._failures.pop(name, None)
        bundle = self._bundles.pop(name, None)
        if bundle is None:
            return None
        if bundle.model is not None:
            with contextlib.suppress(Exception):
                await self.scheduler.remove_model(name)
            with contextlib.suppress(Exception):
                bundle.model.close()
        log.info("model_unloaded", model=name)
        return bundle

    def rename(self, old: str, new: str) -> ModelBundle:
        """Rekey a loaded model without recompiling or moving memory.

        The scheduler is renamed first: when it refuses (``new`` is loaded there), nothing
        changes here either.
        """
        bundle = self._bundles.get(old)
        if bundle is None:
            raise unknown_model(old)
        if bundle.model is not None:
            self.scheduler.rename_model(old, new)
        del self._bundles[old]
        bundle.name = new
        self._bundles[new] = bundle
        log.info("model_renamed", old=old, model=new)
        still_called = self.metas_calling(old)
        if still_called:
            log.warning("meta_calls_renamed_model", model=old, renamed_to=new, metas=still_called)
        return bundle

    def close(self) -> None:
        """Release every compiled model's device and host weights (once the tree has stopped)."""
        for bundle in self._bundles.values():
            if bundle.model is not None:
                with contextlib.suppress(Exception):
                    bundle.model.close()


__all__ = ["ModelRepository"]

"""Registration functions a bundle's ``model.py`` calls, and the context that routes them.

A bundle's ``model.py`` runs in its own module namespace with ``register_model`` and
``register_meta_model`` injected; it may equally ``from kserve_trio.worker.hooks import
register_model``. Either way the call registers into *the bundle being loaded*, which the
registry announces through a context variable (``loading_bundle``), so two bundles loading in
different threads or tasks never see each other's registrations.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kserve_trio.core.errors import BundleError
from kserve_trio.core.tensors import NamedTensor

Hook = Callable[[list[NamedTensor]], list[NamedTensor]]


@dataclass
class Registration:
    """What one ``model.py`` registered while it was being executed."""

    bundle: str
    kind: str | None = None  # "model" | "meta"
    name: str | None = None
    preprocess: Hook | None = None
    postprocess: Hook | None = None
    run: Callable | None = None
    calls: list[str] = field(default_factory=list)
    module: object | None = None  # the executed model.py namespace, kept alive for closures


_current: contextvars.ContextVar[Registration | None] = contextvars.ContextVar(
    "kserve_trio_loading_bundle", default=None
)


@contextlib.contextmanager
def loading_bundle(bundle: str) -> Iterator[Registration]:
    """Route ``register_*`` calls made inside the block into a fresh ``Registration``."""
    reg = Registration(bundle=bundle)
    token = _current.set(reg)
    try:
        yield reg
    finally:
        _current.reset(token)


def _target(fn: str) -> Registration:
    reg = _current.get()
    if reg is None:
        raise RuntimeError(f"{fn} may only be called from a bundle's model.py while it loads")
    if reg.kind is not None:
        raise BundleError(
            f"bundle '{reg.bundle}': model.py registered twice ({fn} after {reg.kind})"
        )
    return reg


def register_model(
    name: str, preprocess: Hook | None = None, postprocess: Hook | None = None
) -> None:
    """Register pre/post-processing hooks for the regular bundle being loaded.

    Both hooks take and return a ``list[NamedTensor]``; an omitted hook is the identity. They run
    on the request's task in a worker thread, overlapping device execution. ``name`` is
    informational: the serving name is the bundle directory's basename.
    """
    for label, hook in (("preprocess", preprocess), ("postprocess", postprocess)):
        if hook is not None and not callable(hook):
            raise TypeError(f"register_model: {label} must be callable")
    reg = _target("register_model")
    reg.kind, reg.name, reg.preprocess, reg.postprocess = "model", name, preprocess, postprocess


def register_meta_model(name: str, run: Callable | None = None) -> None:
    """Register the orchestration function ``run(inputs, call)`` of the meta bundle being loaded."""
    if run is None or not callable(run):
        raise TypeError("register_meta_model: run must be callable")
    reg = _target("register_meta_model")
    reg.kind, reg.name, reg.run = "meta", name, run


__all__ = ["Hook", "Registration", "loading_bundle", "register_meta_model", "register_model"]

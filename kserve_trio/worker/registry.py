"""The model repository: finding bundles, running their ``model.py``, compiling them.

A bundle is an immediate subdirectory of a model directory holding ``manifest.yaml``; its
serving name is the directory's basename. ``model.py`` executes in a fresh module namespace with
the registration functions injected (``kserve_trio.worker.hooks``). A bundle that fails to load
is reported with its reason and skipped by ``load_repository``; the others serve. Every bundle
is served as version ``1`` (``check_version``).
"""

from __future__ import annotations

import os
import pathlib
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kserve_trio.core.bundles import MANIFEST_FILE, MODEL_JL, MODEL_PY, Manifest, validate_manifest
from kserve_trio.core.errors import BundleError, NotFound
from kserve_trio.core.logging import get_logger
from kserve_trio.core.protocol import BUNDLE_VERSION
from kserve_trio.worker.hooks import (
    Hook,
    Registration,
    loading_bundle,
    register_meta_model,
    register_model,
)

if TYPE_CHECKING:
    from kserve_trio.runtime.backend import Backend
    from kserve_trio.runtime.model import CompiledModel

log = get_logger("kserve_trio.worker.registry")


@dataclass
class ModelBundle:
    """One loaded bundle: its manifest, compiled model (None for a meta) and hooks."""

    name: str
    bundle_dir: pathlib.Path
    manifest: Manifest
    model: CompiledModel | None = None
    preprocess: Hook | None = None
    postprocess: Hook | None = None
    run: Callable | None = None  # meta models
    extra: dict = field(default_factory=dict)

    @property
    def is_meta(self) -> bool:
        return self.manifest.is_meta


@dataclass(frozen=True)
class LoadFailure:
    """A bundle that did not load: where it is (the index lists it only while it is there) and
    why (the index's reason)."""

    bundle_dir: pathlib.Path
    reason: str


def is_bundle_dir(path: pathlib.Path) -> bool:
    """Whether ``path`` is a bundle: a directory holding ``manifest.yaml``."""
    try:
        return path.is_dir() and (path / MANIFEST_FILE).is_file()
    except OSError:
        return False


def unknown_model(name: str) -> NotFound:
    """The one error for a model name nothing is loaded under."""
    return NotFound(f"unknown model: {name}")


def check_version(name: str, version: str) -> None:
    """A bundle has exactly one version, ``1``: a request may name it or leave the version
    empty; any other version of a known model is ``NotFound``, so a client asking for a version
    it expects never gets another model's answers silently."""
    if version and version != BUNDLE_VERSION:
        raise NotFound(
            f"model '{name}' has no version '{version}' (a bundle is served as version "
            f"{BUNDLE_VERSION} only)"
        )


def scan_repository(
    model_dirs: Sequence[str | pathlib.Path], include: Iterable[str] = ()
) -> dict[str, pathlib.Path]:
    """Map serving name -> bundle directory over every model directory.

    Immediate subdirectories holding ``manifest.yaml`` only; ``include`` (non-empty) keeps only
    those names. A name found in two model directories is a ``BundleError``; a missing model
    directory is skipped (the caller validates configured directories at startup).
    """
    wanted = set(include)
    found: dict[str, pathlib.Path] = {}
    for root in model_dirs:
        root = pathlib.Path(root)
        if not root.is_dir():
            continue
        for child in sorted(root.iterdir()):
            if not is_bundle_dir(child):
                continue
            if wanted and child.name not in wanted:
                continue
            if child.name in found:
                raise BundleError(
                    f"duplicate model name '{child.name}': {found[child.name]} and {child}"
                )
            found[child.name] = child
    for name in sorted(wanted - set(found)):
        log.warning("model_not_found", model=name, reason="listed in models_include but absent")
    return found


def run_model_py(bundle_dir: pathlib.Path, name: str) -> Registration | None:
    """Execute ``bundle_dir/model.py`` in its own module namespace; None when there is none."""
    path = bundle_dir / MODEL_PY
    if not path.is_file():
        return None
    module = types.ModuleType(f"kserve_trio_bundle_{name}")
    module.__file__ = str(path)
    module.__dict__.update(register_model=register_model, register_meta_model=register_meta_model)
    source = path.read_text()
    with loading_bundle(name) as reg:
        try:
            code = compile(source, str(path), "exec")
            exec(code, module.__dict__)
        except BundleError:
            raise
        except Exception as exc:
            raise BundleError(f"bundle '{name}' ({bundle_dir}): model.py failed: {exc!r}") from exc
    reg.module = module
    return reg


def _apply_registration(bundle: ModelBundle, reg: Registration | None) -> None:
    where = f"bundle '{bundle.name}' ({bundle.bundle_dir})"
    if bundle.is_meta:
        if reg is None or reg.kind is None:
            raise BundleError(f"{where}: model.py did not call register_meta_model")
        if reg.kind != "meta":
            raise BundleError(
                f"{where}: a meta bundle must call register_meta_model, not register_model"
            )
        bundle.run = reg.run
        return
    if reg is None:
        return
    if reg.kind is None:
        raise BundleError(f"{where}: model.py did not call register_model")
    if reg.kind != "model":
        raise BundleError(
            f"{where}: a regular bundle must call register_model, not register_meta_model"
        )
    bundle.preprocess, bundle.postprocess = reg.preprocess, reg.postprocess


def load_bundle(
    bundle_dir: str | os.PathLike[str],
    backend: Backend,
    *,
    name: str | None = None,
    serve_without_hooks: bool = False,
) -> ModelBundle:
    """Validate, run ``model.py`` and compile one bundle (compilation happens here, once).

    The manifest is validated here, once per load, and handed to the runtime loader as is.
    ``serve_without_hooks`` is the worker's opt-in for bundles whose hooks are only in
    ``model.jl`` (``validate_manifest``); one served that way is logged as such."""
    bundle_dir = pathlib.Path(bundle_dir)
    name = name or bundle_dir.name
    manifest = validate_manifest(bundle_dir, serve_without_hooks=serve_without_hooks)
    if (bundle_dir / MODEL_JL).is_file():
        log.warning(
            "model_jl_not_run",
            model=name,
            path=str(bundle_dir / MODEL_JL),
            served_with=MODEL_PY if (bundle_dir / MODEL_PY).is_file() else "no hooks",
        )
    bundle = ModelBundle(name=name, bundle_dir=bundle_dir, manifest=manifest)
    _apply_registration(bundle, run_model_py(bundle_dir, name))
    if not bundle.is_meta:
        from kserve_trio.runtime.model import load_compiled_model

        bundle.model = load_compiled_model(bundle_dir, backend, name=name, manifest=manifest)
    return bundle


def load_repository(
    model_dirs: Sequence[str | pathlib.Path],
    backend: Backend,
    *,
    include: Iterable[str] = (),
    serve_without_hooks: bool = False,
) -> tuple[dict[str, ModelBundle], dict[str, LoadFailure]]:
    """Load every bundle; returns (loaded bundles by name, failures by name)."""
    bundles: dict[str, ModelBundle] = {}
    failures: dict[str, LoadFailure] = {}
    for name, path in scan_repository(model_dirs, include).items():
        try:
            bundles[name] = load_bundle(
                path, backend, name=name, serve_without_hooks=serve_without_hooks
            )
        except Exception as exc:  # a bad bundle never takes the others down
            failures[name] = LoadFailure(path, str(exc))
            log.error("model_load_failed", model=name, path=str(path), reason=str(exc))
    _check_meta_calls(bundles, failures)
    return bundles, failures


def _check_meta_calls(bundles: dict[str, ModelBundle], failures: dict[str, LoadFailure]) -> None:
    for name in [n for n, b in bundles.items() if b.is_meta]:
        bundle = bundles[name]
        for callee in bundle.manifest.meta_calls:
            target = bundles.get(callee)
            if target is not None and target.is_meta:
                reason = f"bundle '{name}': meta model calls another meta model '{callee}'"
                failures[name] = LoadFailure(bundle.bundle_dir, reason)
                log.error("model_load_failed", model=name, reason=reason)
                del bundles[name]
                break
            if target is None:
                log.info("meta_callee_missing", model=name, callee=callee)


def hidden_submodels(bundles: dict[str, ModelBundle]) -> set[str]:
    """Names declared in any meta's ``calls``: internal, hidden from RepositoryIndex."""
    return {c for b in bundles.values() if b.is_meta for c in b.manifest.meta_calls}


__all__ = [
    "LoadFailure",
    "ModelBundle",
    "check_version",
    "hidden_submodels",
    "is_bundle_dir",
    "load_bundle",
    "load_repository",
    "run_model_py",
    "scan_repository",
    "unknown_model",
]

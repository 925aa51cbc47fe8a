"""A loaded bundle: every compiled module of one model plus one shared set of device weights.

``load_compiled_model`` turns a bundle directory into a ``CompiledModel``:

1. validate the manifest and find the modules (``core.bundles.bundle``);
2. read the ``weights.safetensors`` header (order from ``argument_order``, footprint from the
   header alone) and memory-map the tensors;
3. for every module, read its entry signature and check it against the manifest and the weights
   -- the arity first (``BundleError`` naming both numbers), then each argument's and result's
   shape and dtype -- before anything is compiled or executed;
4. compile each module exactly once, from its ``.jaxexport`` sidecar when one is present and
   agrees with the ``.mlir`` (jax's public loading path), else from the portable ``.mlir``
   artifact alone (any StableHLO producer);
5. transfer the weights to the device once; every batch size and variant shares them.

``CompiledModel.execute`` is the hot path of the worker: a dict lookup, the compiled function
called with host inputs and the pre-bound device weights, and the results brought back as numpy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kserve_trio.core.bundles import (
    WEIGHTS_FILE,
    DimKind,
    Manifest,
    TensorSpec,
    discover_modules,
    sidecar_path,
    validate_manifest,
)
from kserve_trio.core.errors import BundleError, FailedPrecondition, Internal
from kserve_trio.core.logging import get_logger
from kserve_trio.runtime import _xla
from kserve_trio.runtime.backend import Backend, Executable
from kserve_trio.runtime.weights import WeightsIndex, read_weights_index

log = get_logger(__name__)

ModuleKey = tuple[int | None, int]


class CompiledModel:
    """The executables and device weights of one regular bundle.

    ``execute(variant, batch_key, inputs)`` takes the executable inputs in manifest order as host
    numpy arrays of exactly the compiled shapes and returns the executable outputs in manifest
    order as host numpy arrays (read-only views on the CPU). Weights stay on the device between
    calls; ``free_weights``/``load_weights`` move them off and back (the weight cache builds on
    these), and executing while they are off is a ``FailedPrecondition``. The residency calls
    are serialised by a lock; ``execute`` takes none, so callers must not free the weights of a
    model that is executing.
    """

    def __init__(
        self,
        name: str,
        manifest: Manifest,
        bundle_dir: Path,
        backend: Backend,
        weights: WeightsIndex,
        executables: dict[ModuleKey, Executable],
    ) -> None:
        self.name = name
        self.manifest = manifest
        self.bundle_dir = bundle_dir
        self.backend = backend
        self.weights = weights
        self.weight_nbytes: int = weights.nbytes
        self.executables = executables
        keys: dict[int | None, list[int]] = {}
        for variant, key in executables:
            keys.setdefault(variant, []).append(key)
        self.variants: tuple[int | None, ...] = tuple(
            sorted(keys, key=lambda v: -1 if v is None else v)
        )
        self._keys = {v: tuple(sorted(ks)) for v, ks in keys.items()}
        self._calls: dict[ModuleKey, Callable[..., tuple[Any, ...]]] = {
            k: exe.call for k, exe in executables.items()
        }
        self._device_weights: tuple[Any, ...] | None = None
        self._host_weights: list[np.ndarray] | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._to_host = _host_converter(getattr(backend, "platform", "cpu"))

    # -- the scheduler's interface --------------------------------------------------------

    def batch_keys(self, variant: int | None) -> tuple[int, ...]:
        """The compiled batch keys of a variant, ascending; 0 is the one any-size module."""
        try:
            return self._keys[variant]
        except KeyError:
            raise Internal(
                f"model '{self.name}' has no shape variant {variant} (have {list(self.variants)})"
            ) from None

    def execute(
        self, variant: int | None, batch_key: int, inputs: Sequence[np.ndarray]
    ) -> list[np.ndarray]:
        """Run the module compiled for ``(variant, batch_key)`` on ``inputs``."""
        weights = self._device_weights
        call = self._calls.get((variant, batch_key))
        if call is None or weights is None:
            raise self._cannot_execute(variant, batch_key)
        try:
            outs = call(*inputs, *weights)
        except Exception as exc:
            raise Internal(
                f"model '{self.name}' execution failed (variant {variant}, batch size "
                f"{batch_key}): {exc}"
            ) from exc
        return self._to_host(outs)

    def _cannot_execute(self, variant: int | None, batch_key: int) -> Exception:
        if self._closed:
            return FailedPrecondition(f"model '{self.name}' has been unloaded")
        if (variant, batch_key) not in self._calls:
            have = [k for k in self._calls if k[0] == variant]
            return Internal(
                f"model '{self.name}' has no module compiled for variant {variant} batch size "
                f"{batch_key} (have batch sizes {[k for _, k in have]})"
            )
        return FailedPrecondition(f"model '{self.name}' is not resident")

    # -- device residency -----------------------------------------------------------------

    def weights_resident(self) -> bool:
        """Whether the device holds this model's weights."""
        return self._device_weights is not None

    def host_weights(self) -> list[np.ndarray]:
        """The weights as read-only host arrays in argument order (memory-mapped, lazily)."""
        if self._host_weights is None:
            self._host_weights = self.weights.host_arrays()
        return self._host_weights

    def load_weights(self, hosts: Sequence[np.ndarray] | None = None) -> None:
        """Put the weights on the device (no-op when resident).

        ``hosts`` are host copies to transfer from (e.g. a shared host weight store), checked
        against the weights file's names, shapes and dtypes; by default the memory-mapped file
        is the source.
        """
        with self._lock:
            if self._closed:
                raise FailedPrecondition(f"model '{self.name}' has been unloaded")
            if self._device_weights is not None:
                return
            src = list(hosts) if hosts is not None else self.host_weights()
            self._check_hosts(src)
            self._device_weights = tuple(self.backend.transfer_to_device(src))

    def free_weights(self) -> None:
        """Release the device copy of the weights (no-op when not resident)."""
        with self._lock:
            bufs, self._device_weights = self._device_weights, None
            if bufs:
                self.backend.free_weights(bufs)

    def close(self) -> None:
        """Free the device weights, drop the executables and the file mapping."""
        self.free_weights()
        with self._lock:
            self._closed = True
            self._calls = {}
            self.executables = {}
            self._host_weights = None

    def _check_hosts(self, hosts: Sequence[np.ndarray]) -> None:
        entries = self.weights.entries
        if len(hosts) != len(entries):
            raise BundleError(
                f"bundle '{self.name}' ({self.bundle_dir}): {len(hosts)} host weight array(s) "
                f"given, the weights file has {len(entries)}"
            )
        for e, h in zip(entries, hosts, strict=True):
            if tuple(h.shape) != e.shape or np.dtype(h.dtype) != e.dtype.numpy:
                raise BundleError(
                    f"bundle '{self.name}' ({self.bundle_dir}): host weight '{e.name}' is "
                    f"{h.dtype}{list(h.shape)}, the weights file has {e.dtype.token}{list(e.shape)}"
                )

    # -- diagnostics ----------------------------------------------------------------------

    @property
    def compile_seconds(self) -> float:
        """Total compile time of this model's modules."""
        return sum(e.compile_seconds for e in self.executables.values())

    def __repr__(self) -> str:
        sizes = {v: list(k) for v, k in self._keys.items()}
        return (
            f"CompiledModel({self.name!r}, modules={sizes}, weights={self.weight_nbytes} B, "
            f"resident={self.weights_resident()})"
        )


def _host_converter(platform: str) -> Callable[[Sequence[Any]], list[np.ndarray]]:
    if platform == "cpu":
        # np.asarray of a CPU jax array is a zero-copy read-only view.
        def to_host(outs: Sequence[Any]) -> list[np.ndarray]:
            return [np.asarray(o) for o in outs]

        return to_host

    def to_host_batched(outs: Sequence[Any]) -> list[np.ndarray]:
        import jax

        return list(jax.device_get(tuple(outs)))  # starts every copy before waiting on any

    return to_host_batched


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------


def _fmt(dtype_token: str, shape: Sequence[int]) -> str:
    return f"{dtype_token}[{','.join(str(d) for d in shape)}]"


def _expected_shape(
    spec: TensorSpec, batch_key: int, variant_sizes: dict[str, int]
) -> list[int | None]:
    """The concrete shape a module compiled for ``batch_key`` must have; ``None`` = any extent
    (the batch axis of the any-size module ``model.mlir``, batch key 0)."""
    out: list[int | None] = []
    for d in spec.dims:
        if d.kind is DimKind.FIXED:
            out.append(d.size)
        elif d.kind is DimKind.BATCH:
            out.append(batch_key if batch_key > 0 else None)
        else:
            out.append(variant_sizes.get(d.letter))
    return out


def check_module_signature(
    sig: _xla.EntrySignature,
    *,
    manifest: Manifest,
    weights: WeightsIndex,
    module: str,
    variant: int | None,
    batch_key: int,
    where: str,
) -> None:
    """Check a module's entry signature against the manifest and the weights. Rules:

    1. arity: ``main`` takes exactly (executable inputs + weights in ``argument_order``)
       arguments;
    2. each input argument has the input's dtype and its shape at this batch key and variant;
    3. each weight argument has the weight's dtype and shape;
    4. ``main`` returns exactly the executable outputs, with their dtypes, and their shapes
       where the manifest fixes them (variable output axes take any extent).
    """
    n_in = len(manifest.executable_inputs)
    n_w = len(weights.entries)
    if sig.arity != n_in + n_w:
        raise BundleError(
            f"{where}: module '{module}' takes {sig.arity} argument(s) but the bundle declares "
            f"{n_in + n_w} ({n_in} executable input(s) in manifest.yaml + {n_w} weight(s) in "
            f"{WEIGHTS_FILE})"
        )
    sizes = manifest.input_shapes[variant] if variant is not None else {}
    for i, spec in enumerate(manifest.executable_inputs):
        _check_tensor(
            sig.args[i],
            spec,
            batch_key,
            sizes,
            f"{where}: module '{module}' argument {i} (input '{spec.name}')",
        )
    for j, e in enumerate(weights.entries):
        t = sig.args[n_in + j]
        if t.token != e.dtype.token or t.shape != e.shape:
            raise BundleError(
                f"{where}: module '{module}' argument {n_in + j} (weight '{e.name}') is "
                f"{t.spelling} but {WEIGHTS_FILE} holds {_fmt(e.dtype.token, e.shape)}"
            )
    outs = manifest.executable_outputs
    if len(sig.results) != len(outs):
        raise BundleError(
            f"{where}: module '{module}' returns {len(sig.results)} result(s) but the manifest "
            f"declares {len(outs)} executable output(s)"
        )
    for k, spec in enumerate(outs):
        _check_tensor(
            sig.results[k],
            spec,
            batch_key,
            {},  # letters are tensor-scoped: an output's variable axis is free in every variant
            f"{where}: module '{module}' result {k} (output '{spec.name}')",
        )


def _check_tensor(
    t: _xla.TensorType, spec: TensorSpec, batch_key: int, sizes: dict[str, int], what: str
) -> None:
    expected = _expected_shape(spec, batch_key, sizes)
    ok = (
        t.token == spec.dtype.token
        and len(t.shape) == len(expected)
        and all(e is None or e == s for e, s in zip(expected, t.shape, strict=True))
    )
    if not ok:
        shown = ["?" if e is None else e for e in expected]
        raise BundleError(
            f"{what} is {t.spelling} but the manifest declares "
            f"{spec.dtype.token}[{','.join(str(s) for s in shown)}]"
        )


def load_compiled_model(
    bundle_dir: str | Path,
    backend: Backend,
    *,
    name: str | None = None,
    resident: bool = True,
    prefer_jaxexport: bool = True,
    manifest: Manifest | None = None,
) -> CompiledModel:
    """Load and compile a regular bundle (see the module docstring for the steps).

    ``name`` is the serving name (default: the directory's basename). ``resident=False`` leaves
    the weights off the device (a weight cache loads them on demand); so does a backend whose
    ``load_weights_at_compile`` is False (a worker with the on-demand weight cache sets it, so
    that compiling a repository never puts every model's weights on the device at once). ``prefer_jaxexport=False``
    ignores ``.jaxexport`` sidecars. ``manifest`` is the bundle's manifest when the caller has
    already validated it (``validate_manifest``), so a load validates it once; the first step then
    only finds the modules. Errors: ``ManifestError``/``BundleError`` for a bundle that breaks a
    rule, each naming the bundle and the rule.
    """
    d = Path(bundle_dir)
    if manifest is None:
        manifest = validate_manifest(d)
    name = name or manifest.name
    where = f"bundle '{name}' ({d})"
    if manifest.is_meta:
        raise BundleError(f"{where}: a meta bundle has no compiled modules to load")
    modules = discover_modules(d, manifest)
    weights = read_weights_index(d / WEIGHTS_FILE, bundle=name)

    plan: list[tuple[ModuleKey, Path, bytes, _xla.EntrySignature]] = []
    for variant, by_key in modules.items():
        for key, path in by_key.items():
            data = path.read_bytes()
            try:
                sig = _xla.entry_signature(data)
            except _xla.ModuleFormatError as exc:
                raise BundleError(f"{where}: module '{path.name}': {exc}") from None
            check_module_signature(
                sig,
                manifest=manifest,
                weights=weights,
                module=path.name,
                variant=variant,
                batch_key=key,
                where=where,
            )
            plan.append(((variant, key), path, data, sig))

    executables: dict[ModuleKey, Executable] = {}
    for mkey, path, data, sig in plan:
        exe = None
        sidecar = sidecar_path(path)
        if prefer_jaxexport and sidecar.is_file():
            exe = _compile_sidecar(backend, sidecar, sig, where)
        if exe is None:
            try:
                exe = backend.compile_module(data, name=f"{name}.{path.stem}", signature=sig)
            except _xla.ModuleFormatError as exc:
                raise BundleError(f"{where}: module '{path.name}': {exc}") from None
        executables[mkey] = exe

    model = CompiledModel(name, manifest, d, backend, weights, executables)
    if resident and getattr(backend, "load_weights_at_compile", True):
        model.load_weights()
    log.info(
        "model_compiled",
        model=name,
        modules=len(executables),
        sources=sorted({e.source for e in executables.values()}),
        compile_s=round(model.compile_seconds, 3),
        weight_bytes=model.weight_nbytes,
    )
    return model


def _compile_sidecar(
    backend: Backend, sidecar: Path, sig: _xla.EntrySignature, where: str
) -> Executable | None:
    """Compile a ``.jaxexport`` sidecar if it is usable here and agrees with its ``.mlir``."""
    try:
        exe = backend.compile_exported(
            sidecar.read_bytes(), name=f"{sidecar.parent.name}.{sidecar.stem}", signature=sig
        )
    except Exception as exc:  # an unreadable sidecar is not fatal: the .mlir is authoritative
        log.warning("jaxexport_unusable", bundle=where, file=sidecar.name, reason=str(exc)[:200])
        return None
    if exe is None:
        log.info("jaxexport_skipped", bundle=where, file=sidecar.name)
    return exe


__all__ = ["CompiledModel", "check_module_signature", "load_compiled_model"]

"""The device backend: compile StableHLO for one device, move weights there, execute, account.

``JaxBackend`` is the one backend of the server (``cpu`` or ``cuda`` through jax/XLA). It owns:

* applying the process-wide jax settings that must be in place before jax creates its backends
  (the platform, ``mem_fraction``, ``preallocate``, GPU autotuning and its cache, and
  ``cache_dir`` as jax's persistent compilation cache), planned by the pure
  ``plan_jax_settings`` (``runtime/settings.py``), once, in ``JaxBackend.create``;
* the numerics policy planned by ``plan_numerics`` (``runtime/settings.py``): ``auto``, ``f32``
  (every f32 matmul/convolution at HIGHEST precision) and ``tf32`` (refuses to start on hardware
  without TF32, the CPU included);
* compiling a module into an ``Executable`` (each call counts in ``compile_count()``), moving host
  weight arrays to the device (``transfer_to_device``) and freeing them (``free_weights``),
  executing, and reporting device memory (on CPU: the bytes of live jax arrays).

Executables run through jax's AOT path (``jax.jit(...).lower(...).compile()``): its C++ dispatch
takes host numpy inputs directly and reuses device-resident weights without a copy.

64-bit tensors (``i64``, ``u64``, ``f64``): jax narrows them to 32 bits unless its 64-bit mode is
on, so a module whose signature has one is compiled, called and given its weights inside
``x64_scope()`` and nothing else is (see ``runtime.x64`` for why the process-wide flag is left
alone).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kserve_trio.core.errors import ConfigError
from kserve_trio.core.logging import get_logger
from kserve_trio.runtime import _xla
from kserve_trio.runtime.settings import (
    JaxSettings,
    NumericsPlan,
    backend_token,
    numerics_token,
    plan_jax_settings,
    plan_numerics,
    tf32_capable,
)
from kserve_trio.runtime.x64 import in_x64, needs_x64, x64_scope

log = get_logger(__name__)


_compile_lock = threading.Lock()
_compile_count = 0


def compile_count() -> int:
    """How many modules this process has compiled (every ``JaxBackend.compile_*`` call).

    Tests read it before and after loading a bundle to prove each module compiles exactly once.
    """
    return _compile_count


def _count_compile() -> None:
    global _compile_count
    with _compile_lock:
        _compile_count += 1


def _apply_settings(settings: JaxSettings) -> None:
    import jax

    initialized = _xla.backends_initialized()
    if initialized and (settings.env or settings.xla_flags):
        log.warning(
            "runtime_settings_late",
            reason="jax backends already initialised; allocator and XLA flag settings may not apply",
            env=sorted(settings.env),
            xla_flags=list(settings.xla_flags),
        )
    for k, v in settings.env.items():
        os.environ[k] = v
    if settings.xla_flags:
        current = os.environ.get("XLA_FLAGS", "").split()
        names = {f.split("=")[0] for f in settings.xla_flags}
        kept = [f for f in current if f.split("=")[0] not in names]
        os.environ["XLA_FLAGS"] = " ".join([*kept, *settings.xla_flags])
    for name, value in settings.config.items():
        if name == "jax_platforms" and initialized:
            continue  # cannot change once backends exist; the device lookup below still applies
        jax.config.update(name, value)


# ----------------------------------------------------------------------------------------------
# Executables and the backend interface
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Executable:
    """A compiled module for one device.

    ``call(*inputs, *weights)`` takes the module's arguments flat and returns its results as a
    tuple of device arrays; inputs may be host numpy arrays, weights should be device arrays from
    ``transfer_to_device``. ``source`` says which artifact it came from (``jaxexport`` or
    ``mlir``).
    """

    name: str
    call: Callable[..., tuple[Any, ...]]
    arg_shapes: tuple[tuple[tuple[int, ...], np.dtype], ...]
    result_shapes: tuple[tuple[tuple[int, ...], np.dtype], ...]
    compile_seconds: float
    source: str
    numerics: _xla.NumericsRewrite = field(default_factory=_xla.NumericsRewrite)

    @property
    def n_args(self) -> int:
        return len(self.arg_shapes)


class Backend(Protocol):
    """What the model loader needs from a device backend."""

    platform: str

    def compile_module(
        self, module: bytes, *, name: str, signature: _xla.EntrySignature | None = None
    ) -> Executable: ...

    def compile_exported(
        self, blob: bytes, *, name: str, signature: _xla.EntrySignature | None = None
    ) -> Executable | None: ...

    def transfer_to_device(self, hosts: Sequence[np.ndarray]) -> list[Any]: ...

    def free_weights(self, bufs: Sequence[Any]) -> None: ...

    def execute(
        self, exe: Executable, inputs: Sequence[np.ndarray], weights: Sequence[Any]
    ) -> list[np.ndarray]: ...

    def memory_stats(self) -> dict[str, int]: ...


class WorkerBackend(Backend, Protocol):
    """What a worker needs from its backend (``JaxBackend`` is one): the loader's surface, the
    memory figure the weight cache budgets with, and the switch that lets the cache, rather
    than the loader, place the weights."""

    load_weights_at_compile: bool

    def memory_in_use(self) -> int: ...


class JaxBackend:
    """The jax/XLA backend for one device (``cpu`` or ``cuda``); build it with ``create``.

    ``load_weights_at_compile`` (default True) says whether ``load_compiled_model`` puts a
    model's weights on the device once compiled; a worker with the on-demand weight cache
    turns it off and lets the cache place them.
    """

    def __init__(self, device: Any, platform: str, plan: NumericsPlan, memory_limit: int = 0):
        self.device = device
        self.platform = platform
        self.numerics = plan
        self.load_weights_at_compile = True
        self._cpu_memory_limit = int(memory_limit)
        import jax

        self._sharding = jax.sharding.SingleDeviceSharding(device)

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        backend: str = "cpu",
        *,
        device_ordinal: int = 0,
        mem_fraction: float = 0.9,
        preallocate: bool = True,
        autotune: bool = True,
        autotune_cache: bool | None = None,
        autotune_cache_dir: str = "",
        cache_dir: str = "",
        numerics: object = "auto",
        allow_cpu_fallback: bool = True,
        cpu_device_memory_bytes: int = 0,
    ) -> JaxBackend:
        """Apply the process settings, pick the device and resolve the numerics policy.

        Settings that jax reads when it creates its backends take effect only if this runs
        first in the process (a warning says so otherwise). ``cuda`` without a usable GPU falls
        back to the CPU when ``allow_cpu_fallback`` (with a warning), else it is a
        ``ConfigError``; so is a ``device_ordinal`` out of range, and ``numerics='tf32'`` on a
        device without TF32. ``cpu_device_memory_bytes`` is the device-memory limit the CPU
        backend reports (0 = none), so the weight cache can be exercised without a GPU.
        """
        requested = backend_token(backend)
        numerics_token(numerics)
        settings = plan_jax_settings(
            backend=requested,
            mem_fraction=mem_fraction,
            preallocate=preallocate,
            autotune=autotune,
            autotune_cache=autotune_cache,
            autotune_cache_dir=autotune_cache_dir,
            cache_dir=cache_dir,
        )
        _apply_settings(settings)
        import jax

        platform = requested
        devices: list[Any]
        if requested == "cuda":
            try:
                devices = list(jax.devices("cuda"))
            except RuntimeError as exc:
                if not allow_cpu_fallback:
                    raise ConfigError(
                        f"'cuda' requested but no CUDA device is usable ({exc}); "
                        "set runtime.allow_cpu_fallback to run on the CPU instead",
                        "runtime.backend",
                    ) from None
                log.warning("cuda_unavailable_cpu_fallback", reason=str(exc))
                platform = "cpu"
                devices = list(jax.devices("cpu"))
        else:
            devices = list(jax.devices("cpu"))
        if not 0 <= int(device_ordinal) < len(devices):
            raise ConfigError(
                f"device {device_ordinal} requested but {len(devices)} {platform} device(s) "
                "are visible",
                "runtime.device_ordinal",
            )
        device = devices[int(device_ordinal)]
        capable = tf32_capable(device)
        plan = plan_numerics(numerics, tf32_capable=capable, device=f"{platform} device {device}")
        self = cls(device, platform, plan, cpu_device_memory_bytes if platform == "cpu" else 0)
        log.info(
            "backend_ready",
            platform=platform,
            device=str(device),
            numerics=plan.mode,
            tf32=capable,
            cache_dir=cache_dir or None,
        )
        return self

    @classmethod
    def from_config(cls, runtime_cfg: Any, cache_dir: str = "") -> JaxBackend:
        """``create`` from a ``RuntimeConfig`` (attribute names as in ``core.process.config``)."""
        return cls.create(
            runtime_cfg.backend,
            device_ordinal=runtime_cfg.device_ordinal,
            mem_fraction=runtime_cfg.mem_fraction,
            preallocate=runtime_cfg.preallocate,
            autotune=runtime_cfg.autotune,
            autotune_cache=runtime_cfg.autotune_cache,
            autotune_cache_dir=runtime_cfg.autotune_cache_dir,
            cache_dir=cache_dir or "",
            numerics=runtime_cfg.numerics,
            allow_cpu_fallback=runtime_cfg.allow_cpu_fallback,
            cpu_device_memory_bytes=getattr(runtime_cfg, "cpu_device_memory_bytes", 0),
        )

    # -- compiling ------------------------------------------------------------------------

    def _rewrite(self, module: bytes) -> tuple[bytes, _xla.NumericsRewrite]:
        plan = self.numerics
        return _xla.rewrite_numerics(module, force_f32=plan.force_f32, strip_tf32=plan.strip_tf32)

    def compile_module(
        self, module: bytes, *, name: str, signature: _xla.EntrySignature | None = None
    ) -> Executable:
        """Compile a bare StableHLO module (artifact bytes or text) whose ``main`` takes
        ``(inputs..., weights...)``; raises ``_xla.ModuleFormatError`` for unusable modules.

        ``signature`` is the module's entry signature when the caller has already read it (the
        numerics rewrite never changes it), saving a parse.
        """
        artifact = bytes(module) if _xla.is_bytecode(module) else _xla.as_portable_artifact(module)
        artifact, rewrite = self._rewrite(artifact)
        sig = signature or _xla.entry_signature(artifact)
        wide = needs_x64([_xla.numpy_dtype(t) for t in (*sig.args, *sig.results) if t.token])
        with x64_scope() if wide else contextlib.nullcontext():
            exp = _xla.exported_from_module(
                artifact, sig, platform=self.platform, name=_fun_name(name)
            )
        return self._compile(exp, name=name, source="mlir", rewrite=rewrite)

    def compile_exported(
        self, blob: bytes, *, name: str, signature: _xla.EntrySignature | None = None
    ) -> Executable | None:
        """Compile a ``jax.export`` blob (a ``.jaxexport`` sidecar) through jax's public path.

        Returns ``None`` -- before compiling anything -- when the blob was exported for other
        platforms, uses features a bundle module must not (effects, symbolic shapes, several
        devices), or its argument/result types differ from ``signature`` (the entry signature
        of the ``.mlir`` it accompanies); the caller then compiles the portable ``.mlir``.
        """
        import dataclasses

        from jax import export as jexp

        with x64_scope():  # read 64-bit types as written (deserializing compiles nothing)
            exp = jexp.deserialize(bytearray(blob))
        if (
            self.platform not in exp.platforms
            or exp.nr_devices != 1
            or exp.ordered_effects
            or exp.uses_global_constants
            or len(exp.platforms) != 1
        ):
            return None
        if signature is not None and not (
            _xla.signature_matches(signature.args, exp.in_avals)
            and _xla.signature_matches(signature.results, exp.out_avals)
        ):
            return None
        new, rewrite = self._rewrite(exp.mlir_module_serialized)
        if rewrite.changed:
            exp = dataclasses.replace(exp, mlir_module_serialized=new)
        return self._compile(exp, name=name, source="jaxexport", rewrite=rewrite)

    def _compile(
        self, exp: Any, *, name: str, source: str, rewrite: _xla.NumericsRewrite
    ) -> Executable:
        import jax

        in_tree = exp.in_tree
        call = exp.call

        def flat_call(*flat: Any) -> tuple[Any, ...]:
            args, kwargs = jax.tree_util.tree_unflatten(in_tree, flat)
            return tuple(jax.tree_util.tree_leaves(call(*args, **kwargs)))

        flat_call.__name__ = _fun_name(name)
        wide = needs_x64([a.dtype for a in (*exp.in_avals, *exp.out_avals)])
        t0 = time.perf_counter()
        with x64_scope() if wide else contextlib.nullcontext():
            specs = [
                jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self._sharding)
                for a in exp.in_avals
            ]
            compiled = jax.jit(flat_call, keep_unused=True).lower(*specs).compile()
        seconds = time.perf_counter() - t0
        _count_compile()
        log.debug(
            "module_compiled", module=name, source=source, seconds=round(seconds, 4), x64=wide
        )
        return Executable(
            name=name,
            call=in_x64(compiled) if wide else compiled,
            arg_shapes=tuple((tuple(a.shape), np.dtype(a.dtype)) for a in exp.in_avals),
            result_shapes=tuple((tuple(a.shape), np.dtype(a.dtype)) for a in exp.out_avals),
            compile_seconds=seconds,
            source=source,
            numerics=rewrite,
        )

    # -- weights and execution --------------------------------------------------------------

    def transfer_to_device(self, hosts: Sequence[np.ndarray]) -> list[Any]:
        """Copy host arrays to the device, in order, as one batched transfer.

        The device arrays never alias the host memory: the host copy may be a memory map of a
        file that is later rewritten. (jax's CPU client adopts any 64-byte-aligned numpy buffer
        as the device buffer, ``may_alias=False`` notwithstanding, so on the CPU the "transfer"
        is an explicit copy that the device array then owns.)
        """
        import jax

        if not hosts:
            return []
        src = list(hosts)
        if self.platform == "cpu":
            src = [np.array(h, copy=True, order="C") for h in src]
        with x64_scope() if needs_x64([h.dtype for h in src]) else contextlib.nullcontext():
            return list(jax.device_put(src, self.device, may_alias=False))

    def free_weights(self, bufs: Sequence[Any]) -> None:
        """Release every device buffer in ``bufs`` now (already-freed ones are skipped)."""
        for b in bufs:
            if not b.is_deleted():
                b.delete()

    def execute(
        self, exe: Executable, inputs: Sequence[np.ndarray], weights: Sequence[Any]
    ) -> list[np.ndarray]:
        """Run ``exe(inputs..., weights...)`` and return the results as host numpy arrays."""
        return [np.asarray(o) for o in exe.call(*inputs, *weights)]

    # -- accounting -----------------------------------------------------------------------

    @property
    def tf32(self) -> bool:
        return tf32_capable(self.device)

    def memory_stats(self) -> dict[str, int]:
        """Device memory: ``bytes_in_use`` and ``bytes_limit`` at least (0 = unknown limit).

        On a GPU these are the allocator's own figures (plus its other counters); the CPU
        allocator reports nothing, so ``bytes_in_use`` is the size of this device's live jax
        arrays and ``bytes_limit`` is ``cpu_device_memory_bytes``.
        """
        stats = self.device.memory_stats()
        if stats:
            out = {k: int(v) for k, v in stats.items() if isinstance(v, int | float)}
            out.setdefault("bytes_in_use", 0)
            out.setdefault("bytes_limit", 0)
            return out
        return {"bytes_in_use": self.memory_in_use(), "bytes_limit": self._cpu_memory_limit}

    def memory_in_use(self) -> int:
        """Bytes of device memory in use (see ``memory_stats``)."""
        stats = self.device.memory_stats()
        if stats and "bytes_in_use" in stats:
            return int(stats["bytes_in_use"])
        import jax

        dev = self.device
        return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted() and dev in a.devices())

    def __repr__(self) -> str:
        return f"JaxBackend({self.platform}, {self.device}, numerics={self.numerics.mode})"


def _fun_name(name: str) -> str:
    cleaned = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return cleaned or "module"


def transfer_to_device(backend: Backend, hosts: Sequence[np.ndarray]) -> list[Any]:
    """Function spelling of ``backend.transfer_to_device(hosts)``."""
    return backend.transfer_to_device(hosts)


def free_weights(backend: Backend, bufs: Sequence[Any]) -> None:
    """Function spelling of ``backend.free_weights(bufs)``."""
    backend.free_weights(bufs)


__all__ = [
    "Backend",
    "Executable",
    "JaxBackend",
    "WorkerBackend",
    "compile_count",
    "free_weights",
    "transfer_to_device",
]

"""The backend's pure planners: the numerics policy (``plan_numerics``) and the process-wide
jax settings (``plan_jax_settings``), resolved from configuration values with no jax import, so
their rules are tested as plain functions; ``JaxBackend`` (``runtime/backend.py``) applies them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kserve_trio.core.errors import ConfigError

NUMERICS_MODES: tuple[str, ...] = ("auto", "f32", "tf32")
BACKENDS: tuple[str, ...] = ("cpu", "cuda")
TF32_MIN_COMPUTE_CAPABILITY = 8.0


def numerics_token(value: object) -> str:
    """``auto``/``f32``/``tf32`` from a string or an enum member (``core.process.config.NumericsMode``)."""
    raw = getattr(value, "value", value)
    token = str(raw).strip().lower() if raw is not None else ""
    if token not in NUMERICS_MODES:
        raise ConfigError(
            f"unknown numerics mode {raw!r}; expected one of {', '.join(NUMERICS_MODES)}",
            "runtime.numerics",
        )
    return token


@dataclass(frozen=True)
class NumericsPlan:
    """How modules are rewritten before compiling, resolved once per backend.

    ``force_f32``: every f32 dot/convolution at HIGHEST, TF32 dot algorithms rewritten to f32.
    ``strip_tf32``: explicit TF32 dot algorithms removed (hardware without TF32, mode ``auto``).
    """

    mode: str
    force_f32: bool
    strip_tf32: bool


def plan_numerics(mode: object, *, tf32_capable: bool, device: str = "device") -> NumericsPlan:
    """Resolve ``runtime.numerics`` for one device. Rules:

    1. ``f32``: rewrite to full f32 everywhere (same numbers on every GPU generation);
    2. ``tf32``: compile like ``auto`` but refuse hardware without TF32 (``ConfigError``);
    3. ``auto``: leave the module alone where TF32 exists, strip explicit TF32 algorithms where
       it does not, so the same bundle compiles everywhere.
    """
    token = numerics_token(mode)
    if token == "f32":
        return NumericsPlan("f32", force_f32=True, strip_tf32=False)
    if token == "tf32":
        if not tf32_capable:
            raise ConfigError(
                f"'tf32' requires a GPU with TF32 (compute capability >= "
                f"{TF32_MIN_COMPUTE_CAPABILITY:.1f}); {device} has none. Use 'auto' to accept "
                "whatever precision the hardware has, or 'f32' for full f32 everywhere",
                "runtime.numerics",
            )
        return NumericsPlan("tf32", force_f32=False, strip_tf32=False)
    return NumericsPlan("auto", force_f32=False, strip_tf32=not tf32_capable)


def backend_token(value: object) -> str:
    """``cpu`` or ``cuda`` (``gpu`` is accepted for ``cuda``); anything else is a ConfigError."""
    raw = getattr(value, "value", value)
    token = str(raw).strip().lower()
    if token == "gpu":
        token = "cuda"
    if token not in BACKENDS:
        raise ConfigError(
            f"unknown backend {raw!r}; expected one of {', '.join(BACKENDS)}", "runtime.backend"
        )
    return token


@dataclass(frozen=True)
class JaxSettings:
    """Process-wide settings to apply before jax initialises its backends.

    ``env`` is set in ``os.environ``; ``xla_flags`` are appended to ``XLA_FLAGS``; ``config`` is
    passed to ``jax.config.update`` name by name.
    """

    env: Mapping[str, str] = field(default_factory=dict)
    xla_flags: tuple[str, ...] = ()
    config: Mapping[str, Any] = field(default_factory=dict)


def plan_jax_settings(
    *,
    backend: str,
    mem_fraction: float = 0.9,
    preallocate: bool = True,
    autotune: bool = True,
    autotune_cache: bool | None = None,
    autotune_cache_dir: str = "",
    cache_dir: str = "",
) -> JaxSettings:
    """The settings for one worker process. Rules:

    1. ``cpu``: jax is limited to its CPU platform (a CUDA jaxlib never touches a GPU); the GPU
       knobs do not apply (XLA's CPU build rejects unknown GPU flags, so none are emitted).
    2. ``cuda``: ``mem_fraction`` and ``preallocate`` become jax's client allocator variables;
       ``autotune=False`` compiles with ``--xla_gpu_autotune_level=0``.
    3. Autotune cache: ``autotune_cache=False`` turns off the per-fusion cache jax derives from
       the compilation cache; an ``autotune_cache_dir`` (with ``autotune_cache`` not False) is
       passed to XLA directly and jax's derived one is turned off; otherwise jax's own default
       applies (a cache inside ``cache_dir``, when there is one).
    4. ``cache_dir`` non-empty: jax's persistent compilation cache in that directory, caching
       every compiled module however quick (a restart recompiles nothing).
    """
    backend = backend_token(backend)
    if not 0.0 < float(mem_fraction) <= 1.0:
        raise ConfigError(f"must be in (0, 1], got {mem_fraction}", "runtime.mem_fraction")
    env: dict[str, str] = {}
    flags: list[str] = []
    config: dict[str, Any] = {}
    if backend == "cpu":
        config["jax_platforms"] = "cpu"
    else:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{float(mem_fraction):g}"
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true" if preallocate else "false"
        if not autotune:
            flags.append("--xla_gpu_autotune_level=0")
        if autotune_cache is False:
            config["jax_persistent_cache_enable_xla_caches"] = "none"
        elif autotune_cache_dir:
            config["jax_persistent_cache_enable_xla_caches"] = "none"
            flags.append(f"--xla_gpu_per_fusion_autotune_cache_dir={autotune_cache_dir}")
    if cache_dir:
        config["jax_compilation_cache_dir"] = str(cache_dir)
        config["jax_persistent_cache_min_compile_time_secs"] = 0.0
        config["jax_persistent_cache_min_entry_size_bytes"] = -1
    return JaxSettings(env, tuple(flags), config)


def tf32_capable(device: Any) -> bool:
    """Whether ``device`` has TF32 tensor cores (an NVIDIA GPU of compute capability >= 8.0)."""
    if getattr(device, "platform", "") not in ("gpu", "cuda"):
        return False
    cc = getattr(device, "compute_capability", None)
    if cc is None:
        return False
    try:
        return float(cc) >= TF32_MIN_COMPUTE_CAPABILITY
    except (TypeError, ValueError):
        return False


__all__ = [
    "BACKENDS",
    "NUMERICS_MODES",
    "TF32_MIN_COMPUTE_CAPABILITY",
    "JaxSettings",
    "NumericsPlan",
    "backend_token",
    "numerics_token",
    "plan_jax_settings",
    "plan_numerics",
    "tf32_capable",
]

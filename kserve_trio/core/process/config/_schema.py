"""The worker configuration's YAML schema and the builder: every accepted key, the removed keys'
migration messages, the typed readers and ``build_config`` (raw dict -> ``ServerConfig``).

No key is inert: an unknown key anywhere is a ``ConfigError`` naming its YAML path, and the keys
upstream removed (``batch_policy``, ``runtime.residency_mode``) fail with a migration message.
The readers are public so the other configurations (node files, ``gateway.yml``) type-check their
values with the same messages.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
from collections.abc import Mapping
from typing import Any

from kserve_trio.core.errors import ConfigError
from kserve_trio.core.plain import is_int
from kserve_trio.core.process.config._limits import LIMIT_FIELDS, EdgeLimits
from kserve_trio.core.process.config._raw import join_path
from kserve_trio.core.process.config._tracing import TRACING_FIELDS, TRACING_READERS, TracingConfig
from kserve_trio.core.process.config._types import (
    EndpointsConfig,
    FrozenMap,
    GrpcConfig,
    MetaConfig,
    ModelControlMode,
    ModelSchedConfig,
    NumericsMode,
    ResidencyState,
    RuntimeConfig,
    SchedulerConfig,
    SchedulingDiscipline,
    ServerConfig,
    TlsConfig,
    parse_backend,
    parse_enum,
    parse_octal_mode,
)

# ---------------------------------------------------------------------------------------------
# Schema: every accepted key. A leaf is None; a nested mapping is a dict; _ANY matches any key.

_ANY = "*"
_MODEL_KEYS = {"weight": None, "residency": None, "pin_to_gpu": None, "max_batch_size": None}
SCHEMA: dict[str, Any] = {
    "model_dirs": None,
    "cache_dir": None,
    "models_include": None,
    "model_control_mode": None,
    "model_poll_seconds": None,
    "serve_without_hooks": None,
    "runtime": {f.name: None for f in dataclasses.fields(RuntimeConfig)},
    "scheduler": {
        **{f.name: None for f in dataclasses.fields(SchedulerConfig) if f.name != "models"},
        "models": {_ANY: _MODEL_KEYS},
    },
    "endpoints": {
        **{f.name: None for f in dataclasses.fields(EndpointsConfig) if f.name != "tls"},
        "tls": {f.name: None for f in dataclasses.fields(TlsConfig)},
    },
    "grpc": {f.name: None for f in dataclasses.fields(GrpcConfig)},
    "meta": {f.name: None for f in dataclasses.fields(MetaConfig)},
    "limits": {f.name: None for f in LIMIT_FIELDS},
    "tracing": {f.name: None for f in TRACING_FIELDS},
}

BATCH_POLICY_REMOVED = (
    "the 'batch_policy' config has been removed; set a per-model cap via "
    "scheduler.models.<name>.max_batch_size (the batch axis comes from the model manifest)"
)
RESIDENCY_MODE_REMOVED = (
    "runtime.residency_mode has been removed; use the top-level model_control_mode instead "
    "('explicit' replaces 'externally_managed'; 'static'/'dynamic' are self-managed)"
)
_REMOVED = {"batch_policy": BATCH_POLICY_REMOVED, "runtime.residency_mode": RESIDENCY_MODE_REMOVED}


def check_keys(
    raw: Mapping[str, Any], prefix: str = "", schema: Mapping[str, Any] = SCHEMA
) -> None:
    """Reject removed and unknown keys (and non-mapping blocks) under ``raw``.

    ``prefix`` is prepended to error paths, e.g. ``"global"`` when checking a node file's
    ``global:`` block, so the error names the key where the user wrote it.
    """
    _check_keys(raw, prefix, "", schema)


def _check_keys(raw: Any, prefix: str, rel: str, schema: Mapping[str, Any]) -> None:
    for key, value in raw.items():
        key_rel = join_path(rel, str(key))
        path = join_path(prefix, key_rel)
        if key_rel in _REMOVED:
            raise ConfigError(_REMOVED[key_rel], path)
        if not isinstance(key, str):
            raise ConfigError(f"keys must be strings (got {key!r})", join_path(prefix, rel))
        if key in schema:
            sub = schema[key]
        elif _ANY in schema:
            sub = schema[_ANY]
        else:
            close = difflib.get_close_matches(key, list(schema), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"unknown key{hint} (known: {', '.join(schema)})", path)
        if isinstance(sub, dict) and value is not None:
            if not isinstance(value, Mapping):
                raise ConfigError(f"config '{path}' must be a mapping", path)
            _check_keys(value, prefix, key_rel, sub)


# ---------------------------------------------------------------------------------------------
# Typed reads from a raw dict (YAML shape). Missing keys keep the dataclass default.


def as_int(v: Any, path: str) -> int:
    if not is_int(v):
        raise ConfigError(f"config '{path}' must be an integer (got {v!r})", path)
    return int(v)


def as_float(v: Any, path: str) -> float:
    if not (is_int(v) or isinstance(v, float)):
        raise ConfigError(f"config '{path}' must be a number (got {v!r})", path)
    return float(v)


def as_bool(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"config '{path}' must be a boolean (got {v!r})", path)
    return v


def as_str(v: Any, path: str) -> str:
    if not isinstance(v, str):
        raise ConfigError(f"config '{path}' must be a string (got {v!r})", path)
    return v


def as_str_list(v: Any, path: str) -> tuple[str, ...]:
    if isinstance(v, str) or not isinstance(v, list | tuple):
        raise ConfigError(f"config '{path}' must be a list (got {v!r})", path)
    return tuple(as_str(x, f"{path}[{i}]") for i, x in enumerate(v))


def _block(raw: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"config '{key}' must be a mapping", key)
    return value


_READERS = {"int": as_int, "float": as_float, "bool": as_bool, "str": as_str}


def read_block(cls: type, block: Mapping[str, Any], prefix: str, special: Mapping) -> Any:
    """Build dataclass ``cls`` from ``block``: plain fields are read by their annotation
    (``int``/``float``/``bool``/``str``), the others through ``special[name](value, path)``."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in block:
            continue
        path = f"{prefix}.{f.name}"
        value = block[f.name]
        if f.name in special:
            kwargs[f.name] = special[f.name](value, path)
        else:
            kwargs[f.name] = _READERS[str(f.type)](value, path)
    return cls(**kwargs)


def _residency(value: Any, path: str) -> ResidencyState:
    names = {
        "unpinned": ResidencyState.UNPINNED,
        "system": ResidencyState.PINNED_SYSTEM,
        "pinned_system": ResidencyState.PINNED_SYSTEM,
        "device": ResidencyState.PINNED_DEVICE,
        "pinned_device": ResidencyState.PINNED_DEVICE,
    }
    state = names.get(as_str(value, path).strip().lower())
    if state is None:
        raise ConfigError(f"must be 'unpinned', 'system' or 'device' (got {value!r})", path)
    return state


def _model_block(name: str, block: Any) -> ModelSchedConfig:
    path = f"scheduler.models.{name}"
    if block is None:
        block = {}
    if not isinstance(block, Mapping):
        raise ConfigError(f"config '{path}' must be a mapping", path)
    residency = None
    if block.get("residency") is not None:
        residency = _residency(block["residency"], f"{path}.residency")
    pin = as_bool(block["pin_to_gpu"], f"{path}.pin_to_gpu") if "pin_to_gpu" in block else False
    if pin:
        if residency not in (None, ResidencyState.PINNED_DEVICE):
            raise ConfigError(
                "pin_to_gpu: true contradicts the model's residency; set only one", path
            )
        residency = ResidencyState.PINNED_DEVICE
    cap = block.get("max_batch_size")
    return ModelSchedConfig(
        weight=as_float(block.get("weight", 1.0), f"{path}.weight"),
        residency=residency,
        max_batch_size=None if cap is None else as_int(cap, f"{path}.max_batch_size"),
    )


def _models(value: Any, path: str) -> FrozenMap[ModelSchedConfig]:
    if value is None:
        return FrozenMap()
    if not isinstance(value, Mapping):
        raise ConfigError(f"config '{path}' must be a mapping", path)
    return FrozenMap((str(name), _model_block(str(name), block)) for name, block in value.items())


def _optional_bool(value: Any, path: str) -> bool | None:
    return None if value is None else as_bool(value, path)


def build_config(raw: Mapping[str, Any]) -> ServerConfig:
    """Turn a raw dict (YAML shape) into a ``ServerConfig``; absent keys keep the defaults.

    Rules, in order:
    1. a removed key fails with its migration message; an unknown key fails naming its path;
    2. every value is type-checked ("config 'k' must be an integer|a number|...");
    3. enum strings are matched case-insensitively; nothing is range-checked here
       (that is ``validate_config``'s job, so a code-built config gets the same checks).
    """
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config root must be a mapping (got {type(raw).__name__})")
    check_keys(raw)
    top: dict[str, Any] = {}
    for key in ("model_dirs", "models_include"):
        if key in raw:
            top[key] = as_str_list(raw[key], key)
    if "cache_dir" in raw:
        top["cache_dir"] = as_str(raw["cache_dir"], "cache_dir")
    if "model_control_mode" in raw:
        value = as_str(raw["model_control_mode"], "model_control_mode")
        top["model_control_mode"] = parse_enum(ModelControlMode, value, "model_control_mode")
    if "model_poll_seconds" in raw:
        top["model_poll_seconds"] = as_float(raw["model_poll_seconds"], "model_poll_seconds")
    if "serve_without_hooks" in raw:
        top["serve_without_hooks"] = as_bool(raw["serve_without_hooks"], "serve_without_hooks")

    def enum_reader(cls: type[enum.Enum]) -> Any:
        return lambda v, p: parse_enum(cls, as_str(v, p), p)

    runtime = read_block(
        RuntimeConfig,
        _block(raw, "runtime"),
        "runtime",
        {
            "backend": lambda v, p: parse_backend(as_str(v, p), p),
            "shared_host_weights_mode": lambda v, p: parse_octal_mode(_shm_mode_str(v, p), p),
            "autotune_cache": _optional_bool,
            "numerics": enum_reader(NumericsMode),
        },
    )
    scheduler = read_block(
        SchedulerConfig,
        _block(raw, "scheduler"),
        "scheduler",
        {"discipline": enum_reader(SchedulingDiscipline), "models": _models},
    )
    endpoints = read_block(
        EndpointsConfig,
        _block(raw, "endpoints"),
        "endpoints",
        {
            "tls": lambda v, p: read_block(TlsConfig, v or {}, p, {}),
            "restricted_protocols": as_str_list,
            "client_shared_memory_prefixes": as_str_list,
        },
    )
    grpc = read_block(GrpcConfig, _block(raw, "grpc"), "grpc", {})
    meta = read_block(MetaConfig, _block(raw, "meta"), "meta", {})
    limits = read_block(EdgeLimits, _block(raw, "limits"), "limits", {})
    tracing = read_block(TracingConfig, _block(raw, "tracing"), "tracing", TRACING_READERS)
    return ServerConfig(
        **top,
        runtime=runtime,
        scheduler=scheduler,
        endpoints=endpoints,
        grpc=grpc,
        meta=meta,
        limits=limits,
        tracing=tracing,
    )


def _shm_mode_str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(
            f"config '{path}' must be a string (quote the octal bits, e.g. \"660\"; got {value!r})",
            path,
        )
    return value

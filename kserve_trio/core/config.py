"""A worker's typed configuration: the ``ServerConfig`` family, its YAML schema, the environment
overrides, validation and the one loading entry point.

One set of defaults holds however a config is built (YAML, code or command line): the dataclass
field defaults *are* the YAML defaults, and ``build_config`` only fills in what a raw dict sets.
Precedence everywhere is defaults < node file < ``INFERENCE_SERVER_*``/``KSERVE_TRIO_*``
environment < command-line overrides (``load_server_config``).

No key is inert: every accepted key is implemented somewhere, an
unknown key anywhere is a ``ConfigError`` naming its YAML path, and the keys upstream removed
(``batch_policy``, ``runtime.residency_mode``) fail with a migration message.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from kserve_trio.core.errors import ConfigError
from kserve_trio.core.logging import get_logger

DEFAULT_GRPC_MSG_BYTES = 512 << 20
"""gRPC message cap in each direction (a decode/encode bound, not an allocation)."""

ENV_PREFIX = "INFERENCE_SERVER_"
WORKER_NAME_ENV = "KSERVE_TRIO_WORKER_NAME"


class ModelControlMode(enum.Enum):
    """How the set of loaded models changes over a worker's life (Triton's model-control-mode)."""

    STATIC = "static"
    DYNAMIC = "dynamic"
    EXPLICIT = "explicit"


class SchedulingDiscipline(enum.Enum):
    """Inter-model dispatch ordering; coalescing runs underneath all three."""

    FAIR = "fair"
    FIFO = "fifo"
    EDF = "edf"


class NumericsMode(enum.Enum):
    """f32 matmul/convolution precision policy (``runtime.numerics``)."""

    AUTO = "auto"
    F32 = "f32"
    TF32 = "tf32"


class ResidencyState(enum.IntEnum):
    """A model's weight-residency floor; same numbers as the control proto's enum."""

    UNPINNED = 1
    PINNED_SYSTEM = 2
    PINNED_DEVICE = 3


class ResidencyMode(enum.Enum):
    """Who owns device residency; derived from ``ModelControlMode`` (explicit -> external)."""

    SELF_MANAGED = "self_managed"
    EXTERNALLY_MANAGED = "externally_managed"


V = TypeVar("V")


class FrozenMap(Mapping[str, V]):
    """A read-only, hashable mapping, so a frozen config holding per-model blocks stays frozen."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, V] | Iterable[tuple[str, V]] = ()) -> None:
        self._items: dict[str, V] = dict(items)

    def __getitem__(self, key: str) -> V:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return f"FrozenMap({self._items!r})"


_BACKENDS = {"cpu": "cpu", "cuda": "cuda", "gpu": "cuda"}


def _enum(cls: type[enum.Enum], value: Any, path: str) -> Any:
    """Accept an enum member or its (case-insensitive, trimmed) value string."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        for member in cls:
            if member.value == value.strip().lower():
                return member
    choices = ", ".join(f"'{m.value}'" for m in cls)
    raise ConfigError(f"must be one of {choices} (got {value!r})", path)


def _backend(value: Any, path: str = "runtime.backend") -> str:
    name = value.strip().lower() if isinstance(value, str) else None
    if name not in _BACKENDS:
        raise ConfigError(f"must be 'cpu' or 'cuda' ('gpu' is an alias) (got {value!r})", path)
    return _BACKENDS[name]


def _octal_mode(value: Any, path: str = "runtime.shared_host_weights_mode") -> int:
    """An octal permission string such as ``"660"`` -> ``0o660`` (at most ``0o777``)."""
    try:
        mode = int(value.strip(), 8)
    except (AttributeError, ValueError):
        mode = -1
    if not 0 <= mode <= 0o777:
        raise ConfigError(
            f'must be an octal permission string like "666" or "660" (got {value!r})', path
        )
    return mode


@dataclass(frozen=True)
class RuntimeConfig:
    """Device and runtime settings (the ``runtime:`` block).

    ``cpu_device_memory_bytes`` is the device-memory size the CPU backend reports to the weight
    cache (0 = none), so on-demand residency can be exercised without a GPU. ``autotune_cache``
    ``None`` and ``autotune_cache_dir`` ``""`` mean "inherit the compiler's own setting".
    """

    backend: str = "cpu"
    device_ordinal: int = 0
    mem_fraction: float = 0.9
    preallocate: bool = True
    allow_cpu_fallback: bool = True
    shared_host_weights: bool = False
    shared_host_weights_mode: int = 0o666
    weight_cache_fraction: float = 1.0
    weight_cache_wiggle_fraction: float = 0.1
    autotune: bool = True
    autotune_cache: bool | None = None
    autotune_cache_dir: str = ""
    numerics: NumericsMode = NumericsMode.AUTO
    cpu_device_memory_bytes: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", _backend(self.backend))
        object.__setattr__(self, "numerics", _enum(NumericsMode, self.numerics, "runtime.numerics"))


@dataclass(frozen=True)
class ModelSchedConfig:
    """Per-model scheduler overrides (``scheduler.models.<name>``).

    ``residency`` ``None`` is resolved by the server at startup (PINNED_SYSTEM with the weight
    cache on, UNPINNED otherwise); ``max_batch_size`` ``None`` means uncapped coalescing.
    """

    weight: float = 1.0
    residency: ResidencyState | None = None
    max_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.residency is not None and not isinstance(self.residency, ResidencyState):
            object.__setattr__(self, "residency", ResidencyState(self.residency))


@dataclass(frozen=True)
class SchedulerConfig:
    """Global scheduler settings (the ``scheduler:`` block); ``models`` holds per-model blocks.

    ``dispatch_timeout_seconds`` (0 = off) bounds a request's execution wait and is enforced by
    the scheduler; ``compaction_interval`` compacts every N on-demand loads (0 = off).
    """

    discipline: SchedulingDiscipline = SchedulingDiscipline.FAIR
    ema_halflife_seconds: float = 30.0
    recency_penalty_cap: float = 0.25
    coalescing_discount: float = 0.1
    cost_ema_alpha: float = 0.2
    max_queue_depth: int = 1024
    dispatch_timeout_seconds: float = 30.0
    compaction_interval: int = 0
    models: Mapping[str, ModelSchedConfig] = field(default_factory=FrozenMap)

    def __post_init__(self) -> None:
        discipline = _enum(SchedulingDiscipline, self.discipline, "scheduler.discipline")
        object.__setattr__(self, "discipline", discipline)
        if not isinstance(self.models, FrozenMap):
            object.__setattr__(self, "models", FrozenMap(self.models))


@dataclass(frozen=True)
class TlsConfig:
    """TLS on the gRPC endpoint (``endpoints.tls``): PEM files of the server's certificate chain
    and private key (both or neither; neither = plaintext), and optionally a CA bundle that
    client certificates must chain to (mutual TLS: a client without one is refused)."""

    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)

    @property
    def mutual(self) -> bool:
        return bool(self.client_ca_file)


@dataclass(frozen=True)
class EndpointsConfig:
    """Listen addresses; port 0 binds an ephemeral port, ``metrics_port`` 0 disables metrics,
    ``max_concurrent_requests`` 0 means uncapped; ``tls`` secures the gRPC port."""

    host: str = "127.0.0.1"
    port: int = 8001
    metrics_port: int = 0
    max_concurrent_requests: int = 64
    tls: TlsConfig = TlsConfig()


@dataclass(frozen=True)
class GrpcConfig:
    """gRPC message-size caps in each direction (on the decompressed size), and whether every
    reply is compressed (``compress_responses``; by default a reply is compressed only when its
    request was)."""

    max_recv_msg_bytes: int = DEFAULT_GRPC_MSG_BYTES
    max_send_msg_bytes: int = DEFAULT_GRPC_MSG_BYTES
    compress_responses: bool = False


@dataclass(frozen=True)
class MetaConfig:
    """The meta models' scratch buffer pool (``meta:`` block; ``KSERVE_TRIO_FANOUT_*`` env).

    Either value ``<= 0`` disables the pool (sub-calls then allocate their own buffers).
    """

    fanout_bytes: int = 1 << 30
    fanout_slots: int = 16

    @property
    def pool_enabled(self) -> bool:
        return self.fanout_bytes > 0 and self.fanout_slots > 0


@dataclass(frozen=True)
class ServerConfig:
    """The fully resolved configuration of one worker process, frozen for its lifetime.

    ``worker_name`` is the node worker entry it was resolved for ("" when none); it is not a
    YAML key. A non-empty ``cache_dir`` enables JAX's persistent compilation cache there.
    """

    model_dirs: tuple[str, ...] = ("models",)
    cache_dir: str = ""
    models_include: tuple[str, ...] = ()
    model_control_mode: ModelControlMode = ModelControlMode.DYNAMIC
    model_poll_seconds: float = 15.0
    runtime: RuntimeConfig = RuntimeConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    endpoints: EndpointsConfig = EndpointsConfig()
    grpc: GrpcConfig = GrpcConfig()
    worker_name: str = ""
    meta: MetaConfig = MetaConfig()

    def __post_init__(self) -> None:
        for name in ("model_dirs", "models_include"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        mode = _enum(ModelControlMode, self.model_control_mode, "model_control_mode")
        object.__setattr__(self, "model_control_mode", mode)

    @property
    def residency_mode(self) -> ResidencyMode:
        """EXPLICIT control cedes residency to a control plane; the others self-manage."""
        if self.model_control_mode is ModelControlMode.EXPLICIT:
            return ResidencyMode.EXTERNALLY_MANAGED
        return ResidencyMode.SELF_MANAGED

    def model_sched(self, name: str) -> ModelSchedConfig:
        """The model's scheduler block, or the defaults when it has none."""
        return self.scheduler.models.get(name, ModelSchedConfig())


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


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


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
        key_rel = _join(rel, str(key))
        path = _join(prefix, key_rel)
        if key_rel in _REMOVED:
            raise ConfigError(_REMOVED[key_rel], path)
        if not isinstance(key, str):
            raise ConfigError(f"keys must be strings (got {key!r})", _join(prefix, rel))
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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _as_int(v: Any, path: str) -> int:
    if not _is_int(v):
        raise ConfigError(f"config '{path}' must be an integer (got {v!r})", path)
    return int(v)


def _as_float(v: Any, path: str) -> float:
    if not (_is_int(v) or isinstance(v, float)):
        raise ConfigError(f"config '{path}' must be a number (got {v!r})", path)
    return float(v)


def _as_bool(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"config '{path}' must be a boolean (got {v!r})", path)
    return v


def _as_str(v: Any, path: str) -> str:
    if not isinstance(v, str):
        raise ConfigError(f"config '{path}' must be a string (got {v!r})", path)
    return v


def _as_str_list(v: Any, path: str) -> tuple[str, ...]:
    if isinstance(v, str) or not isinstance(v, list | tuple):
        raise ConfigError(f"config '{path}' must be a list (got {v!r})", path)
    return tuple(_as_str(x, f"{path}[{i}]") for i, x in enumerate(v))


def _block(raw: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"config '{key}' must be a mapping", key)
    return value


_READERS = {"int": _as_int, "float": _as_float, "bool": _as_bool, "str": _as_str}


def _read_block(cls: type, block: Mapping[str, Any], prefix: str, special: Mapping) -> Any:
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
    state = names.get(_as_str(value, path).strip().lower())
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
    pin = _as_bool(block["pin_to_gpu"], f"{path}.pin_to_gpu") if "pin_to_gpu" in block else False
    if pin:
        if residency not in (None, ResidencyState.PINNED_DEVICE):
            raise ConfigError(
                "pin_to_gpu: true contradicts the model's residency; set only one", path
            )
        residency = ResidencyState.PINNED_DEVICE
    cap = block.get("max_batch_size")
    return ModelSchedConfig(
        weight=_as_float(block.get("weight", 1.0), f"{path}.weight"),
        residency=residency,
        max_batch_size=None if cap is None else _as_int(cap, f"{path}.max_batch_size"),
    )


def _models(value: Any, path: str) -> FrozenMap[ModelSchedConfig]:
    if value is None:
        return FrozenMap()
    if not isinstance(value, Mapping):
        raise ConfigError(f"config '{path}' must be a mapping", path)
    return FrozenMap((str(name), _model_block(str(name), block)) for name, block in value.items())


def _optional_bool(value: Any, path: str) -> bool | None:
    return None if value is None else _as_bool(value, path)


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
            top[key] = _as_str_list(raw[key], key)
    if "cache_dir" in raw:
        top["cache_dir"] = _as_str(raw["cache_dir"], "cache_dir")
    if "model_control_mode" in raw:
        value = _as_str(raw["model_control_mode"], "model_control_mode")
        top["model_control_mode"] = _enum(ModelControlMode, value, "model_control_mode")
    if "model_poll_seconds" in raw:
        top["model_poll_seconds"] = _as_float(raw["model_poll_seconds"], "model_poll_seconds")

    def enum_reader(cls: type[enum.Enum]) -> Any:
        return lambda v, p: _enum(cls, _as_str(v, p), p)

    runtime = _read_block(
        RuntimeConfig,
        _block(raw, "runtime"),
        "runtime",
        {
            "backend": lambda v, p: _backend(_as_str(v, p), p),
            "shared_host_weights_mode": lambda v, p: _octal_mode(_shm_mode_str(v, p), p),
            "autotune_cache": _optional_bool,
            "numerics": enum_reader(NumericsMode),
        },
    )
    scheduler = _read_block(
        SchedulerConfig,
        _block(raw, "scheduler"),
        "scheduler",
        {"discipline": enum_reader(SchedulingDiscipline), "models": _models},
    )
    endpoints = _read_block(
        EndpointsConfig,
        _block(raw, "endpoints"),
        "endpoints",
        {"tls": lambda v, p: _read_block(TlsConfig, v or {}, p, {})},
    )
    grpc = _read_block(GrpcConfig, _block(raw, "grpc"), "grpc", {})
    meta = _read_block(MetaConfig, _block(raw, "meta"), "meta", {})
    return ServerConfig(
        **top, runtime=runtime, scheduler=scheduler, endpoints=endpoints, grpc=grpc, meta=meta
    )


def _shm_mode_str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(
            f"config '{path}' must be a string (quote the octal bits, e.g. \"660\"; got {value!r})",
            path,
        )
    return value


# ---------------------------------------------------------------------------------------------
# Environment overrides: table-driven (field names contain underscores, so no name splitting).

# variable (INFERENCE_SERVER_ prefix implied unless spelled out)   YAML path   kind
_ENV_TABLE_TEXT = """
CACHE_DIR                              cache_dir                           str
MODEL_POLL_SECONDS                     model_poll_seconds                  float
MODEL_CONTROL_MODE                     model_control_mode                  str
MODEL_DIRS                             model_dirs                          list
MODELS_INCLUDE                         models_include                      list
RUNTIME_BACKEND                        runtime.backend                     str
RUNTIME_DEVICE_ORDINAL                 runtime.device_ordinal              int
RUNTIME_MEM_FRACTION                   runtime.mem_fraction                float
RUNTIME_PREALLOCATE                    runtime.preallocate                 bool
RUNTIME_ALLOW_CPU_FALLBACK             runtime.allow_cpu_fallback          bool
RUNTIME_WEIGHT_CACHE_FRACTION          runtime.weight_cache_fraction       float
RUNTIME_WEIGHT_CACHE_WIGGLE_FRACTION   runtime.weight_cache_wiggle_fraction float
RUNTIME_AUTOTUNE                       runtime.autotune                    bool
RUNTIME_AUTOTUNE_CACHE                 runtime.autotune_cache              bool
RUNTIME_AUTOTUNE_CACHE_DIR             runtime.autotune_cache_dir          str
RUNTIME_NUMERICS                       runtime.numerics                    str
RUNTIME_SHARED_HOST_WEIGHTS            runtime.shared_host_weights         bool
RUNTIME_SHARED_HOST_WEIGHTS_MODE       runtime.shared_host_weights_mode    str
RUNTIME_CPU_DEVICE_MEMORY_BYTES        runtime.cpu_device_memory_bytes     int
SCHEDULER_DISCIPLINE                   scheduler.discipline                str
SCHEDULER_EMA_HALFLIFE_SECONDS         scheduler.ema_halflife_seconds      float
SCHEDULER_RECENCY_PENALTY_CAP          scheduler.recency_penalty_cap       float
SCHEDULER_COALESCING_DISCOUNT          scheduler.coalescing_discount       float
SCHEDULER_COST_EMA_ALPHA               scheduler.cost_ema_alpha            float
SCHEDULER_MAX_QUEUE_DEPTH              scheduler.max_queue_depth           int
SCHEDULER_DISPATCH_TIMEOUT_SECONDS     scheduler.dispatch_timeout_seconds  float
SCHEDULER_COMPACTION_INTERVAL          scheduler.compaction_interval       int
ENDPOINTS_HOST                         endpoints.host                      str
ENDPOINTS_PORT                         endpoints.port                      int
ENDPOINTS_METRICS_PORT                 endpoints.metrics_port              int
ENDPOINTS_MAX_CONCURRENT_REQUESTS      endpoints.max_concurrent_requests   int
ENDPOINTS_TLS_CERT_FILE                endpoints.tls.cert_file             str
ENDPOINTS_TLS_KEY_FILE                 endpoints.tls.key_file              str
ENDPOINTS_TLS_CLIENT_CA_FILE           endpoints.tls.client_ca_file        str
GRPC_MAX_RECV_MSG_BYTES                grpc.max_recv_msg_bytes             int
GRPC_MAX_SEND_MSG_BYTES                grpc.max_send_msg_bytes             int
GRPC_COMPRESS_RESPONSES                grpc.compress_responses             bool
KSERVE_TRIO_FANOUT_BYTES               meta.fanout_bytes                   int
KSERVE_TRIO_FANOUT_SLOTS               meta.fanout_slots                   int
"""
_ENV_TABLE: tuple[tuple[str, str, str], ...] = tuple(
    (var if var.startswith("KSERVE_TRIO_") else ENV_PREFIX + var, path, kind)
    for var, path, kind in (line.split() for line in _ENV_TABLE_TEXT.strip().splitlines())
)
ENV_OVERRIDES: Mapping[str, str] = FrozenMap((var, path) for var, path, _ in _ENV_TABLE)
"""Every environment variable that overrides a config key -> the YAML path it sets."""

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_KIND_NAMES = {"int": "integer", "float": "number", "bool": "boolean"}


def parse_env_bool(var: str, text: str, path: str = "") -> bool:
    """``1|true|yes|on`` / ``0|false|no|off`` (any case, trimmed); anything else is an error."""
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ConfigError(
        f"environment override {var} has invalid boolean value {text!r} "
        "(expected 1|true|yes|on or 0|false|no|off)",
        path,
    )


def _parse_env(var: str, text: str, path: str, kind: str) -> Any:
    if kind == "str":
        return text
    if kind == "list":
        return [part for part in text.split(":") if part]
    if kind == "bool":
        return parse_env_bool(var, text, path)
    try:
        return int(text.strip()) if kind == "int" else float(text.strip())
    except ValueError:
        raise ConfigError(
            f"environment override {var} has invalid {_KIND_NAMES[kind]} value {text!r}", path
        ) from None


def _set_path(raw: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    cur = raw
    walked = ""
    for key in parents:
        walked = _join(walked, key)
        nxt = cur.get(key)
        if nxt is None:
            nxt = cur[key] = {}
        elif not isinstance(nxt, dict):
            if not isinstance(nxt, Mapping):
                raise ConfigError(f"config '{walked}' must be a mapping", walked)
            nxt = cur[key] = dict(nxt)
        cur = nxt
    cur[leaf] = value


def apply_env_overrides(
    raw: Mapping[str, Any], env: Mapping[str, str]
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Apply the environment table to a copy of ``raw``; return it and the applied pairs.

    Rules:
    1. ``INFERENCE_SERVER_BATCH_POLICY_*`` and ``INFERENCE_SERVER_RUNTIME_RESIDENCY_MODE`` fail
       with the migration messages; ``KSERVE_TRIO_META_CONCURRENCY`` fails (no meta gate);
    2. any other unknown ``INFERENCE_SERVER_*`` variable fails (a typo must not be inert);
    3. known variables are parsed by kind (int/float/bool strictly, lists colon-separated with
       empties dropped) and set at their YAML path, in table order; ``raw`` is not modified.
    """
    for var in sorted(env):
        if var.startswith(ENV_PREFIX + "BATCH_POLICY_"):
            raise ConfigError(f"environment override {var}: {BATCH_POLICY_REMOVED}")
        if var == ENV_PREFIX + "RUNTIME_RESIDENCY_MODE":
            raise ConfigError(f"environment override {var}: {RESIDENCY_MODE_REMOVED}")
        if var == "KSERVE_TRIO_META_CONCURRENCY":
            raise ConfigError(
                f"{var} is not supported: a meta model runs on the device thread as one "
                "scheduled unit, so there is no meta concurrency gate to size"
            )
        if var.startswith(ENV_PREFIX) and var not in ENV_OVERRIDES:
            close = difflib.get_close_matches(var, list(ENV_OVERRIDES), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"unknown environment override {var}{hint}")
    out = deep_merge({}, raw)
    applied: list[tuple[str, str]] = []
    for var, path, kind in _ENV_TABLE:
        if var in env:
            _set_path(out, path, _parse_env(var, env[var], path, kind))
            applied.append((var, env[var]))
    return out, applied


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """A new dict: ``over`` merged into ``base``; mappings merge recursively, the rest replace.

    Neither argument is modified and no nested mapping of either is shared with the result.
    """
    out: dict[str, Any] = {}
    for key, value in base.items():
        out[key] = deep_merge({}, value) if isinstance(value, Mapping) else _copy(value)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = deep_merge({}, value) if isinstance(value, Mapping) else _copy(value)
    return out


def _copy(value: Any) -> Any:
    return [_copy(v) for v in value] if isinstance(value, list) else value


# ---------------------------------------------------------------------------------------------
# Validation


def validate_config(cfg: ServerConfig, *, check_dirs: bool = True) -> None:
    """Range and consistency checks, the same for YAML-, code- and CLI-built configs.

    Each rule is "path, holds?, what it must be"; comparisons are written as the valid range so
    a NaN fails too. ``check_dirs`` also requires every model directory to exist (off for
    configs checked away from the host that will serve them).
    """
    ep, sc, rt = cfg.endpoints, cfg.scheduler, cfg.runtime
    rules: list[tuple[str, bool, str]] = [
        ("model_poll_seconds", cfg.model_poll_seconds >= 0, "must be >= 0"),
        ("endpoints.port", 0 <= ep.port <= 65535, "must be in 0..65535 (0 = ephemeral)"),
        ("endpoints.metrics_port", 0 <= ep.metrics_port <= 65535, "must be in 0..65535 (0 = off)"),
        (
            "endpoints.max_concurrent_requests",
            ep.max_concurrent_requests >= 0,
            "must be >= 0 (0 = uncapped)",
        ),
        ("grpc.max_recv_msg_bytes", cfg.grpc.max_recv_msg_bytes > 0, "must be positive"),
        ("grpc.max_send_msg_bytes", cfg.grpc.max_send_msg_bytes > 0, "must be positive"),
        ("scheduler.ema_halflife_seconds", sc.ema_halflife_seconds > 0, "must be positive"),
        ("scheduler.recency_penalty_cap", 0 < sc.recency_penalty_cap <= 1, "must be in (0, 1]"),
        ("scheduler.coalescing_discount", 0 <= sc.coalescing_discount < 1, "must be in [0, 1)"),
        ("scheduler.cost_ema_alpha", 0 < sc.cost_ema_alpha <= 1, "must be in (0, 1]"),
        ("scheduler.max_queue_depth", sc.max_queue_depth > 0, "must be positive"),
        (
            "scheduler.dispatch_timeout_seconds",
            sc.dispatch_timeout_seconds >= 0,
            "must be >= 0 (0 = off)",
        ),
        ("scheduler.compaction_interval", sc.compaction_interval >= 0, "must be >= 0 (0 = off)"),
        ("runtime.device_ordinal", rt.device_ordinal >= 0, "must be >= 0"),
        ("runtime.mem_fraction", 0 < rt.mem_fraction <= 1, "must be in (0, 1]"),
        (
            "runtime.weight_cache_fraction",
            0 <= rt.weight_cache_fraction <= 1,
            "must be in [0, 1] (0 = cache off)",
        ),
        (
            "runtime.weight_cache_wiggle_fraction",
            0 <= rt.weight_cache_wiggle_fraction < 1,
            "must be in [0, 1)",
        ),
        (
            "runtime.shared_host_weights_mode",
            0 <= rt.shared_host_weights_mode <= 0o777,
            "must be in 0..0o777",
        ),
        (
            "runtime.cpu_device_memory_bytes",
            rt.cpu_device_memory_bytes >= 0,
            "must be >= 0 (0 = none)",
        ),
    ]
    for path, ok, rule in rules:
        if not ok:
            raise ConfigError(f"{rule} (got {_value_at(cfg, path)})", path)
    for model, mc in sc.models.items():
        path = f"scheduler.models.{model}"
        if not mc.weight > 0:
            raise ConfigError(f"must be positive (got {mc.weight})", f"{path}.weight")
        if mc.max_batch_size is not None and mc.max_batch_size < 1:
            raise ConfigError(f"must be >= 1 (got {mc.max_batch_size})", f"{path}.max_batch_size")

    if not cfg.model_dirs:
        raise ConfigError("at least one model directory is required", "model_dirs")
    for d in cfg.model_dirs if check_dirs else ():
        if not os.path.isdir(d):
            raise ConfigError(f"model directory does not exist: {d}", "model_dirs")
    if cfg.model_control_mode is ModelControlMode.DYNAMIC and not cfg.model_poll_seconds > 0:
        raise ConfigError(
            "model_control_mode 'dynamic' requires model_poll_seconds > 0", "model_poll_seconds"
        )
    if ep.metrics_port != 0 and ep.metrics_port == ep.port:
        raise ConfigError(f"must differ from endpoints.port ({ep.port})", "endpoints.metrics_port")
    _validate_tls(ep.tls, check_files=check_dirs)
    if rt.numerics is NumericsMode.TF32 and rt.backend == "cpu":
        raise ConfigError(
            "'tf32' requires a CUDA backend; the CPU backend cannot run TF32", "runtime.numerics"
        )


def _validate_tls(tls: TlsConfig, *, check_files: bool, prefix: str = "endpoints.tls") -> None:
    """A TLS block (``endpoints.tls``, or ``prefix``): cert and key both or neither; a client CA
    needs them (mutual TLS is TLS plus client certificates); with ``check_files`` every named
    file must exist."""
    if bool(tls.cert_file) != bool(tls.key_file):
        missing = "key_file" if tls.cert_file else "cert_file"
        present = "cert_file" if tls.cert_file else "key_file"
        raise ConfigError(f"must be set together with {present}", f"{prefix}.{missing}")
    if tls.client_ca_file and not tls.cert_file:
        raise ConfigError(
            "requires cert_file and key_file (mutual TLS is TLS plus client certificates)",
            f"{prefix}.client_ca_file",
        )
    for name in ("cert_file", "key_file", "client_ca_file") if check_files else ():
        path = getattr(tls, name)
        if path and not os.path.isfile(path):
            raise ConfigError(f"file does not exist: {path}", f"{prefix}.{name}")


def _value_at(cfg: ServerConfig, path: str) -> Any:
    value: Any = cfg
    for key in path.split("."):
        value = getattr(value, key)
    return value


# ---------------------------------------------------------------------------------------------
# Loading and reporting


def load_server_config(
    node_path: str | os.PathLike[str] | None = None,
    worker: str | None = None,
    *,
    env: Mapping[str, str] = os.environ,
    overrides: Mapping[str, Any] | None = None,
    check_dirs: bool = True,
) -> tuple[ServerConfig, list[tuple[str, str]]]:
    """Resolve, build and validate one worker's configuration; THE entry point of a worker.

    Layers, lowest first: the dataclass defaults; the node file's entry for ``worker`` (or
    ``KSERVE_TRIO_WORKER_NAME``, or the sole worker; see ``node.worker_raw_config``); the
    environment; ``overrides``, a raw dict in YAML shape holding the command-line flags (``None``
    values mean "flag not given" and are dropped). Returns the config and the applied
    environment ``(VAR, value)`` pairs for logging.
    """
    from kserve_trio.core import node as _node  # node builds on this module

    if node_path is not None:
        loaded = _node.load_node(node_path)
        name, chosen_by_env = _node.choose_worker(loaded, worker, env)
        raw: dict[str, Any] = _node.worker_raw_config(loaded, name)
    else:
        name = worker or env.get(WORKER_NAME_ENV, "")
        chosen_by_env = worker is None and bool(env.get(WORKER_NAME_ENV))
        raw = {}
    raw, applied = apply_env_overrides(raw, env)
    if chosen_by_env:
        applied.append((WORKER_NAME_ENV, env[WORKER_NAME_ENV]))
    if overrides:
        raw = deep_merge(raw, _drop_none(overrides))
    cfg = dataclasses.replace(build_config(raw), worker_name=name)
    validate_config(cfg, check_dirs=check_dirs)
    return cfg, applied


def _drop_none(raw: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, Mapping):
            out[key] = _drop_none(value)
        elif value is not None:
            out[key] = value
    return out


def config_to_raw(cfg: ServerConfig) -> dict[str, Any]:
    """The config as a raw dict in YAML shape (``build_config`` inverts it; ``worker_name``,
    not being a YAML key, is left out). For logging the effective configuration."""

    def plain(value: Any) -> Any:
        if isinstance(value, enum.Enum) and not isinstance(value, ResidencyState):
            return value.value
        if isinstance(value, tuple):
            return list(value)
        return value

    def block(obj: Any) -> dict[str, Any]:
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}

    runtime = block(cfg.runtime)
    runtime["shared_host_weights_mode"] = f"{cfg.runtime.shared_host_weights_mode:o}"
    scheduler = block(cfg.scheduler)
    scheduler["models"] = {
        name: {
            "weight": mc.weight,
            "residency": None if mc.residency is None else mc.residency.name.lower(),
            "max_batch_size": mc.max_batch_size,
        }
        for name, mc in cfg.scheduler.models.items()
    }
    endpoints = block(cfg.endpoints)
    endpoints["tls"] = block(cfg.endpoints.tls)
    return {
        "model_dirs": list(cfg.model_dirs),
        "cache_dir": cfg.cache_dir,
        "models_include": list(cfg.models_include),
        "model_control_mode": cfg.model_control_mode.value,
        "model_poll_seconds": cfg.model_poll_seconds,
        "runtime": runtime,
        "scheduler": scheduler,
        "endpoints": endpoints,
        "grpc": block(cfg.grpc),
        "meta": block(cfg.meta),
    }


def log_config(cfg: ServerConfig, applied: Iterable[tuple[str, str]], log: Any = None) -> None:
    """Log the effective configuration, then the environment overrides that shaped it."""
    log = log or get_logger(__name__)
    log.info("config_effective", worker=cfg.worker_name, config=config_to_raw(cfg))
    overrides = [f"{var}={value}" for var, value in applied]
    if overrides:
        log.info("config_overridden_by_environment", worker=cfg.worker_name, overrides=overrides)


# ---------------------------------------------------------------------------------------------
# The helpers the other YAML configurations (node files, the gateway's gateway.yml) build on.


def load_yaml_mapping(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    """Read a YAML file whose root must be a mapping; ``what`` names it in errors
    (``"node config"``: "node config file not found: ...")."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} file not found: {p}")
    try:
        raw = YAML(typ="safe").load(p.read_text())
    except (YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what} {p} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} root must be a mapping (file {p})")
    return raw


as_int = _as_int
as_float = _as_float
as_bool = _as_bool
as_str = _as_str
as_str_list = _as_str_list
parse_enum = _enum
read_block = _read_block
parse_env_value = _parse_env
set_path = _set_path
validate_tls = _validate_tls
"""Public names of the typed readers, the environment parser and the TLS block check, for the
configurations that share this module's schema conventions (same messages, same paths)."""
